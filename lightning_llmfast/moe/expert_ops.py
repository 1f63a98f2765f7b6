"""The grouped experts' custom ops: ``grouped_mm``, the gather fused into the first expert GEMM, the SwiGLU
activation, and the down projection with the activation (and the routing weight) fused in.

Opaque to ``torch.compile`` (each is one call with a declared shape function and a registered backward), so they trace
in any dtype and a compiled backward never traces into a kernel; eager calls skip the dispatcher
(:func:`~lightning_llmfast._autograd.eager_custom_op`). :mod:`~lightning_llmfast.moe.experts` composes them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast._autograd import eager_custom_op
from lightning_llmfast._rebuild import mark_rebuildable
from lightning_llmfast.moe.kernels import gather_rows
from lightning_llmfast.moe.kernels.swiglu import (
    swiglu_backward_reference,
    swiglu_forward,
    swiglu_forward_reference,
    swiglu_grads,
)
from lightning_llmfast.moe.token_rows import combine_token_rows, permute_rows

__all__ = ["gather_grouped_mm", "gather_rows_into", "grouped_mm", "grouped_mm_shape", "silu_glu", "swiglu_down"]


@torch.library.custom_op("lightning_llmfast::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as a custom op.

    The built-in op's meta function accepts bfloat16 only, so ``torch.compile`` cannot trace it for the float32
    CPU path; as an opaque custom op with its own shape function and backward it traces for every dtype.
    ``a`` ``(M, K)`` with ``b`` ``(E, K, N)`` gives ``(M, N)``; ``a`` ``(K, M)`` with ``b`` ``(M, N)`` (the weight
    gradient) gives ``(E, K, N)``, groups running along ``M``.
    """
    return F.grouped_mm(a, b, offs=offs)


def grouped_mm_shape(a: Tensor, b: Tensor, offs: Tensor) -> tuple[int, ...]:
    """The shape of ``grouped_mm(a, b, offs)``: ``(M, N)`` for ``b`` ``(E, K, N)``, else ``(E, K, N)``.

    Example::

        grouped_mm_shape(torch.empty(6, 4), torch.empty(2, 4, 8), torch.tensor([2, 6]))  # (6, 8)
    """
    return (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[-1])


@grouped_mm.register_fake
def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(grouped_mm_shape(a, b, offs))


def _grouped_mm_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    # grouped_mm rejects stride-0 (expanded) gradients such as those of a plain .sum().
    grad = grad.contiguous()
    grad_a = grouped_mm(grad, b.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("lightning_llmfast::swiglu", mutates_args=())
def silu_glu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``(M, 2F)`` ``[gate | up]`` rows, with a backward that fills one ``(M, 2F)`` buffer.

    Autograd's default backward of ``chunk -> silu -> mul`` builds the gate and up gradients in separate ``(M, F)``
    buffers and concatenates them (``chunk``'s backward): a full extra pass over ``(M, 2F)`` plus two buffers. A custom
    op rather than an ``autograd.Function``: its backward writes with ``out=`` into halves of one buffer, which
    Dynamo cannot trace ("non-contiguous out="), whereas an opaque op runs the same code compiled or not.

    Only ``gate_up`` is saved: backward recomputes ``silu(gate)``. Keeping it would hold another ``(M, F)`` per layer
    until backward (46 MB at hidden 1024, ffn 1408, 8192 tokens, top-2: 9% of what a reference layer saves) to spare
    one elementwise pass (memory-bound and negligible on a GPU).
    """
    return swiglu_forward_reference(gate_up)


@silu_glu.register_fake
def _silu_glu_fake(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("lightning_llmfast::swiglu_backward", mutates_args=())
def _silu_glu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """Gradient of :func:`silu_glu` for ``gate_up``: ``(M, 2F)`` from ``grad`` ``(M, F)``."""
    return swiglu_backward_reference(grad, gate_up, need_product=False, need_dots=False)[0]


@_silu_glu_backward.register_fake
def _silu_glu_backward_fake(grad: Tensor, gate_up: Tensor) -> Tensor:
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _silu_glu_setup(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_glu_grad(ctx: Any, grad: Tensor) -> Tensor:
    (gate_up,) = ctx.saved_tensors
    return _silu_glu_backward(grad, gate_up)


silu_glu.register_autograd(_silu_glu_grad, setup_context=_silu_glu_setup)


@torch.library.custom_op("lightning_llmfast::swiglu_down", mutates_args=())
def swiglu_down(gate_up: Tensor, down: Tensor, offs: Tensor, scale: Tensor | None, backend: str) -> Tensor:
    """The down projection of the SwiGLU product, ``grouped_mm(scale * silu(gate) * up, down)``: ``(M, 2F)`` ->
    ``(M, H)``.

    One op so that its backward can rebuild the ``(M, F)`` product from ``gate_up`` (saved anyway for the SwiGLU
    gradient) instead of keeping it as the GEMM's input: per reference layer at hidden 1024, ffn 1408, 8192 tokens,
    top-2 that is 46 MB less held until backward, for one elementwise pass in backward.

    ``scale`` ``(M,)`` (optional) multiplies each row by its routing weight before the GEMM (the same as after it,
    row by row), so that the combine after it is a plain sum that keeps no rows for backward. Its gradient
    ``<grad[r], out_unscaled[r]>`` is taken as ``<(grad @ down^T)[r], product[r]>`` (the same value), from tensors
    the backward has anyway. The activation and its backward are one launch each on the Triton path
    (:mod:`~lightning_llmfast.moe.kernels.swiglu`). ``down`` ``(E, F, H)``; ``offs`` ``(E,)`` int32 group ends;
    ``backend``: of the activation (``"torch"`` or ``"triton"``).
    """
    return F.grouped_mm(swiglu_forward(gate_up, scale, backend=backend), down, offs=offs)


@swiglu_down.register_fake
def _swiglu_down_fake(gate_up: Tensor, down: Tensor, offs: Tensor, scale: Tensor | None, backend: str) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], down.shape[-1])


def _swiglu_down_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    *saved, ctx.backend = inputs
    ctx.save_for_backward(*saved)


def _swiglu_down_grad(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    gate_up, down, offs, scale = ctx.saved_tensors
    need_gate_up, need_down, _, need_scale, _ = ctx.needs_input_grad
    need_scale = need_scale and scale is not None
    grad = grad.contiguous()  # grouped_mm rejects stride-0 (expanded) gradients
    grad_gate_up = product = grad_scale = None
    if need_gate_up or need_scale:
        grad_product = grouped_mm(grad, down.transpose(-1, -2), offs)  # of the scaled product
        grad_gate_up, product, grad_scale = swiglu_grads(
            grad_product, gate_up, scale, need_product=need_down, need_dots=need_scale, backend=ctx.backend,
            grad_is_scratch=True,
        )  # fmt: skip
        grad_scale = None if grad_scale is None else grad_scale.to(scale.dtype)
    elif need_down:
        product = swiglu_forward_reference(gate_up, scale)  # traceable: a compiled backward never sees Triton
    grad_down = grouped_mm(product.transpose(0, 1), grad, offs) if need_down else None
    return grad_gate_up if need_gate_up else None, grad_down, None, grad_scale, None


swiglu_down.register_autograd(_swiglu_down_grad, setup_context=_swiglu_down_setup)


@torch.library.custom_op("lightning_llmfast::permute_grouped_mm", mutates_args=())
def gather_grouped_mm(
    x: Tensor,
    x_compute: Tensor,
    tokens: Tensor,
    num_valid: Tensor | None,
    positions: Tensor,
    pair_mask: Tensor | None,
    weight: Tensor,
    offs: Tensor,
    backend: str,
) -> Tensor:
    """``grouped_mm(x_compute[tokens], weight, offs)``: ``(R, N)``; rows from ``num_valid`` on are gathered as zeros
    (padding: :func:`~lightning_llmfast.moe.experts.expert_swiglu` gives them to the last group, so that every row of
    every GEMM is written).

    ``x`` ``(T, H)`` is the differentiable input; its gradient comes back in its dtype, each token's rows summed in
    float32 (as ``permute`` after a cast would). ``x_compute`` is ``x`` in the compute dtype (``x`` itself, or the
    autocast copy the router also reads; it gets no gradient from here): with indices and the weight, all that is
    saved.
    ``positions`` ``(T, k)`` and ``pair_mask`` ``(T, k)`` or ``None`` are for the backward, as in ``permute``.
    """
    return _gather_grouped_mm(x_compute, tokens, num_valid, weight, offs, backend)


def _gather_grouped_mm(
    x_compute: Tensor, tokens: Tensor, num_valid: Tensor | None, weight: Tensor, offs: Tensor, backend: str
) -> Tensor:
    # The forward and its rebuild: one function, so a rebuilt output has the forward's bits by construction.
    return F.grouped_mm(gather_rows(x_compute, tokens, num_valid, backend=backend), weight, offs=offs)


@gather_grouped_mm.register_fake
def _gather_grouped_mm_fake(
    x: Tensor,
    x_compute: Tensor,
    tokens: Tensor,
    num_valid: Tensor | None,
    positions: Tensor,
    pair_mask: Tensor | None,
    weight: Tensor,
    offs: Tensor,
    backend: str,
) -> Tensor:
    return x_compute.new_empty(tokens.shape[0], weight.shape[-1])


def _gather_grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, *saved, ctx.backend = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(*saved)
    # The output (T * k, 2F) is the largest tensor an MoE layer saves (swiglu_down keeps it); an offloader asked to
    # rebuild GEMM outputs recomputes it from the tokens and the weight saved here instead.
    mark_rebuildable(ctx, output, _gather_grouped_mm_rebuild, gemm=True)


def _gather_grouped_mm_rebuild(
    ctx: Any,
    x_compute: Tensor,
    tokens: Tensor,
    num_valid: Tensor | None,
    positions: Tensor,
    pair_mask: Tensor | None,
    weight: Tensor,
    offs: Tensor,
) -> Tensor:
    # Rows past num_valid are unwritten in both the forward's output and this one, and masked by every consumer.
    return _gather_grouped_mm(x_compute, tokens, num_valid, weight, offs, ctx.backend)


def _gather_grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x_compute, tokens, num_valid, positions, pair_mask, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()  # grouped_mm rejects stride-0 (expanded) gradients
    grad_x = grad_weight = grad_rows = None
    if ctx.needs_input_grad[0]:
        grad_rows = grouped_mm(grad, weight.transpose(-1, -2), offs)
        grad_x = combine_token_rows(grad_rows, positions, pair_mask, ctx.x_dtype, ctx.backend)
    if ctx.needs_input_grad[6]:
        # The forward's rows, rebuilt through an opaque op (a compiled backward never traces into a kernel): into the
        # data gradient's rows once the combine has read them, which spares a (T * k, H) buffer at the peak.
        if grad_rows is not None and grad_rows.dtype == x_compute.dtype and grad_rows.is_contiguous():
            rows = grad_rows
            gather_rows_into(rows, x_compute, tokens, num_valid, ctx.backend)
        else:
            rows = permute_rows(x_compute, tokens, num_valid, positions, pair_mask, ctx.backend)
        grad_weight = grouped_mm(rows.transpose(0, 1), grad, offs)
    return grad_x, None, None, None, None, None, grad_weight, None, None


gather_grouped_mm.register_autograd(_gather_grouped_mm_backward, setup_context=_gather_grouped_mm_setup)


@torch.library.custom_op("lightning_llmfast::gather_rows_into", mutates_args=("out",))
def gather_rows_into(out: Tensor, x: Tensor, tokens: Tensor, num_valid: Tensor | None, backend: str) -> None:
    """``out[r] = x[tokens[r]]`` (zero from row ``num_valid`` on), written into ``out``: contiguous ``(R, H)``."""
    gather_rows(x, tokens, num_valid, backend=backend, out=out)


@gather_rows_into.register_fake
def _gather_rows_into_fake(out: Tensor, x: Tensor, tokens: Tensor, num_valid: Tensor | None, backend: str) -> None:
    return None


# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
grouped_mm, silu_glu, _silu_glu_backward, swiglu_down, gather_grouped_mm = (
    eager_custom_op(op) for op in (grouped_mm, silu_glu, _silu_glu_backward, swiglu_down, gather_grouped_mm)
)
