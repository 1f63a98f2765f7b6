"""Token rows of a routing plan: gathered into expert-grouped rows and combined back, deterministically, sync-free.

The dispatchers' data movement: :class:`~lightning_llmfast.moe.dispatcher.LocalDispatcher` gathers inside the first
expert GEMM and sums with :func:`sum_rows`; the all-to-all dispatchers materialise the rows with :func:`permute` and
weight them back at home with :func:`unpermute`.

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

from lightning_llmfast._autograd import eager_custom_op
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.kernels import combine_rows, combine_rows_backward, gather_rows, resolve_backend
from lightning_llmfast.moe.kernels.rows import acc_dtype
from lightning_llmfast.moe.routing import RoutingPlan

__all__ = [
    "PlanIndices",
    "combine_token_rows",
    "pair_values_to_rows",
    "permute",
    "permute_rows",
    "plan_indices",
    "sum_rows",
    "unpermute",
]


class PlanIndices(NamedTuple):
    """Index tensors derived from a plan (O(T * k) integers, cheap next to the ``hidden``-wide gathers)."""

    pairs: Tensor  # (R,) int32: flattened pair index of each permuted row
    tokens: Tensor  # (R,) int64: token of each permuted row
    positions: Tensor  # (T, k) int64: permuted row of each pair; clamped into range for dropped pairs
    num_valid: Tensor | None  # 0-d: offsets[-1] (kept rows) for a padded plan; None when every pair is kept


def plan_indices(plan: RoutingPlan) -> PlanIndices:
    num_rows = plan.num_rows
    pairs = plan.permutation[:num_rows]
    positions, tokens = plan.positions, plan.row_tokens
    if positions is None or tokens is None:  # a plan built by hand: derive them from the permutation
        permutation = plan.permutation.long()
        positions = torch.empty_like(permutation).scatter_(
            0, permutation, torch.arange(permutation.numel(), device=permutation.device)
        )
        # Dropped (and masked) pairs sit beyond the kept rows; any in-range row will do, their weight is masked out.
        positions = positions.clamp(max=max(num_rows - 1, 0)).view(plan.num_tokens, plan.top_k)
        tokens = permutation[:num_rows] // plan.top_k
    num_valid = plan.offsets[-1] if plan.padded else None
    return PlanIndices(pairs, tokens, positions, num_valid)


# The data movement runs inside custom ops rather than as torch.autograd.Function bodies, so that
# torch.compile treats each as one opaque call with a declared shape function and never traces the kernels'
# internals. Tracing them is not safe across torch versions: the references fill fresh buffers with out= and
# in-place writes, and torch 2.11's Dynamo silently drops the gradient of an autograd.Function whose forward
# returns such a buffer (x.grad and every weight gradient came out zero under
# torch.compile(fullgraph=True, backend="aot_eager")). A custom op's contract is simple and checkable with
# torch.library.opcheck: fresh outputs (no alias of an input), no input mutated (mutates_args=()), and a fake
# implementation with the real outputs' shapes, dtypes and (contiguous) strides.


@torch.library.custom_op("lightning_llmfast::permute_rows", mutates_args=())
def permute_rows(
    x: Tensor, tokens: Tensor, num_valid: Tensor | None, positions: Tensor, pair_mask: Tensor | None, backend: str
) -> Tensor:
    """``rows[r] = x[tokens[r]]`` (zero from row ``num_valid`` on): ``(R, H)``.

    ``positions`` ``(T, k)`` and ``pair_mask`` ``(T, k)`` (1 kept, 0 dropped, or ``None``) are for the backward.
    """
    return gather_rows(x, tokens, num_valid, backend=backend)


@permute_rows.register_fake
def _permute_rows_fake(
    x: Tensor, tokens: Tensor, num_valid: Tensor | None, positions: Tensor, pair_mask: Tensor | None, backend: str
) -> Tensor:
    return x.new_empty(tokens.shape[0], x.shape[1])


def _permute_rows_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, _, _, positions, pair_mask, backend = inputs
    ctx.save_for_backward(positions, pair_mask)
    ctx.backend = backend


def _permute_rows_backward(ctx: Any, grad_rows: Tensor) -> tuple[Tensor | None, ...]:
    """Sums each token's kept rows in slot order: a gather, no atomics."""
    positions, pair_mask = ctx.saved_tensors
    # pair_mask zeroes dropped pairs, whose clamped position points at an unrelated row.
    needed = ctx.needs_input_grad[0]
    grad_x = combine_token_rows(grad_rows, positions, pair_mask, grad_rows.dtype, ctx.backend) if needed else None
    return grad_x, None, None, None, None, None


permute_rows.register_autograd(_permute_rows_backward, setup_context=_permute_rows_setup)


@torch.library.custom_op("lightning_llmfast::combine_rows", mutates_args=())
def combine_token_rows(
    rows: Tensor, positions: Tensor, weights: Tensor | None, out_dtype: torch.dtype, backend: str
) -> Tensor:
    """``out[t] = sum_s weights[t, s] * rows[positions[t, s]]`` (plain sum without weights): ``(T, H)``."""
    return combine_rows(rows, positions, weights, out_dtype=out_dtype, backend=backend)


@combine_token_rows.register_fake
def _combine_token_rows_fake(
    rows: Tensor, positions: Tensor, weights: Tensor | None, out_dtype: torch.dtype, backend: str
) -> Tensor:
    return rows.new_empty(positions.shape[0], rows.shape[1], dtype=out_dtype)


@torch.library.custom_op("lightning_llmfast::sum_rows", mutates_args=())
def sum_rows(
    rows: Tensor, positions: Tensor, pair_mask: Tensor | None, tokens: Tensor, num_valid: Tensor | None, backend: str
) -> Tensor:
    """``out[t] = sum_s rows[positions[t, s]]`` over kept pairs: ``(T, H)``, the adjoint of ``permute_rows``.

    For rows that already carry their routing weight (``pair_values_to_rows``): unlike ``unpermute_rows`` it needs no
    rows for its backward, which gathers ``grad[tokens[r]]`` (zero from row ``num_valid`` on).
    """
    return combine_rows(rows, positions, pair_mask, backend=backend)


@sum_rows.register_fake
def _sum_rows_fake(
    rows: Tensor, positions: Tensor, pair_mask: Tensor | None, tokens: Tensor, num_valid: Tensor | None, backend: str
) -> Tensor:
    return rows.new_empty(positions.shape[0], rows.shape[1])


def _sum_rows_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, positions, pair_mask, tokens, num_valid, backend = inputs
    ctx.save_for_backward(positions, pair_mask, tokens, num_valid)
    ctx.backend = backend


def _sum_rows_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    positions, pair_mask, tokens, num_valid = ctx.saved_tensors
    needed = ctx.needs_input_grad[0]
    grad_rows = permute_rows(grad, tokens, num_valid, positions, pair_mask, ctx.backend) if needed else None
    return grad_rows, None, None, None, None, None


sum_rows.register_autograd(_sum_rows_backward, setup_context=_sum_rows_setup)


@torch.library.custom_op("lightning_llmfast::pair_values_to_rows", mutates_args=())
def pair_values_to_rows(values: Tensor, pairs: Tensor, positions: Tensor, kept: Tensor | None) -> Tensor:
    """``out[r] = values.flatten()[pairs[r]]``: ``(R,)``; backward is the gather ``grad[positions]`` (no atomics)."""
    return values.reshape(-1).index_select(0, pairs)


@pair_values_to_rows.register_fake
def _pair_values_to_rows_fake(values: Tensor, pairs: Tensor, positions: Tensor, kept: Tensor | None) -> Tensor:
    return values.new_empty(pairs.shape[0])


def _pair_values_to_rows_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, _, positions, kept = inputs
    ctx.save_for_backward(positions, kept)


def _pair_values_to_rows_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    positions, kept = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    grad_values = grad.index_select(0, positions.reshape(-1)).view(positions.shape)
    if kept is not None:
        # A dropped pair's clamped position points at another pair's row, or at a padding row whose gradient
        # grouped_mm never wrote: a select, not a product, so that garbage cannot leak in as NaN * 0.
        grad_values = torch.where(kept, grad_values, 0)
    return grad_values, None, None, None


pair_values_to_rows.register_autograd(_pair_values_to_rows_backward, setup_context=_pair_values_to_rows_setup)


@torch.library.custom_op("lightning_llmfast::unpermute_rows", mutates_args=())
def _unpermute_rows(
    rows: Tensor, weights: Tensor, pairs: Tensor, tokens: Tensor, positions: Tensor, backend: str
) -> Tensor:
    """``out[t] = sum_s weights[t, s] * rows[positions[t, s]]``: ``(T, H)``. ``pairs``, ``tokens``: for the backward."""
    return combine_rows(rows, positions, weights, backend=backend)


@_unpermute_rows.register_fake
def _unpermute_rows_fake(
    rows: Tensor, weights: Tensor, pairs: Tensor, tokens: Tensor, positions: Tensor, backend: str
) -> Tensor:
    return rows.new_empty(positions.shape[0], rows.shape[1])


def _unpermute_rows_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    rows, weights, pairs, tokens, positions, backend = inputs
    ctx.save_for_backward(rows, weights, pairs, tokens, positions)
    ctx.backend = backend


def _unpermute_rows_backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """Each row belongs to exactly one pair: its gradient is a scaled gather, no accumulation."""
    rows, weights, pairs, tokens, positions = ctx.saved_tensors
    # Dropped pairs have weight 0. Both gradients come from one gather of grad_out; an unneeded one is dropped.
    row_weights = weights.reshape(-1).index_select(0, pairs)
    grad_rows, grad_weights = _combine_rows_backward(
        grad_out.to(rows.dtype), rows, tokens, row_weights, positions, ctx.backend
    )
    return (
        grad_rows if ctx.needs_input_grad[0] else None,
        grad_weights.to(weights.dtype) if ctx.needs_input_grad[1] else None,
        None,
        None,
        None,
        None,
    )


_unpermute_rows.register_autograd(_unpermute_rows_backward, setup_context=_unpermute_rows_setup)


@torch.library.custom_op("lightning_llmfast::combine_rows_backward", mutates_args=())
def _combine_rows_backward(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    """``grad_rows`` ``(R, H)`` (dtype of ``grad``) and ``grad_weights`` ``(T, k)`` (float32/float64)."""
    return combine_rows_backward(grad, rows, src, scale, positions, backend=backend)


@_combine_rows_backward.register_fake
def _combine_rows_backward_fake(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    return grad.new_empty(rows.shape), rows.new_empty(positions.shape, dtype=acc_dtype(rows))


# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
permute_rows, combine_token_rows, sum_rows, pair_values_to_rows, _unpermute_rows, _combine_rows_backward = (
    eager_custom_op(op)
    for op in (permute_rows, combine_token_rows, sum_rows, pair_values_to_rows, _unpermute_rows, _combine_rows_backward)
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
    idx = plan_indices(plan)
    pair_mask = plan.kept.to(x.dtype) if plan.padded else None
    return permute_rows(x, idx.tokens, idx.num_valid, idx.positions, pair_mask, backend)


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
    idx = plan_indices(plan)
    weights = plan.weights * plan.kept.to(plan.weights.dtype) if plan.padded else plan.weights
    return _unpermute_rows(rows, weights, idx.pairs, idx.tokens, idx.positions, backend)
