"""Packing: properties against the input documents, PackedBatch transport, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.data import IGNORE_INDEX, PackedBatch, SyntheticCorpus, TextCorpus, pack_documents
from lightning_llmfast.errors import DataError

_STRIDE = 1000  # token of document d at position p: 1 + d * _STRIDE + p, so every token names its origin


def _document(d: int, length: int, as_tensor: bool) -> list[int] | torch.Tensor:
    tokens = [1 + d * _STRIDE + p for p in range(length)]
    return torch.tensor(tokens, dtype=torch.int32) if as_tensor else tokens


def _check(lengths: list[int], batches: list[PackedBatch], seq_len: int, batch_size: int, complete: bool = True):
    """Check every batch against the documents (tokens named by ``_document``, pad_id 0) with plain loops."""
    chunks_seen: dict[int, list[int]] = {}
    for b, batch in enumerate(batches):
        rows, width = batch.input_ids.shape
        assert width == seq_len
        assert rows == batch_size or (b == len(batches) - 1 and 0 < rows < batch_size)
        for name in ("input_ids", "labels", "position_ids"):
            assert getattr(batch, name).dtype == torch.int64
            assert getattr(batch, name).shape == (rows, width)
        assert batch.cu_seqlens.dtype == torch.int32
        assert torch.equal(batch.cu_seqlens_cpu, batch.cu_seqlens)
        assert isinstance(batch.max_seqlen, int) and isinstance(batch.num_tokens, int)
        cu = batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == rows * width
        assert all(a < b for a, b in itertools.pairwise(cu))
        assert set(range(0, rows * width + 1, width)) <= set(cu), "a segment crosses a row"
        ids, labels, pos = (getattr(batch, n).flatten().tolist() for n in ("input_ids", "labels", "position_ids"))
        real = 0
        for start, end in itertools.pairwise(cu):
            segment = ids[start:end]
            assert pos[start:end] == list(range(end - start))
            if segment[0] == 0:  # padding tail: only at the end of a row
                assert end % width == 0 and start % width != 0
                assert set(segment) == {0} and set(labels[start:end]) == {IGNORE_INDEX}
                continue
            d, first = divmod(segment[0] - 1, _STRIDE)
            assert first % seq_len == 0, "a chunk does not start at a multiple of seq_len"
            assert end - start == min(seq_len, lengths[d] - first)
            assert segment == [1 + d * _STRIDE + first + k for k in range(end - start)]
            assert labels[start:end] == [*segment[1:], IGNORE_INDEX], "a label crosses a boundary"
            chunks_seen.setdefault(d, []).append(first)
            real += end - start
        assert batch.num_tokens == real
        assert batch.max_seqlen == max(b - a for a, b in itertools.pairwise(cu))
        assert batch.padding_fraction == pytest.approx(1 - real / (rows * width))
    if complete:
        for d, length in enumerate(lengths):
            # exactly once and in document order
            assert chunks_seen.get(d, []) == list(range(0, length, seq_len)), f"document {d}"
    return chunks_seen


@st.composite
def _corpora(draw):
    seq_len = draw(st.sampled_from([2, 3, 5, 8, 13]))
    special = st.sampled_from([0, 1, seq_len - 1, seq_len, seq_len + 1, 2 * seq_len, 3 * seq_len + 2])
    lengths = draw(st.lists(st.one_of(special, st.integers(0, 3 * seq_len + 2)), min_size=1, max_size=25))
    if not any(lengths):
        lengths.append(draw(st.integers(1, 3 * seq_len)))
    as_tensor = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    return seq_len, lengths, as_tensor, draw(st.integers(1, 4)), draw(st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(_corpora(), st.booleans())
def test_packing_properties(corpus, with_vocab):
    seq_len, lengths, as_tensor, batch_size, lookahead = corpus
    documents = [_document(d, n, t) for d, (n, t) in enumerate(zip(lengths, as_tensor))]
    snapshot = [torch.as_tensor(doc).clone() for doc in documents]
    vocab_size = 1 + len(lengths) * _STRIDE if with_vocab else None
    batches = list(pack_documents(documents, seq_len, batch_size, vocab_size=vocab_size, lookahead=lookahead))
    _check(lengths, batches, seq_len, batch_size)
    assert all(torch.equal(torch.as_tensor(doc), old) for doc, old in zip(documents, snapshot)), "input mutated"
    # deterministic, and drop_last only removes a final short batch
    again = list(pack_documents(iter(documents), seq_len, batch_size, vocab_size=vocab_size, lookahead=lookahead))
    assert all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        for a, b in zip(batches, again, strict=True)
    )
    dropped = list(pack_documents(documents, seq_len, batch_size, lookahead=lookahead, drop_last=True))
    full = batches if batches[-1].batch_size == batch_size else batches[:-1]
    assert [b.input_ids.tolist() for b in dropped] == [b.input_ids.tolist() for b in full]


def test_one_document_fills_everything_and_length_one():
    # A single long document: every row is a full chunk, no padding anywhere.
    batches = list(pack_documents([_document(0, 97, True)], seq_len=7, batch_size=3))
    _check([97], batches, 7, 3)
    assert sum(b.num_tokens for b in batches) == 97
    # Length-1 documents are sequences whose only label is -100.
    batch = next(pack_documents([[5], [6], [7]], seq_len=2, batch_size=4))
    assert batch.labels.eq(IGNORE_INDEX).all()
    assert batch.num_tokens == 3 and batch.batch_size == 2


def test_packing_is_tight_on_synthetic_corpus():
    corpus = SyntheticCorpus(num_docs=600, mean_len=90, seed=3)
    batches = list(pack_documents(corpus, seq_len=256, batch_size=8, vocab_size=corpus.vocab_size))
    real = sum(b.num_tokens for b in batches)
    assert real == sum(corpus.lengths)
    assert 1 - real / sum(b.input_ids.numel() for b in batches) < 0.05


def test_packing_is_tight_on_stdlib_corpus():
    corpus = TextCorpus(max_docs=120)
    for seq_len in (256, 2048):
        batches = list(pack_documents(corpus, seq_len, 8, vocab_size=corpus.vocab_size))
        assert sum(b.num_tokens for b in batches) == sum(len(doc) for doc in corpus)
        assert 1 - sum(b.num_tokens for b in batches) / sum(b.input_ids.numel() for b in batches) < 0.05


def test_streaming_holds_at_most_lookahead_pieces():
    read = []

    def documents():
        for d in range(10_000):
            read.append(d)
            yield [1 + d] * 2  # short: every document waits in the look-ahead buffer

    first = next(pack_documents(documents(), seq_len=4, batch_size=2, lookahead=8))
    assert first.batch_size == 2 and first.num_tokens == 8
    assert len(read) <= 8 + 2 * 2  # lookahead + (per row) the pieces it took
    assert first.input_ids[0].tolist() == [1, 1, 2, 2]  # each row starts with the oldest waiting piece


def _small_batch() -> PackedBatch:
    return next(pack_documents([[3, 4, 5], [6], [7, 8, 9, 10, 11]], seq_len=4, batch_size=3))


def test_packed_batch_moves_with_lightning_and_keeps_host_metadata():
    batch = _small_batch()
    for device in (torch.device("cpu"), torch.device("meta")):
        with SyncCounter(host=batch) as counter:  # the collator's batch: host data, checked on the host
            moved = move_data_to_device(batch, device)
        # From pageable memory each copy to a device blocks the host; the pinned batch below copies without a sync.
        copies = 4 if device.type == "meta" else 0  # input_ids, labels, position_ids, cu_seqlens
        assert counter.syncs["host_to_device_copy"] == counter.num_syncs == copies, counter.syncs
        assert isinstance(moved, PackedBatch) and moved is not batch
        assert moved.input_ids.device.type == device.type and moved.cu_seqlens.device.type == device.type
        assert moved.cu_seqlens_cpu.device.type == "cpu"
        assert torch.equal(moved.cu_seqlens_cpu, batch.cu_seqlens)
        assert (moved.max_seqlen, moved.num_tokens) == (batch.max_seqlen, batch.num_tokens)
        assert moved.padding_fraction == batch.padding_fraction
    assert batch.input_ids.device.type == "cpu"  # the original is untouched
    # without a host copy, moving between devices never derives one (that would read the device)
    on_device = PackedBatch(**{**vars(batch.to("meta")), "cu_seqlens_cpu": None})
    assert on_device.cu_seqlens_cpu is None and on_device.to("meta").cu_seqlens_cpu is None


def test_packed_batch_padding_fraction_and_shape_properties():
    batch = _small_batch()
    assert (batch.batch_size, batch.seq_len) == tuple(batch.input_ids.shape)
    expected = batch.input_ids.eq(0).double().mean().item()  # pad_id 0; real tokens here are > 0
    assert batch.padding_fraction == pytest.approx(expected)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("input_ids", torch.zeros(2, 4, dtype=torch.int32), "input_ids"),
        ("labels", torch.zeros(2, 5, dtype=torch.int64), "labels"),
        ("position_ids", torch.zeros(8, dtype=torch.int64), "position_ids"),
        ("cu_seqlens", torch.tensor([0, 8], dtype=torch.int64), "cu_seqlens"),
        ("cu_seqlens", torch.tensor([0], dtype=torch.int32), "cu_seqlens"),
        ("max_seqlen", torch.tensor(4), "max_seqlen"),
        ("max_seqlen", 5, "max_seqlen"),
        ("num_tokens", 9, "num_tokens"),
        ("cu_seqlens_cpu", torch.tensor([0, 4, 8, 9], dtype=torch.int32), "cu_seqlens_cpu"),
    ],
)
def test_packed_batch_rejects_bad_fields(field, value, match):
    fields = {
        "input_ids": torch.zeros(2, 4, dtype=torch.int64),
        "labels": torch.zeros(2, 4, dtype=torch.int64),
        "position_ids": torch.zeros(2, 4, dtype=torch.int64),
        "cu_seqlens": torch.tensor([0, 4, 8], dtype=torch.int32),
        "max_seqlen": 4,
        "num_tokens": 8,
    }
    PackedBatch(**fields)  # the unchanged fields are valid
    fields[field] = value
    with pytest.raises(DataError, match=match):
        PackedBatch(**fields)


@pytest.mark.parametrize(
    ("documents", "kwargs", "match"),
    [
        ([], {}, "empty corpus"),
        ([[], torch.empty(0, dtype=torch.long)], {}, "empty corpus"),
        ([[1, 2]], {"seq_len": 1}, "seq_len"),
        ([[1, 2]], {"seq_len": 0}, "seq_len"),
        ([[1, 2]], {"seq_len": 4.0}, "seq_len"),
        ([[1, 2]], {"batch_size": 0}, "batch_size"),
        ([[1, 2]], {"lookahead": 0}, "lookahead"),
        ([[1, 2], [3, -1]], {}, r"document 1 has token id -1 at position 1"),
        ([[1, 2], [3, 4, 10]], {"vocab_size": 10}, r"document 1 has token id 10 at position 2"),
        ([torch.tensor([0, 300])], {"vocab_size": 258}, "token id 300"),
        ([[1, 2], [1.5, 2.0]], {}, "document 1 must hold integer"),
        ([torch.tensor([1.0, 2.0])], {}, "document 0 must hold integer"),
        ([torch.tensor([True])], {}, "document 0 must hold integer"),
        (["hello"], {}, "document 0 is a str"),
        ([[1], ["a", "b"]], {}, "document 1 is not a sequence of integer"),
        ([[1], None], {}, "document 1 is not a sequence of integer"),
        ([[[1, 2], [3, 4]]], {}, r"document 0 must be a 1-D.*\(2, 2\)"),
        ([torch.ones(2, 3, dtype=torch.long)], {}, "document 0 must be a 1-D"),
        ([[1, 2]], {"pad_id": -1}, "pad_id"),
        ([[1, 2]], {"pad_id": 10, "vocab_size": 10}, "pad_id"),
        (5, {}, "iterable"),
    ],
)
def test_bad_input_raises_data_error(documents, kwargs, match):
    args = {"seq_len": 4, "batch_size": 2, **kwargs}
    with pytest.raises(DataError, match=match):
        list(pack_documents(documents, args.pop("seq_len"), args.pop("batch_size"), **args))


def test_bad_arguments_fail_before_iteration():
    with pytest.raises(DataError, match="batch_size"):
        pack_documents([[1, 2]], seq_len=4, batch_size=-3)  # not iterated


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and non-blocking copies need CUDA")
def test_pinned_batch_moves_to_cuda_without_sync():
    batch = _small_batch()
    loader = DataLoader([batch], batch_size=None, pin_memory=True)
    pinned = next(iter(loader))
    assert isinstance(pinned, PackedBatch) and pinned.input_ids.is_pinned() and pinned.cu_seqlens.is_pinned()
    assert pinned.cu_seqlens_cpu is pinned.cu_seqlens
    with SyncCounter() as counter:
        moved = move_data_to_device(pinned, torch.device("cuda"))
    assert counter.num_syncs == 0
    assert moved.input_ids.is_cuda and moved.cu_seqlens_cpu.device.type == "cpu"
    assert torch.equal(moved.input_ids.cpu(), batch.input_ids)
    assert torch.equal(moved.cu_seqlens.cpu(), moved.cu_seqlens_cpu)
