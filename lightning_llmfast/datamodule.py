"""``PackedDataModule``: packed batches built in ``DataLoader`` workers, sharded across workers and ranks, pinned.

The Lightning layer only wires things: corpora and packing live in :mod:`lightning_llmfast.data`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from typing_extensions import override

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import (
    DEFAULT_LOOKAHEAD,
    VOCAB_SIZE,
    PackedBatch,
    SyntheticCorpus,
    TextCorpus,
    check_packing_args,
    pack_documents,
)
from lightning_llmfast.data.corpus import _DISTRIBUTIONS, _MAX_SEED
from lightning_llmfast.errors import ConfigError, DataError

__all__ = ["PackedDataModule", "PackedDocumentDataset"]

_CORPORA = ("stdlib", "synthetic", "files")
# What torch.Generator.manual_seed takes.
_GENERATOR_SEED_MIN, _GENERATOR_SEED_MAX = -(2**63), 2**64 - 1


class PackedDocumentDataset(IterableDataset[PackedBatch]):
    """Packs one shard of a corpus per ``DataLoader`` worker and distributed rank; yields :class:`PackedBatch`.

    Documents are dealt round robin over ``world_size * num_workers`` shards (shard ``rank * num_workers +
    worker``), so within an epoch every document is packed by exactly one worker of one rank. Use it with
    ``DataLoader(dataset, batch_size=None)``: each item already is a batch.

    Args:
        corpus: sized, indexable documents (``TextCorpus``, ``SyntheticCorpus``, a list of token lists...).
        seq_len: tokens per row.
        batch_size: rows per batch.
        vocab_size: every token id must lie in ``[0, vocab_size)``.
        pad_id: token id of padding.
        lookahead: see :func:`~lightning_llmfast.data.pack_documents`.
        shuffle_seed: when given, documents are visited in a permutation drawn from this seed (the same on every
            rank and worker, so the shards still partition the corpus); else in corpus order.
        rank: this process's global rank.
        world_size: number of ranks.
        limit_batches: at most this many batches per rank and epoch, split evenly over the workers.

    Raises:
        DataError: ``corpus`` is not sized and indexable, or a packing argument is invalid.
        ConfigError: ``rank``, ``world_size``, ``shuffle_seed`` or ``limit_batches`` is not an int in range.

    Example::

        dataset = PackedDocumentDataset(SyntheticCorpus(64, 40, seed=0), seq_len=32, batch_size=4, vocab_size=258)
        loader = DataLoader(dataset, batch_size=None, num_workers=2)
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
    ) -> None:
        check_packing_args(seq_len, batch_size, pad_id=pad_id, vocab_size=vocab_size, lookahead=lookahead)
        if not (hasattr(corpus, "__len__") and hasattr(corpus, "__getitem__")):
            raise DataError(f"corpus must be a sized, indexable sequence of documents, got {type(corpus).__name__}")
        check_int("world_size", world_size, low=1)
        check_int("rank", rank, low=0)
        if rank >= world_size:
            raise ConfigError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        if shuffle_seed is not None:
            shuffle_seed = check_int("shuffle_seed", shuffle_seed, low=_GENERATOR_SEED_MIN, high=_GENERATOR_SEED_MAX)
        if limit_batches is not None:
            check_int("limit_batches", limit_batches, low=0)
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.lookahead = lookahead
        self.rank = rank
        self.world_size = world_size
        self.limit_batches = limit_batches
        self.order: list[int] | range = range(len(corpus))
        if shuffle_seed is not None:
            generator = torch.Generator().manual_seed(shuffle_seed)
            self.order = torch.randperm(len(corpus), generator=generator).tolist()

    def shard(self, worker: int, num_workers: int) -> list[int] | range:
        """Corpus indices packed by ``worker`` (of ``num_workers``) on this rank."""
        return self.order[self.rank * num_workers + worker :: self.world_size * num_workers]

    @override
    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        indices = self.shard(worker, num_workers)
        limit = None
        if self.limit_batches is not None:
            limit = self.limit_batches // num_workers + int(worker < self.limit_batches % num_workers)
        if not indices or limit == 0:
            return  # a shard can be empty when there are fewer documents than shards
        batches = pack_documents(
            (self.corpus[i] for i in indices),
            self.seq_len,
            self.batch_size,
            pad_id=self.pad_id,
            vocab_size=self.vocab_size,
            lookahead=self.lookahead,
        )
        yield from islice(batches, limit)


class PackedDataModule(LightningDataModule):
    """Packed documents for training and validation, packed in worker processes and shipped in pinned memory.

    Every init argument is a plain type, so ``LightningCLI`` fills it from YAML (``data: {seq_len: 256, ...}``).
    Documents are sharded across ``DataLoader`` workers and distributed ranks so that no document is seen twice
    in an epoch. Batches are :class:`~lightning_llmfast.data.PackedBatch` objects; Lightning moves them to the
    device with their host-side metadata intact.

    Note:
        Ranks pack different documents, so with several ranks they can run out of batches at different steps;
        set ``limit_batches`` (smaller than what one rank's share yields) to give every rank the same count.

    Args:
        corpus: ``"stdlib"`` (the running Python's standard library sources), ``"synthetic"`` or ``"files"``.
        paths: files or directories for ``corpus="files"``.
        seq_len: tokens per row.
        batch_size: rows per batch.
        num_workers: ``DataLoader`` worker processes (0 packs in the main process).
        pin_memory: pin batches when training on an accelerator, for asynchronous host-to-device copies.
        max_docs: use at most this many documents per split.
        val_fraction: share of documents in the validation split.
        synthetic_num_docs: training documents of the synthetic corpus.
        synthetic_mean_len: mean document length of the synthetic corpus.
        synthetic_distribution: length distribution of the synthetic corpus (see ``SyntheticCorpus``).
        seed: seed of the synthetic corpus and of the training document order.
        shuffle: visit training documents in a seeded random order (validation keeps corpus order).
        limit_batches: at most this many training batches per rank and epoch.
        limit_val_batches: at most this many validation batches per rank.
        pad_id: token id of padding.
        lookahead: short pieces the packer may hold back for a better fit.

    Raises:
        ConfigError: a bad ``corpus``/``paths`` choice, or ``num_workers``, ``pin_memory``, ``shuffle`` or a
            ``limit_*`` that is not of its type and range.
        DataError: a bad corpus argument (``max_docs``, ``val_fraction``, ``seed``, ``synthetic_*``) or packing
            argument (what the corpus or the packer would raise later).

    Example::

        import lightning as L
        from lightning_llmfast import PackedDataModule

        data = PackedDataModule(seq_len=256, batch_size=8)
        model = MyLM(vocab_size=data.vocab_size)
        L.Trainer(max_steps=100).fit(model, datamodule=data)
    """

    def __init__(
        self,
        corpus: str = "stdlib",
        paths: list[str] | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        num_workers: int = 2,
        pin_memory: bool = True,
        max_docs: int | None = None,
        val_fraction: float = 0.05,
        synthetic_num_docs: int = 2048,
        synthetic_mean_len: float = 512.0,
        synthetic_distribution: str = "lognormal",
        seed: int = 0,
        shuffle: bool = True,
        limit_batches: int | None = None,
        limit_val_batches: int | None = None,
        pad_id: int = 0,
        lookahead: int = DEFAULT_LOOKAHEAD,
    ) -> None:
        super().__init__()
        if corpus not in _CORPORA:
            raise ConfigError(f"corpus must be one of {_CORPORA}, got {corpus!r}")
        if (corpus == "files") != bool(paths):
            raise ConfigError(f"paths must be given exactly when corpus='files' (corpus={corpus!r}, paths={paths!r})")
        check_int("num_workers", num_workers, low=0)
        check_bool("pin_memory", pin_memory)
        check_bool("shuffle", shuffle)
        for name, value in (("limit_batches", limit_batches), ("limit_val_batches", limit_val_batches)):
            if value is not None:
                check_int(name, value, low=1)
        # Corpus arguments: checked here (DataError, as the corpora raise) rather than at the first corpus_for().
        if max_docs is not None:
            check_int("max_docs", max_docs, low=1, error=DataError)
        check_number("val_fraction", val_fraction, low=0, high=1, error=DataError)
        check_int("synthetic_num_docs", synthetic_num_docs, low=1, error=DataError)
        check_number("synthetic_mean_len", synthetic_mean_len, low=1, error=DataError)
        if synthetic_distribution not in _DISTRIBUTIONS:
            raise DataError(f"synthetic_distribution must be one of {_DISTRIBUTIONS}, got {synthetic_distribution!r}")
        # The validation corpus uses seed + 1.
        check_int("seed", seed, low=-_MAX_SEED, high=_MAX_SEED - 1, error=DataError)
        check_packing_args(seq_len, batch_size, pad_id=pad_id, vocab_size=VOCAB_SIZE, lookahead=lookahead)
        self.save_hyperparameters()
        self.corpus = corpus
        self.paths = paths
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.max_docs = max_docs
        self.val_fraction = val_fraction
        self.synthetic_num_docs = synthetic_num_docs
        self.synthetic_mean_len = synthetic_mean_len
        self.synthetic_distribution = synthetic_distribution
        self.seed = seed
        self.shuffle = shuffle
        self.limit_batches = limit_batches
        self.limit_val_batches = limit_val_batches
        self.pad_id = pad_id
        self.lookahead = lookahead
        self._corpora: dict[str, Sequence[Sequence[int]]] = {}

    @property
    def vocab_size(self) -> int:
        """Vocabulary the batches draw from: the byte tokenizer's ``VOCAB_SIZE``."""
        return VOCAB_SIZE

    def corpus_for(self, split: str) -> Sequence[Sequence[int]]:
        """The documents of ``split`` (``"train"`` or ``"val"``), built once (file contents are read lazily)."""
        if split not in self._corpora:
            if self.corpus == "synthetic":
                num_docs = (
                    self.synthetic_num_docs
                    if split == "train"
                    else max(1, round(self.synthetic_num_docs * self.val_fraction))
                )
                self._corpora[split] = SyntheticCorpus(
                    num_docs if self.max_docs is None else min(num_docs, self.max_docs),
                    self.synthetic_mean_len,
                    # A different seed for validation: its documents must not repeat the training ones.
                    self.seed if split == "train" else self.seed + 1,
                    distribution=self.synthetic_distribution,
                    vocab_size=self.vocab_size,
                )
            else:
                paths = self.paths if self.corpus == "files" else None
                self._corpora[split] = TextCorpus(
                    paths, split=split, val_fraction=self.val_fraction, max_docs=self.max_docs
                )
        return self._corpora[split]

    @override
    def setup(self, stage: str) -> None:
        # Listing files here (not in __init__) keeps construction cheap for LightningCLI's argument parsing;
        # bad paths or an empty split still fail before the first step.
        if stage in ("fit", "validate"):
            self.corpus_for("val")
        if stage == "fit":
            self.corpus_for("train")

    @override
    def train_dataloader(self) -> DataLoader[PackedBatch]:
        return self._loader("train", self.seed if self.shuffle else None, self.limit_batches)

    @override
    def val_dataloader(self) -> DataLoader[PackedBatch]:
        return self._loader("val", None, self.limit_val_batches)

    def _loader(self, split: str, shuffle_seed: int | None, limit_batches: int | None) -> DataLoader[PackedBatch]:
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        dataset = PackedDocumentDataset(
            self.corpus_for(split),
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            vocab_size=self.vocab_size,
            pad_id=self.pad_id,
            lookahead=self.lookahead,
            shuffle_seed=shuffle_seed,
            rank=rank,
            world_size=world_size,
            limit_batches=limit_batches,
        )
        # Pinning only pays (and only works) when batches go to an accelerator.
        on_accelerator = trainer.strategy.root_device.type != "cpu" if trainer is not None else True
        return DataLoader(
            dataset,
            batch_size=None,  # the dataset yields whole PackedBatch objects
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and on_accelerator and torch.accelerator.is_available(),
            persistent_workers=self.num_workers > 0,
        )
