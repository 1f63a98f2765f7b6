"""Offline packing (``pack_lengths``): best-fit decreasing against a naive loop, every token once, rows in document
order, less padding than the streaming packer, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llmfast.data.packing import pack_lengths, plan_rows
from lightning_llmfast.errors import DataError


def _reference_loads(sizes: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing, one piece at a time over a list of rows: the sorted tokens of every row it opens."""
    loads: list[int] = []
    for size in sorted(sizes, reverse=True):
        fitting = [r for r, load in enumerate(loads) if load + size <= capacity]
        if fitting:
            loads[min(fitting, key=lambda r: capacity - loads[r])] += size
        else:
            loads.append(size)
    return sorted(loads)


def _rows(rows: np.ndarray, pieces: np.ndarray) -> list[list[tuple[int, int, int]]]:
    return [[tuple(p) for p in pieces[a:b].tolist()] for a, b in itertools.pairwise(rows.tolist())]


def _check(lengths: list[int], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Check ``pack_lengths`` against the lengths and the naive best-fit decreasing loop; return its rows."""
    rows, pieces = pack_lengths(np.array(lengths, dtype=np.int64), seq_len)
    assert rows.dtype == pieces.dtype == np.int64 and pieces.shape == (len(pieces), 3)
    assert rows[0] == 0 and rows[-1] == len(pieces) and np.all(np.diff(rows) > 0), "an empty row or bad offsets"
    packed = _rows(rows, pieces)
    seen: dict[int, list[tuple[int, int]]] = {}
    for row in packed:
        assert sum(n for _, _, n in row) <= seq_len
        assert [d for d, _, _ in row] == sorted({d for d, _, _ in row}), "pieces of a row not in document order"
        assert len(row) == 1 or all(n < seq_len for _, _, n in row), "a full chunk shares its row"
        for d, start, n in row:
            seen.setdefault(d, []).append((start, n))
    # every token of every document exactly once: chunks of seq_len from the start, then the remainder
    for d, length in enumerate(lengths):
        assert sorted(seen.pop(d, [])) == [(s, min(seq_len, length - s)) for s in range(0, length, seq_len)]
    assert not seen
    firsts = [row[0][:2] for row in packed]
    assert firsts == sorted(firsts), "rows not in the order of their first piece"
    # the rows of short pieces are best-fit decreasing's (which rows tie is free; their loads are not)
    short = [length % seq_len for length in lengths if length % seq_len]
    loads = sorted(sum(n for _, _, n in row) for row in packed if row[0][2] < seq_len)
    assert loads == _reference_loads(short, seq_len)
    return packed


_PRIMES = [2, 3, 5, 7, 13, 31, 127]


@st.composite
def _lengths(draw: st.DrawFn) -> tuple[list[int], int]:
    seq_len = draw(st.sampled_from([*_PRIMES, 4, 16]))
    special = st.sampled_from([0, 1, 2, seq_len - 1, seq_len, seq_len + 1, 2 * seq_len, 3 * seq_len + 2, *_PRIMES])
    lengths = draw(st.lists(st.one_of(special, st.integers(0, 4 * seq_len)), min_size=0, max_size=60))
    return lengths, seq_len


@settings(max_examples=200, deadline=None)
@given(_lengths())
def test_rows_are_best_fit_decreasing_and_hold_every_token_once(case: tuple[list[int], int]) -> None:
    _check(*case)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_corpora_of_many_documents(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seq_len = int(rng.choice([61, 64, 257]))
    lengths = rng.integers(0, 3 * seq_len, size=int(rng.integers(300, 700))).tolist()
    lengths[:39] = rng.integers(1, 4, size=39).tolist()  # a run of tiny documents
    _check(lengths, seq_len)


def test_one_document_empty_documents_and_length_one() -> None:
    assert _check([97], 7) == [[(0, s, 7)] for s in range(0, 91, 7)] + [[(0, 91, 6)]]
    assert _check([0, 5, 0], 5) == [[(1, 0, 5)]]
    assert _check([1, 1, 1], 2) == [[(0, 0, 1), (1, 0, 1)], [(2, 0, 1)]]
    assert _check([0, 0], 3) == [] and _check([], 3) == []
    # a row length past 16 bits (the sort keys take two radix passes); 3 goes to the row with 3 left, not 69,996
    assert _check([2 * 70_001 + 5, 3, 70_000, 69_998], 70_001)[2:] == [
        [(0, 140_002, 5)],
        [(1, 0, 3), (3, 0, 69_998)],
        [(2, 0, 70_000)],
    ]


def test_padding_is_not_above_the_streaming_packers_on_web_like_lengths() -> None:
    """Log-normal lengths (median 500 tokens), as web text: best-fit decreasing pads no more than the look-ahead."""
    lengths = np.maximum(1, np.random.default_rng(0).lognormal(np.log(500), 1.2, 20_000)).astype(np.int64)
    for seq_len in (512, 2048):
        rows, _ = pack_lengths(lengths, seq_len)
        streaming = sum(1 for _ in plan_rows(lengths.tolist(), seq_len))
        assert len(rows) - 1 <= streaming
        assert 1 - lengths.sum() / ((len(rows) - 1) * seq_len) < 0.001


@pytest.mark.parametrize(
    ("lengths", "seq_len", "match"),
    [
        ([3, -1], 4, "integers >= 0"),
        ([[1, 2]], 4, "1-D"),
        ([1.5], 4, "integers"),
        ([3], 1, "seq_len"),
        ([3], 4.0, "seq_len"),
    ],
)
def test_bad_input_raises_data_error(lengths: list[object], seq_len: object, match: str) -> None:
    with pytest.raises(DataError, match=match):
        pack_lengths(np.array(lengths), seq_len)  # type: ignore[arg-type]
