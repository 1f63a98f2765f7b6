"""A byte-level tokenizer and two corpora: local text files (the stdlib by default) and synthetic documents.

Both corpora are sized, indexable sequences of documents (``list[int]`` token ids) so that data loaders can shard
them by index across workers and ranks without reading what they skip.
"""

from __future__ import annotations

import math
import numbers
import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.errors import DataError

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "VOCAB_SIZE",
    "SyntheticCorpus",
    "TextCorpus",
    "decode",
    "encode",
]

BOS_ID = 256
"""Begin-of-document token, after the 256 byte values."""
EOS_ID = 257
"""End-of-document token."""
VOCAB_SIZE = 258
"""Byte tokenizer vocabulary: 256 byte values, ``BOS_ID`` and ``EOS_ID``."""

_SPLITS = ("train", "val", "test")
DISTRIBUTIONS = ("lognormal", "uniform", "fixed", "exponential")
"""Document-length distributions of :class:`SyntheticCorpus`."""
_MAX_DOC_LEN = 2**31 - 1
"""Longest synthetic document: a drawn length above it (an absurd ``mean_len`` or ``sigma``) is an error."""
_DOC_SEED_STRIDE = 1_000_003
MAX_SEED = 2**63 // _DOC_SEED_STRIDE
"""Bound of ``abs(seed)`` in :class:`SyntheticCorpus`: each document seed ``seed * stride + index`` must fit."""


def encode(text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Byte-level token ids of ``text`` (UTF-8), framed by ``BOS_ID``/``EOS_ID`` unless told otherwise.

    Raises:
        DataError: ``text`` is not a ``str`` (bytes are already tokens: ``list(data)``).

    Example::

        >>> encode("hi")
        [256, 104, 105, 257]
        >>> decode(encode("héllo"))
        'héllo'
    """
    if not isinstance(text, str):
        raise DataError(f"encode: text must be a str, got {type(text).__name__}")
    check_bool("encode: add_special_tokens", add_special_tokens, error=DataError)
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids, EOS_ID] if add_special_tokens else ids


def decode(ids: Iterable[int] | torch.Tensor) -> str:
    """Text of byte-level token ids; special tokens are dropped, invalid UTF-8 becomes U+FFFD.

    Raises:
        DataError: ``ids`` is not a 1-D sequence (or tensor) of ints, or an id lies outside ``[0, VOCAB_SIZE)``.

    Example::

        >>> decode([256, 104, 105, 257])
        'hi'
    """
    if isinstance(ids, torch.Tensor):
        integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
        if ids.dim() != 1 or not (integer or ids.numel() == 0):  # torch.tensor([]) is float32: nothing to misread
            raise DataError(f"decode: ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        values = ids.tolist()
    elif isinstance(ids, str) or not isinstance(ids, Iterable):
        raise DataError(f"decode: ids must be a 1-D sequence of int token ids, got {type(ids).__name__}")
    else:
        # 0-d integer tensors (list(torch.tensor([...]))) count as ints, as the tensor path reads them.
        values = [_scalar(v) for v in ids]
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise DataError(f"token id {value!r} at position {position} is not an int")
        if not 0 <= value < VOCAB_SIZE:
            raise DataError(f"token id {value} at position {position} is outside the byte vocabulary [0, {VOCAB_SIZE})")
    return bytes(v for v in values if v < 256).decode("utf-8", errors="replace")


def _scalar(value: object) -> object:
    """A 0-d integer tensor's value (an int); anything else as given."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        return value.item()
    return value


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _in_split(relative: str, split: str, val_fraction: float, test_fraction: float) -> bool:
    # A stable hash of the path (not Python's randomised hash) puts each file in the same split on every run and
    # keeps the split of a file unchanged when other files are added or removed.
    bucket = zlib.crc32(relative.encode("utf-8")) % 1_000_000
    if bucket < val_fraction * 1_000_000:
        return split == "val"
    if bucket < (val_fraction + test_fraction) * 1_000_000:
        return split == "test"
    return split == "train"


class TextCorpus(Sequence[list[int]]):
    """Local text files as byte-level documents, one document per file, read lazily.

    With no ``paths`` it uses the ``.py`` sources of the running Python's standard library (present on every
    machine, so nothing is downloaded), excluding installed third-party packages. Files are listed in sorted order
    and split deterministically (by a stable hash of each file's path) into ``"train"``, ``"val"`` and ``"test"``
    (the test split is empty unless ``test_fraction > 0``; it never changes the validation split). Empty files
    are left out. Each document is ``[BOS_ID, *bytes, EOS_ID]``.

    Args:
        paths: files and/or directories (walked recursively for all files); ``None`` for the stdlib sources.
        split: ``"train"``, ``"val"`` or ``"test"``.
        val_fraction: share of the files in the validation split, in ``[0, 1]``.
        test_fraction: share of the files in the test split, in ``[0, 1 - val_fraction]``.
        max_docs: keep only the first ``max_docs`` files of the split.

    Raises:
        DataError: unknown split, bad fraction or ``max_docs``, a path that does not exist, or no file left.

    Example::

        >>> corpus = TextCorpus(max_docs=4)
        >>> len(corpus), corpus.vocab_size
        (4, 258)
        >>> corpus[0][0] == BOS_ID
        True
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str] | None = None,
        *,
        split: str = "train",
        val_fraction: float = 0.05,
        max_docs: int | None = None,
        test_fraction: float = 0.0,
    ) -> None:
        if split not in _SPLITS:
            raise DataError(f"split must be one of {_SPLITS}, got {split!r}")
        check_number("val_fraction", val_fraction, low=0, high=1, error=DataError)
        check_number("test_fraction", test_fraction, low=0, high=1 - val_fraction, error=DataError)
        if max_docs is not None:
            check_int("max_docs", max_docs, low=1, error=DataError)
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.split = split
        files = self._stdlib_files() if paths is None else self._listed_files([Path(p) for p in paths])
        roots = [str(_stdlib_root())] if paths is None else [str(p) for p in paths]
        self.files: list[Path] = [
            path
            for relative, path in files
            if path.stat().st_size > 0 and _in_split(relative, split, val_fraction, test_fraction)
        ][:max_docs]
        if not self.files:
            raise DataError(
                f"empty corpus: no non-empty file in the {split!r} split (val_fraction={val_fraction}, "
                f"test_fraction={test_fraction}) under {roots}"
            )
        self._lengths: list[int] | None = None

    @staticmethod
    def _stdlib_files() -> list[tuple[str, Path]]:
        root = _stdlib_root()
        skip = {"site-packages", "dist-packages", "__pycache__"}
        found = []
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in skip)
            found.extend(Path(directory, name) for name in names if name.endswith(".py"))
        return sorted((path.relative_to(root).as_posix(), path) for path in found)

    @staticmethod
    def _listed_files(paths: list[Path]) -> list[tuple[str, Path]]:
        found = []
        for path in paths:
            if path.is_dir():
                found.extend(
                    (f"{path.name}/{p.relative_to(path).as_posix()}", p) for p in path.rglob("*") if p.is_file()
                )
            elif path.is_file():
                found.append((path.name, path))
            else:
                raise DataError(f"corpus path {str(path)!r} does not exist")
        # Sorted by full path: deterministic whatever order the caller or the file system gives.
        return sorted(found, key=lambda item: str(item[1]))

    def __len__(self) -> int:
        return len(self.files)

    @property
    def lengths(self) -> list[int]:
        """Token count of every document (file size + 2 framing tokens), from the file system: nothing is read."""
        if self._lengths is None:
            self._lengths = [path.stat().st_size + 2 for path in self.files]
        return self._lengths

    def __getitem__(self, index: int) -> list[int]:  # type: ignore[override]
        """Read file ``index`` now: ``[BOS_ID, *bytes, EOS_ID]``."""
        return [BOS_ID, *self.files[index].read_bytes(), EOS_ID]

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))


class SyntheticCorpus(Sequence[list[int]]):
    """Deterministic random documents with a configurable length distribution, for tests and benchmarks.

    Lengths are drawn once from ``seed``; the tokens of document ``i`` are drawn on access from a generator seeded
    by ``(seed, i)``, so any document can be read alone (sharding) and reads are reproducible.

    Args:
        num_docs: number of documents (at least 1).
        mean_len: mean document length in tokens (before clamping to ``[min_len, max_len]``).
        seed: random seed, an int of magnitude at most ``2**63 // 1_000_003`` (document seeds derive from it).
        distribution: ``"lognormal"`` (``sigma`` sets the spread), ``"uniform"`` (on
            ``[min_len, 2 * mean_len - min_len]``), ``"exponential"`` or ``"fixed"`` (every document ``mean_len``).
        vocab_size: token ids are drawn uniformly from ``[0, vocab_size)``.
        min_len: shortest document (at least 1).
        max_len: longest document (``None``: unbounded).
        sigma: standard deviation of the log-length for ``"lognormal"``.

    Raises:
        DataError: an argument out of range, or a drawn length over ``2**31 - 1`` tokens (lower ``mean_len`` or
            ``sigma``, or set ``max_len``).

    Example::

        >>> corpus = SyntheticCorpus(num_docs=3, mean_len=8, seed=0, distribution="fixed", vocab_size=10)
        >>> len(corpus), [len(doc) for doc in corpus], corpus.vocab_size
        (3, [8, 8, 8], 10)
    """

    def __init__(
        self,
        num_docs: int,
        mean_len: float,
        seed: int = 0,
        *,
        distribution: str = "lognormal",
        vocab_size: int = VOCAB_SIZE,
        min_len: int = 1,
        max_len: int | None = None,
        sigma: float = 1.0,
    ) -> None:
        check_int("num_docs", num_docs, low=1, error=DataError)
        check_int("min_len", min_len, low=1, error=DataError)
        check_int("vocab_size", vocab_size, low=1, high=2**63 - 1, error=DataError)
        check_number("mean_len", mean_len, low=1, error=DataError)
        seed = check_int("seed", seed, low=-MAX_SEED, high=MAX_SEED, error=DataError)  # a NumPy int: a Python int
        if max_len is not None:
            check_int("max_len", max_len, low=min_len, error=DataError)
        if distribution not in DISTRIBUTIONS:
            raise DataError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        check_number("sigma", sigma, low=0, low_open=True, error=DataError)

        self.seed = seed
        self.vocab_size = vocab_size
        generator = torch.Generator().manual_seed(seed)
        shape = (num_docs,)
        if distribution == "lognormal":
            try:
                # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean_len
                mu = math.log(mean_len) - sigma**2 / 2
            except OverflowError:
                raise DataError(f"sigma={sigma!r} is too large: sigma**2 overflows a float") from None
            lengths = torch.empty(shape, dtype=torch.float64).log_normal_(mu, sigma, generator=generator)
        elif distribution == "uniform":
            high = max(2 * mean_len - min_len, min_len) + 1
            if not math.isfinite(high):  # torch refuses an infinite bound
                raise DataError(
                    f"mean_len={mean_len!r} is too large for distribution='uniform': 2 * mean_len overflows"
                )
            lengths = torch.empty(shape, dtype=torch.float64).uniform_(min_len, high, generator=generator)
        elif distribution == "exponential":
            lengths = torch.empty(shape, dtype=torch.float64).exponential_(1 / mean_len, generator=generator)
        else:
            lengths = torch.full(shape, float(mean_len), dtype=torch.float64)
        lengths = lengths.floor().clamp(min=min_len, max=max_len)
        longest = float(lengths.max())  # a CPU tensor: no device involved
        if not longest <= _MAX_DOC_LEN:  # NaN or inf too: the int64 cast would wrap them to negative lengths
            spread = f" sigma={sigma!r}" if distribution == "lognormal" else ""
            raise DataError(
                f"document lengths do not fit: distribution={distribution!r} mean_len={mean_len!r}{spread} draws "
                f"a length of {longest:.4g} tokens, over {_MAX_DOC_LEN}; lower mean_len (or sigma) or set max_len"
            )
        self.lengths: list[int] = lengths.to(torch.int64).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> list[int]:  # type: ignore[override]
        """Document ``index`` (``list[int]`` of ``lengths[index]`` ids), regenerated identically on every read."""
        length = self.lengths[index]
        generator = torch.Generator().manual_seed(self.seed * _DOC_SEED_STRIDE + int(index) % len(self))
        return torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))
