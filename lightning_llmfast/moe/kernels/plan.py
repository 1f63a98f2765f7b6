"""The routing plan's integer bookkeeping from one counting pass: counts, group offsets, the capacity layout, each
pair's row and each row's token, in Triton (the three counting-sort launches, nothing else) with its PyTorch
reference.

On a GPU every small op around the counting sort is a kernel launch of its own: int32 casts of the counts and the
permutation, the offsets' cumulative sum and padding, the capacity's ranks, limits and start offsets, the inverse
permutation (each pair's row) and each row's token. The Triton path writes all of them from the counting sort's scan
and scatter kernels. Integer results agree bit for bit with the reference.

Example::

    plan = routing_plan(expert_ids.reshape(-1), num_bins=4, num_experts=4, capacity=None, top_k=2)
    plan.offsets  # (5,) int32 group boundaries; plan.positions: the row of each pair
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import is_triton
from lightning_llmfast.moe.kernels.sort import PlanBuffers, launch_counting_sort, stable_counting_sort_reference

__all__ = [
    "PlanTensors",
    "capacity_layout_reference",
    "plan_from_permutation",
    "plan_with_losses_triton",
    "routing_plan",
    "routing_plan_reference",
    "routing_plan_triton",
]


class PlanTensors(NamedTuple):
    """The integer tensors of a routing plan (``n = T * k`` pairs, ``R`` rows, ``E`` experts)."""

    routed: Tensor  # (E,) int32 valid pairs per expert before the capacity limit
    tokens_per_expert: Tensor  # (E,) int32 kept pairs per expert
    offsets: Tensor  # (E + 1,) int32 exclusive prefix sums of tokens_per_expert
    permutation: Tensor  # (n,) int32 pair at each row: kept pairs by expert, then the dropped ones by key
    positions: Tensor | None  # (n,) int64 row of each pair, clamped into [0, R) (dropped pairs' rows are padding)
    tokens: Tensor | None  # (R,) int64 token of each row (pair // k)
    kept: Tensor  # (n,) bool
    num_dropped: Tensor  # 0-d int64 valid pairs dropped by the capacity limit


def _num_rows(n: int, num_experts: int, capacity: int | None) -> int:
    return n if capacity is None else min(n, num_experts * capacity)


def capacity_layout_reference(
    keys: Tensor, counts: Tensor, dest: Tensor, capacity: int, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keeps the first ``capacity`` pairs of each expert in index order (keys ``>= num_experts`` are never kept).

    Args:
        keys: ``(n,)`` int64 key of each pair.
        counts: ``(B,)`` int64 pairs per key.
        dest: ``(n,)`` int64 position of each pair in the stable order by key.
        capacity: kept pairs per expert at most.
        num_experts: ``E``.

    Returns:
        ``tokens_per_expert`` ``(E,)`` int64, ``kept`` ``(n,)`` bool, each pair's row ``(n,)`` int64 (kept pairs
        grouped by expert first, then the dropped ones by key, both stable) and its inverse, the permutation.
    """
    starts = counts.cumsum(0) - counts
    limit = counts.clamp(max=capacity)
    if counts.numel() > num_experts:
        limit = torch.cat([limit[:num_experts], limit.new_zeros(counts.numel() - num_experts)])
    # Rank inside the key by flattened index: it falls out of the stable order.
    rank = dest - starts[keys]
    kept = rank < limit[keys]
    # Kept pairs keep their rank; dropped ones line up after all kept pairs, by key, in the same order.
    kept_start = (limit.cumsum(0) - limit)[keys]
    dropped = counts - limit
    dropped_start = limit.sum() + (dropped.cumsum(0) - dropped)[keys]
    position = torch.where(kept, kept_start + rank, dropped_start + rank - limit[keys])
    pairs = torch.arange(position.numel(), device=position.device)
    return limit[:num_experts], kept, position, torch.empty_like(position).scatter_(0, position, pairs)


def plan_from_permutation(
    routed: Tensor,
    tokens_per_expert: Tensor,
    kept: Tensor,
    permutation: Tensor,
    num_rows: int,
    top_k: int,
    masked: bool,
) -> PlanTensors:
    """The :class:`PlanTensors` of a permutation made elsewhere (the score drop policy's), without rows or tokens;
    ``masked``: some pairs have the masked key."""
    offsets = torch.nn.functional.pad(tokens_per_expert.cumsum(0), (1, 0))
    return _plan(routed, tokens_per_expert, offsets, permutation, None, kept, num_rows, top_k, masked)


def _plan(
    routed: Tensor,
    tokens_per_expert: Tensor,
    offsets: Tensor,
    permutation: Tensor,
    positions: Tensor | None,
    kept: Tensor,
    num_rows: int,
    top_k: int,
    masked: bool,
) -> PlanTensors:
    int32 = torch.int32
    # Valid pairs: every pair without a mask (a host int, no launch), else the unmasked keys' count.
    valid = routed.sum() if masked else kept.numel()
    return PlanTensors(
        routed.to(int32),
        tokens_per_expert.to(int32),
        offsets.to(int32),
        permutation.to(int32),
        None if positions is None else positions.clamp(max=max(num_rows - 1, 0)),
        None if positions is None else permutation[:num_rows] // top_k,
        kept,
        valid - offsets[-1],
    )


def routing_plan_reference(
    keys: Tensor, num_bins: int, num_experts: int, capacity: int | None, top_k: int, rows: bool = True
) -> PlanTensors:
    """PyTorch reference of :func:`routing_plan`; ``rows=False`` leaves ``positions`` and ``tokens`` ``None``."""
    keys = keys.long()
    counts, dest, order = stable_counting_sort_reference(keys, num_bins)
    routed = counts[:num_experts]
    num_rows = _num_rows(keys.numel(), num_experts, capacity)
    if capacity is None and num_bins == num_experts:  # dropless without a mask: the sorted order itself
        offsets = torch.nn.functional.pad(routed.cumsum(0), (1, 0))
        kept = torch.ones_like(keys, dtype=torch.bool)
        return _plan(routed, routed, offsets, order, dest if rows else None, kept, num_rows, top_k, False)
    limit, kept, position, permutation = capacity_layout_reference(
        keys, counts, dest, keys.numel() if capacity is None else capacity, num_experts
    )
    offsets = torch.nn.functional.pad(limit.cumsum(0), (1, 0))
    masked = num_bins > num_experts
    return _plan(routed, limit, offsets, permutation, position if rows else None, kept, num_rows, top_k, masked)


def routing_plan_triton(keys: Tensor, num_bins: int, num_experts: int, capacity: int | None, top_k: int) -> PlanTensors:
    """Triton :func:`routing_plan`: the counting sort's three launches write every output."""
    return plan_with_losses_triton(keys, num_bins, num_experts, capacity, top_k)[0]


def plan_with_losses_triton(
    keys: Tensor,
    num_bins: int,
    num_experts: int,
    capacity: int | None,
    top_k: int,
    weights: Tensor | None = None,
    sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[PlanTensors, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`routing_plan_triton`, plus each row's pair weight from ``weights`` ``(n,)`` float32 and the balance
    and z-losses from the router kernel's per-block ``sums`` (``(blocks, E)`` probabilities, ``(blocks,)``
    ``logsumexp ** 2``; :func:`~lightning_llmfast.moe.kernels.topk.topk_scores_triton`), in the same launches.

    Returns:
        The plan, the ``(R,)`` row weights (or ``None``), the 0-d balance loss and z-loss (or ``None``).
    """
    keys = keys.contiguous()
    n, device = keys.numel(), keys.device
    num_rows = _num_rows(n, num_experts, capacity)
    counts = torch.empty(num_bins, dtype=torch.int32, device=device)
    layout = torch.empty(3 * num_bins, dtype=torch.int32, device=device)  # kept per key (first row), starts
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    num_dropped = torch.empty((), dtype=torch.int64, device=device)
    positions = torch.empty(n, dtype=torch.int64, device=device)
    permutation = torch.empty(n, dtype=torch.int32, device=device)
    kept = torch.empty(n, dtype=torch.bool, device=device)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    row_weights = None if weights is None else torch.empty(num_rows, dtype=torch.float32, device=device)
    aux, z = (None, None) if sums is None else (torch.empty((), device=device), torch.empty((), device=device))
    if n == 0:
        zeros = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        plan = PlanTensors(zeros[1:], zeros[1:], zeros, permutation, positions, tokens, kept, num_dropped.zero_())
        return plan, row_weights, None if aux is None else aux.zero_(), None if z is None else z.zero_()
    buffers = PlanBuffers(
        layout, offsets, num_dropped, kept, tokens, n if capacity is None else capacity, num_experts, num_rows, top_k,
        weights, row_weights, *(sums or (None, None)), aux, z,
    )  # fmt: skip
    launch_counting_sort(keys, num_bins, counts, positions, permutation, buffers)
    plan = PlanTensors(
        counts[:num_experts], layout[:num_experts], offsets, permutation, positions, tokens, kept, num_dropped
    )
    return plan, row_weights, aux, z


def routing_plan(
    keys: Tensor,
    num_bins: int,
    num_experts: int,
    capacity: int | None,
    top_k: int,
    *,
    backend: str = "torch",
    rows: bool = True,
) -> PlanTensors:
    """Counts, capacity layout, rows and tokens of ``n = T * k`` pairs, pairs ``t * k + s`` keyed by expert.

    Args:
        keys: ``(n,)`` integer key of each pair: its expert, or ``num_experts`` for a masked token's pair.
        num_bins: ``num_experts`` (+ 1 when some pair has the masked key).
        num_experts: ``E``.
        capacity: kept pairs per expert at most (the first ones in index order), or ``None`` (dropless).
        top_k: ``k``.
        backend: ``"torch"`` or ``"triton"`` (already resolved).
        rows: also each pair's row and each row's token (the Triton kernels write them anyway; the reference skips
            them when ``False``, leaving ``None``).

    Returns:
        :class:`PlanTensors`.

    Example::

        plan = routing_plan(torch.tensor([1, 0, 1, 1]), 2, 2, capacity=1, top_k=2)  # pairs 1 and 0 kept
    """
    if is_triton(backend):
        return routing_plan_triton(keys, num_bins, num_experts, capacity, top_k)
    return routing_plan_reference(keys, num_bins, num_experts, capacity, top_k, rows)
