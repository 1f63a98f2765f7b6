"""Context parallelism's split of a packed batch: which flattened positions each of ``cp`` ranks holds.

:func:`context_split` cuts the ``N`` positions of a packed batch (documents and padding tails, every row boundary a
segment boundary) into ``cp`` sets of exactly ``N / cp`` positions whose causal attention work (over the held
positions, the number of keys each attends: its place in its document plus one) is balanced across ranks, with no
per-document padding.

How. Read a document of length ``L`` in *fold order*, offsets ``0, L-1, 1, L-2, ...``: every pair of consecutive
fold positions is a mirrored pair ``(j, L-1-j)`` whose work is ``L + 1``, so a run of fold positions has the
document's mean work per token, ``(L + 1) / 2``, up to half a pair at its two ends; a run of fold positions is at
most two contiguous pieces of the document (a prefix-side piece and its mirror: the classic 2·cp "zigzag" chunks
when one document is split across all ranks).

- Heavy documents (at least two positions per rank, and more than a quarter of a rank's fair work) are split across
  every rank in runs of whole mirrored pairs (so each run has exactly its document's mean work per position; at most
  two pieces), the ``floor``/``ceil`` of the pairs rotating over the ranks from document to document; the last one
  evens the ranks' counts out.
- Every other document is one *item*, or, when it weighs more than 4% of a rank's fair work or is longer than a
  sixteenth of a rank's positions, a few equal runs of whole mirrored pairs. Items are dealt heaviest first (the
  lightest in bundles) into ``cp`` lanes, each to the lane whose work still due most exceeds what the items left would
  bring its room; the lanes are laid end to end (each lane's lightest items at its two ends), read in fold order, and
  cut where each rank's count reaches exactly ``N / cp`` minus what the heavy documents gave it. A cut splits at most
  one item.

Balance: the largest rank's work is within 5% of the mean whenever every rank holds at least
:func:`balanced_min_positions` positions (``N / cp >= max(64, 8 * cp)``), whatever the document lengths (one
document, hundreds of short ones, length-1 documents, prime lengths, rows with padding tails);
tests/test_context_split.py checks this on random batches of six length distributions against a brute-force count.
Below that the integer works may make 5% impossible (positions of works ``1, 2, 3`` and ``1..5`` over 4 ranks of 2:
the best split's largest rank does 6, the mean is 5.25).

Pieces: a rank holds at most two pieces of each heavy document, whole light documents or runs of mirrored pairs of
mid-size ones, and at most two partial items at its cuts. Host NumPy only; deterministic (stable sorts, no randomness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError, MetadataError

__all__ = ["ContextShard", "balanced_min_positions", "context_shard_plan", "context_split", "split_positions"]

# A document of at least two positions per rank whose work exceeds this share of a rank's fair work is split across
# every rank (at most two pieces on each).
_SPLIT_ALL_SHARE = 0.25
# Other documents weighing more than this share of a rank's fair work, or longer than 1/_ITEM_FRACTION of its
# positions, are cut into equal fold runs (whole mirrored pairs) below both, dealt like short documents.
_ITEM_SHARE = 0.04
_ITEM_FRACTION = 16
# Light items are dealt in bundles of at most this share of a rank's work and 1/_BUNDLE_FRACTION of its positions.
_BUNDLE_SHARE = 0.004
_BUNDLE_FRACTION = 64


def balanced_min_positions(cp_size: int) -> int:
    """Positions per rank from which :func:`context_split` keeps every rank's work within 5% of the mean:
    ``max(64, 8 * cp_size)`` (below it, integer works may make 5% impossible; see the module docstring).

    Example::

        balanced_min_positions(4), balanced_min_positions(16)  # (64, 128)
    """
    return max(64, 8 * check_int("cp_size", cp_size, low=1))


def context_split(cu_seqlens: Any, cp_size: int) -> list[Tensor]:
    """The flattened positions each of ``cp_size`` context-parallel ranks holds for a packed batch.

    Args:
        cu_seqlens: ``(segments + 1,)`` host boundaries over the flattened ``B * T`` positions (a CPU tensor, NumPy
            array or list), rising from 0; a ``PackedBatch``'s ``cu_seqlens_cpu`` already has every row end and
            padding tail as a boundary. Empty segments are allowed.
        cp_size: ranks of the context-parallel group (at least 1).

    Returns:
        ``cp_size`` int64 CPU tensors of ``N / cp_size`` ascending positions each: every position held exactly once,
        causal attention work balanced within 5% (max/mean) when ``N / cp_size >= balanced_min_positions(cp_size)``.

    Raises:
        ConfigError: ``cp_size`` is not a positive int, or ``N`` is not a multiple of it.
        MetadataError: ``cu_seqlens`` is not 1-D integer boundaries rising from 0.

    Example::

        parts = context_split(torch.tensor([0, 8]), 2)
        parts  # [tensor([0, 1, 6, 7]), tensor([2, 3, 4, 5])]: the zigzag halves of one document
    """
    return [torch.from_numpy(part) for part in split_positions(_host_boundaries(cu_seqlens), cp_size)]


def _host_boundaries(cu_seqlens: Any) -> np.ndarray:
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.device.type != "cpu":
            raise MetadataError(
                f"cu_seqlens: context_split plans on the host; pass the CPU copy (cu_seqlens_cpu), got a tensor on "
                f"{cu_seqlens.device}"
            )
        cu = cu_seqlens.numpy()
    else:
        cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or (cu.size and not np.issubdtype(cu.dtype, np.integer)):
        raise MetadataError(f"cu_seqlens: must be 1-D integer boundaries, got shape {cu.shape} and dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or (np.diff(cu) < 0).any():
        raise MetadataError(f"cu_seqlens: must rise from 0 (non-decreasing), got {cu[:8].tolist()}...")
    return cu


def split_positions(cu: np.ndarray, cp_size: int) -> list[np.ndarray]:
    """:func:`context_split` on a checked int64 host array of boundaries; returns NumPy arrays."""
    cp = check_int("cp_size", cp_size, low=1)
    total = int(cu[-1])
    if total % cp:
        raise ConfigError(
            f"context parallelism: the batch's {total} positions (B * T) are not divisible by "
            f"context_parallel_size={cp}; make batch_size * seq_len a multiple of {cp} "
            f"(e.g. seq_len a multiple of {cp})"
        )
    if cp == 1:
        return [np.arange(total, dtype=np.int64)]
    per_rank = total // cp
    lengths = np.diff(cu)
    starts = cu[:-1]
    work = lengths * (lengths + 1) / 2.0
    fair = float(work.sum()) / cp
    split_all = (lengths >= 2 * cp) & (work > _SPLIT_ALL_SHARE * fair)
    # Longest first (stable: ties keep batch order), so the rotation of the extra positions is deterministic.
    by_length = np.argsort(-lengths, kind="stable")
    parts: list[list[np.ndarray]] = [[] for _ in range(cp)]
    count, load = _split_long(by_length[split_all[by_length]].tolist(), starts, lengths, cp, parts)
    dealt = by_length[~split_all[by_length] & (lengths[by_length] > 0)]
    items = _items(dealt, lengths, fair, per_rank)
    _deal(items, starts, lengths, per_rank - count, fair - load, parts)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]


def _fold_offsets(length: int, begin: int, end: int) -> np.ndarray:
    """Offsets inside a document of length ``length`` at fold positions ``[begin, end)`` (``0, L-1, 1, L-2, ...``)."""
    k = np.arange(begin, end, dtype=np.int64)
    half = k // 2
    return np.where(k % 2 == 0, half, length - 1 - half)


def _split_long(
    docs: list[int], starts: np.ndarray, lengths: np.ndarray, cp: int, parts: list[list[np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Splits each document in ``docs`` over all ranks in fold order; returns the positions and work each rank got.

    Rank ``r`` ends with ``floor((total + r) / cp)`` positions of these documents. Every document but the last
    (shortest) is cut into runs of whole mirrored pairs (exactly its mean work per position), the ``floor``/``ceil``
    of its pairs over the ranks rotating from document to document and its middle position (odd lengths) going to
    the rank with the fewest so far; the last evens the counts out. Where it cannot (its share would be negative on
    some rank), every document is cut into ``floor``/``ceil`` of ``L / cp`` positions, rotating likewise.
    """
    ranks = np.arange(cp)
    takes = _pair_takes(docs, lengths, cp)
    if takes is None:
        before, takes = 0, []
        for doc in docs:
            length = int(lengths[doc])
            takes.append((before + length + ranks) // cp - (before + ranks) // cp)
            before += length
    count = np.zeros(cp, dtype=np.int64)
    work = np.zeros(cp)
    for i, (doc, took) in enumerate(zip(docs, takes)):
        length, start = int(lengths[doc]), int(starts[doc])
        # Alternate which ranks take the leading fold positions, so that no rank always holds a document's start;
        # a rank with an odd share goes last (a run of whole pairs ending at the middle position).
        order = ranks if i % 2 == 0 else ranks[::-1]
        order = np.concatenate([order[took[order] % 2 == 0], order[took[order] % 2 == 1]])
        cursor = 0
        for rank in order:
            n = int(took[rank])
            if n:
                offsets = _fold_offsets(length, cursor, cursor + n)
                parts[rank].append(start + offsets)
                work[rank] += float(offsets.sum() + n)
                cursor += n
        count += took
    return count, work


def _pair_takes(docs: list[int], lengths: np.ndarray, cp: int) -> list[np.ndarray] | None:
    """Each document's positions per rank in whole pairs, the last one evening the counts out (``None``: it cannot)."""
    ranks = np.arange(cp)
    target = (int(lengths[docs].sum()) + ranks) // cp
    count = np.zeros(cp, dtype=np.int64)
    takes = []
    pairs_before = 0  # pairs already dealt: where this document's rotation starts
    for doc in docs[:-1]:
        length = int(lengths[doc])
        pairs = length // 2
        took = 2 * ((pairs_before + pairs + ranks) // cp - (pairs_before + ranks) // cp)
        pairs_before += pairs
        if length % 2:
            took[int(np.argmin(count + took))] += 1
        takes.append(took)
        count += took
    last = target - count
    if (last < 0).any():
        return None
    return [*takes, last]


def _items(docs: np.ndarray, lengths: np.ndarray, fair: float, per_rank: int) -> tuple[np.ndarray, ...]:
    """``(document, fold begin, fold end)`` arrays of the runs to deal whole: a document, or equal runs of whole
    mirrored pairs of one that weighs more than ``_ITEM_SHARE`` of a rank's work or is longer than
    ``per_rank / _ITEM_FRACTION``."""
    length = lengths[docs]
    pairs = (length + 1) // 2
    pieces = np.maximum(
        np.ceil(length * (length + 1) / 2.0 / (_ITEM_SHARE * fair)), np.ceil(length * _ITEM_FRACTION / per_rank)
    )
    pieces = np.clip(pieces.astype(np.int64), 1, np.maximum(pairs, 1))
    whole = pieces == 1
    doc, begin, end = [docs[whole]], [np.zeros(int(whole.sum()), dtype=np.int64)], [length[whole]]
    for d, n, count, p in zip(
        docs[~whole].tolist(), length[~whole].tolist(), pairs[~whole].tolist(), pieces[~whole].tolist()
    ):
        bounds = [2 * (count * k // p) for k in range(p)] + [n]
        doc.append(np.full(p, d, dtype=np.int64))
        begin.append(np.array(bounds[:-1], dtype=np.int64))
        end.append(np.array(bounds[1:], dtype=np.int64))
    return np.concatenate(doc), np.concatenate(begin), np.concatenate(end)


def _deal(
    items: tuple[np.ndarray, ...],
    starts: np.ndarray,
    lengths: np.ndarray,
    quota: np.ndarray,
    work_left: np.ndarray,
    parts: list[list[np.ndarray]],
) -> None:
    """Deals the items (heaviest first) into lanes, lays the lanes end to end and cuts them at exactly ``quota[r]``
    positions per rank (a cut splits at most one item, in fold order)."""
    cp = quota.size
    doc, begin, end = items
    if doc.size == 0:
        return
    size = end - begin
    # A run of whole mirrored pairs (plus the middle position of an odd document) has its document's mean work.
    weight = size * (lengths[doc] + 1) / 2.0
    units = _bundles(weight, size, float(work_left.sum()) / cp, float(quota.sum()) / cp)
    unit_size = np.array([int(size[u].sum()) for u in units], dtype=np.int64)
    unit_weight = np.array([float(weight[u].sum()) for u in units])
    # Each lane must end with its rank's positions and work left after the split documents. Units go heaviest first
    # to the lane whose work left most exceeds what the units still to come would bring its positions left (plain
    # Python floats: cp is small and a batch may hold thousands of units).
    room = [float(q) for q in quota]
    need = [float(w) for w in work_left]
    lanes: list[list[int]] = [[] for _ in range(cp)]
    rest_len, rest_work = float(size.sum()), float(weight.sum())
    for j, (n, w) in enumerate(zip(unit_size.tolist(), unit_weight.tolist())):
        density = rest_work / rest_len
        lane, best = -1, -math.inf
        for r in range(cp):  # ties: the lowest rank
            value = need[r] - density * room[r]
            if room[r] >= n and value > best:
                lane, best = r, value
        if lane < 0:  # no lane has room for it whole: the cuts will split it
            lane = max(range(cp), key=lambda r: (need[r] - density * room[r], -r))
        lanes[lane].append(j)
        room[lane] -= n
        need[lane] -= w
        rest_len -= n
        rest_work -= w
    # Each lane's lightest units at its two ends, where the exact cuts may move a few positions to a neighbour.
    order: list[np.ndarray] = []
    for lane in lanes:
        ascending = sorted(lane, key=lambda j: (unit_weight[j], j))
        order.extend(units[j] for j in ascending[0::2] + ascending[1::2][::-1])
    # The lanes end to end as one stream of positions (each item in fold order), cut at the ranks' quotas.
    ordered = np.concatenate(order)
    run = size[ordered]
    first = np.repeat(np.cumsum(run) - run, run)
    fold = np.repeat(begin[ordered], run) + np.arange(int(run.sum()), dtype=np.int64) - first
    length = np.repeat(lengths[doc[ordered]], run)
    half = fold // 2
    stream = np.repeat(starts[doc[ordered]], run) + np.where(fold % 2 == 0, half, length - 1 - half)
    cuts = np.zeros(cp + 1, dtype=np.int64)
    np.cumsum(quota, out=cuts[1:])
    for rank in range(cp):
        if cuts[rank + 1] > cuts[rank]:
            parts[rank].append(stream[cuts[rank] : cuts[rank + 1]])


def _bundles(weight: np.ndarray, size: np.ndarray, fair: float, per_rank: float) -> list[np.ndarray]:
    """The items heaviest first (ties: batch order) as *units* to deal: each item alone, except that consecutive light
    items (under ``_BUNDLE_SHARE`` of a rank's work) are bundled up to that weight and ``per_rank / _BUNDLE_FRACTION``
    positions, so that thousands of tiny documents cost a few hundred choices."""
    ranked = np.lexsort((np.arange(size.size), -weight))
    cap, size_cap = max(_BUNDLE_SHARE * fair, 1.0), max(per_rank / _BUNDLE_FRACTION, 1.0)
    light = weight[ranked] <= cap
    heavy = [ranked[i : i + 1] for i in np.flatnonzero(~light)]
    rest = ranked[light]
    if rest.size == 0:
        return heavy
    bundle = np.maximum(np.cumsum(weight[rest]) // cap, np.cumsum(size[rest]) // size_cap)
    breaks = np.flatnonzero(np.diff(bundle)) + 1
    return heavy + np.split(rest, breaks)


@dataclass(frozen=True, eq=False)
class ContextShard:
    """What one context-parallel rank's share of a packed batch needs to attend, built once on the host.

    The rank holds ``positions`` (ascending global flattened positions) as *pieces*: runs of consecutive positions of
    one document, the segments of its shard batch's ``cu_seqlens``. Piece ``j`` starts ``offsets[j]`` positions into
    its document and attends that document's keys from its start up to the piece's end: ``offsets[j] + len_j`` keys,
    the ranges of ``cu_seqlens_k``. Every rank of the group holds the same number of positions, so all-gathering a
    per-position tensor gives ``size * len(positions)`` rows, rank after rank (*gathered order*).

    Attributes:
        rank: this rank's index in the context-parallel group.
        size: ranks in the group.
        group: the group's ``ProcessGroup`` (``None`` for the default group, or when ``size == 1``).
        positions: ``(N / size,)`` int64 host: the global positions held.
        offsets: ``(pieces,)`` int64 host: each piece's first position inside its document (its RoPE position).
        cu_seqlens_k: ``(pieces + 1,)`` int32 host: cumulative key counts, piece after piece.
        max_seqlen_k: the most keys a piece attends.
        key_index: ``(cu_seqlens_k[-1],)`` int64 host: for each piece's keys, in order, its row in gathered order.
        gather_order: ``(N,)`` int64 host: the gathered row of every global position
            (``gathered.index_select(0, gather_order)`` is the batch's global order).
        documents: ``(pieces,)`` int64 host: each piece's document, as its segment's index in the batch's
            ``cu_seqlens`` (the same numbering on every rank of the group: what a per-document statistic sums over).
        num_documents: segments of the batch's ``cu_seqlens``.

    Example::

        shard, cu_q = context_shard_plan(torch.tensor([0, 8]), cp_rank=0, cp_size=2)
        shard.positions, shard.offsets        # tensor([0, 1, 6, 7]), tensor([0, 6])
        shard.cu_seqlens_k                     # tensor([0, 2, 10], dtype=torch.int32)
        shard.documents, shard.num_documents   # tensor([0, 0]), 1: both pieces belong to document 0
    """

    rank: int
    size: int
    group: Any
    positions: Tensor
    offsets: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_k: int
    key_index: Tensor
    gather_order: Tensor
    documents: Tensor
    num_documents: int

    @property
    def num_keys(self) -> int:
        """Keys attended over all pieces (rows of the per-piece key buffer)."""
        return int(self.cu_seqlens_k[-1])


def context_shard_plan(cu_seqlens: Any, cp_rank: int, cp_size: int, group: Any = None) -> tuple[ContextShard, Tensor]:
    """Rank ``cp_rank``'s :class:`ContextShard` of the packed batch with boundaries ``cu_seqlens`` (host), and its
    pieces' boundaries over its positions (``(pieces + 1,)`` int32 host, the shard batch's ``cu_seqlens``).

    Args:
        cu_seqlens: host boundaries over the batch's flattened positions (as for :func:`context_split`).
        cp_rank: this rank's index in the group, in ``[0, cp_size)``.
        cp_size: ranks in the context-parallel group.
        group: the group's ``ProcessGroup``, carried for the attention's all-gather.

    Returns:
        ``(shard, cu_seqlens_q)``.

    Raises:
        ConfigError: ``cp_rank`` is outside ``[0, cp_size)`` or ``cp_size`` does not divide the positions.

    Example::

        shard, cu_q = context_shard_plan(batch.cu_seqlens_cpu, cp_rank=1, cp_size=2, group=cp_group)
    """
    cu = _host_boundaries(cu_seqlens)
    parts = split_positions(cu, cp_size)
    rank = check_int("cp_rank", cp_rank, low=0, high=cp_size - 1)
    per_rank = int(cu[-1]) // cp_size
    gather_order = np.empty(int(cu[-1]), dtype=np.int64)
    for r, part in enumerate(parts):
        gather_order[part] = r * per_rank + np.arange(per_rank, dtype=np.int64)
    held = parts[rank]
    doc = np.searchsorted(cu, held, side="right") - 1  # the non-empty segment of each position
    new_piece = np.ones(held.size, dtype=bool)
    new_piece[1:] = (held[1:] != held[:-1] + 1) | (doc[1:] != doc[:-1])
    first = np.flatnonzero(new_piece)
    lengths = np.diff(np.append(first, held.size))
    doc_start = cu[doc[first]]
    offsets = held[first] - doc_start
    keys = offsets + lengths
    cu_q = np.zeros(first.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_q[1:])
    cu_k = np.zeros(first.size + 1, dtype=np.int64)
    np.cumsum(keys, out=cu_k[1:])
    # Each piece's keys: its document's positions from the start to the piece's end, as rows of the gathered buffer.
    key_positions = np.repeat(doc_start - cu_k[:-1], keys) + np.arange(int(cu_k[-1]), dtype=np.int64)
    plan = [torch.from_numpy(a) for a in (offsets, cu_k.astype(np.int32), gather_order[key_positions])]
    for tensor in plan:
        # Their sizes change with the document layout: torch.compile traces them with dynamic sizes from the first
        # batch on (the compiled attention takes them as op inputs), not one graph per size.
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    shard = ContextShard(
        rank=rank,
        size=int(cp_size),
        group=group,
        positions=torch.from_numpy(held),
        offsets=plan[0],
        cu_seqlens_k=plan[1],
        max_seqlen_k=int(keys.max()) if keys.size else 0,
        key_index=plan[2],
        gather_order=torch.from_numpy(gather_order),
        documents=torch.from_numpy(doc[first]),
        num_documents=int(cu.size - 1),
    )
    return shard, torch.from_numpy(cu_q.astype(np.int32))
