"""Expert selection and capacity for :func:`~lightning_llmfast.moe.route`: top-k (optionally group-limited),
exact integer capacity, and the capacity limit over the one counting pass.

Group-limited routing is DeepSeek-V3's node-limited routing: the ``E`` experts form ``num_groups`` equal groups
of consecutive experts; each token scores every group by the sum of its ``group_topk`` best selection scores,
keeps its ``topk_groups`` best groups and picks its top-k experts inside them only.

Example::

    ids = select_experts(scores, top_k=2, num_groups=4, topk_groups=2)  # (T, 2) int64
    capacity = expert_capacity(1.1, num_pairs=50, num_experts=5)  # 11, exactly ceil(1.1 * 50 / 5)
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Integral

import torch
from torch import Tensor

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.kernels import stable_counting_sort
from lightning_llmfast.moe.kernels.plan import capacity_layout_reference

__all__ = ["apply_capacity", "check_groups", "expert_capacity", "group_score_count", "select_experts"]


def check_groups(
    num_experts: int, top_k: int, num_groups: int | None, topk_groups: int | None, group_topk: int | None
) -> None:
    """Validate the group-limited routing options (host-side only).

    Raises:
        RoutingError: only one of ``num_groups``/``topk_groups`` given, ``num_groups`` not dividing ``E``,
            ``topk_groups`` outside ``[1, num_groups]``, fewer than ``top_k`` experts in ``topk_groups`` groups, or
            ``group_topk`` outside ``[1, E / num_groups]``.
    """
    if num_groups is None and topk_groups is None:
        if group_topk is not None:
            raise RoutingError("group_topk needs num_groups and topk_groups (group-limited routing)")
        return
    if num_groups is None or topk_groups is None:
        raise RoutingError(f"num_groups and topk_groups go together, got {num_groups=} and {topk_groups=}")
    check_int("num_groups", num_groups, low=1, high=num_experts, error=RoutingError)
    if num_experts % num_groups:
        raise RoutingError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    check_int("topk_groups", topk_groups, low=1, high=num_groups, error=RoutingError)
    group_size = num_experts // num_groups
    if topk_groups * group_size < top_k:
        raise RoutingError(
            f"topk_groups={topk_groups} groups of {group_size} experts hold fewer than top_k={top_k} experts"
        )
    if group_topk is not None:
        check_int("group_topk", group_topk, low=1, high=group_size, error=RoutingError)


def _descending(scores: Tensor, k: int) -> Tensor:
    # topk, not a sort: a sort's (T, E) int64 indices would break the O(T * k) integer memory of the router.
    return torch.topk(scores, k, dim=-1, sorted=True).indices


def select_experts(
    selection: Tensor,
    top_k: int,
    *,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    group_topk: int | None = None,
) -> Tensor:
    """Top-k experts per token by descending ``selection`` score (ties are broken by ``torch.topk``).

    Args:
        selection: ``(T, E)`` float selection scores (detached; the expert bias already added).
        top_k: experts per token.
        num_groups: ``None`` for plain top-k; else the number of equal groups of consecutive experts.
        topk_groups: groups each token may use.
        group_topk: best scores summed into a group's score; default ``max(1, top_k // topk_groups)`` (DeepSeek-V3:
            "the sum of the highest K_r / M affinity scores"), at most the group size.

    Returns:
        ``(T, top_k)`` int64 expert ids, best first.

    Example::

        select_experts(torch.rand(3, 8), 2, num_groups=4, topk_groups=1)  # both experts of one group
    """
    if num_groups is None or topk_groups is None:
        return _descending(selection, top_k)
    num_tokens, num_experts = selection.shape
    group_size = num_experts // num_groups
    per_group = group_score_count(num_experts, top_k, num_groups, topk_groups, group_topk)
    grouped = selection.view(num_tokens, num_groups, group_size)
    group_scores = grouped.topk(per_group, dim=-1).values.sum(dim=-1)  # (T, G): values only, ties do not matter
    chosen = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=selection.device)
    chosen.scatter_(1, _descending(group_scores, topk_groups), True)
    masked = grouped.masked_fill(~chosen.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    return _descending(masked, top_k)


def group_score_count(num_experts: int, top_k: int, num_groups: int, topk_groups: int, group_topk: int | None) -> int:
    """The best scores summed into a group's score: ``group_topk``, by default ``max(1, top_k // topk_groups)``
    capped at the group size.

    Example::

        group_score_count(256, 8, num_groups=8, topk_groups=4, group_topk=None)  # 2, as DeepSeek-V3
    """
    return group_topk if group_topk is not None else min(max(1, top_k // topk_groups), num_experts // num_groups)


def expert_capacity(capacity_factor: float, num_pairs: int, num_experts: int, min_capacity: int | None = None) -> int:
    """``min(max(ceil(capacity_factor * num_pairs / num_experts), min_capacity), num_pairs)`` in exact arithmetic.

    A float factor counts as the decimal it prints as (``1.1`` is 11/10, not the double just above it), so
    ``expert_capacity(1.1, 50, 5) == 11``; ints and :class:`fractions.Fraction` are exact as they are.

    Raises:
        RoutingError: ``capacity_factor`` not a finite number ``> 0`` or ``min_capacity`` not an int ``>= 0``.

    Example::

        expert_capacity(1.25, num_pairs=64, num_experts=8)  # 10
    """
    check_number("capacity_factor", capacity_factor, low=0, low_open=True, error=RoutingError)
    factor = capacity_factor if isinstance(capacity_factor, (Integral, Fraction)) else str(float(capacity_factor))
    ratio = Fraction(factor) * num_pairs / num_experts
    capacity = -(-ratio.numerator // ratio.denominator)  # exact ceil
    if min_capacity is not None:
        capacity = max(capacity, check_int("min_capacity", min_capacity, low=0, error=RoutingError))
    # No expert can get more than T * k pairs: a larger capacity only adds padding rows.
    return min(capacity, num_pairs)


def apply_capacity(
    keys: Tensor,
    flat_weights: Tensor,
    counts: Tensor,
    dest: Tensor,
    capacity: int,
    num_experts: int,
    drop_policy: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Keeps at most ``capacity`` pairs per expert; pairs of the extra key ``num_experts`` (masked) are never kept.

    Args:
        keys: ``(T * k,)`` int64 key of each pair: its expert, or ``num_experts`` for a masked token's pair.
        flat_weights: ``(T * k,)`` float32 weight of each pair (detached), for ``drop_policy="score"``.
        counts: ``(B,)`` int64 pairs per key, ``B = num_experts`` (or ``+ 1`` with masked pairs).
        dest: ``(T * k,)`` int64 position of each pair in the stable order by key.
        capacity: kept pairs per expert at most.
        num_experts: ``E``.
        drop_policy: ``"position"`` (later pairs dropped first) or ``"score"`` (lowest weights first).
        backend: resolved kernel backend.

    Returns:
        ``tokens_per_expert`` ``(E,)`` int64, ``kept`` ``(T * k,)`` bool and the permutation ``(T * k,)`` int64
        (kept pairs grouped by expert first, then the dropped ones by key, both stable).
    """
    if drop_policy == "position":
        limit, kept, _, permutation = capacity_layout_reference(keys, counts, dest, capacity, num_experts)
        return limit, kept, permutation
    num_bins = counts.numel()
    starts = counts.cumsum(0) - counts
    # Exactly min(count, capacity) pairs of each expert survive, none of the masked key.
    limit = counts.clamp(max=capacity)
    if num_bins > num_experts:
        limit = torch.cat([limit[:num_experts], limit.new_zeros(num_bins - num_experts)])
    # Rank inside the key by descending weight (ties by index): the same counting sort over the pairs visited in
    # descending-weight order.
    order = torch.sort(flat_weights, descending=True, stable=True).indices
    _, dest_by_weight, _ = stable_counting_sort(keys[order], num_bins, backend=backend, validate=False)
    rank = torch.empty_like(dest).scatter_(0, order, dest_by_weight - starts[keys[order]])
    kept = rank < limit[keys]
    # Keys 0..B-1 for kept pairs and B..2B-1 for dropped ones: one more stable pass yields the final layout.
    _, _, permutation = stable_counting_sort(
        keys + num_bins * (~kept).long(), 2 * num_bins, backend=backend, validate=False
    )
    return limit[:num_experts], kept, permutation
