"""Packing variable-length documents into fixed ``(batch_size, seq_len)`` rows, metadata computed on the CPU.

The packer streams: it holds at most ``lookahead`` short pieces and ``batch_size`` finished rows, so it runs over
corpora of any size inside a ``DataLoader`` worker. Pieces of exactly ``seq_len`` tokens (whole documents, or full
chunks of longer documents) fill a row on their own; shorter pieces wait in a look-ahead buffer, and each new row
takes the oldest waiting piece (so no piece waits forever) and then, best fit, repeatedly the longest waiting
piece that still fits the space left.

Prepared datasets know every length in advance and pack them offline with :func:`pack_lengths`, best-fit decreasing
over a whole block of documents, computed with NumPy per distinct length rather than per document.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.data.batch import PackedBatch
from lightning_llmfast.errors import DataError

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "IGNORE_INDEX",
    "Piece",
    "as_tokens",
    "check_packing_args",
    "make_batch",
    "pack_documents",
    "pack_lengths",
    "plan_batches",
    "plan_rows",
    "segment_documents",
]

IGNORE_INDEX = -100
"""Label of positions that have no next token: each sequence's last token and padding (cross-entropy's default)."""

DEFAULT_LOOKAHEAD = 256
"""Short pieces the packer may hold back to find a better fit (padding < 1% on the stdlib corpus, see README)."""

_INT32_MAX = 2**31 - 1


def pack_documents(
    documents: Iterable[Any],
    seq_len: int,
    batch_size: int,
    *,
    pad_id: int = 0,
    vocab_size: int | None = None,
    drop_last: bool = False,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> Iterator[PackedBatch]:
    """Pack documents into batches of ``batch_size`` rows of exactly ``seq_len`` tokens.

    Each row holds whole documents; a document longer than ``seq_len`` is split into chunks of at most ``seq_len``
    tokens, each chunk a sequence of its own (its chunks come out in document order). Empty documents are skipped.
    Labels are the next token of the same sequence; nothing is learned across a boundary. The output is a
    deterministic function of the inputs, and the caller's documents are never modified.

    Arguments are checked when this is called; documents are checked as they are read.

    Args:
        documents: iterable of token sequences: lists of ints or 1-D integer tensors (any integer dtype).
        seq_len: tokens per row ``T`` (at least 2).
        batch_size: rows per batch ``B`` (at least 1). The last batch may have fewer rows.
        pad_id: token id written on padding positions; must lie in ``[0, vocab_size)``.
        vocab_size: when given, every token id must lie in ``[0, vocab_size)``.
        drop_last: drop a final batch with fewer than ``batch_size`` rows.
        lookahead: how many short pieces may wait for a better-fitting row (at least 1); larger packs tighter.

    Yields:
        :class:`PackedBatch` objects with ``input_ids``/``labels``/``position_ids`` of shape ``(B, T)`` and
        ``cu_seqlens`` of shape ``(N + 1,)`` over the flattened ``B * T`` positions.

    Raises:
        DataError: ``seq_len < 2``, ``batch_size < 1``, ``pad_id`` outside the vocabulary, a document that is not a
            1-D sequence of integers or has ids outside the vocabulary, or a corpus without any document.

    Example::

        >>> from lightning_llmfast.data import pack_documents
        >>> batches = list(pack_documents([[1, 2, 3, 4, 5], [6, 7]], seq_len=4, batch_size=2))
        >>> batches[0].input_ids  # the 5-token document is split into chunks of 4 and 1
        tensor([[1, 2, 3, 4],
                [5, 6, 7, 0]])
        >>> batches[0].labels
        tensor([[   2,    3,    4, -100],
                [-100,    7, -100, -100]])
        >>> batches[0].position_ids
        tensor([[0, 1, 2, 3],
                [0, 0, 1, 0]])
    """
    seq_len, batch_size, pad_id, vocab_size, lookahead = check_packing_args(
        seq_len, batch_size, pad_id=pad_id, vocab_size=vocab_size, lookahead=lookahead
    )
    try:
        stream = iter(documents)
    except TypeError:
        raise DataError(f"documents must be an iterable of token sequences, got {type(documents).__name__}") from None
    return _pack(stream, seq_len, batch_size, pad_id, vocab_size, drop_last, lookahead)


def check_packing_args(
    seq_len: int,
    batch_size: int,
    *,
    pad_id: int = 0,
    vocab_size: int | None = None,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> tuple[int, int, int, int | None, int]:
    """Raise :class:`DataError` naming the first invalid packing argument (see :func:`pack_documents`).

    Python and NumPy integers pass (as everywhere in this package); ``bool`` does not.

    Returns:
        ``(seq_len, batch_size, pad_id, vocab_size, lookahead)`` as Python ints.

    Example::

        >>> check_packing_args(seq_len=1, batch_size=8)
        Traceback (most recent call last):
        ...
        lightning_llmfast.errors.DataError: seq_len must be an int >= 2 (one token and its next), got 1
    """
    seq_len = _check_int("seq_len", seq_len, 2, "one token and its next")
    batch_size = _check_int("batch_size", batch_size, 1, "at least one row")
    lookahead = _check_int("lookahead", lookahead, 1, "at least one waiting piece")
    if vocab_size is not None:
        vocab_size = _check_int("vocab_size", vocab_size, 1, "at least one token id")
    if batch_size * seq_len > _INT32_MAX:
        raise DataError(f"batch_size * seq_len = {batch_size * seq_len} does not fit the int32 cu_seqlens")
    high = None if vocab_size is None else vocab_size - 1
    try:
        pad_id = check_int("pad_id", pad_id, low=0, high=high, error=DataError)
    except DataError:
        raise DataError(f"pad_id must be an int in [0, vocab_size={vocab_size}), got {pad_id!r}") from None
    return seq_len, batch_size, pad_id, vocab_size, lookahead


def _check_int(name: str, value: object, low: int, why: str) -> int:
    try:
        return check_int(name, value, low=low, error=DataError)
    except DataError:
        raise DataError(f"{name} must be an int >= {low} ({why}), got {value!r}") from None


def as_tokens(document: Any, index: int, vocab_size: int | None) -> Tensor:
    """Document ``index`` as a 1-D int64 CPU tensor (possibly a view of the caller's data: never written)."""
    if isinstance(document, (str, bytes)):
        raise DataError(
            f"document {index} is a {type(document).__name__}, not token ids; encode text first "
            "(lightning_llmfast.data.encode)"
        )
    try:
        tokens = document if isinstance(document, Tensor) else torch.as_tensor(document)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise DataError(f"document {index} is not a sequence of integer token ids: {err}") from None
    if tokens.dim() != 1:
        raise DataError(f"document {index} must be a 1-D sequence of token ids, got shape {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        return tokens
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise DataError(f"document {index} must hold integer token ids, got dtype {tokens.dtype}")
    tokens = tokens.to("cpu", torch.int64)
    low, high = (int(v) for v in tokens.aminmax())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = (tokens < 0) if low < 0 else (tokens >= vocab_size)
        position = int(bad.to(torch.uint8).argmax())
        raise DataError(
            f"document {index} has token id {int(tokens[position])} at position {position}, outside the "
            f"vocabulary [0, {vocab_size if vocab_size is not None else 'inf'})"
        )
    return tokens


Piece = tuple[int, int, int]
"""``(document, start, length)``: tokens ``[start, start + length)`` of document ``document`` (its stream index)."""


class _Waiting:
    """Pieces shorter than ``seq_len`` waiting for a row: oldest-first and longest-that-fits lookups."""

    def __init__(self) -> None:
        self._pieces: dict[int, Piece] = {}
        self._order: deque[int] = deque()  # arrival order; ids of pieces already taken are skipped lazily
        # (length, -id): the last entry with length <= space is the longest fitting piece, oldest among equals.
        self._by_length: list[tuple[int, int]] = []
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._pieces)

    def add(self, piece: Piece) -> None:
        self._pieces[self._next_id] = piece
        self._order.append(self._next_id)
        bisect.insort(self._by_length, (piece[2], -self._next_id))
        self._next_id += 1

    def take_row(self, seq_len: int) -> list[Piece]:
        while self._order[0] not in self._pieces:
            self._order.popleft()
        oldest = self._order.popleft()
        row = [self._remove(oldest, bisect.bisect_left(self._by_length, (self._pieces[oldest][2], -oldest)))]
        space = seq_len - row[0][2]
        while space > 0 and self._by_length:
            at = bisect.bisect_right(self._by_length, (space, math.inf)) - 1
            if at < 0:
                break
            row.append(self._remove(-self._by_length[at][1], at))
            space -= row[-1][2]
        return row

    def _remove(self, piece_id: int, at: int) -> Piece:
        del self._by_length[at]
        return self._pieces.pop(piece_id)


def plan_rows(lengths: Iterable[int], seq_len: int, lookahead: int = DEFAULT_LOOKAHEAD) -> Iterator[list[Piece]]:
    """The rows :func:`pack_documents` builds, as pieces, from document lengths alone (no token is read).

    Rows come out in the order ``pack_documents`` puts them into batches, as soon as they are final, so a consumer
    can stream. Document ``i`` is the ``i``-th length.

    Raises:
        DataError: no length at all, or only zeros (an empty corpus).

    Example::

        >>> list(plan_rows([5, 2], seq_len=4, lookahead=1))
        [[(0, 0, 4)], [(0, 4, 1), (1, 0, 2)]]
    """
    waiting = _Waiting()
    num_documents = num_tokens = 0
    for document, length in enumerate(lengths):
        num_documents += 1
        num_tokens += length
        # Full chunks become rows at once, before the document's remainder can: chunks keep document order.
        full = length // seq_len * seq_len
        for start in range(0, full, seq_len):
            yield [(document, start, seq_len)]
        if full < length:
            waiting.add((document, full, length - full))
        while len(waiting) > lookahead:
            yield waiting.take_row(seq_len)
    if num_documents == 0:
        raise DataError("empty corpus: the documents iterable yielded no document")
    if num_tokens == 0:
        raise DataError(f"empty corpus: all {num_documents} documents are empty")
    while len(waiting):
        yield waiting.take_row(seq_len)


def plan_batches(
    lengths: Iterable[int],
    seq_len: int,
    batch_size: int,
    *,
    drop_last: bool = False,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> Iterator[list[list[Piece]]]:
    """:func:`plan_rows` grouped into batches of ``batch_size`` rows (the last one may be shorter).

    Example::

        >>> [len(batch) for batch in plan_batches([9, 3, 3], seq_len=4, batch_size=2, lookahead=1)]
        [2, 2]
    """
    rows: list[list[Piece]] = []
    for row in plan_rows(lengths, seq_len, lookahead):
        rows.append(row)
        if len(rows) == batch_size:
            yield rows
            rows = []
    if rows and not drop_last:
        yield rows


def pack_lengths(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``seq_len`` tokens for documents of the given lengths, packed best-fit decreasing with NumPy.

    A document longer than ``seq_len`` is cut into chunks of ``seq_len`` tokens from its start, each a row of its own.
    The pieces shorter than ``seq_len`` (short documents and the remainders of long ones; empty documents have none)
    are packed best-fit decreasing: longest first (ties in document order), each into the row with the least space
    left that still holds it, into a new row when none does. Rows are ordered by their first piece and pieces within
    a row by document, so the rows follow the documents. The result is a deterministic function of the lengths.

    Pieces of one length are placed together, so the Python work grows with the number of distinct lengths (below
    ``seq_len``) and of free-space classes met, not with the number of documents; the rest is NumPy.

    Args:
        lengths: 1-D integer lengths (``>= 0``) of documents ``0 ... N - 1``.
        seq_len: tokens per row (at least 2).

    Returns:
        ``(rows, pieces)``: ``int64`` offsets ``(R + 1,)`` into ``pieces`` and ``int64`` ``(P, 3)`` triples
        ``(document, start, length)``; row ``r`` is ``pieces[rows[r]:rows[r + 1]]``.

    Raises:
        DataError: ``seq_len`` below 2, or ``lengths`` not a 1-D array of non-negative integers.

    Example::

        >>> rows, pieces = pack_lengths(np.array([5, 2, 3]), seq_len=4)
        >>> [pieces[a:b].tolist() for a, b in zip(rows[:-1], rows[1:])]
        [[[0, 0, 4]], [[0, 4, 1], [2, 0, 3]], [[1, 0, 2]]]
    """
    seq_len = _check_int("seq_len", seq_len, 2, "one token and its next")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and (lengths.dtype.kind not in "iu" or lengths.min() < 0)):
        raise DataError(f"lengths must be a 1-D array of integers >= 0, got {lengths.dtype} of shape {lengths.shape}")
    lengths = lengths.astype(np.int64)
    # The pieces in document order: each document's full chunks, then its remainder.
    per_document = -(-lengths // seq_len)
    document = np.repeat(np.arange(len(lengths), dtype=np.int64), per_document)
    start = (np.arange(len(document)) - np.repeat(np.cumsum(per_document) - per_document, per_document)) * seq_len
    length = np.minimum(seq_len, lengths[document] - start)
    short = np.flatnonzero(length < seq_len)
    bins = _best_fit_decreasing(length[short], seq_len)
    members = short[_stable_order(bins)]  # the short pieces bin by bin, in document order within
    bin_size = np.bincount(bins)
    bin_first = np.cumsum(bin_size) - bin_size  # where each bin starts in ``members``
    # A row is led by its first piece: a full chunk leads its own row, a bin's first member leads the bin.
    row_size = (length == seq_len).astype(np.int64)
    row_size[members[bin_first]] = bin_size
    leaders = np.flatnonzero(row_size)
    rows = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(row_size[leaders])])
    # Where each piece goes: its row's first slot, plus (for a bin member) its place in the bin.
    slot = np.zeros(len(document), dtype=np.int64)
    slot[leaders] = rows[:-1]
    place = np.arange(len(members)) - np.repeat(bin_first, bin_size)
    slot[members] = slot[np.repeat(members[bin_first], bin_size)] + place
    pieces = np.empty((len(document), 3), dtype=np.int64)
    pieces[slot] = np.stack([document, start, length], axis=1)
    return rows, pieces


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of non-negative integers, as radix passes over 16-bit digits.

    NumPy's stable sort is a radix sort for 16-bit keys only (a merge sort otherwise, several times slower on
    millions of keys); sorting digit by digit, least significant first, keeps every pass stable and linear.
    """
    order = np.arange(len(keys), dtype=np.int64)
    for shift in range(0, max(1, int(keys.max(initial=0)).bit_length()), 16):
        digit = (keys[order] >> shift) & 0xFFFF
        order = order[np.argsort(digit.astype(np.uint16), kind="stable")]
    return order


class _OpenRows:
    """Rows being filled by :func:`_best_fit_decreasing`, grouped by their free space (rows with none are dropped)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.opened = 0
        self._rows: dict[int, list[int]] = {}  # free space -> rows with exactly that much left
        self._free: list[int] = []  # the keys of ``_rows``, ascending

    def best_fit(self, size: int) -> int:
        """The least free space of an open row that holds ``size`` tokens; ``capacity`` (a new row) if none."""
        at = bisect.bisect_left(self._free, size)
        return self._free[at] if at < len(self._free) else self.capacity

    def take(self, free: int, count: int) -> list[int]:
        """Up to ``count`` rows with ``free`` tokens left (``count`` new rows when ``free`` is the capacity)."""
        if free == self.capacity:
            self.opened += count
            return list(range(self.opened - count, self.opened))
        rows = self._rows[free]
        taken = rows[-count:]
        del rows[-count:]
        if not rows:
            del self._rows[free]
            del self._free[bisect.bisect_left(self._free, free)]
        return taken

    def put(self, rows: list[int], free: int) -> None:
        """Rows now with ``free`` tokens left."""
        if not rows or free == 0:
            return
        if free not in self._rows:
            self._rows[free] = []
            bisect.insort(self._free, free)
        self._rows[free].extend(rows)


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The row of every piece (sizes in ``[1, capacity)``) under best-fit decreasing; rows numbered as opened."""
    order = _stable_order(capacity - sizes)  # longest first, ties in input order
    ordered = sizes[order]
    open_rows = _OpenRows(capacity)
    # The rows that take the ordered pieces, and how many consecutive pieces each takes: expanded once at the end.
    takers: list[int] = []
    takes: list[int] = []
    begin = 0
    for end in [*(np.flatnonzero(np.diff(ordered)) + 1).tolist(), len(ordered)] if len(ordered) else []:
        size = int(ordered[begin])
        while begin < end:
            # The least fitting space is ``free``; once a row takes a piece it stays the least fitting one until it
            # has less than ``size`` left, so each of those rows takes ``per_row`` pieces in turn.
            free = open_rows.best_fit(size)
            per_row = free // size
            rows = open_rows.take(free, -(-(end - begin) // per_row))
            count = min(end - begin, len(rows) * per_row)
            last = count - (len(rows) - 1) * per_row  # pieces of the last row: fewer when the pieces ran out
            takers += rows
            takes += [per_row] * (len(rows) - 1)
            takes.append(last)
            begin += count
            open_rows.put(rows[:-1], free - per_row * size)
            open_rows.put(rows[-1:], free - last * size)
    out = np.empty(len(sizes), dtype=np.int64)
    out[order] = np.repeat(np.array(takers, dtype=np.int64), np.array(takes, dtype=np.int64))
    return out


def segment_documents(rows: list[list[Piece]], seq_len: int) -> list[int]:
    """The document of every ``cu_seqlens`` segment of a batch of ``rows``: ``-1`` for each padding tail.

    Example::

        >>> segment_documents([[(3, 0, 2), (5, 0, 1)], [(4, 0, 4)]], seq_len=4)
        [3, 5, -1, 4]
    """
    documents = []
    for row in rows:
        documents.extend(d for d, _, _ in row)
        if sum(n for _, _, n in row) < seq_len:
            documents.append(-1)
    return documents


def make_batch(rows: list[list[Tensor]], seq_len: int, pad_id: int, documents: list[int] | None = None) -> PackedBatch:
    """A :class:`PackedBatch` of ``rows`` (each a list of 1-D int64 token pieces of total length <= ``seq_len``).

    Example::

        >>> make_batch([[torch.tensor([5, 6]), torch.tensor([7])]], seq_len=4, pad_id=0).labels
        tensor([[   6, -100, -100, -100]])
    """
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.empty((len(rows), seq_len), dtype=torch.int64)
    positions = torch.arange(seq_len, dtype=torch.int64)
    boundaries = [0]
    max_seqlen = num_tokens = 0
    for r, row in enumerate(rows):
        # Every piece, and the padding tail after them, is a segment starting at position 0.
        lengths = [piece.numel() for piece in row]
        used = sum(lengths)
        if used < seq_len:
            lengths.append(seq_len - used)
        offset = 0
        for i, length in enumerate(lengths):
            if i < len(row):
                input_ids[r, offset : offset + length] = row[i]
                labels[r, offset : offset + length - 1] = row[i][1:]
            position_ids[r, offset : offset + length] = positions[:length]
            offset += length
            boundaries.append(r * seq_len + offset)
        max_seqlen = max(max_seqlen, *lengths)
        num_tokens += used
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        cu_seqlens=torch.tensor(boundaries, dtype=torch.int32),
        max_seqlen=max_seqlen,
        num_tokens=num_tokens,
        documents=documents,
    )


def _pack(
    documents: Iterator[Any],
    seq_len: int,
    batch_size: int,
    pad_id: int,
    vocab_size: int | None,
    drop_last: bool,
    lookahead: int,
) -> Iterator[PackedBatch]:
    # Documents are read (and checked) as the planner asks for their lengths and kept until their last piece is
    # packed, so memory stays bounded by the look-ahead.
    tokens: dict[int, Tensor] = {}
    left: dict[int, int] = {}

    def lengths() -> Iterator[int]:
        for index, document in enumerate(documents):
            piece = as_tokens(document, index, vocab_size)
            if piece.numel():
                tokens[index], left[index] = piece, piece.numel()
            yield piece.numel()

    for rows in plan_batches(lengths(), seq_len, batch_size, drop_last=drop_last, lookahead=lookahead):
        pieces = []
        for row in rows:
            pieces.append([tokens[d][start : start + n] for d, start, n in row])
            for d, _, n in row:
                left[d] -= n
                if not left[d]:
                    del tokens[d], left[d]
        yield make_batch(pieces, seq_len, pad_id, segment_documents(rows, seq_len))
