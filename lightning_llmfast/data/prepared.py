"""Prepared datasets: token shards, a document index and packed rows on disk, read through memory maps.

``python -m lightning_llmfast.prepare`` writes a directory (see ``docs/data.md`` for the format, readable with NumPy
alone):

- ``tokens-NNNNN.bin``: raw token ids (``uint16`` when the vocabulary fits, else ``uint32``), whole documents, each
  ending with the tokenizer's EOS; a shard holds hundreds of MiB (format version 2; one per chunk in version 1);
- ``documents.npy``: ``int64`` offsets of the documents in the concatenated token stream (``N + 1`` entries);
- ``rows-L{seq_len}-{split}.npy`` and ``pieces-L{seq_len}-{split}.npy``: the split's documents packed into rows of
  ``seq_len`` tokens: row ``r`` is ``pieces[rows[r]:rows[r + 1]]``, each piece a ``(document, start, length)``
  triple. Written by ``prepare`` for its ``--seq-len`` (listed in the manifest), and derived from the document index
  on first use for any other length (:mod:`~lightning_llmfast.data.layouts`: checked, and cached beside the data in
  ``layout-L{seq_len}-{split}/``);
- ``manifest.json``, written last: format version, tokenizer, counts, dtypes, settings and the size and sha256 of
  every file. A directory without it is incomplete and refused.

:class:`PreparedDataset` is the documents of one such directory (a ``Sequence`` of token arrays);
:class:`PreparedBatches` deals the pre-packed rows of one or several of them (blended by weight) as
:class:`~lightning_llmfast.data.PackedBatch` objects through
:class:`~lightning_llmfast.data.dataset.PlannedBatchDataset`: equal batches per rank, a new order per epoch,
resumable. Anonymous memory stays O(1) in the dataset size: tokens, offsets and rows are memory-mapped, and an
epoch's order is a keyed permutation computed per batch (:func:`permute`), never materialised.
"""

from __future__ import annotations

import functools
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
from typing_extensions import override

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.data.dataset import PlannedBatchDataset
from lightning_llmfast.data.files import atomic_file, npy_from_raw, sha256_file, sha256_text
from lightning_llmfast.data.layouts import (
    PACK_WINDOW,
    SPLITS,
    LayoutPlace,
    PackedLayout,
    derived_layout,
    in_validation,
    layout_files,
    mix64,
    split_windows,
    write_layout,
)
from lightning_llmfast.data.packing import Piece
from lightning_llmfast.errors import DataError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PACK_WINDOW",
    "READ_VERSIONS",
    "SPLITS",
    "PackedLayout",
    "PreparedBatches",
    "PreparedDataset",
    "atomic_file",
    "in_validation",
    "layout_files",
    "mix64",
    "npy_from_raw",
    "permute",
    "read_manifest",
    "sha256_file",
    "sha256_text",
    "shard_file",
    "write_layout",
]

FORMAT = "lightning_llmfast.prepared"
"""The ``format`` field of every manifest."""

FORMAT_VERSION = 2
"""Version of the on-disk layout that ``prepare`` writes."""

READ_VERSIONS = (1, 2)
"""Versions a reader reads (1: a token shard per chunk of documents; 2: shards of hundreds of MiB); it refuses any
other."""

MANIFEST = "manifest.json"
"""Name of the manifest, the file that makes a prepared directory complete."""

_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 4
_OPEN_SHARDS = 4  # token shards a reader keeps mapped at once (least recently used closed first)


def shard_file(index: int) -> str:
    """Name of token shard ``index``: ``tokens-00000.bin``."""
    return f"tokens-{index:05d}.bin"


def _key(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, purpose...), each mixed in turn."""
    key = 0
    for part in parts:
        key = int(mix64((key ^ part) & _MASK64)[0])
    return key


def permute(positions: np.ndarray, size: int, key: int) -> np.ndarray:
    """Where ``positions`` go under the permutation of ``range(size)`` drawn from ``key``, in O(1) memory.

    A balanced Feistel network on the smallest even number of bits covering ``size`` is a bijection of
    ``[0, 4**half)``; values that land at or past ``size`` are sent through it again (cycle walking), which keeps it a
    bijection of ``[0, size)``. Each position costs a few integer operations, so an epoch's order is never stored.

    Args:
        positions: integers in ``[0, size)``.
        size: length of the permuted range.
        key: any integer; equal keys give equal permutations.

    Returns:
        ``int64`` array of the permuted positions, as long as ``positions``.

    Example::

        >>> sorted(permute(np.arange(10), 10, key=7).tolist()) == list(range(10))
        True
    """
    x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    if size <= 1:
        return x.astype(np.int64)
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_key(key, r)) for r in range(_FEISTEL_ROUNDS)]

    def rounds(values: np.ndarray) -> np.ndarray:
        left, right = values >> np.uint64(half), values & mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    x = rounds(x)
    walking = np.flatnonzero(x >= np.uint64(size))
    while walking.size:
        x[walking] = rounds(x[walking])
        walking = walking[x[walking] >= np.uint64(size)]
    return x.astype(np.int64)


def read_manifest(path: str | Path, *, checksums: bool = False) -> dict[str, Any]:
    """The manifest of a complete prepared directory, after checking that every file it lists is there, whole.

    Args:
        path: the prepared directory.
        checksums: also recompute the sha256 of every file (reads everything; what ``prepare --verify`` does).

    Raises:
        DataError: no directory, no manifest (an unfinished ``prepare``), an unreadable manifest or another format
            version, or a listed file that is missing, of another size or (``checksums``) of other content; the
            message names the file.

    Example::

        manifest = read_manifest("data/prepared")
        manifest["num_tokens"], manifest["tokenizer"]["vocab_size"]
    """
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"prepared dataset {root}: no such directory")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise DataError(
            f"prepared dataset {root}: no {MANIFEST}, so the preparation did not finish (run the same prepare command "
            "again to complete it)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"prepared dataset {root}: unreadable {MANIFEST}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"prepared dataset {root}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") not in READ_VERSIONS:
        raise DataError(
            f"prepared dataset {root}: format version {manifest.get('version')!r}, this reader reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}; prepare it again"
        )
    for name, entry in manifest["files"].items():
        file = root / name
        if not file.is_file():
            raise DataError(f"prepared dataset {root}: {name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise DataError(
                f"prepared dataset {root}: {name} has {size} bytes, the manifest says {entry['bytes']} (truncated or "
                "overwritten; prepare it again)"
            )
        if checksums and sha256_file(file) != entry["sha256"]:
            raise DataError(f"prepared dataset {root}: {name} does not match its sha256 in {MANIFEST} (corrupted)")
    return manifest


class PreparedDataset(Sequence[np.ndarray]):
    """The documents of a prepared directory: ``dataset[i]`` is document ``i``'s tokens, EOS included.

    Memory-mapped: opening reads the manifest and checks file sizes, and ``dataset[i]`` is a read-only view into a
    token shard (``uint16`` or ``uint32``). At most a few token shards are mapped at once (the least recently used
    is closed first), so a reader holds O(1) maps and file descriptors whatever the number of shards. Pickles
    without its maps (``DataLoader`` workers reopen them). Reads format versions 1 and 2.

    Args:
        path: a directory written by ``python -m lightning_llmfast.prepare``.

    Raises:
        DataError: see :func:`read_manifest`.

    Example::

        from lightning_llmfast.data import PreparedDataset

        docs = PreparedDataset("data/prepared")
        len(docs), docs[0][-1] == docs.eos_id, docs.vocab_size
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        tokenizer = self.manifest["tokenizer"]
        self.vocab_size: int = tokenizer["vocab_size"]
        self.eos_id: int = tokenizer["eos_id"]
        self.bos_id: int | None = tokenizer["bos_id"]
        self.pad_id: int | None = tokenizer["pad_id"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.num_tokens: int = self.manifest["num_tokens"]
        shards = self.manifest["shards"]
        self._shard_first = np.array([s["first_document"] for s in shards], dtype=np.int64)
        self._shard_start = np.array([s["first_token"] for s in shards], dtype=np.int64)
        self._maps: dict[str, np.ndarray] = {}
        self._shards: OrderedDict[int, np.ndarray] = OrderedDict()
        self._layouts: dict[tuple[int, str], PackedLayout] = {}
        # Where the derived layouts lie once checked or written: kept when pickled, so DataLoader workers open them.
        self._derived: dict[tuple[int, str], LayoutPlace] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}, "_shards": OrderedDict(), "_layouts": {}}

    @functools.cached_property
    def key(self) -> str:
        """A key of this dataset (its resolved path and manifest): names its derived layouts within a process."""
        return sha256_text(f"{self.path.resolve()}\n{json.dumps(self.manifest, sort_keys=True)}")[:32]

    def _map(self, name: str) -> np.ndarray:
        if name not in self._maps:
            self._maps[name] = np.load(self.path / name, mmap_mode="r")
        return self._maps[name]

    def _shard(self, index: int) -> np.ndarray:
        """Token shard ``index``, mapped; the least recently used map beyond a few is dropped (and so closed)."""
        if index in self._shards:
            self._shards.move_to_end(index)
        else:
            self._shards[index] = np.memmap(self.path / self.manifest["shards"][index]["file"], dtype=self.dtype,
                                            mode="r")  # fmt: skip
            if len(self._shards) > _OPEN_SHARDS:
                self._shards.popitem(last=False)
        return self._shards[index]

    @property
    def offsets(self) -> np.ndarray:
        """``int64`` start of every document in the token stream, and its end (``N + 1`` entries, memory-mapped)."""
        return self._map("documents.npy")

    def __len__(self) -> int:
        return self.manifest["num_documents"]

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = check_int("document index", index, error=DataError)
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of a prepared dataset of {len(self)}")
        index %= len(self)
        return self.read(index, 0, int(self.offsets[index + 1] - self.offsets[index]))

    def read(self, document: int, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of ``document``, a read-only view of its shard."""
        shard = int(np.searchsorted(self._shard_first, document, side="right")) - 1
        begin = int(self.offsets[document]) - int(self._shard_start[shard]) + start
        return self._shard(shard)[begin : begin + length]  # a view keeps its map open, even once dropped here

    def layout(self, seq_len: int, split: str) -> PackedLayout:
        """The packed rows of ``split`` for rows of ``seq_len`` tokens, for any ``seq_len``.

        The lengths given to ``prepare --seq-len`` were packed then (listed and checked by the manifest). Any other
        length is packed from the document index on first use, with the same packer and memory bounded by its window,
        and published beside the data (``layout-L{seq_len}-{split}/``, one atomic rename) for every later reader,
        which checks it in full before use (a damaged one is packed again, with a warning); no token file is read or
        changed. On a read-only directory it goes to a temporary directory of this process instead, once per process.
        Either way the ``DataLoader`` workers this dataset is pickled to open it as it is
        (:func:`~lightning_llmfast.data.layouts.derived_layout`).

        Raises:
            DataError: ``seq_len`` below 2, or ``split`` not one of :data:`SPLITS`.
        """
        seq_len = check_int("seq_len", seq_len, low=2, error=DataError)
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS}, got {split!r}")
        key = (seq_len, split)
        if key not in self._layouts:
            if str(seq_len) in self.manifest["layouts"]:
                rows, pieces = layout_files(seq_len, split)
                self._layouts[key] = PackedLayout(self._map(rows), self._map(pieces))
            else:
                windows = functools.partial(split_windows, len(self), self.manifest["settings"]["val_fraction"], split)
                known = self._derived.get(key)
                self._derived[key] = derived_layout(self.path, self.key, seq_len, split, windows, self.offsets, known)
                self._layouts[key] = self._derived[key].open()
        return self._layouts[key]


class PreparedBatches(PlannedBatchDataset):
    """Pre-packed rows of one or several prepared directories as :class:`~lightning_llmfast.data.PackedBatch`.

    An epoch is a sequence of row slots, ``batch_size`` per batch, dealt to ranks as in
    :class:`~lightning_llmfast.data.dataset.PlannedBatchDataset`. Without ``shuffle_seed`` the slots are the rows of
    every source in order. With it, source ``s`` gets ``weights[s]`` of the slots (its own number of rows when
    ``weights`` is ``None``), in an order drawn from ``(shuffle_seed, epoch)``, and its rows are visited in a fresh
    permutation for every pass (a source sampled above its size repeats rows only after using all of them).
    ``documents`` of a batch are indices in the concatenation of the sources (source ``s``'s document ``d`` is
    ``d + sum(len(sources[:s]))``).

    Args:
        sources: the prepared datasets; all from the same tokenizer.
        split: ``"train"`` or ``"val"``.
        seq_len: tokens per row: any length (one a source was not prepared with is packed on first use, see
            :meth:`PreparedDataset.layout`).
        batch_size: rows per batch.
        weights: share of the epoch's rows per source (normalised); ``None`` keeps the sources' sizes.
        shuffle_seed: seed of the epoch orders; ``None`` reads rows in order.
        pad_id: token id of padding; default the tokenizer's pad id, else its EOS.
        rank: this process's global rank.
        world_size: number of ranks.
        limit_batches: at most this many batches per rank and epoch.
        uneven: ``"drop"`` or ``"fill"`` the last incomplete round (see ``PlannedBatchDataset``).

    Raises:
        DataError: no source, sources from different tokenizers, a ``seq_len`` below 2, bad ``weights`` (one per
            source, non-negative, not all zero), a weighted source without rows in ``split``, or no row at all.

    Example::

        from torch.utils.data import DataLoader
        from lightning_llmfast.data import PreparedBatches, PreparedDataset

        sources = [PreparedDataset("data/web"), PreparedDataset("data/code")]
        batches = PreparedBatches(sources, "train", seq_len=2048, batch_size=8, weights=[0.7, 0.3], shuffle_seed=0)
        for batch in DataLoader(batches, batch_size=None, num_workers=2): ...
    """

    def __init__(
        self,
        sources: Sequence[PreparedDataset],
        split: str,
        *,
        seq_len: int,
        batch_size: int,
        weights: Sequence[float] | None = None,
        shuffle_seed: int | None = None,
        pad_id: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        limit_batches: int | None = None,
        uneven: str = "drop",
    ) -> None:
        if not sources:
            raise DataError("PreparedBatches needs at least one prepared dataset")
        first = sources[0]
        for source in sources[1:]:
            if source.manifest["tokenizer"]["sha256"] != first.manifest["tokenizer"]["sha256"]:
                raise DataError(
                    f"prepared datasets {first.path} and {source.path} come from different tokenizers (tokenizer.json "
                    "sha256 differs); blend only datasets prepared with the same tokenizer"
                )
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS}, got {split!r}")
        if pad_id is None:
            pad_id = first.pad_id if first.pad_id is not None else first.eos_id
        super().__init__(
            seq_len=seq_len, batch_size=batch_size, vocab_size=max(s.vocab_size for s in sources), pad_id=pad_id,
            rank=rank, world_size=world_size, limit_batches=limit_batches, uneven=uneven,
        )  # fmt: skip
        if shuffle_seed is not None:
            shuffle_seed = check_int("shuffle_seed", shuffle_seed, low=-(2**63), high=_MASK64, error=DataError)
        self.sources, self.split, self.shuffle_seed = list(sources), split, shuffle_seed
        self._layouts: list[PackedLayout] | None = None
        self.rows_per_source = [layout.num_rows for layout in self.layouts]
        self.weights = None if weights is None else self._check_weights(weights)
        self.document_offsets = np.cumsum([0, *(len(source) for source in self.sources)])
        self.slots_per_source = self._allocate()
        if sum(self.slots_per_source) == 0:
            raise DataError(f"no packed row in the {split!r} split of {', '.join(str(s.path) for s in self.sources)}")

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps pickle as copies of their data: DataLoader workers reopen them instead.
        return {**self.__dict__, "_layouts": None}

    @property
    def layouts(self) -> list[PackedLayout]:
        """Every source's packed rows of this split and ``seq_len`` (memory-mapped; packed on first use if needed)."""
        if self._layouts is None:
            self._layouts = [source.layout(self.seq_len, self.split) for source in self.sources]
        return self._layouts

    def _check_weights(self, weights: Sequence[float]) -> list[float]:
        if len(weights) != len(self.sources):
            raise DataError(f"weights: one per prepared dataset ({len(self.sources)}), got {len(weights)}")
        checked = [check_number(f"weights[{i}]", w, low=0, error=DataError) for i, w in enumerate(weights)]
        if sum(checked) <= 0:
            raise DataError(f"weights must not all be 0, got {list(weights)}")
        for source, rows, weight in zip(self.sources, self.rows_per_source, checked, strict=True):
            if weight > 0 and rows == 0:
                raise DataError(
                    f"prepared dataset {source.path} has weight {weight} but no row in the {self.split!r} split"
                )
        return checked

    def _allocate(self) -> list[int]:
        """Row slots of every source in one epoch: their sizes, or the weighted shares of the same total."""
        if self.weights is None or self.shuffle_seed is None:
            return list(self.rows_per_source)
        total = sum(self.rows_per_source)
        exact = [total * w / sum(self.weights) for w in self.weights]
        slots = [math.floor(x) for x in exact]
        # Largest remainders (ties to the lower index) take the slots that rounding down left over.
        for i in sorted(range(len(exact)), key=lambda i: (slots[i] - exact[i], i))[: total - sum(slots)]:
            slots[i] += 1
        return slots

    @property
    def num_rows(self) -> int:
        """Row slots of one epoch."""
        return sum(self.slots_per_source)

    def slot_rows(self, epoch: int, slots: np.ndarray) -> Iterator[tuple[int, int]]:
        """``(source, row)`` of every epoch slot in ``slots``."""
        bounds = np.cumsum([0, *self.slots_per_source])
        if self.shuffle_seed is None:
            virtual = slots
        else:
            virtual = permute(slots, self.num_rows, _key(self.shuffle_seed, epoch, 0))
        owners = np.searchsorted(bounds, virtual, side="right") - 1
        for owner, position in zip(owners.tolist(), (virtual - bounds[owners]).tolist(), strict=True):
            size = self.rows_per_source[owner]
            passes, row = divmod(position, size)
            if self.shuffle_seed is not None:
                row = int(permute(np.array([row]), size, _key(self.shuffle_seed, epoch, 1 + owner, passes))[0])
            yield owner, row

    @override
    def epoch_batches(self, epoch: int) -> Sequence[list[list[Piece]]]:
        return _EpochRows(self, epoch)

    @override
    def read_piece(self, piece: Piece, cache: dict[int, torch.Tensor]) -> torch.Tensor:
        document, start, length = piece
        owner = int(np.searchsorted(self.document_offsets, document, side="right")) - 1
        tokens = self.sources[owner].read(document - int(self.document_offsets[owner]), start, length)
        return torch.from_numpy(tokens.astype(np.int64))

    @override
    def fingerprint(self) -> dict[str, Any]:
        return {
            "manifests": [sha256_text(json.dumps(s.manifest, sort_keys=True)) for s in self.sources],
            "split": self.split,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "pad_id": self.pad_id,
            "weights": self.weights,
            "shuffle_seed": self.shuffle_seed,
            "world_size": self.world_size,
        }


class _EpochRows(Sequence[list[list[Piece]]]):
    """The batches of one epoch of :class:`PreparedBatches`, each built from its row slots when asked for."""

    def __init__(self, batches: PreparedBatches, epoch: int) -> None:
        self.batches, self.epoch = batches, epoch

    def __len__(self) -> int:
        return -(-self.batches.num_rows // self.batches.batch_size)

    @overload
    def __getitem__(self, index: int) -> list[list[Piece]]: ...

    @overload
    def __getitem__(self, index: slice) -> list[list[list[Piece]]]: ...

    def __getitem__(self, index: int | slice) -> list[list[Piece]] | list[list[list[Piece]]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of an epoch of {len(self)}")
        size = self.batches.batch_size
        slots = np.arange(index * size, min((index + 1) * size, self.batches.num_rows), dtype=np.int64)
        offsets = self.batches.document_offsets
        layouts = self.batches.layouts
        return [layouts[s].row(r, int(offsets[s])) for s, r in self.batches.slot_rows(self.epoch, slots)]
