"""Packed layouts: which documents a split holds, their rows of ``seq_len`` tokens, and layouts derived at load time.

A layout is a pair of ``int64`` arrays: ``rows`` (``R + 1`` offsets into ``pieces``) and ``pieces`` (``(P, 3)``
triples ``(document, start, length)``); row ``r`` is ``pieces[rows[r]:rows[r + 1]]``. ``prepare`` writes the layouts
of its ``--seq-len`` beside the data and lists them in the manifest. Any other length is derived from the document
index when first asked for (:func:`derived_layout`), with the same packer, window by window:

- memory is bounded by the packing window (:data:`PACK_WINDOW` documents of the split), whatever the number of
  documents: the split's documents are found block by block (:func:`split_windows`), each window is packed on its
  own and its pieces streamed into the output file;
- the pair is written into a temporary directory named for this host, process and a random part, then published by
  one rename of that directory (``layout-L{seq_len}-{split}/`` beside the data): a reader sees the whole pair or none;
- a published pair is checked in full before use (:func:`check_layout`: offsets increasing, every piece of every
  document of the split exactly once and within bounds, no row longer than ``seq_len``), window by window too; one
  that fails is derived again, with a warning;
- on a read-only dataset the pair goes to a temporary directory of this process (removed at its exit), once per
  process; what a process derived or checked travels with the pickled dataset to its ``DataLoader`` workers, which
  open it as it is.

Example::

    for window in split_windows(num_documents=10, val_fraction=0.0, split="train"):
        window.tolist()  # [0, 1, ..., 9]: one window
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_llmfast.data.files import fsync_directory, npy_from_raw, unique_suffix
from lightning_llmfast.data.packing import Piece, pack_lengths

__all__ = [
    "PACK_WINDOW",
    "SPLITS",
    "LayoutPlace",
    "PackedLayout",
    "check_layout",
    "derived_layout",
    "id_windows",
    "in_validation",
    "layout_directory",
    "layout_files",
    "mix64",
    "publish_layout",
    "split_windows",
    "write_layout",
]

SPLITS = ("train", "val")
"""Splits of whole documents that ``prepare`` packs separately."""

PACK_WINDOW = 1 << 18
"""Documents of a split packed together (best-fit decreasing, :func:`~lightning_llmfast.data.packing.pack_lengths`):
bounds the packer's memory (about 50 MiB) and keeps every row within a window of the document order."""

_VAL_KEY = 0x5EED5A1D  # fixed key of the validation split's document hash
_BLOCK = 1 << 14  # documents whose split membership is computed at once (a few hundred KiB)

Identity = tuple[int, int, int, int]
"""``(device, inode, size, mtime_ns)`` of a file: what a checked file was."""


def mix64(values: np.ndarray | int) -> np.ndarray:
    """SplitMix64's finaliser on ``uint64`` values: a fixed, well-mixed bijection of 64-bit integers.

    Example::

        >>> int(mix64(0)[0]) == int(mix64(np.array([0], dtype=np.uint64))[0])
        True
    """
    z = np.atleast_1d(np.asarray(values, dtype=np.uint64)) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def in_validation(first: int, count: int, val_fraction: float) -> np.ndarray:
    """Whether each of documents ``first ... first + count - 1`` is in the validation split (a fixed hash).

    Example::

        >>> in_validation(0, 4, 0.0).tolist()
        [False, False, False, False]
    """
    if val_fraction == 0:
        return np.zeros(count, dtype=bool)
    ids = np.arange(first, first + count, dtype=np.uint64)
    return (mix64(ids ^ np.uint64(_VAL_KEY)) >> np.uint64(11)).astype(np.float64) / 2.0**53 < val_fraction


def layout_files(seq_len: int, split: str) -> tuple[str, str]:
    """Names of the ``(rows, pieces)`` files of ``split`` packed into rows of ``seq_len`` tokens."""
    return f"rows-L{seq_len}-{split}.npy", f"pieces-L{seq_len}-{split}.npy"


def layout_directory(seq_len: int, split: str) -> str:
    """Name of the directory a derived layout is published as: ``layout-L{seq_len}-{split}``."""
    return f"layout-L{seq_len}-{split}"


class PackedLayout:
    """The rows of one split packed into ``seq_len`` tokens: row ``r`` is ``pieces[rows[r]:rows[r + 1]]``.

    Args:
        rows: ``int64`` offsets into ``pieces`` (``R + 1`` entries), memory-mapped.
        pieces: ``int64`` ``(P, 3)`` array of ``(document, start, length)``, memory-mapped.

    Example::

        layout = PreparedDataset("data/prepared").layout(2048, "train")
        layout.num_rows, layout.row(0)  # [(document, start, length), ...]
    """

    def __init__(self, rows: np.ndarray, pieces: np.ndarray) -> None:
        self.rows, self.pieces = rows, pieces

    @property
    def num_rows(self) -> int:
        """Number of packed rows ``R``."""
        return len(self.rows) - 1

    def row(self, index: int, document_offset: int = 0) -> list[Piece]:
        """The pieces of row ``index``; ``document_offset`` is added to every document index."""
        block = self.pieces[int(self.rows[index]) : int(self.rows[index + 1])]
        return [(int(d) + document_offset, int(s), int(n)) for d, s, n in block]


def split_windows(num_documents: int, val_fraction: float, split: str) -> Iterator[np.ndarray]:
    """The ``int64`` numbers of ``split``'s documents, ascending, by windows of :data:`PACK_WINDOW` (the last may be
    shorter); membership is computed block by block, so memory stays bounded by a window and a block.

    Example::

        >>> [w.tolist() for w in split_windows(3, 0.0, "train")]
        [[0, 1, 2]]
    """
    window = PACK_WINDOW
    pending: list[np.ndarray] = []
    held = 0
    for first in range(0, num_documents, _BLOCK):
        val = in_validation(first, min(_BLOCK, num_documents - first), val_fraction)
        pending.append(first + np.flatnonzero(val if split == "val" else ~val).astype(np.int64))
        held += len(pending[-1])
        while held >= window:
            joined = np.concatenate(pending)
            yield joined[:window]
            pending, held = [joined[window:]], held - window
    if held:
        yield np.concatenate(pending)


def id_windows(ids: np.ndarray) -> Iterator[np.ndarray]:
    """``ids`` (a split's document numbers, ascending; a memory map is read a window at a time) by windows of
    :data:`PACK_WINDOW`, as :func:`split_windows` gives them."""
    window = PACK_WINDOW
    for first in range(0, len(ids), window):
        yield np.asarray(ids[first : first + window], dtype=np.int64)


def write_layout(
    directory: Path, seq_len: int, split: str, windows: Iterable[np.ndarray], offsets: np.ndarray, scratch: Path
) -> dict[str, int]:
    """Pack a split's documents, given by windows, into rows of ``seq_len`` tokens; write its rows and pieces files.

    Each window (:func:`split_windows`, :func:`id_windows`) is packed by
    :func:`~lightning_llmfast.data.packing.pack_lengths` (whole documents, longer ones cut into ``seq_len`` chunks,
    short pieces best-fit decreasing) and its pieces go to disk before the next window is read, so a layout derived
    at load time equals the one ``prepare`` writes for the same length and memory is bounded by the window. The
    pieces file is renamed into place before the rows file.

    Args:
        directory: where the ``.npy`` files go.
        seq_len: tokens per row.
        split: the split's name (for the file names).
        windows: ``int64`` numbers of the split's documents, ascending, window by window.
        offsets: the document index (``N + 1`` token offsets).
        scratch: a directory for the raw files written before the ``.npy`` headers are known.

    Returns:
        ``{"rows": R, "pieces": P}``.
    """
    rows_name, pieces_name = layout_files(seq_len, split)
    tag = f".raw-{unique_suffix()}"
    rows_raw, pieces_raw = scratch / f"{rows_name}{tag}", scratch / f"{pieces_name}{tag}"
    try:
        counts = _pack_raw(rows_raw, pieces_raw, seq_len, windows, offsets)
        npy_from_raw(pieces_raw, directory / pieces_name, 3)
        npy_from_raw(rows_raw, directory / rows_name, 1)
    finally:
        rows_raw.unlink(missing_ok=True)
        pieces_raw.unlink(missing_ok=True)
    return counts


def _pack_raw(
    rows_raw: Path, pieces_raw: Path, seq_len: int, windows: Iterable[np.ndarray], offsets: np.ndarray
) -> dict[str, int]:
    """:func:`write_layout`'s packing into raw ``int64`` files (rows offsets, pieces triples), window by window."""
    num_rows = num_pieces = 0
    with open(rows_raw, "wb") as rows_file, open(pieces_raw, "wb") as pieces_file:
        rows_file.write(np.zeros(1, dtype=np.int64).tobytes())
        for window in windows:
            rows, pieces = pack_lengths(offsets[window + 1] - offsets[window], seq_len)
            pieces[:, 0] = window[pieces[:, 0]]  # pack_lengths numbers the window's documents 0, 1, ...
            pieces_file.write(pieces.tobytes())
            rows_file.write((num_pieces + rows[1:]).tobytes())
            num_rows, num_pieces = num_rows + len(rows) - 1, num_pieces + len(pieces)
    return {"rows": num_rows, "pieces": num_pieces}


def check_layout(
    rows: np.ndarray, pieces: np.ndarray, windows: Iterable[np.ndarray], offsets: np.ndarray, seq_len: int
) -> str | None:
    """What is wrong with a layout of a split's documents (given by the windows it was packed by), or ``None``.

    In full and window by window (memory bounded by a window's pieces): ``rows`` is a 1-D ``int64`` array running
    from 0 to the number of pieces and increasing; the pieces of each window's documents fill whole rows, in window
    order; each piece is ``seq_len`` tokens of its document from a multiple of ``seq_len`` (or the remainder), within
    the document; every piece of every document of the split is there exactly once; no row holds more than
    ``seq_len`` tokens.

    Example::

        >>> rows, pieces = pack_lengths(np.array([5, 2]), seq_len=4)
        >>> check_layout(rows, pieces, [np.arange(2)], np.array([0, 5, 7]), 4) is None
        True
        >>> check_layout(rows, pieces[1:], [np.arange(2)], np.array([0, 5, 7]), 4)
        'rows run from 0 to 3, not to the 2 pieces'
    """
    if rows.ndim != 1 or rows.dtype != np.int64 or len(rows) < 1:
        return f"rows is not a 1-D int64 array of offsets ({rows.dtype}, shape {rows.shape})"
    if pieces.ndim != 2 or pieces.shape[1] != 3 or pieces.dtype != np.int64:
        return f"pieces is not an int64 (P, 3) array ({pieces.dtype}, shape {pieces.shape})"
    if int(rows[0]) != 0 or int(rows[-1]) != len(pieces):
        return f"rows run from {int(rows[0])} to {int(rows[-1])}, not to the {len(pieces)} pieces"
    piece_at = row_at = 0
    for window in windows:
        lengths = offsets[window + 1] - offsets[window]
        counts = -(-lengths // seq_len)
        end = piece_at + int(counts.sum())
        if end > len(pieces):
            return f"{len(pieces)} pieces, fewer than the split's documents make"
        # Every row holds a piece: this window's rows are among the next ``end - piece_at`` offsets.
        row_end = row_at + int(np.searchsorted(rows[row_at : row_at + end - piece_at + 1], end))
        if row_end >= len(rows) or int(rows[row_end]) != end:
            return f"the pieces of documents {int(window[0])} to {int(window[-1])} do not end a row"
        starts = np.asarray(rows[row_at : row_end + 1])
        if np.any(np.diff(starts) <= 0):
            return f"row offsets that do not increase (rows {row_at} to {row_end})"
        if end > piece_at:
            problem = _check_window(np.asarray(pieces[piece_at:end]), starts - piece_at, window, lengths, seq_len)
            if problem is not None:
                return problem
        piece_at, row_at = end, row_end
    if piece_at != len(pieces):
        return f"{len(pieces) - piece_at} pieces beyond those of the split's documents"
    return None


def _check_window(
    block: np.ndarray, starts: np.ndarray, window: np.ndarray, lengths: np.ndarray, seq_len: int
) -> str | None:
    """:func:`check_layout` on the pieces of one window (``starts``: its row offsets, from 0)."""
    document, start, length = block[:, 0], block[:, 1], block[:, 2]
    at = np.minimum(np.searchsorted(window, document), len(window) - 1)
    foreign = window[at] != document
    if foreign.any():
        return (
            f"a piece of document {int(document[foreign][0])} among those of documents {int(window[0])} to "
            f"{int(window[-1])} of the split: one of theirs is missing, or it is out of place"
        )
    size = lengths[at]
    wrong = (start < 0) | (start >= size) | (start % seq_len != 0) | (length != np.minimum(seq_len, size - start))
    if wrong.any():
        d, s, n = (int(v) for v in block[np.argmax(wrong)])
        return f"piece ({d}, {s}, {n}) is not a piece of its document of {int(lengths[at][np.argmax(wrong)])} tokens"
    counts = -(-lengths // seq_len)
    ordinal = (np.cumsum(counts) - counts)[at] + start // seq_len  # the piece's place among the window's pieces
    if np.any(np.bincount(ordinal, minlength=len(block)) != 1):
        return f"a piece of documents {int(window[0])} to {int(window[-1])} is missing and another is counted twice"
    if np.any(np.add.reduceat(length, starts[:-1]) > seq_len):
        return f"a row of documents {int(window[0])} to {int(window[-1])} holds more than {seq_len} tokens"
    return None


@dataclass(frozen=True)
class LayoutPlace:
    """Where a derived layout's pair of files lies, and what the pair was when this process checked or wrote it.

    It pickles with the dataset: a ``DataLoader`` worker opens the pair as it is while it is unchanged (same
    device, inode, size and mtime), without packing or checking it again.
    """

    directory: Path
    names: tuple[str, str]
    identity: tuple[Identity, Identity]

    @classmethod
    def of(cls, directory: Path, seq_len: int, split: str) -> LayoutPlace:
        """The pair in ``directory`` as it is now."""
        names = layout_files(seq_len, split)
        return cls(directory, names, (_identity(directory / names[0]), _identity(directory / names[1])))

    def unchanged(self) -> bool:
        """Whether both files are still the ones recorded."""
        try:
            return (_identity(self.directory / self.names[0]), _identity(self.directory / self.names[1])) == (
                self.identity
            )
        except OSError:
            return False

    def open(self) -> PackedLayout:
        """The pair, memory-mapped."""
        rows, pieces = (np.load(self.directory / name, mmap_mode="r") for name in self.names)
        return PackedLayout(rows, pieces)


def _identity(path: Path) -> Identity:
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


_PLACES: dict[tuple[str, int, str], LayoutPlace] = {}  # this process's checked or derived layouts
_SCRATCH: dict[int, Path] = {}  # per process id: where the layouts of read-only datasets go


def derived_layout(
    root: Path,
    dataset: str,
    seq_len: int,
    split: str,
    windows: Callable[[], Iterable[np.ndarray]],
    offsets: np.ndarray,
    known: LayoutPlace | None = None,
) -> LayoutPlace:
    """Where the layout of ``split`` at ``seq_len`` of the dataset at ``root`` lies: checked, or derived now.

    In order: ``known`` (what the process that pickled the dataset found) or what this process found before, while
    unchanged; the pair published beside the data, once :func:`check_layout` passes (else a warning, and it is
    derived again); a new derivation published beside the data (:func:`publish_layout`), or into this process's
    temporary directory when ``root`` cannot be written.

    Args:
        root: the prepared directory.
        dataset: a key of the dataset (its path and manifest), naming its layouts in this process.
        seq_len: tokens per row.
        split: ``"train"`` or ``"val"``.
        windows: gives the split's documents by windows (:func:`split_windows`), on each call anew.
        offsets: the document index (``N + 1`` token offsets).
        known: a place found earlier, e.g. by the process that started this ``DataLoader`` worker.
    """
    key = (dataset, seq_len, split)
    for place in (known, _PLACES.get(key)):
        if place is not None and place.unchanged():
            _PLACES[key] = place
            return place
    published = root / layout_directory(seq_len, split)
    damaged = _directory_identity(published)
    if damaged is not None:
        problem = _published_problem(published, seq_len, split, windows(), offsets)
        if problem is None:
            _PLACES[key] = LayoutPlace.of(published, seq_len, split)
            return _PLACES[key]
        warnings.warn(f"derived layout {published}: {problem}; deriving it again", stacklevel=3)
    try:
        directory = publish_layout(root, seq_len, split, windows(), offsets, damaged)
    except OSError:  # a read-only dataset (or no room beside it): this process's temporary directory
        directory = publish_layout(_scratch(dataset), seq_len, split, windows(), offsets)
    _PLACES[key] = LayoutPlace.of(directory, seq_len, split)
    return _PLACES[key]


def _published_problem(
    directory: Path, seq_len: int, split: str, windows: Iterable[np.ndarray], offsets: np.ndarray
) -> str | None:
    try:
        rows, pieces = (np.load(directory / name, mmap_mode="r") for name in layout_files(seq_len, split))
    except (OSError, ValueError, EOFError) as err:  # a missing, truncated or garbled file
        return f"unreadable ({type(err).__name__}: {err})"
    return check_layout(rows, pieces, windows, offsets, seq_len)


def publish_layout(
    parent: Path,
    seq_len: int,
    split: str,
    windows: Iterable[np.ndarray],
    offsets: np.ndarray,
    damaged: tuple[int, int] | None = None,
) -> Path:
    """Derive a layout into a new directory beside ``parent / layout-L{seq_len}-{split}`` and rename it there.

    The temporary directory is ``.layout-L{seq_len}-{split}.tmp-{host}-{pid}-{random}``: writers on other hosts or
    in other PID namespaces never share it. The rename publishes both files at once. The directory already there is
    replaced only when it is ``damaged`` (its device and inode, as found by the caller): renamed aside, then removed.
    Any other one was published by another process meanwhile, from the same index (equal, byte for byte): it stands,
    and this derivation is dropped.

    Raises:
        OSError: ``parent`` cannot be written.
    """
    final = parent / layout_directory(seq_len, split)
    tmp = parent / f".{final.name}.tmp-{unique_suffix()}"
    os.mkdir(tmp)
    try:
        write_layout(tmp, seq_len, split, windows, offsets, tmp)
        fsync_directory(tmp)
        while not _renamed(tmp, final):
            found = _directory_identity(final)
            if found is not None and found != damaged:
                break  # published by another process meanwhile: it stands
            if found is not None:
                aside = final.with_name(f".{final.name}.old-{unique_suffix()}")
                with contextlib.suppress(FileNotFoundError):  # another process moved it aside first
                    os.rename(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed; a dropped derivation or what an error left
    fsync_directory(parent)
    return final


def _renamed(source: Path, target: Path) -> bool:
    """Rename the directory ``source`` to ``target``; ``False`` when a non-empty directory is there."""
    try:
        os.rename(source, target)
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    return True


def _directory_identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of a directory, or ``None`` when there is none."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _scratch(dataset: str) -> Path:
    """This process's temporary directory for the layouts of ``dataset`` (removed when the process exits)."""
    pid = os.getpid()
    if pid not in _SCRATCH:
        _SCRATCH[pid] = Path(tempfile.mkdtemp(prefix=f"lightning_llmfast-layouts-{unique_suffix()}-"))
        atexit.register(_remove_scratch, _SCRATCH[pid], pid)
    path = _SCRATCH[pid] / dataset
    path.mkdir(exist_ok=True)
    return path


def _remove_scratch(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the handler, not the directory
        shutil.rmtree(path, ignore_errors=True)
