"""Stable counting sort (the router's one counting pass) in Triton, with its PyTorch reference.

The stable counting sort is the heart of the router. Given one integer key per ``(token, slot)`` pair (its expert),
it returns how many pairs each key has and where each pair lands when the pairs are ordered by key, pairs of one
key staying in ascending index order. The Triton version does this without a global sort:

1. ``_block_histogram_kernel``: every block of ``BLOCK`` pairs counts its keys into its own histogram row
   (a compare-and-sum, no atomics, so no zero-filled buffer) and ranks each pair among the earlier pairs of the
   block with the same key;
2. ``_block_scan_kernel``: one program walks the blocks in order and turns the histograms into, for each block
   and key, the number of pairs with that key in all earlier blocks; it also sums the counts and scans them into
   the per-key start offsets;
3. ``_scatter_kernel``: each pair's destination is ``start[key] + earlier_blocks[block, key] + rank_in_block``,
   which is exactly its position in the stable order, so the result does not depend on scheduling; the kernel
   also writes the inverse (the sorted order) with ``order[dest] = index``.

Example::

    keys = torch.tensor([2, 0, 2, 1, 0])
    counts, dest, order = stable_counting_sort(keys, num_bins=3)
    # counts == [2, 1, 2]; dest == [3, 0, 4, 2, 1]; order == [1, 4, 3, 0, 2] (keys[order] == [0, 0, 1, 2, 2])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.kernels.backend import resolve_backend, tl, triton, triton_jit

__all__ = [
    "PlanBuffers",
    "launch_counting_sort",
    "stable_counting_sort",
    "stable_counting_sort_reference",
    "stable_counting_sort_triton",
]

# Pairs per program of the counting kernels: the in-block rank compares every pair with every other pair of its
# block, so the work per pair is O(BLOCK) whatever the number of experts.
_SORT_BLOCK = 128
# Elements of the (blocks, bins) tile the scan kernel holds at once.
_SCAN_TILE = 8192


def stable_counting_sort_reference(keys: Tensor, num_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch reference of the stable counting sort.

    Args:
        keys: ``(n,)`` integer keys in ``[0, num_bins)``.
        num_bins: number of distinct keys.

    Returns:
        ``counts`` ``(num_bins,)`` int64 (elements per key), ``dest`` ``(n,)`` int64 (position of each element in
        the order sorted by key, ties in ascending index order) and its inverse ``order`` ``(n,)`` int64 (the
        element at each sorted position).

    Example::

        counts, dest, order = stable_counting_sort_reference(torch.tensor([1, 0, 1]), 2)
        # [1, 2], [1, 0, 2], [1, 0, 2]
    """
    keys = keys.long()
    n = keys.numel()
    # scatter_add_ into a fixed-size buffer instead of bincount: bincount's output size depends on the data
    # (a host sync on CUDA) unless minlength is given, and this states the shape outright.
    counts = torch.zeros(num_bins, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    # Sorting narrow keys gives the same stable order, faster (2.3 ms -> 0.8 ms for 65536 int64 keys on CPU).
    narrow = torch.int16 if num_bins <= torch.iinfo(torch.int16).max else torch.int64
    order = torch.sort(keys.to(narrow), stable=True).indices
    dest = torch.empty_like(keys).scatter_(0, order, torch.arange(n, device=keys.device))
    return counts, dest, order


@triton_jit
def _block_histogram_kernel(keys_ptr, hist_ptr, rank_ptr, n, num_bins, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Per-block histogram ``hist[block, key]`` and each pair's rank among earlier same-key pairs of its block."""
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    offs = pid * BLOCK + idx
    in_range = offs < n
    raw = tl.load(keys_ptr + offs, mask=in_range, other=0)
    # A key outside [0, num_bins) (possible only with validate=False) is skipped, never used as an address.
    valid = in_range & (raw >= 0) & (raw < num_bins)
    keys = raw.to(tl.int32)
    # Rank by flattened index: count the earlier valid pairs of the block with the same key. Comparing all pairs
    # of the block (instead of a running count per key) keeps the result independent of thread scheduling.
    same = (keys[:, None] == keys[None, :]) & (idx[None, :] < idx[:, None]) & valid[None, :]
    rank = tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + offs, rank, mask=in_range)
    # The whole histogram row from one compare-and-sum: no atomics, and no zero-filled buffer to launch first.
    bins = tl.arange(0, BINS)
    hits = (keys[:, None] == bins[None, :]) & valid[:, None]
    tl.store(hist_ptr + pid * num_bins + bins, tl.sum(hits.to(tl.int32), axis=0), mask=bins < num_bins)


@triton_jit
def _block_scan_kernel(
    hist_ptr, prefix_ptr, counts_ptr, starts_ptr, num_blocks, num_bins, plan_ptr, offsets_ptr, dropped_ptr,
    capacity, num_experts, prob_sums_ptr, lse_sums_ptr, aux_ptr, z_ptr, num_token_blocks, top_k,
    CHUNK: tl.constexpr, BINS: tl.constexpr, PLAN: tl.constexpr, LOSSES: tl.constexpr,
):  # fmt: skip
    """Exclusive scan of the histograms over blocks, total counts per key, and the keys' start offsets.

    With ``PLAN`` (:func:`~lightning_llmfast.moe.kernels.plan.routing_plan`) the capacity bookkeeping too
    (:func:`_plan_layout`); with ``LOSSES`` (needs ``PLAN``) the balance and z-losses (:func:`_losses`).
    """
    bins = tl.arange(0, BINS)
    rows = tl.arange(0, CHUNK)
    bin_ok = bins < num_bins
    total = tl.zeros([BINS], dtype=tl.int64)
    # CHUNK blocks per step: a scan inside the tile plus a running total, so the serial loop is num_blocks / CHUNK
    # long instead of num_blocks.
    for start in range(0, num_blocks, CHUNK):
        blocks = start + rows
        ptrs = blocks[:, None].to(tl.int64) * num_bins + bins[None, :]
        ok = (blocks[:, None] < num_blocks) & bin_ok[None, :]
        hist = tl.load(hist_ptr + ptrs, mask=ok, other=0).to(tl.int64)
        inclusive = tl.cumsum(hist, axis=0)
        tl.store(prefix_ptr + ptrs, (inclusive - hist + total[None, :]).to(tl.int32), mask=ok)
        total += tl.sum(hist, axis=0)
    tl.store(counts_ptr + bins, total.to(counts_ptr.dtype.element_ty), mask=bin_ok)
    tl.store(starts_ptr + bins, tl.cumsum(total, axis=0) - total, mask=bin_ok)
    if PLAN:
        _plan_layout(total, bins, num_bins, plan_ptr, offsets_ptr, dropped_ptr, capacity, num_experts)
    if LOSSES:
        _losses(
            total, bins, rows, num_experts, prob_sums_ptr, lse_sums_ptr, aux_ptr, z_ptr, num_token_blocks,
            top_k, CHUNK, BINS,
        )  # fmt: skip


@triton_jit
def _plan_layout(total, bins, num_bins, plan_ptr, offsets_ptr, dropped_ptr, capacity, num_experts):
    """Per key the kept pairs ``min(count, capacity)`` (none for the masked key ``num_experts``), their start rows,
    the dropped pairs' start rows after all kept ones (three rows of ``num_bins`` at ``plan_ptr``), the int32 group
    offsets and the number of dropped valid pairs."""
    bin_ok = bins < num_bins
    is_expert = bins < num_experts
    limit = tl.where(is_expert, tl.minimum(total, capacity), 0)
    kept_end = tl.cumsum(limit, axis=0)
    dropped = total - limit
    dropped_start = tl.sum(limit, axis=0) + tl.cumsum(dropped, axis=0) - dropped
    layout_type = plan_ptr.dtype.element_ty
    tl.store(plan_ptr + bins, limit.to(layout_type), mask=bin_ok)
    tl.store(plan_ptr + num_bins + bins, (kept_end - limit).to(layout_type), mask=bin_ok)
    tl.store(plan_ptr + 2 * num_bins + bins, dropped_start.to(layout_type), mask=bin_ok)
    tl.store(offsets_ptr + 1 + bins, kept_end.to(tl.int32), mask=is_expert)
    tl.store(offsets_ptr + bins, tl.zeros([bins.shape[0]], dtype=tl.int32), mask=bins == 0)
    tl.store(dropped_ptr, tl.sum(tl.where(is_expert, dropped, 0), axis=0))


@triton_jit
def _losses(
    total, bins, rows, num_experts, prob_sums_ptr, lse_sums_ptr, aux_ptr, z_ptr, num_token_blocks, top_k,
    CHUNK: tl.constexpr, BINS: tl.constexpr,
):  # fmt: skip
    """The balance loss ``E * sum_e f_e * P_e`` and the z-loss from the router kernel's per-block sums of the
    probabilities and of ``logsumexp ** 2`` (:mod:`~lightning_llmfast.moe.kernels.topk`), in a fixed order. Both
    average over the tokens that route: ``top_k`` valid pairs each (a masked token's pairs have the key ``E``)."""
    is_expert = bins < num_experts
    prob_sums = tl.zeros([BINS], dtype=tl.float32)
    lse_sums = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, num_token_blocks, CHUNK):
        blocks = start + rows
        ptrs = blocks[:, None].to(tl.int64) * num_experts + bins[None, :]
        ok = (blocks[:, None] < num_token_blocks) & is_expert[None, :]
        prob_sums += tl.sum(tl.load(prob_sums_ptr + ptrs, mask=ok, other=0), axis=0)
        lse_sums += tl.load(lse_sums_ptr + blocks, mask=blocks < num_token_blocks, other=0)
    routed = tl.where(is_expert, total, 0)
    valid_pairs = tl.sum(routed, axis=0)
    pairs = tl.maximum(valid_pairs, 1).to(tl.float32)
    tokens = tl.maximum(valid_pairs // top_k, 1).to(tl.float32)
    tl.store(aux_ptr, tl.sum(routed.to(tl.float32) * prob_sums, axis=0) * (num_experts / pairs / tokens))
    tl.store(z_ptr, tl.sum(lse_sums, axis=0) / tokens)


@triton_jit
def _scatter_kernel(
    keys_ptr,
    rank_ptr,
    prefix_ptr,
    starts_ptr,
    dest_ptr,
    order_ptr,
    n,
    num_bins,
    plan_ptr,
    kept_ptr,
    tokens_ptr,
    num_rows,
    top_k,
    weights_ptr,
    row_weights_ptr,
    BLOCK: tl.constexpr,
    PLAN: tl.constexpr,
    WEIGHTS: tl.constexpr,
):
    """``dest = starts[key] + earlier_blocks[block, key] + rank_in_block`` (the stable position); ``order[dest]``.

    With ``PLAN``: each pair's row in the capacity layout (kept pairs grouped by expert, then the dropped ones), the
    int32 permutation at it, ``dest`` clamped into the ``num_rows`` rows, whether the pair is kept, and each row's
    token (``pair // top_k``); with ``WEIGHTS`` each row's pair weight (0 for a dropped pair).
    """
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    keys = tl.load(keys_ptr + offs, mask=in_range, other=0).to(tl.int64)
    # Out-of-range keys (validate=False only) are masked out of every key-addressed load and store: their dest
    # is -1 and they write nothing, so a bad key can never make the kernel touch memory out of bounds.
    valid = in_range & (keys >= 0) & (keys < num_bins)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0).to(tl.int64)
    rank += tl.load(prefix_ptr + pid * num_bins + keys, mask=valid, other=0).to(tl.int64)  # rank inside the key
    if PLAN:
        limit = tl.load(plan_ptr + keys, mask=valid, other=0).to(tl.int64)
        kept = valid & (rank < limit)
        kept_row = tl.load(plan_ptr + num_bins + keys, mask=valid, other=0).to(tl.int64) + rank
        dropped_row = tl.load(plan_ptr + 2 * num_bins + keys, mask=valid, other=0).to(tl.int64) + rank - limit
        dest = tl.where(kept, kept_row, dropped_row)
        tl.store(order_ptr + dest, offs.to(order_ptr.dtype.element_ty), mask=valid)
        tl.store(dest_ptr + offs, tl.maximum(tl.minimum(dest, num_rows - 1), 0), mask=in_range)
        tl.store(kept_ptr + offs, kept.to(kept_ptr.dtype.element_ty), mask=in_range)
        tl.store(tokens_ptr + dest, offs.to(tl.int64) // top_k, mask=valid & (dest < num_rows))
        if WEIGHTS:
            weight = tl.load(weights_ptr + offs, mask=kept, other=0)
            tl.store(row_weights_ptr + dest, weight, mask=valid & (dest < num_rows))
    else:
        dest = tl.where(valid, tl.load(starts_ptr + keys, mask=valid, other=0) + rank, -1)
        tl.store(dest_ptr + offs, dest, mask=in_range)
        tl.store(order_ptr + dest, offs.to(tl.int64), mask=valid)


def stable_counting_sort_triton(keys: Tensor, num_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """Triton stable counting sort; same contract and outputs as :func:`stable_counting_sort_reference`.

    Three launches (histogram, scan, scatter) with sizes fixed by ``keys.numel()`` and ``num_bins``; no host sync.

    Example::

        counts, dest, order = stable_counting_sort_triton(expert_ids.reshape(-1), num_experts)
    """
    keys = keys.contiguous()
    n, device = keys.numel(), keys.device
    if n == 0:  # a launch grid of zero programs is an error
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return torch.zeros(num_bins, dtype=torch.int64, device=device), empty, empty
    counts = torch.empty(num_bins, dtype=torch.int64, device=device)
    dest = torch.empty(n, dtype=torch.int64, device=device)
    order = torch.empty_like(dest)
    launch_counting_sort(keys, num_bins, counts, dest, order)
    return counts, dest, order


class PlanBuffers(NamedTuple):
    """Where :func:`launch_counting_sort` writes the routing plan (:mod:`~lightning_llmfast.moe.kernels.plan`)."""

    layout: Tensor  # (3 * B,) int32: kept pairs per key, their start rows, the dropped pairs' start rows
    offsets: Tensor  # (E + 1,) int32
    num_dropped: Tensor  # 0-d int64
    kept: Tensor  # (n,) bool
    tokens: Tensor  # (R,) int64
    capacity: int
    num_experts: int
    num_rows: int
    top_k: int
    weights: Tensor | None = None  # (n,) float32 pair weights, read with row_weights
    row_weights: Tensor | None = None  # (R,) float32
    prob_sums: Tensor | None = None  # (blocks, E) float32 per-block probability sums, read with the next four
    lse_sums: Tensor | None = None  # (blocks,) float32 per-block sums of logsumexp ** 2
    aux: Tensor | None = None  # 0-d float32 balance loss
    z: Tensor | None = None  # 0-d float32 z-loss


def launch_counting_sort(
    keys: Tensor, num_bins: int, counts: Tensor, dest: Tensor, order: Tensor, plan: PlanBuffers | None = None
) -> None:
    """The three counting-sort launches into caller-made buffers (``keys`` contiguous, ``n >= 1``).

    With ``plan`` they write the routing plan's capacity layout into it
    (:func:`~lightning_llmfast.moe.kernels.plan.routing_plan`); ``counts`` then may be int32, ``dest`` holds the
    clamped rows and ``order`` the permutation.
    """
    n, device = keys.numel(), keys.device
    num_blocks = triton.cdiv(n, _SORT_BLOCK)
    bins = triton.next_power_of_2(num_bins)
    hist = torch.empty(num_blocks, num_bins, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    _block_histogram_kernel[(num_blocks,)](keys, hist, rank, n, num_bins, BLOCK=_SORT_BLOCK, BINS=bins)
    prefix = torch.empty_like(hist)
    starts = torch.empty(num_bins, dtype=torch.int64, device=device)
    # Arguments a mode leaves unread get any tensor.
    p = plan or PlanBuffers(starts, starts, starts, dest, dest, 0, 0, 0, 1)
    losses = p.prob_sums is not None
    token_blocks = p.lse_sums.numel() if losses else 0
    chunk = max(1, min(triton.next_power_of_2(max(num_blocks, token_blocks)), _SCAN_TILE // bins))
    _block_scan_kernel[(1,)](
        hist, prefix, counts, starts, num_blocks, num_bins, p.layout, p.offsets, p.num_dropped, p.capacity,
        p.num_experts, *((p.prob_sums, p.lse_sums, p.aux, p.z) if losses else (starts,) * 4), token_blocks,
        p.top_k, CHUNK=chunk, BINS=bins, PLAN=plan is not None, LOSSES=losses,
    )  # fmt: skip
    weights = (p.weights, p.row_weights) if p.weights is not None else (starts, starts)
    _scatter_kernel[(num_blocks,)](
        keys, rank, prefix, starts, dest, order, n, num_bins, p.layout, p.kept, p.tokens, p.num_rows, p.top_k,
        *weights, BLOCK=_SORT_BLOCK, PLAN=plan is not None, WEIGHTS=p.weights is not None,
    )  # fmt: skip


def stable_counting_sort(
    keys: Tensor, num_bins: int, *, backend: str = "torch", validate: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Stable counting sort of integer keys; dispatches to the Triton kernels or the PyTorch reference.

    Args:
        keys: ``(n,)`` integer keys in ``[0, num_bins)``.
        num_bins: number of distinct keys, ``>= 1``.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (see :func:`resolve_backend`).
        validate: check that every key is in ``[0, num_bins)`` (one host sync on an accelerator). With ``False``
            (callers that produce the keys, such as :func:`~lightning_llmfast.moe.route`) an out-of-range key
            gives unspecified results: the PyTorch reference raises a torch error, the Triton kernels skip it
            (they never access memory out of bounds).

    Returns:
        ``counts`` ``(num_bins,)`` int64, ``dest`` ``(n,)`` int64 (the position of each key in the stable order)
        and ``order`` ``(n,)`` int64 (its inverse: the index of the key at each sorted position).

    Raises:
        RoutingError: ``keys`` not a 1-D integer tensor, ``num_bins`` not an int >= 1, an unknown ``backend``,
            or (``validate=True``) a key outside ``[0, num_bins)``.

    Example::

        counts, dest, order = stable_counting_sort(torch.tensor([1, 0, 1]), 2)  # [1, 2], [1, 0, 2], [1, 0, 2]
    """
    if not isinstance(keys, Tensor) or keys.dim() != 1:
        got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
        raise RoutingError(f"keys must be a 1-D integer tensor, got {got}")
    if keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
        raise RoutingError(f"keys must be an integer tensor, got {keys.dtype}")
    check_int("num_bins", num_bins, low=1, error=RoutingError)
    backend = resolve_backend(backend, keys.device)
    if validate and keys.numel():
        # NOTE: host sync (reads the key range); route() passes validate=False for the keys it makes itself.
        low, high = torch.stack(torch.aminmax(keys)).tolist()
        if low < 0 or high >= num_bins:
            bad = low if low < 0 else high
            raise RoutingError(f"keys must be in [0, num_bins={num_bins}), got a key {bad}")
    if backend == "triton":
        return stable_counting_sort_triton(keys, num_bins)
    return stable_counting_sort_reference(keys, num_bins)
