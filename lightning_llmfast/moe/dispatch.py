"""Expert dispatch that keeps no ``(T * k, H)`` rows for backward: gather + gate/up GEMM, SwiGLU + down GEMM scaled
by the routing weights, plain sum.

The unfused composition (:func:`~lightning_llmfast.moe.permute`, :class:`~lightning_llmfast.moe.GroupedExperts`,
:func:`~lightning_llmfast.moe.unpermute`) holds two ``(T * k, H)`` row tensors until backward: the permuted input
rows (the gate/up GEMM's input) and the experts' output rows (for the routing weights' gradient). Here neither is
kept:

- ``permute_grouped_mm`` gathers the rows inside the gate/up GEMM and saves the ``(T, H)`` token activations in the
  compute dtype instead: the tensor the router's matmul saves anyway, so it costs nothing. Backward gathers again.
- each row's routing weight is applied inside ``swiglu_down``, whose backward gets the weights' gradient from
  tensors it has anyway, so the combine is a plain sum that saves indices only.

At hidden 1024, 8192 tokens, top-2 under bf16 autocast a reference layer holds 67 MB less (16% of what it saved;
``benchmarks/bench_offload.py``'s ``saved_inventory``), for one more gather and two elementwise passes in
backward. The gather's backward gives the same bits as ``permute``'s (rows summed in float32, straight into the
input's dtype). The weighting moves, so outputs and gradients differ from the unfused path by rounding order: each
weighted row is rounded to the compute dtype before the sum, and the down projection's input gradient is scaled
after its GEMM instead of before (tests check both paths against float64 loops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast._autograd import eager_custom_op, mark_rebuildable
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.experts import (
    _grouped_mm,
    _swiglu_down,
    autocast_inputs,
    check_swiglu_inputs,
    grouped_mm_supported,
    grouped_swiglu,
)
from lightning_llmfast.moe.kernels import gather_rows, resolve_backend
from lightning_llmfast.moe.permute import (
    _combine_rows,
    _pair_values_to_rows,
    _plan_indices,
    _sum_rows,
    permute,
    unpermute,
)
from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["compute_copy", "routed_swiglu"]


@torch.library.custom_op("lightning_llmfast::permute_grouped_mm", mutates_args=())
def _permute_grouped_mm(
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
    """``grouped_mm(x_compute[tokens], weight, offs)``: ``(R, N)``; rows from ``num_valid`` on are left unwritten
    (``grouped_mm`` skips rows past the last group: the caller masks them, as it does the down projection's).

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


@_permute_grouped_mm.register_fake
def _permute_grouped_mm_fake(
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


def _permute_grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, *saved, ctx.backend = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(*saved)
    # The output (T * k, 2F) is the largest tensor an MoE layer saves (swiglu_down keeps it); an offloader asked to
    # rebuild GEMM outputs recomputes it from the tokens and the weight saved here instead.
    mark_rebuildable(ctx, output, _permute_grouped_mm_rebuild, gemm=True)


def _permute_grouped_mm_rebuild(
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


def _permute_grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x_compute, tokens, num_valid, positions, pair_mask, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()  # grouped_mm rejects stride-0 (expanded) gradients
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_rows = _grouped_mm(grad, weight.transpose(-1, -2), offs)
        if num_valid is not None:
            # grouped_mm leaves rows past the last group unwritten; a fill, as garbage * 0 may be NaN.
            padding = torch.arange(grad_rows.shape[0], device=grad.device) >= num_valid
            grad_rows = grad_rows.masked_fill(padding.unsqueeze(1), 0)
        grad_x = _combine_rows(grad_rows, positions, pair_mask, ctx.x_dtype, ctx.backend)
    if ctx.needs_input_grad[6]:
        rows = gather_rows(x_compute, tokens, num_valid, backend=ctx.backend)  # the forward's rows, rebuilt
        grad_weight = _grouped_mm(rows.transpose(0, 1), grad, offs)
    return grad_x, None, None, None, None, None, grad_weight, None, None


_permute_grouped_mm.register_autograd(_permute_grouped_mm_backward, setup_context=_permute_grouped_mm_setup)
# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
_permute_grouped_mm = eager_custom_op(_permute_grouped_mm)


def routed_swiglu(
    x: Tensor,
    plan: RoutingPlan,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor] = F.silu,
    *,
    x_compute: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """``out[t] = sum_s weights[t, s] * expert_{e(t, s)}(x[t])`` over kept pairs, for SwiGLU experts.

    The same function as ``unpermute(grouped_swiglu(permute(x, plan), ...), plan)``, without keeping the permuted
    input or output rows for backward (module docstring). Where ``grouped_mm`` does not take the inputs (float64,
    odd sizes, older GPUs) or ``act`` is not ``F.silu``, it is that composition.

    Args:
        x: ``(T, H)`` token activations.
        plan: their routing plan.
        gate_up: ``(E, H, 2F)`` expert weights (any strides), gate half first.
        down: ``(E, F, H)`` expert weights (any strides).
        act: activation of the gate half.
        x_compute: ``x`` already cast to the compute dtype (autocast's), to be shared with the router's matmul;
            ``None``: cast here.
        backend: ``"auto"`` (Triton gathers on CUDA), ``"torch"`` or ``"triton"``.

    Returns:
        ``(T, H)`` in the compute dtype.

    Raises:
        RoutingError: ``x`` is not ``(plan.num_tokens, H)``, ``gate_up``/``down`` are not ``(E, H, 2F)``/
            ``(E, F, H)`` with ``E = plan.num_experts``, or ``x_compute`` has another shape or a dtype other than
            ``compute_copy(x)``'s.

    Example::

        x_compute = x.to(torch.bfloat16)  # under bf16 autocast
        plan = route(router(x_compute), top_k=2, validate=False)
        y = routed_swiglu(x, plan, experts.gate_up_proj, experts.down_proj, x_compute=x_compute)
    """
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
    check_swiglu_inputs(x, gate_up, down)
    if gate_up.shape[0] != plan.num_experts:
        raise RoutingError(
            f"gate_up and down must have E=plan.num_experts={plan.num_experts} experts, got {gate_up.shape[0]}"
        )
    if x_compute is not None:
        if x_compute.shape != x.shape:
            raise RoutingError(f"x_compute must have the shape of x {tuple(x.shape)}, got {tuple(x_compute.shape)}")
        if x_compute.dtype != _compute_dtype(x):
            raise RoutingError(
                f"x_compute must have dtype {_compute_dtype(x)} (compute_copy(x): x's, or autocast's), "
                f"got {x_compute.dtype}"
            )
    backend = resolve_backend(backend, x.device)
    padded = plan.padded
    if x_compute is None:
        x_compute = compute_copy(x)
    gate_up, down = autocast_inputs(x.device, gate_up, down)
    if act is not F.silu or not grouped_mm_supported(x_compute, gate_up, down):
        rows = permute(x, plan, backend=backend)
        hidden = grouped_swiglu(rows, plan.offsets, gate_up, down, act, padded=padded, validate=False)
        return unpermute(hidden, plan, backend=backend)
    idx = _plan_indices(plan)
    kept = plan.kept if padded else None
    pair_mask = kept.to(x.dtype) if kept is not None else None
    ends = plan.offsets[1:].to(torch.int32)  # grouped_mm's `offs`: the group ends
    weights = plan.weights if kept is None else plan.weights * kept.to(plan.weights.dtype)
    row_weights = _pair_values_to_rows(weights, idx.pairs, idx.positions, kept)
    # x_compute is not detached: its grad_fn (a cast of the norm's output) lets the offloader rebuild it in backward.
    hidden = _permute_grouped_mm(
        x, x_compute, idx.tokens, idx.num_valid, idx.positions, pair_mask, gate_up, ends, backend
    )
    rows = _swiglu_down(hidden, down, ends, row_weights, backend)
    if idx.num_valid is not None:
        # grouped_mm leaves the padding rows unwritten: zero them (a select: garbage * 0 may be NaN).
        valid = torch.arange(rows.shape[0], device=rows.device) < idx.num_valid
        rows = torch.where(valid.unsqueeze(1), rows, 0)
    return _sum_rows(rows, idx.positions, pair_mask, idx.tokens, idx.num_valid, backend)


def compute_copy(x: Tensor) -> Tensor:
    """``x`` in autocast's dtype when autocast is on (and ``x`` is a float type it casts), else ``x`` itself.

    Example::

        x_compute = compute_copy(x)
        logits = router(x_compute)  # autocast keeps an already cast input as is: one copy for router and experts
    """
    dtype = _compute_dtype(x)
    return x if dtype == x.dtype else x.to(dtype)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of :func:`compute_copy`'s result."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype
