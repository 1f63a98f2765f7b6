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
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.checks import check_swiglu_inputs
from lightning_llmfast.moe.dispatcher import ExpertRows, RowGather, TokenDispatcher
from lightning_llmfast.moe.experts import (
    _grouped_mm,
    _swiglu_down,
    autocast_inputs,
    grouped_mm_supported,
    grouped_swiglu,
)
from lightning_llmfast.moe.kernels import BACKENDS, gather_rows, resolve_backend
from lightning_llmfast.moe.kernels.host_gemm import grouped_mm
from lightning_llmfast.moe.permute import (
    _combine_rows,
    _pair_values_to_rows,
    _permute_rows,
    _plan_indices,
    _sum_rows,
)
from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["LocalDispatcher", "compute_copy", "expert_swiglu", "routed_swiglu"]


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
    """``grouped_mm(x_compute[tokens], weight, offs)``: ``(R, N)``; rows from ``num_valid`` on are gathered as zeros
    (padding: :func:`expert_swiglu` gives them to the last group, so that every row of every GEMM is written).

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
    return grouped_mm(gather_rows(x_compute, tokens, num_valid, backend=backend), weight, offs)


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
    grad_x = grad_weight = grad_rows = None
    if ctx.needs_input_grad[0]:
        grad_rows = _grouped_mm(grad, weight.transpose(-1, -2), offs)
        grad_x = _combine_rows(grad_rows, positions, pair_mask, ctx.x_dtype, ctx.backend)
    if ctx.needs_input_grad[6]:
        # The forward's rows, rebuilt through an opaque op (a compiled backward never traces into a kernel): into the
        # data gradient's rows once the combine has read them, which spares a (T * k, H) buffer (on CPU, where a fresh
        # one of 32 MiB or more is mapped anew, its first-touch page faults cost several times the gather).
        if grad_rows is not None and grad_rows.dtype == x_compute.dtype and grad_rows.is_contiguous():
            rows = grad_rows
            _gather_rows_into(rows, x_compute, tokens, num_valid, ctx.backend)
        else:
            rows = _permute_rows(x_compute, tokens, num_valid, positions, pair_mask, ctx.backend)
        grad_weight = _grouped_mm(rows.transpose(0, 1), grad, offs)
    return grad_x, None, None, None, None, None, grad_weight, None, None


_permute_grouped_mm.register_autograd(_permute_grouped_mm_backward, setup_context=_permute_grouped_mm_setup)


@torch.library.custom_op("lightning_llmfast::gather_rows_into", mutates_args=("out",))
def _gather_rows_into(out: Tensor, x: Tensor, tokens: Tensor, num_valid: Tensor | None, backend: str) -> None:
    """``out[r] = x[tokens[r]]`` (zero from row ``num_valid`` on), written into ``out``: contiguous ``(R, H)``."""
    gather_rows(x, tokens, num_valid, backend=backend, out=out)


@_gather_rows_into.register_fake
def _gather_rows_into_fake(out: Tensor, x: Tensor, tokens: Tensor, num_valid: Tensor | None, backend: str) -> None:
    return None


# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
_permute_grouped_mm = eager_custom_op(_permute_grouped_mm)


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank: a fused gather into the first expert GEMM, weights in the second's epilogue.

    :meth:`dispatch` materialises no rows: it hands the experts the token activations with the gather indices and
    each row's combine weight; :meth:`combine` is a plain sum over each token's rows that keeps no rows for
    backward (module docstring).

    Args:
        backend: gather/combine kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

    Example::

        dispatcher = LocalDispatcher()
        rows, ctx = dispatcher.dispatch(x, plan)
        y = dispatcher.combine(expert_swiglu(rows, gate_up, down), ctx)
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.backend = backend

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        _check_tokens(x, plan, x_compute)
        backend = resolve_backend(self.backend, x.device)
        idx = _plan_indices(plan)
        kept = plan.kept if plan.padded else None
        pair_mask = kept.to(x.dtype) if kept is not None else None
        row_weights = plan.row_weights
        if row_weights is None:
            weights = plan.weights if kept is None else plan.weights * kept.to(plan.weights.dtype)
            row_weights = _pair_values_to_rows(weights, idx.pairs, idx.positions, kept)
        # x_compute is not detached: its grad_fn (a cast of the norm's output) lets the offloader rebuild it.
        gather = RowGather(x, idx.tokens, idx.positions, pair_mask, idx.num_valid, backend)
        rows = ExpertRows(compute_copy(x) if x_compute is None else x_compute, plan.offsets, plan.padded, gather)
        return rows._replace(row_weights=row_weights), gather

    def combine(self, rows: Tensor, ctx: RowGather) -> Tensor:
        return _sum_rows(rows, ctx.positions, ctx.pair_mask, ctx.tokens, ctx.num_valid, ctx.backend)

    def __repr__(self) -> str:
        return f"LocalDispatcher(backend={self.backend!r})"


def expert_swiglu(rows: ExpertRows, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """SwiGLU experts over dispatched rows: ``(M, H)`` outputs, times ``rows.row_weights`` when given.

    A fused gather (``rows.gather``) goes into the first grouped GEMM and the row weights into the second's
    epilogue; where ``grouped_mm`` does not take the inputs (float64, odd sizes, older GPUs) or ``act`` is not
    ``F.silu``, the rows are gathered first and weighted after the experts. Padding rows come back as zeros. On CPU
    the large outputs are reused from step to step (:mod:`~lightning_llmfast.moe.kernels.host_memory`).

    Args:
        rows: a dispatcher's :class:`~lightning_llmfast.moe.dispatcher.ExpertRows`.
        gate_up: ``(E_local, H, 2F)`` expert weights (any strides), gate half first.
        down: ``(E_local, F, H)`` expert weights (any strides).
        act: activation of the gate half.

    Returns:
        ``(M, H)`` in the compute dtype.

    Example::

        rows, ctx = dispatcher.dispatch(x, plan)
        y = dispatcher.combine(expert_swiglu(rows, experts.gate_up_proj, experts.down_proj), ctx)
    """
    gather = rows.gather
    if gather is None:
        out = grouped_swiglu(rows.rows, rows.offsets, gate_up, down, act, padded=rows.padded, validate=False)
        return out if rows.row_weights is None else out * rows.row_weights.unsqueeze(1).to(out.dtype)
    x_compute = rows.rows
    check_swiglu_inputs(x_compute, gate_up, down)
    gate_up, down = autocast_inputs(x_compute.device, gate_up, down)
    if act is not F.silu or not grouped_mm_supported(x_compute, gate_up, down):
        g = gather
        permuted = _permute_rows(g.x, g.tokens, g.num_valid, g.positions, g.pair_mask, g.backend)
        return expert_swiglu(
            ExpertRows(permuted, rows.offsets, rows.padded, None, rows.row_weights), gate_up, down, act
        )
    # grouped_mm's `offs`: the group ends. It leaves rows past the last end unwritten, so with padding (capacity,
    # token mask) the last group also takes the padding rows: gathered as zeros, with zero weight, they come out as
    # zeros from both GEMMs, forward and backward, and add nothing to the weight gradients. No mask pass is needed.
    ends = rows.offsets[1:]
    if rows.padded:
        ends = F.pad(rows.offsets[1:-1], (0, 1), value=gather.tokens.shape[0])
    hidden = _permute_grouped_mm(
        gather.x,
        x_compute,
        gather.tokens,
        gather.num_valid,
        gather.positions,
        gather.pair_mask,
        gate_up,
        ends,
        gather.backend,
    )
    return _swiglu_down(hidden, down, ends, rows.row_weights, gather.backend)


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

    :class:`LocalDispatcher` and :func:`expert_swiglu` in one call: the same function as
    ``unpermute(grouped_swiglu(permute(x, plan), ...), plan)``, without keeping the permuted input or output rows
    for backward (module docstring).

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

        plan = route(router(x), 2, validate=False)
        y = routed_swiglu(x, plan, experts.gate_up_proj, experts.down_proj)
    """
    dispatcher = LocalDispatcher(backend)
    rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
    check_swiglu_inputs(x, gate_up, down)
    if gate_up.shape[0] != plan.num_experts:
        raise RoutingError(
            f"gate_up and down must have E=plan.num_experts={plan.num_experts} experts, got {gate_up.shape[0]}"
        )
    return dispatcher.combine(expert_swiglu(rows, gate_up, down, act), ctx)


def _check_tokens(x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
    if x_compute is not None:
        if x_compute.shape != x.shape:
            raise RoutingError(f"x_compute must have the shape of x {tuple(x.shape)}, got {tuple(x_compute.shape)}")
        if x_compute.dtype != _compute_dtype(x):
            raise RoutingError(
                f"x_compute must have dtype {_compute_dtype(x)} (compute_copy(x): x's, or autocast's), "
                f"got {x_compute.dtype}"
            )


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
