"""The grouped experts' custom ops: ``grouped_mm``, the SwiGLU activation, and the down projection with the
activation (and the routing weight) fused in.

Opaque to ``torch.compile`` (each is one call with a declared shape function and a registered backward), so they trace
in any dtype and a compiled backward never traces into a kernel; eager calls skip the dispatcher
(:func:`~lightning_llmfast._autograd.eager_custom_op`). :mod:`~lightning_llmfast.moe.experts` composes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmfast._autograd import eager_custom_op
from lightning_llmfast.moe.kernels.host_gemm import grouped_mm, grouped_mm_shape
from lightning_llmfast.moe.kernels.swiglu import (
    swiglu_backward_reference,
    swiglu_forward,
    swiglu_forward_reference,
    swiglu_grads,
)

__all__: list[str] = []


@torch.library.custom_op("lightning_llmfast::grouped_mm", mutates_args=())
def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as a custom op.

    The built-in op's meta function accepts bfloat16 only, so ``torch.compile`` cannot trace it for the float32
    CPU path; as an opaque custom op with its own shape function and backward it traces for every dtype.
    ``a`` ``(M, K)`` with ``b`` ``(E, K, N)`` gives ``(M, N)``; ``a`` ``(K, M)`` with ``b`` ``(M, N)`` (the weight
    gradient) gives ``(E, K, N)``, groups running along ``M``.
    """
    return grouped_mm(a, b, offs)


@_grouped_mm.register_fake
def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(grouped_mm_shape(a, b, offs))


def _grouped_mm_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    # grouped_mm rejects stride-0 (expanded) gradients such as those of a plain .sum().
    grad = grad.contiguous()
    grad_a = _grouped_mm(grad, b.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
    grad_b = _grouped_mm(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("lightning_llmfast::swiglu", mutates_args=())
def _silu_glu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``(M, 2F)`` ``[gate | up]`` rows, with a backward that fills one ``(M, 2F)`` buffer.

    Autograd's default backward of ``chunk -> silu -> mul`` builds the gate and up gradients in separate ``(M, F)``
    buffers and concatenates them (``chunk``'s backward): a full extra pass over ``(M, 2F)`` plus two buffers. At
    T=8192, E=64, k=8 (M=65536, F=512) that ``cat`` alone took 0.31 s of a 4.9 s block forward+backward. A custom
    op rather than an ``autograd.Function``: its backward writes with ``out=`` into halves of one buffer, which
    Dynamo cannot trace ("non-contiguous out="), whereas an opaque op runs the same code compiled or not.

    Only ``gate_up`` is saved: backward recomputes ``silu(gate)``. Keeping it would hold another ``(M, F)`` per layer
    until backward (46 MB at hidden 1024, ffn 1408, 8192 tokens, top-2: 9% of what a reference layer saves) to spare
    one elementwise pass (about 4% of the block's forward+backward on CPU; memory-bound and negligible on a GPU).
    """
    return swiglu_forward_reference(gate_up)


@_silu_glu.register_fake
def _silu_glu_fake(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("lightning_llmfast::swiglu_backward", mutates_args=())
def _silu_glu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """Gradient of :func:`_silu_glu` for ``gate_up``: ``(M, 2F)`` from ``grad`` ``(M, F)``."""
    return swiglu_backward_reference(grad, gate_up, need_product=False, need_dots=False)[0]


@_silu_glu_backward.register_fake
def _silu_glu_backward_fake(grad: Tensor, gate_up: Tensor) -> Tensor:
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _silu_glu_setup(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_glu_grad(ctx: Any, grad: Tensor) -> Tensor:
    (gate_up,) = ctx.saved_tensors
    return _silu_glu_backward(grad, gate_up)


_silu_glu.register_autograd(_silu_glu_grad, setup_context=_silu_glu_setup)


@torch.library.custom_op("lightning_llmfast::swiglu_down", mutates_args=())
def _swiglu_down(gate_up: Tensor, down: Tensor, offs: Tensor, scale: Tensor | None, backend: str) -> Tensor:
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
    return grouped_mm(swiglu_forward(gate_up, scale, backend=backend), down, offs)


@_swiglu_down.register_fake
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
        grad_product = _grouped_mm(grad, down.transpose(-1, -2), offs)  # of the scaled product
        grad_gate_up, product, grad_scale = swiglu_grads(
            grad_product, gate_up, scale, need_product=need_down, need_dots=need_scale, backend=ctx.backend,
            grad_is_scratch=True,
        )  # fmt: skip
        grad_scale = None if grad_scale is None else grad_scale.to(scale.dtype)
    elif need_down:
        product = swiglu_forward_reference(gate_up, scale)  # traceable: a compiled backward never sees Triton
    grad_down = _grouped_mm(product.transpose(0, 1), grad, offs) if need_down else None
    return grad_gate_up if need_gate_up else None, grad_down, None, grad_scale, None


_swiglu_down.register_autograd(_swiglu_down_grad, setup_context=_swiglu_down_setup)
# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
_grouped_mm, _silu_glu, _silu_glu_backward, _swiglu_down = (
    eager_custom_op(op) for op in (_grouped_mm, _silu_glu, _silu_glu_backward, _swiglu_down)
)
