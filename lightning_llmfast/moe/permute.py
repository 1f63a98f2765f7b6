"""Permute tokens into expert-grouped rows and combine expert outputs back, deterministically and sync-free.

Both directions are gathers with indices from the :class:`~lightning_llmfast.moe.routing.RoutingPlan`; the
backward passes are gathers too (never ``index_add_``/``scatter_add_`` of floats, whose atomics on an accelerator
make the summation order, and so the gradients, vary from run to run).

Example::

    plan = route(logits, top_k=2, validate=False)
    rows = permute(x, plan)  # (plan.num_rows, hidden), grouped by expert
    out = unpermute(expert_fn(rows, plan.offsets), plan)  # (num_tokens, hidden)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.kernels import combine_rows, combine_rows_backward, gather_rows, resolve_backend
from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["permute", "unpermute"]


class _PlanIndices(NamedTuple):
    """Index tensors derived from a plan (O(T * k) integers, cheap next to the ``hidden``-wide gathers)."""

    pairs: Tensor  # (R,) int64: flattened pair index of each permuted row
    tokens: Tensor  # (R,) int64: token of each permuted row
    positions: Tensor  # (T, k) int64: permuted row of each pair; clamped into range for dropped pairs
    num_valid: Tensor | None  # 0-d: offsets[-1] (kept rows) with a capacity limit; None when dropless


def _plan_indices(plan: RoutingPlan) -> _PlanIndices:
    num_pairs, num_rows = plan.permutation.numel(), plan.num_rows
    permutation = plan.permutation.long()
    pairs = permutation[:num_rows]
    positions = torch.empty_like(permutation).scatter_(
        0, permutation, torch.arange(num_pairs, device=permutation.device)
    )
    num_valid = None
    if plan.capacity is not None:
        # Dropped pairs sit beyond the static row count; any in-range row will do, their weight is masked out.
        positions = positions.clamp(max=max(num_rows - 1, 0))
        num_valid = plan.offsets[-1]
    return _PlanIndices(pairs, pairs // plan.top_k, positions.view(plan.num_tokens, plan.top_k), num_valid)


class _Permute(torch.autograd.Function):
    """``rows[r] = x[tokens[r]]``; backward sums each token's kept rows in slot order (a gather, no atomics)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        tokens: Tensor,
        num_valid: Tensor | None,
        positions: Tensor,
        pair_mask: Tensor | None,
        backend: str,
    ) -> Tensor:
        ctx.save_for_backward(positions, pair_mask)
        ctx.backend = backend
        return gather_rows(x, tokens, num_valid, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[Tensor | None, ...]:
        positions, pair_mask = ctx.saved_tensors
        # pair_mask (1 kept, 0 dropped) zeroes dropped pairs, whose clamped position points at an unrelated row.
        grad_x = combine_rows(grad_rows, positions, pair_mask, backend=ctx.backend)
        return grad_x, None, None, None, None, None


class _Unpermute(torch.autograd.Function):
    """``out[t] = sum_s w[t, s] * rows[positions[t, s]]``; a fixed-order sum, so bitwise reproducible."""

    @staticmethod
    def forward(
        ctx: Any, rows: Tensor, weights: Tensor, pairs: Tensor, tokens: Tensor, positions: Tensor, backend: str
    ) -> Tensor:
        ctx.save_for_backward(rows, weights, pairs, tokens, positions)
        ctx.backend = backend
        return combine_rows(rows, positions, weights, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        rows, weights, pairs, tokens, positions = ctx.saved_tensors
        # Each row belongs to exactly one pair: its gradient is a scaled gather, no accumulation (dropped pairs
        # have weight 0). Both gradients come from one gather of grad_out; an unneeded one is simply dropped.
        row_weights = weights.reshape(-1).index_select(0, pairs)
        grad_rows, grad_weights = combine_rows_backward(
            grad_out.to(rows.dtype), rows, tokens, row_weights, positions, backend=ctx.backend
        )
        return (
            grad_rows if ctx.needs_input_grad[0] else None,
            grad_weights.to(weights.dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
        )


def permute(x: Tensor, plan: RoutingPlan, *, backend: str = "auto") -> Tensor:
    """Gathers token activations into expert-grouped rows (each token once per chosen expert).

    Row ``r`` holds the token of pair ``plan.permutation[r]``; expert ``e`` owns rows
    ``plan.offsets[e]:plan.offsets[e + 1]``. The row count is static: ``T * k`` when dropless (then it equals
    ``offsets[-1]``), else ``plan.num_rows = min(T * k, E * capacity)``, whose rows from ``offsets[-1]`` on are zero
    padding. Autograd-aware; the backward is deterministic.

    Args:
        x: ``(num_tokens, hidden)`` activations, in any dtype.
        plan: the routing plan of these tokens.
        backend: ``"auto"`` (Triton gather on CUDA), ``"torch"`` or ``"triton"``.

    Returns:
        ``(plan.num_rows, hidden)`` permuted activations.

    Raises:
        RoutingError: ``x`` is not 2-D or its token count differs from the plan's.

    Example::

        rows = permute(x, route(router(x), top_k=2))
    """
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
    backend = resolve_backend(backend, x.device)
    idx = _plan_indices(plan)
    pair_mask = plan.kept.to(x.dtype) if plan.capacity is not None else None
    return _Permute.apply(x, idx.tokens, idx.num_valid, idx.positions, pair_mask, backend)


def unpermute(rows: Tensor, plan: RoutingPlan, *, backend: str = "auto") -> Tensor:
    """Combines expert outputs back into token order, weighted by ``plan.weights`` (dropped pairs contribute 0).

    ``out[t] = sum_s weights[t, s] * rows[row of pair (t, s)]``, summed in a fixed order (no atomics), so the
    result and the gradients for ``rows`` and ``plan.weights`` are bitwise reproducible. Tokens whose pairs were
    all dropped get zeros (add the residual outside).

    Args:
        rows: ``(plan.num_rows, hidden)`` expert outputs, in the layout :func:`permute` produced.
        plan: the routing plan used for :func:`permute`.
        backend: ``"auto"`` (Triton combine on CUDA), ``"torch"`` or ``"triton"``.

    Returns:
        ``(num_tokens, hidden)`` in the dtype of ``rows`` (combined in float32 or wider).

    Raises:
        RoutingError: ``rows`` is not 2-D or its row count differs from ``plan.num_rows``.

    Example::

        out = unpermute(rows, plan)
    """
    if rows.dim() != 2 or rows.shape[0] != plan.num_rows:
        raise RoutingError(f"rows must have shape (plan.num_rows={plan.num_rows}, hidden), got {tuple(rows.shape)}")
    backend = resolve_backend(backend, rows.device)
    idx = _plan_indices(plan)
    weights = plan.weights if plan.capacity is None else plan.weights * plan.kept.to(plan.weights.dtype)
    return _Unpermute.apply(rows, weights, idx.pairs, idx.tokens, idx.positions, backend)
