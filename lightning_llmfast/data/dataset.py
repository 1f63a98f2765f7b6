"""Planned batch datasets: the same number of packed batches on every rank, a new order per epoch, resumable.

:class:`PlannedBatchDataset` is the machinery; :class:`PackedDocumentDataset` packs an in-memory corpus with it and
:class:`~lightning_llmfast.data.PreparedBatches` reads rows that ``prepare`` packed offline. Each epoch is planned on
the host without reading a token (from document lengths, or from the prepared rows) into one global sequence of
batches, and batch ``i`` goes to rank ``i % world_size``. Every rank
and worker computes the same plan, so no communication is needed and every rank gets the same number of batches.
The ``M % world_size`` batches that do not fill a round are dropped (training: less than one batch per rank) or
filled with copies whose labels are all ignored (evaluation: no rank is left without a batch, no token counts
twice). A worker ``w`` of ``W`` packs the rank's batches ``start + w, start + w + W, ...``; ``DataLoader`` takes
them round robin, so the rank sees its batches in plan order whatever ``num_workers`` is, and a position
``(epoch, batches consumed)`` is enough to resume exactly.
"""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from typing_extensions import override

from lightning_llmfast._checks import check_int
from lightning_llmfast.data.batch import PackedBatch
from lightning_llmfast.data.packing import (
    DEFAULT_LOOKAHEAD,
    IGNORE_INDEX,
    Piece,
    as_tokens,
    check_packing_args,
    make_batch,
    plan_batches,
    segment_documents,
)
from lightning_llmfast.errors import ConfigError, DataError

__all__ = ["UNEVEN", "EpochPlan", "PackedDocumentDataset", "PlannedBatchDataset"]

UNEVEN = ("drop", "fill")
# What torch.Generator.manual_seed takes.
_GENERATOR_SEED_MIN, _GENERATOR_SEED_MAX = -(2**63), 2**64 - 1
_EPOCH_STRIDE = 0x9E3779B97F4A7C15  # odd: (seed, epoch) -> distinct generator seeds for every epoch
_DOC_CACHE = 4  # documents kept between pieces (the chunks of a long document come in consecutive rows)


@dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch, as pieces of corpus documents, and what each rank gets.

    Global batch ``i`` goes to rank ``i % world_size``; slots past the last batch (``fill``) repeat earlier batches
    as fillers.

    Attributes:
        batches: the global batches, each a list of rows of ``(document, start, length)`` pieces; any sequence
            (a list, or a lazy view that builds batch ``i`` on access).
        world_size: number of ranks the plan deals to.
        per_rank: batches every rank gets.
        fill: whether missing batches of the last round are filler copies (else the round is dropped).
    """

    batches: Sequence[list[list[Piece]]]
    world_size: int
    per_rank: int
    fill: bool

    @classmethod
    def deal(
        cls, batches: Sequence[list[list[Piece]]], world_size: int, *, fill: bool, limit: int | None = None
    ) -> EpochPlan:
        """Deal ``batches`` to ``world_size`` ranks: as many per rank as whole rounds give (``fill``: rounded up).

        Example::

            >>> EpochPlan.deal([[[(0, 0, 2)]]] * 5, 2, fill=False).per_rank
            2
        """
        per_rank = -(-len(batches) // world_size) if fill else len(batches) // world_size
        if limit is not None:
            per_rank = min(per_rank, limit)
        return cls(batches, world_size, per_rank, fill)

    def rank_batches(self, rank: int, start: int = 0, step: int = 1) -> Iterator[tuple[list[list[Piece]], bool]]:
        """``(rows, is_filler)`` of batches ``start, start + step, ...`` of ``rank``, in order, built lazily."""
        for i in range(start, self.per_rank, step):
            slot = i * self.world_size + rank
            yield self.batches[slot % len(self.batches)], slot >= len(self.batches)

    def summary(self) -> str:
        """One line: batches, per-rank share, and what is dropped or filled."""
        used = self.per_rank * self.world_size
        line = f"{len(self.batches)} batches, {self.per_rank} per rank on {self.world_size} rank(s)"
        if used < len(self.batches):
            left = [self.batches[i] for i in range(used, len(self.batches))]
            tokens = sum(n for rows in left for row in rows for _, _, n in row)
            docs = len({d for rows in left for row in rows for d, _, _ in row})
            line += f"; {len(left)} batch(es) left out ({tokens} tokens, pieces of {docs} documents)"
        elif used > len(self.batches):
            line += f"; {used - len(self.batches)} filler batch(es) with all labels ignored"
        return line


class PlannedBatchDataset(IterableDataset[PackedBatch]):
    """Batches planned per epoch on the host, dealt to ranks round robin, built in ``DataLoader`` workers.

    A subclass says what an epoch's batches are (:meth:`epoch_batches`), how to read a piece's tokens
    (:meth:`read_piece`) and what a saved position is valid for (:meth:`fingerprint`); this class deals the batches
    to ranks and workers (see the module docstring), builds each :class:`PackedBatch` and keeps the position.
    Use it with ``DataLoader(dataset, batch_size=None)``; call :meth:`set_epoch` before each epoch (as with
    ``DistributedSampler``) and :meth:`set_position` to resume.

    Args:
        seq_len: tokens per row.
        batch_size: rows per batch.
        pad_id: token id of padding.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        lookahead: short pieces a packer may hold back for a better fit (see
            :func:`~lightning_llmfast.data.pack_documents`).
        rank: this process's global rank.
        world_size: number of ranks.
        limit_batches: at most this many batches per rank and epoch.
        uneven: ``"drop"`` the last incomplete round of batches (training) or ``"fill"`` it with copies whose
            labels are all ignored and whose ``documents`` are all ``-1`` (evaluation).

    Raises:
        DataError: a packing argument is invalid.
        ConfigError: ``rank``, ``world_size``, ``limit_batches`` or ``uneven`` out of range.

    Example::

        class Listed(PlannedBatchDataset):  # batches given as pieces of in-memory token lists
            ...
        loader = DataLoader(Listed(...), batch_size=None, num_workers=2)
    """

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        pad_id: int = 0,
        lookahead: int = DEFAULT_LOOKAHEAD,
        rank: int = 0,
        world_size: int = 1,
        limit_batches: int | None = None,
        uneven: str = "drop",
    ) -> None:
        seq_len, batch_size, pad_id, checked_vocab, lookahead = check_packing_args(
            seq_len, batch_size, pad_id=pad_id, vocab_size=vocab_size, lookahead=lookahead
        )
        world_size = check_int("world_size", world_size, low=1)
        rank = check_int("rank", rank, low=0)
        if rank >= world_size:
            raise ConfigError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        if limit_batches is not None:
            limit_batches = check_int("limit_batches", limit_batches, low=0)
        if uneven not in UNEVEN:
            raise ConfigError(f"uneven must be one of {UNEVEN}, got {uneven!r}")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.vocab_size = checked_vocab if checked_vocab is not None else vocab_size
        self.pad_id, self.lookahead = pad_id, lookahead
        self.rank, self.world_size = rank, world_size
        self.limit_batches = limit_batches
        self.uneven = uneven
        self.epoch = 0
        """Epoch the next iteration packs."""
        self.start = 0
        """Batches of this rank the next iteration skips (a resumed position)."""
        self._plan: tuple[int, EpochPlan] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Pack epoch ``epoch`` from its start on the next iteration."""
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, start: int) -> None:
        """Pack epoch ``epoch`` on the next iteration, skipping this rank's first ``start`` batches."""
        self.epoch = check_int("epoch", epoch, low=0)
        self.start = check_int("start", start, low=0)

    @abstractmethod
    def epoch_batches(self, epoch: int) -> Sequence[list[list[Piece]]]:
        """The global batches of epoch ``epoch``, each a list of rows of ``(document, start, length)`` pieces."""

    @abstractmethod
    def read_piece(self, piece: Piece, cache: dict[int, torch.Tensor]) -> torch.Tensor:
        """The tokens of ``piece`` as a 1-D int64 tensor; ``cache`` lives for one iteration (a few documents)."""

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What a saved position is only valid for: the data, the packing and the world size."""

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's global batches and this configuration's per-rank share (computed once per epoch)."""
        if self._plan is None or self._plan[0] != epoch:
            batches = self.epoch_batches(epoch)
            plan = EpochPlan.deal(batches, self.world_size, fill=self.uneven == "fill", limit=self.limit_batches)
            self._plan = (epoch, plan)
        return self._plan[1]

    @override
    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        cache: dict[int, torch.Tensor] = {}
        for rows, filler in self.plan(self.epoch).rank_batches(self.rank, self.start + worker, num_workers):
            pieces = [[self.read_piece(piece, cache) for piece in row] for row in rows]
            documents = segment_documents(rows, self.seq_len)
            batch = make_batch(pieces, self.seq_len, self.pad_id, [-1] * len(documents) if filler else documents)
            if filler:
                batch.labels.fill_(IGNORE_INDEX)
            yield batch


class PackedDocumentDataset(PlannedBatchDataset):
    """Packs a corpus into :class:`PackedBatch` objects: equal batch counts per rank, resumable mid-epoch.

    Use it with ``DataLoader(dataset, batch_size=None)`` (each item already is a batch); any ``num_workers``.
    Without Lightning, call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``) and
    :meth:`set_position` to resume; ``PackedDataModule`` does both.

    Args:
        corpus: sized, indexable documents (``TextCorpus``, ``SyntheticCorpus``, a list of token lists...). A
            ``lengths`` attribute, when present, gives the document lengths without reading them.
        seq_len: tokens per row.
        batch_size: rows per batch.
        vocab_size: every token id must lie in ``[0, vocab_size)``.
        pad_id: token id of padding.
        lookahead: see :func:`~lightning_llmfast.data.pack_documents`.
        shuffle_seed: when given, each epoch visits the documents in a permutation drawn from
            ``(shuffle_seed, epoch)``; else in corpus order.
        rank: this process's global rank.
        world_size: number of ranks.
        limit_batches: at most this many batches per rank and epoch.
        uneven: ``"drop"`` the last incomplete round of batches (training) or ``"fill"`` it with copies whose
            labels are all ignored and whose ``documents`` are all ``-1`` (evaluation).

    Raises:
        DataError: ``corpus`` is not sized and indexable, or a packing argument is invalid; while iterating, a
            document that is invalid or whose length changed since the epoch was planned.
        ConfigError: ``rank``, ``world_size``, ``shuffle_seed``, ``limit_batches`` or ``uneven`` out of range.

    Example::

        dataset = PackedDocumentDataset(SyntheticCorpus(64, 40, seed=0), seq_len=32, batch_size=4, vocab_size=258)
        loader = DataLoader(dataset, batch_size=None, num_workers=2)
        for epoch in range(2):
            dataset.set_epoch(epoch)
            for batch in loader: ...
    """

    def __init__(
        self,
        corpus: Sequence[Sequence[int]],
        *,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        pad_id: int = 0,
        lookahead: int = DEFAULT_LOOKAHEAD,
        shuffle_seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        limit_batches: int | None = None,
        uneven: str = "drop",
    ) -> None:
        super().__init__(
            seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size, pad_id=pad_id, lookahead=lookahead,
            rank=rank, world_size=world_size, limit_batches=limit_batches, uneven=uneven,
        )  # fmt: skip
        if not (hasattr(corpus, "__len__") and hasattr(corpus, "__getitem__")):
            raise DataError(f"corpus must be a sized, indexable sequence of documents, got {type(corpus).__name__}")
        if shuffle_seed is not None:
            shuffle_seed = check_int("shuffle_seed", shuffle_seed, low=_GENERATOR_SEED_MIN, high=_GENERATOR_SEED_MAX)
        self.corpus = corpus
        self.shuffle_seed = shuffle_seed
        self._lengths: list[int] | None = None

    @property
    def lengths(self) -> list[int]:
        """Token count of every corpus document (from ``corpus.lengths`` when it has one)."""
        if self._lengths is None:
            given = getattr(self.corpus, "lengths", None)
            if given is not None and len(given) == len(self.corpus):
                self._lengths = [int(n) for n in given]
            else:
                self._lengths = [len(self.corpus[i]) for i in range(len(self.corpus))]
        return self._lengths

    def order(self, epoch: int) -> list[int] | range:
        """Corpus indices in the order epoch ``epoch`` visits them."""
        if self.shuffle_seed is None:
            return range(len(self.corpus))
        seed = (self.shuffle_seed + epoch * _EPOCH_STRIDE) % 2**64
        return torch.randperm(len(self.corpus), generator=torch.Generator().manual_seed(seed)).tolist()

    @override
    def epoch_batches(self, epoch: int) -> list[list[list[Piece]]]:
        order = self.order(epoch)
        lengths = self.lengths
        return [
            [[(order[d], start, n) for d, start, n in row] for row in rows]
            for rows in plan_batches((lengths[i] for i in order), self.seq_len, self.batch_size,
                                     lookahead=self.lookahead)
        ]  # fmt: skip

    @override
    def fingerprint(self) -> dict[str, Any]:
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        return {
            "num_documents": len(self.lengths),
            "lengths_crc32": zlib.crc32(lengths.numpy().tobytes()),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "pad_id": self.pad_id,
            "lookahead": self.lookahead,
            "shuffle_seed": self.shuffle_seed,
            "world_size": self.world_size,
        }

    @override
    def read_piece(self, piece: Piece, cache: dict[int, torch.Tensor]) -> torch.Tensor:
        index, start, length = piece
        if index not in cache:
            tokens = as_tokens(self.corpus[index], index, self.vocab_size)
            if tokens.numel() != self.lengths[index]:
                raise DataError(
                    f"document {index} has {tokens.numel()} tokens but had {self.lengths[index]} when the epoch was "
                    "planned (corpus.lengths is wrong, or the corpus changed)"
                )
            if len(cache) >= _DOC_CACHE:
                del cache[next(iter(cache))]
            cache[index] = tokens
        return cache[index][start : start + length]
