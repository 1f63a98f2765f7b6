"""Byte tokenizer, TextCorpus (stdlib default and local files) and SyntheticCorpus."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llmfast.data import BOS_ID, EOS_ID, VOCAB_SIZE, SyntheticCorpus, TextCorpus, decode, encode
from lightning_llmfast.errors import DataError


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40))
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert ids == [BOS_ID, *text.encode("utf-8"), EOS_ID]
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert decode(ids) == text
    assert decode(torch.tensor(encode(text, add_special_tokens=False))) == text


def test_vocabulary_and_decode_errors():
    assert VOCAB_SIZE == 258 and {BOS_ID, EOS_ID} == {256, 257}
    with pytest.raises(DataError, match="token id 258 at position 1"):
        decode([104, VOCAB_SIZE])
    with pytest.raises(DataError, match="token id -1"):
        decode([-1])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: decode([104.5]), r"token id 104.5 at position 0 is not an int"),
        (lambda: decode([104, True]), r"token id True at position 1 is not an int"),
        (lambda: decode(None), r"decode: ids must be a 1-D sequence of int token ids, got NoneType"),
        (lambda: decode("hi"), r"decode: ids must be a 1-D sequence of int token ids, got str"),
        (lambda: decode(torch.tensor([[104, 105]])), r"decode: ids must be a 1-D integer tensor, .*shape \(1, 2\)"),
        (lambda: decode(torch.tensor([104.0])), r"decode: ids must be a 1-D integer tensor, got torch.float32"),
        (lambda: encode(b"hi"), r"encode: text must be a str, got bytes"),
        (lambda: encode(None), r"encode: text must be a str, got NoneType"),
        (lambda: encode("hi", add_special_tokens="no"), r"encode: add_special_tokens must be True or False"),
    ],
)
def test_tokenizer_rejects_bad_input(call, match):
    with pytest.raises(DataError, match=match):
        call()


def test_stdlib_corpus_is_deterministic_split_and_lazy():
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = TextCorpus(), TextCorpus(split="val")
    assert train.vocab_size == VOCAB_SIZE
    assert train.files == TextCorpus().files  # deterministic
    assert train.files == sorted(train.files, key=lambda p: p.relative_to(root).as_posix())
    assert not set(train.files) & set(val.files)
    expected = {
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.stat().st_size > 0
    }
    assert set(train.files) | set(val.files) == expected
    assert 0.02 < len(val) / len(expected) < 0.1  # val_fraction 0.05
    document = train[len(train) // 2]
    assert document == [BOS_ID, *train.files[len(train) // 2].read_bytes(), EOS_ID]
    assert len(TextCorpus(max_docs=3)) == 3 and TextCorpus(max_docs=3).files == train.files[:3]


def test_file_corpus_reads_lazily_and_splits(tmp_path):
    (tmp_path / "sub").mkdir()
    for i in range(40):
        (tmp_path / ("sub" if i % 2 else ".") / f"doc{i:02d}.txt").write_text(f"document {i}\n")
    (tmp_path / "empty.txt").write_text("")
    corpus = TextCorpus([str(tmp_path)], val_fraction=0.0)
    assert len(corpus) == 40  # the empty file is left out
    assert corpus.files == sorted(corpus.files, key=str)
    target = corpus.files[5]
    target.write_text("changed after listing")
    assert decode(corpus[5]) == "changed after listing"  # read on access, not at construction
    train, val = TextCorpus(tmp_path, val_fraction=0.5), TextCorpus(tmp_path, split="val", val_fraction=0.5)
    assert sorted(train.files + val.files) == sorted(corpus.files) and len(val) > 0 and len(train) > 0
    single = TextCorpus([target])
    assert list(single) == [encode("changed after listing")]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: TextCorpus([str(p / "missing.txt")]), "does not exist"),
        (lambda p: TextCorpus([str(p)]), "empty corpus"),
        (lambda p: TextCorpus(split="val", val_fraction=0.0), "empty corpus.*'val'"),
        (lambda p: TextCorpus(split="dev"), "split"),
        (lambda p: TextCorpus(split="test"), "empty corpus.*'test'"),
        (lambda p: TextCorpus(val_fraction=0.5, test_fraction=0.6), "test_fraction"),
        (lambda p: TextCorpus(val_fraction=1.5), "val_fraction"),
        (lambda p: TextCorpus(max_docs=0), "max_docs"),
    ],
)
def test_text_corpus_errors(tmp_path, make, match):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=match):
        make(tmp_path)


def test_empty_corpus_error_names_the_paths(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path)):
        TextCorpus([str(tmp_path)])


@pytest.mark.parametrize("distribution", ["lognormal", "uniform", "exponential", "fixed"])
def test_synthetic_corpus_lengths_and_determinism(distribution):
    corpus = SyntheticCorpus(3000, mean_len=40, seed=7, distribution=distribution, vocab_size=50, min_len=2)
    lengths = torch.tensor(corpus.lengths, dtype=torch.float64)
    assert len(corpus) == 3000 and corpus.vocab_size == 50
    assert lengths.min() >= 2
    # mean within 10% of mean_len (flooring and clamping move it a little)
    assert math.isclose(lengths.mean().item(), 40, rel_tol=0.1)
    if distribution == "fixed":
        assert set(corpus.lengths) == {40}
    if distribution == "uniform":
        assert lengths.max() <= 78
    same = SyntheticCorpus(3000, mean_len=40, seed=7, distribution=distribution, vocab_size=50, min_len=2)
    assert same.lengths == corpus.lengths
    for index in (0, 1234, 2999, -1):
        document = corpus[index]
        assert document == same[index] and len(document) == corpus.lengths[index]
        assert all(0 <= t < 50 for t in document)
    assert corpus[-1] == corpus[2999]
    assert SyntheticCorpus(3000, 40, seed=8, distribution=distribution).lengths != corpus.lengths or (
        distribution == "fixed"
    )


def test_synthetic_corpus_max_len_and_iteration():
    corpus = SyntheticCorpus(200, mean_len=30, seed=1, min_len=5, max_len=31)
    assert all(5 <= n <= 31 for n in corpus.lengths)
    assert [len(d) for d in corpus] == corpus.lengths
    assert list(corpus)[17] == corpus[17]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_docs": 0}, "num_docs"),
        ({"mean_len": 0}, "mean_len"),
        ({"mean_len": float("nan")}, "mean_len"),
        ({"distribution": "zipf"}, "distribution"),
        ({"min_len": 0}, "min_len"),
        ({"max_len": 1, "min_len": 2}, "max_len"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": None}, r"sigma must be a finite number > 0, got None"),
        ({"sigma": float("inf")}, r"sigma must be a finite number > 0, got inf"),
        ({"sigma": 1e200}, r"sigma=1e\+200 is too large"),
        ({"seed": None}, r"seed must be an int .*got None"),
        ({"seed": 1.5}, r"seed must be an int .*got 1.5"),
        ({"seed": 2**60}, r"seed must be an int >= -\d+ and <= \d+, got 1152921504606846976"),
        ({"mean_len": True}, r"mean_len must be a finite number >= 1, got True"),
        ({"max_len": True}, r"max_len must be an int >= 1, got True"),
        ({"max_len": 8.0}, r"max_len must be an int"),
        ({"num_docs": 2.0}, r"num_docs must be an int >= 1, got 2.0"),
        ({"vocab_size": True}, r"vocab_size must be an int"),
        ({"mean_len": 1e300, "distribution": "uniform"}, r"document lengths do not fit: .*'uniform'.*set max_len"),
        ({"mean_len": 1e308, "distribution": "uniform"}, r"mean_len=1e\+308 is too large for distribution='uniform'"),
        ({"mean_len": 1e20, "distribution": "fixed"}, r"document lengths do not fit: .*1e\+20 tokens"),
        ({"mean_len": 1e308, "distribution": "exponential"}, r"document lengths do not fit: .*inf tokens"),
        ({"mean_len": 1e300}, r"document lengths do not fit: distribution='lognormal'.*sigma=1.0"),
    ],
)
def test_synthetic_corpus_errors(kwargs, match):
    args = {"num_docs": 10, "mean_len": 8, "seed": 0, **kwargs}
    with pytest.raises(DataError, match=match):
        SyntheticCorpus(args.pop("num_docs"), args.pop("mean_len"), args.pop("seed"), **args)


def test_synthetic_corpus_huge_mean_is_fine_when_max_len_bounds_it():
    corpus = SyntheticCorpus(4, 1e300, seed=3, distribution="uniform", max_len=100)
    assert corpus.lengths == [100] * 4 and len(corpus[0]) == 100
    negative_seed = SyntheticCorpus(4, 8, seed=-5)
    assert all(n >= 1 for n in negative_seed.lengths) and len(negative_seed[3]) == negative_seed.lengths[3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": None}, r"val_fraction must be a finite number >= 0 and <= 1, got None"),
        ({"val_fraction": "0.5"}, r"val_fraction must be a finite number"),
        ({"val_fraction": float("nan")}, r"val_fraction must be a finite number"),
        ({"max_docs": 2.5}, r"max_docs must be an int >= 1, got 2.5"),
        ({"max_docs": True}, r"max_docs must be an int >= 1, got True"),
    ],
)
def test_text_corpus_rejects_non_numbers(kwargs, match):
    with pytest.raises(DataError, match=match):
        TextCorpus(**kwargs)


def test_decode_reads_a_list_of_zero_dim_integer_tensors() -> None:
    assert decode(list(torch.tensor([104, 105]))) == "hi"  # what iterating a tensor gives
    with pytest.raises(DataError, match="is not an int"):
        decode([torch.tensor(104.0)])
