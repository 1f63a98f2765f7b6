"""``context_split``: every position once, equal counts, causal work within 5% across ranks, against a brute-force
count on random and awkward batches; ``PackedBatch.context_shard``: the rank's tokens, pieces and key ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.data.context import balanced_min_positions
from lightning_llmfast.errors import ConfigError, DataError, MetadataError
from lightning_llmfast.seqmeta import SequenceMetadata, context_split


def _brute_work(lengths: list[int], held: torch.Tensor) -> int:
    """Keys attended by the held positions, counted one position at a time."""
    owner = []
    for length in lengths:
        owner.extend(range(1, length + 1))  # the keys position j of a document attends: j + 1
    return sum(owner[p] for p in held.tolist())


def _check(lengths: list[int], cp: int, bound: float | None = 1.05) -> list[torch.Tensor]:
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    parts = context_split(cu, cp)
    total = int(cu[-1])
    assert len(parts) == cp
    for part in parts:
        assert part.dtype == torch.int64 and part.numel() == total // cp
        assert bool((part[1:] > part[:-1]).all())  # ascending, no repeats
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(total))
    if bound is not None:
        work = [_brute_work(lengths, p) for p in parts]
        assert max(work) <= bound * (sum(work) / cp), (lengths, cp, work)
    return parts


def _random_lengths(rng: np.random.Generator, total: int) -> list[int]:
    kind = int(rng.integers(6))
    if kind == 0:  # hundreds of tiny documents
        lengths = rng.integers(1, 4, size=total)
    elif kind == 1:  # geometric, mean anywhere from 2 to half the batch
        lengths = rng.geometric(1.0 / rng.uniform(2, total / 2), size=total)
    elif kind == 2:  # heavy-tailed
        lengths = (rng.pareto(rng.uniform(0.5, 3), size=total) * rng.uniform(1, 50) + 1).astype(np.int64)
    elif kind == 3:  # a few random cuts: long documents
        cuts = np.sort(rng.choice(np.arange(1, total), size=int(rng.integers(1, 6)), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [total]]))
    elif kind == 4:  # primes and length-1 documents mixed
        lengths = rng.choice([1, 2, 3, 5, 7, 11, 13, 97, 211, 1009], size=total)
    else:  # [B, T] rows of geometric documents, each row's last cut at the row end (a padding tail)
        row = int(rng.choice([total // 8, total // 2, total])) or total
        lengths = []
        for _ in range(total // row):
            cuts = np.cumsum(rng.geometric(1.0 / rng.uniform(2, row), size=row))
            cuts = cuts[cuts < row]
            lengths.extend(np.diff(np.concatenate([[0], cuts, [row]])).tolist())
        lengths = np.array([*lengths, total - row * (total // row)], dtype=np.int64)
        lengths = lengths[lengths > 0]
    lengths = lengths[np.cumsum(lengths) <= total]
    rest = total - int(lengths.sum())
    return [int(n) for n in lengths] + ([rest] if rest else [])


def test_random_batches_balanced_against_brute_force() -> None:
    rng = np.random.default_rng(55)  # six length distributions, cp up to 16, the fewest positions the bound allows
    for _ in range(200):
        cp = int(rng.choice([2, 3, 4, 8, 16]))
        least = balanced_min_positions(cp)
        per_rank = int(rng.choice([least, least + 1, least + 33, 2 * least, 509]))
        _check(_random_lengths(rng, cp * per_rank), cp)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_awkward_batches(cp: int) -> None:
    per_rank = 128
    total = cp * per_rank
    _check([total], cp)  # one document across all ranks
    _check([1] * total, cp)  # only length-1 documents
    _check([total - 1, 1], cp)
    _check([1, total - 2, 1], cp)
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101]
    lengths = [p for p in primes * 8 if p]
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), total, side="right"))]
    _check([*lengths, total - sum(lengths)], cp)
    # A [B, T] batch: a document of exactly T, rows of short documents with padding tails, an empty segment.
    rows, seq = 4, total // 4
    _check([seq, 3, seq - 3, 0, 1, seq - 10, 9, seq], cp)
    assert rows * seq == total


def test_one_document_is_the_zigzag() -> None:
    parts = context_split(torch.tensor([0, 8]), 2)
    assert [p.tolist() for p in parts] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    parts = context_split(torch.tensor([0, 16]), 4)
    assert [p.tolist() for p in parts] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_small_batches_cover_and_count() -> None:
    # Below balanced_min_positions(cp) per rank only the 5% bound may fail (integer works); coverage and counts hold.
    rng = np.random.default_rng(7)
    for per_rank in (1, 2, 3, 5, 16):
        for cp in (2, 4):
            _check(_random_lengths(rng, cp * per_rank) if per_rank > 1 else [1] * cp, cp, bound=None)
    # Works 1..3 and 1..5 over 4 ranks of 2 positions: the mean is 5.25, every split has a rank doing 6 or more.
    parts = _check([3, 5], 4, bound=None)
    assert max(_brute_work([3, 5], p) for p in parts) == 6


def test_deterministic_and_cp_one() -> None:
    cu = torch.tensor([0, 5, 6, 40, 41, 64], dtype=torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(context_split(cu, 4), context_split(cu.clone(), 4)))
    assert torch.equal(context_split(cu, 1)[0], torch.arange(64))
    # Lists and NumPy arrays are host boundaries too: two documents of two positions, one to each rank.
    assert sorted(p.tolist() for p in context_split([0, 2, 4], 2)) == [[0, 1], [2, 3]]
    assert [p.tolist() for p in context_split(np.array([0, 0, 2]), 2)] == [[0], [1]]


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match=r"10 positions .* not divisible by context_parallel_size=4.*multiple of 4"):
        context_split(torch.tensor([0, 3, 10]), 4)
    with pytest.raises(ConfigError, match="cp_size"):
        context_split(torch.tensor([0, 4]), 0)
    with pytest.raises(MetadataError, match="rise from 0"):
        context_split(torch.tensor([0, 5, 4]), 2)
    with pytest.raises(MetadataError, match="1-D integer"):
        context_split(torch.tensor([[0, 4]]), 2)


def _packed(seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 37, 64, 5, 1, 90, 13, 2, 29]  # a document of exactly T=64, one longer than T, length-1 ones
    docs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lengths]
    return next(pack_documents(docs, seq_len=64, batch_size=4))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_shard_batches(cp: int) -> None:
    batch = _packed(cp)
    cu = batch.cu_seqlens_cpu.long()
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    held, real = [], 0
    for rank in range(cp):
        shard = batch.context_shard(rank, cp, None)
        shard.validate()
        pos = shard.context.positions
        assert shard.input_ids.shape == (1, batch.input_ids.numel() // cp)
        assert torch.equal(shard.input_ids[0], batch.input_ids.view(-1)[pos])
        assert torch.equal(shard.labels[0], batch.labels.view(-1)[pos])
        assert torch.equal(shard.position_ids[0], pos - starts[pos])  # places inside the documents
        # Pieces: runs of consecutive positions of one segment, each starting at its offset.
        pieces = shard.cu_seqlens_cpu.long()
        assert shard.max_seqlen == int(pieces.diff().max())
        for j, (lo, hi) in enumerate(zip(pieces[:-1].tolist(), pieces[1:].tolist())):
            assert torch.equal(pos[lo:hi], torch.arange(int(pos[lo]), int(pos[lo]) + hi - lo))
            assert int(shard.context.offsets[j]) == int(pos[lo] - starts[pos[lo]])
            keys = int(shard.context.cu_seqlens_k[j + 1] - shard.context.cu_seqlens_k[j])
            assert keys == int(shard.context.offsets[j]) + hi - lo
        meta = SequenceMetadata.from_batch(shard.to("cpu"))
        assert meta.context is shard.context and torch.equal(meta.position_ids, shard.position_ids[0])
        held.append(pos)
        real += shard.num_tokens
    assert torch.equal(torch.cat(held).sort().values, torch.arange(batch.input_ids.numel()))
    assert real == batch.num_tokens  # the padding tails are known from `documents`


def test_context_shard_errors() -> None:
    batch = _packed(0)
    shard = batch.context_shard(0, 2)
    with pytest.raises(DataError, match="already a context-parallel shard"):
        shard.context_shard(0, 2)
    with pytest.raises(ConfigError, match="cp_rank"):
        batch.context_shard(2, 2)
    with pytest.raises(ConfigError, match="not divisible by context_parallel_size=3"):
        batch.context_shard(0, 3)
    shard.position_ids[0, -1] += 1
    with pytest.raises(MetadataError, match="position_ids disagree"):
        shard.validate()
    with pytest.raises(MetadataError, match="ContextShard of these"):
        SequenceMetadata(torch.tensor([0, 4], dtype=torch.int32), context=batch.context_shard(1, 2).context)


def test_rows_are_whole_segments_of_the_batch() -> None:
    # Pipeline microbatches under cp are cut from rows first: the rows' pieces put back together are the batch.
    batch = _packed(1)
    cuts = [(0, 1), (1, 3), (3, 4)]
    parts = [batch.rows(lo, hi) for lo, hi in cuts]
    cu, documents, offset = [0], [], 0
    for (lo, hi), part in zip(cuts, parts, strict=True):
        part.validate()
        assert torch.equal(part.input_ids, batch.input_ids[lo:hi]) and torch.equal(part.labels, batch.labels[lo:hi])
        assert part.max_seqlen == int(part.cu_seqlens_cpu.diff().max())
        cu += (part.cu_seqlens_cpu[1:].long() + offset).tolist()
        documents += part.documents
        offset += part.input_ids.numel()
    assert cu == batch.cu_seqlens_cpu.tolist() and documents == batch.documents
    assert sum(p.num_tokens for p in parts) == batch.num_tokens  # padding tails known from `documents`
    with pytest.raises(DataError, match="not a non-empty range"):
        batch.rows(2, 2)
    with pytest.raises(DataError, match="no rows to cut"):
        batch.context_shard(0, 2).rows(0, 1)
