"""SequenceMetadata, its cache and the HF interop, against simple-loop references on random packings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_llmfast
from lightning_llmfast import MetadataError
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.seqmeta import (
    SequenceMetadata,
    SequenceMetadataCache,
    active_cache,
    dense_block_causal_mask,
    to_flash_attention_kwargs,
)


def _reference(lengths: list[int]) -> dict[str, list[int]]:
    """Simple-loop reference: cu_seqlens, per-token position and document ids."""
    cu, pos, doc = [0], [], []
    for d, n in enumerate(lengths):
        cu.append(cu[-1] + n)
        pos.extend(range(n))
        doc.extend([d] * n)
    return {"cu": cu, "pos": pos, "doc": doc}


def _check_against_reference(meta: SequenceMetadata, lengths: list[int]) -> None:
    ref = _reference(lengths)
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens_cpu.dtype == torch.int32
    assert meta.cu_seqlens_cpu.device.type == "cpu"
    assert meta.cu_seqlens_cpu.tolist() == ref["cu"] and meta.cu_seqlens.tolist() == ref["cu"]
    assert meta.num_tokens == ref["cu"][-1]
    assert meta.num_sequences == len(lengths)
    assert meta.max_seqlen == max(lengths, default=0)
    assert meta.position_ids.tolist() == ref["pos"]
    assert meta.document_ids.tolist() == ref["doc"]


lengths_strategy = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy)
def test_constructors_agree_with_reference(lengths: list[int]) -> None:
    _check_against_reference(SequenceMetadata.from_lengths(lengths), lengths)
    cu = _reference(lengths)["cu"]
    _check_against_reference(SequenceMetadata.from_cu_seqlens(torch.tensor(cu)), lengths)
    _check_against_reference(SequenceMetadata.from_cu_seqlens(cu, num_tokens=cu[-1]), lengths)
    nonempty = [n for n in lengths if n > 0]
    pos = torch.tensor(_reference(nonempty)["pos"], dtype=torch.int64)
    _check_against_reference(SequenceMetadata.from_position_ids(pos), nonempty)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=4), seed=st.integers(0, 2)
)
def test_from_position_ids_2d_rows_always_start_a_sequence(rows: list[list[int]], seed: int) -> None:
    # Each row holds documents; pad every row to the same T with a tail that restarts at 0, like the packer.
    t = max(sum(r) for r in rows) + random.Random(seed).randint(0, 2)
    lengths: list[int] = []
    pos_rows = []
    for r in rows:
        tail = t - sum(r)
        row_lengths = r + ([tail] if tail else [])
        lengths += row_lengths
        pos_rows.append(_reference(row_lengths)["pos"])
    meta = SequenceMetadata.from_position_ids(torch.tensor(pos_rows))
    _check_against_reference(meta, lengths)
    # A row that starts mid-document (position 5) still starts a new sequence: rows are independent.
    meta = SequenceMetadata.from_position_ids(torch.tensor([[0, 1, 2], [5, 6, 0]]))
    assert meta.cu_seqlens.tolist() == [0, 3, 5, 6]


def test_example_and_lazy_memoised_fields() -> None:
    meta = SequenceMetadata.from_lengths([3, 1, 4])
    assert meta.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert meta.position_ids is meta.position_ids  # memoised
    assert meta.document_ids is meta.document_ids
    assert dense_block_causal_mask(meta) is dense_block_causal_mask(meta)
    assert meta.fingerprint == SequenceMetadata.from_cu_seqlens([0, 3, 4, 8]).fingerprint
    assert meta.fingerprint != SequenceMetadata.from_lengths([3, 2, 3]).fingerprint
    assert hash(meta.fingerprint) == hash(SequenceMetadata.from_lengths([3, 1, 4]).fingerprint)
    with pytest.raises(AttributeError, match="immutable"):
        meta.max_seqlen = 2  # type: ignore[misc]
    assert meta.to("cpu") is meta
    assert lightning_llmfast.SequenceMetadata is SequenceMetadata
    assert lightning_llmfast.SequenceMetadataCache is SequenceMetadataCache


def test_max_seqlen_upper_bound_is_kept() -> None:
    assert SequenceMetadata.from_cu_seqlens([0, 2, 5], max_seqlen=8).max_seqlen == 8
    assert SequenceMetadata.from_cu_seqlens([0, 2, 5]).max_seqlen == 3


@pytest.mark.parametrize("lengths", [[1], [7], [1, 1, 1, 1], [2, 5, 3], [4, 0, 2]])
def test_dense_block_causal_mask_matches_loops(lengths: list[int]) -> None:
    meta = SequenceMetadata.from_lengths(lengths)
    doc = _reference(lengths)["doc"]
    n = meta.num_tokens
    causal = [[doc[i] == doc[j] and j <= i for j in range(n)] for i in range(n)]
    block = [[doc[i] == doc[j] for j in range(n)] for i in range(n)]
    assert dense_block_causal_mask(meta).tolist() == causal
    assert dense_block_causal_mask(meta, causal=False).tolist() == block


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cu_seqlens": [1, 3, 5]}, r"cu_seqlens: must start at 0; first offending index 0"),
        ({"cu_seqlens": [0, 3, 2, 5]}, r"cu_seqlens: must be non-decreasing; first offending index 2"),
        ({"cu_seqlens": [0, 3, 5], "num_tokens": 6}, r"cu_seqlens: last value must equal num_tokens=6; .*index 2"),
        ({"cu_seqlens": [0, 3, 2**31]}, r"cu_seqlens: values must fit int32; first offending index 2"),
        ({"cu_seqlens": [0, 3, 2**70]}, r"cu_seqlens: .*int32"),
        ({"cu_seqlens": [0, 3, 5], "max_seqlen": 2}, r"max_seqlen: 2 is below the longest sequence \(3 .*index 0\)"),
        ({"cu_seqlens": torch.tensor([0.0, 3.0])}, r"cu_seqlens: must have an integer dtype"),
        ({"cu_seqlens": [0.0, 3.5]}, r"cu_seqlens: must have an integer dtype"),
        ({"cu_seqlens": torch.zeros(2, 2, dtype=torch.int32)}, r"cu_seqlens: must be 1-D"),
        ({"cu_seqlens": []}, r"cu_seqlens: must hold at least one value"),
        ({"cu_seqlens": "0,3"}, r"cu_seqlens: must be a 1-D integer"),
        ({"cu_seqlens": [0, 1], "num_tokens": True}, r"num_tokens must be an int >= 0, got True"),
        ({"cu_seqlens": [0, 3], "num_tokens": 3.0}, r"num_tokens must be an int >= 0, got 3.0"),
        ({"cu_seqlens": [0, 3], "num_tokens": "3"}, r"num_tokens must be an int >= 0, got '3'"),
        ({"cu_seqlens": [0, 0], "num_tokens": -1}, r"num_tokens must be an int >= 0, got -1"),
    ],
)
def test_invalid_cu_seqlens_raise_metadata_error(kwargs: dict, match: str) -> None:
    with pytest.raises(MetadataError, match=match) as info:
        SequenceMetadata.from_cu_seqlens(**kwargs)
    assert isinstance(info.value, ValueError)


def test_num_tokens_accepts_numpy_ints() -> None:
    assert SequenceMetadata.from_cu_seqlens([0, 3], num_tokens=np.int64(3)).num_tokens == 3


def test_invalid_lengths_and_position_ids_raise_metadata_error() -> None:
    with pytest.raises(MetadataError, match=r"lengths: must be non-negative; first offending index 1"):
        SequenceMetadata.from_lengths([2, -1, 3])
    with pytest.raises(MetadataError, match=r"position_ids: must be non-negative; first offending index 2"):
        SequenceMetadata.from_position_ids(torch.tensor([0, 1, -1]))
    with pytest.raises(MetadataError, match=r"position_ids: must restart at 0 or count up by one; .*index 2"):
        SequenceMetadata.from_position_ids(torch.tensor([0, 1, 3, 0]))
    with pytest.raises(MetadataError, match=r"position_ids: must have an integer dtype"):
        SequenceMetadata.from_position_ids(torch.zeros(3))
    with pytest.raises(MetadataError, match=r"position_ids: must be 1-D or \[batch, seq_len\]"):
        SequenceMetadata.from_position_ids(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(MetadataError, match=r"batch: a dict holds neither cu_seqlens nor position_ids"):
        SequenceMetadata.from_batch({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(MetadataError, match=r"max_seqlen: must be a Python int"):
        SequenceMetadata.from_batch({"cu_seqlens": torch.tensor([0, 2]), "max_seqlen": torch.tensor(2)})


def _packed_batch(rows: int = 2, seq_len: int = 16, seed: int = 0):
    from lightning_llmfast.data import pack_documents

    rng = random.Random(seed)
    docs = [[rng.randrange(1, 200) for _ in range(rng.randint(1, 2 * seq_len))] for _ in range(4 * rows)]
    return next(pack_documents(docs, seq_len=seq_len, batch_size=rows))


def test_from_batch_uses_host_copy_without_syncs() -> None:
    batch = _packed_batch()
    b, t = batch.input_ids.shape
    with SyncCounter(host=batch) as sc:  # a collator batch: host data
        meta = SequenceMetadata.from_batch(batch)
    assert sc.num_syncs == 0, sc.syncs
    assert sc.counts["_local_scalar_dense"] == 0 and sc.counts["nonzero"] == 0
    # num_tokens of the metadata counts flattened positions (B*T); the batch's counts real tokens only.
    assert meta.num_tokens == b * t
    assert meta.max_seqlen == batch.max_seqlen
    assert meta.cu_seqlens.tolist() == batch.cu_seqlens.tolist()
    # The positions derived from cu_seqlens are the packer's.
    assert meta.position_ids.tolist() == batch.position_ids.reshape(-1).tolist()
    assert SequenceMetadata.from_position_ids(batch.position_ids).fingerprint[:2] == meta.fingerprint[:2]
    # Mapping and object sources.
    as_dict = {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}
    assert SequenceMetadata.from_batch(as_dict).fingerprint == meta.fingerprint
    from_positions = SequenceMetadata.from_batch({"position_ids": batch.position_ids})
    assert from_positions.cu_seqlens.tolist() == meta.cu_seqlens.tolist()
    assert SequenceMetadata.from_batch(meta) is meta


def test_to_flash_attention_kwargs() -> None:
    meta = SequenceMetadata.from_lengths([3, 5, 2])
    kw = to_flash_attention_kwargs(meta)
    assert set(kw) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 8, 10] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 5 and isinstance(kw["max_length_q"], int)


def test_hf_position_ids_boundaries_agree() -> None:
    # HF's own derivation from position_ids must give the same boundaries as ours.
    hf = pytest.importorskip("transformers.modeling_flash_attention_utils")
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])
    (cu_q, _), (max_q, _) = hf.prepare_fa_kwargs_from_position_ids(pos)
    meta = SequenceMetadata.from_position_ids(pos)
    assert cu_q.tolist() == meta.cu_seqlens.tolist()
    assert int(max_q) == meta.max_seqlen


# ---------------------------------------------------------------------------------------------------------- cache


def test_cache_builds_once_per_version_and_checks_tokens() -> None:
    batch = _packed_batch(rows=2, seq_len=8, seed=1)
    cache = SequenceMetadataCache()
    hidden = torch.randn(2, 8, 4)
    assert active_cache() is None
    with cache.batch(batch):
        assert active_cache() is cache
        first = cache.get(hidden)
        for _ in range(5):
            assert cache.get(hidden) is first
        assert cache.get() is first
        with pytest.raises(MetadataError, match=r"hidden: holds 24 tokens .* describes 16"):
            cache.get(torch.randn(3, 8, 4))
        with pytest.raises(MetadataError, match=r"hidden: holds 8 tokens"):
            cache.check(torch.randn(8, 4))
        cache.check(torch.randn(16, 4))
    assert active_cache() is None
    # built once when the version opened; the 7 accepted lookups are hits, the rejected one is not counted
    assert cache.stats["builds"] == 1 and cache.stats["hits"] == 7 and cache.stats["version"] == 1
    with pytest.raises(MetadataError, match=r"cache: no open version"):
        cache.get(hidden)
    # A new version never reuses the old batch's metadata, even with identical shapes.
    with cache.batch(_packed_batch(rows=2, seq_len=8, seed=2)):
        second = cache.get(hidden)
    assert second is not first and cache.stats["builds"] == 2 and cache.stats["version"] == 2


def test_cache_sources_position_ids_fallback_and_nesting() -> None:
    outer, inner = SequenceMetadataCache(), SequenceMetadataCache()
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    with outer.batch(None):
        with pytest.raises(MetadataError, match=r"cache: nothing to build metadata from"):
            outer.get(torch.randn(1, 5, 2))
        meta = outer.get(torch.randn(1, 5, 2), position_ids=pos)
        assert meta.cu_seqlens.tolist() == [0, 2, 5]
        with inner.batch((torch.zeros(3), {"cu_seqlens": [0, 4], "max_seqlen": 4})):
            assert active_cache() is inner  # innermost wins
            assert inner.get(torch.randn(4, 3)).cu_seqlens.tolist() == [0, 4]
        assert active_cache() is outer
        with inner.batch(meta):
            assert inner.get() is meta
    assert active_cache() is None


def test_cache_build_from_packed_batch_has_no_syncs() -> None:
    batch = _packed_batch(rows=3, seq_len=16, seed=3)
    cache = SequenceMetadataCache()
    hidden = torch.randn(3, 16, 8)
    with SyncCounter(host=batch) as sc, cache.batch(batch):
        for _ in range(4):
            meta = cache.get(hidden)
        _ = meta.position_ids, meta.document_ids, dense_block_causal_mask(meta)
    assert sc.num_syncs == 0, sc.syncs
    assert cache.stats["builds"] == 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_random_batches_match_reference(seed: int) -> None:
    rows, seq_len = 1 + seed % 3, 1 + seed % 11
    batch = _packed_batch(rows=rows, seq_len=max(seq_len, 2), seed=seed)
    meta = SequenceMetadata.from_batch(batch)
    lengths = np.diff(batch.cu_seqlens_cpu.numpy()).tolist()
    _check_against_reference(meta, lengths)
