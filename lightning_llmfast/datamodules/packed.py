"""``PackedDataModule``: packed batches built in ``DataLoader`` workers, equal on every rank, resumable, pinned.

The Lightning layer only wires things: corpora, packing and the per-epoch plan live in :mod:`lightning_llmfast.data`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import (
    DEFAULT_LOOKAHEAD,
    VOCAB_SIZE,
    PackedDocumentDataset,
    SyntheticCorpus,
    TextCorpus,
    check_packing_args,
)
from lightning_llmfast.data.corpus import DISTRIBUTIONS, MAX_SEED
from lightning_llmfast.datamodules.positioned import PositionedDataModule, data_shard
from lightning_llmfast.errors import ConfigError, DataError

__all__ = ["PackedDataModule", "PackedDocumentDataset"]

_CORPORA = ("stdlib", "synthetic", "files")
_SPLIT_SEED_OFFSET = {"train": 0, "val": 1, "test": 2}


class PackedDataModule(PositionedDataModule):
    """Packed documents for training, validation, test and predict, packed in worker processes, pinned.

    Every init argument is a plain type, so ``LightningCLI`` fills it from YAML (``data: {seq_len: 256, ...}``).
    Each epoch is planned from document lengths on every rank alike (see
    :class:`~lightning_llmfast.data.PackedDocumentDataset`): every rank gets the same number of batches for any
    corpus size, ``num_workers`` and ``limit_*``, and no document is packed twice in an epoch. Training drops the
    last incomplete round of batches (less than one batch per rank); validation, test and predict fill it with
    batches whose labels are all ignored (``documents`` of ``-1``), so no rank is left without a batch. What is
    dropped or filled is logged once per split. With ``shuffle=True`` each epoch visits a new permutation seeded by
    ``(seed, epoch)``.

    Resuming (see :class:`~lightning_llmfast.datamodules.PositionedDataModule`): a checkpoint continues with exactly
    the batches the uninterrupted run would have seen; one from another corpus, ``seq_len``, ``batch_size``,
    packing, seed or world size raises :class:`~lightning_llmfast.errors.DataError`.

    Args:
        corpus: ``"stdlib"`` (the running Python's standard library sources), ``"synthetic"`` or ``"files"``.
        paths: files or directories for ``corpus="files"``.
        seq_len: tokens per row.
        batch_size: rows per batch.
        num_workers: ``DataLoader`` worker processes (0 packs in the main process).
        pin_memory: pin batches when training on an accelerator, for asynchronous host-to-device copies.
        max_docs: use at most this many documents per split.
        val_fraction: share of documents in the validation split; 0 runs no validation.
        test_fraction: share of documents in the test split (also what ``trainer.predict`` packs); 0 gives no
            test or predict batches.
        synthetic_num_docs: training documents of the synthetic corpus.
        synthetic_mean_len: mean document length of the synthetic corpus.
        synthetic_distribution: length distribution of the synthetic corpus (see ``SyntheticCorpus``).
        seed: seed of the synthetic corpus and of the training document order.
        shuffle: visit training documents in a new seeded random order every epoch (evaluation keeps corpus order).
        limit_batches: at most this many training batches per rank and epoch.
        limit_val_batches: at most this many validation batches per rank.
        limit_test_batches: at most this many test (and predict) batches per rank.
        pad_id: token id of padding.
        lookahead: short pieces the packer may hold back for a better fit.

    Raises:
        ConfigError: a bad ``corpus``/``paths`` choice, or ``num_workers``, ``pin_memory``, ``shuffle`` or a
            ``limit_*`` that is not of its type and range.
        DataError: a bad corpus argument (``max_docs``, ``val_fraction``, ``test_fraction``, ``seed``,
            ``synthetic_*``) or packing argument; a checkpoint position that does not fit this configuration.

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
        test_fraction: float = 0.05,
        synthetic_num_docs: int = 2048,
        synthetic_mean_len: float = 512.0,
        synthetic_distribution: str = "lognormal",
        seed: int = 0,
        shuffle: bool = True,
        limit_batches: int | None = None,
        limit_val_batches: int | None = None,
        limit_test_batches: int | None = None,
        pad_id: int = 0,
        lookahead: int = DEFAULT_LOOKAHEAD,
    ) -> None:
        super().__init__(num_workers, pin_memory)
        self.save_hyperparameters()
        self.corpus, self.paths = corpus, paths
        self.seq_len, self.batch_size = seq_len, batch_size
        self.max_docs, self.val_fraction, self.test_fraction = max_docs, val_fraction, test_fraction
        self.synthetic_num_docs = synthetic_num_docs
        self.synthetic_mean_len = synthetic_mean_len
        self.synthetic_distribution = synthetic_distribution
        self.seed, self.shuffle = seed, shuffle
        self.limits = {"train": limit_batches, "val": limit_val_batches, "test": limit_test_batches}
        self.pad_id, self.lookahead = pad_id, lookahead
        self._check_arguments()
        self._corpora: dict[str, Sequence[Sequence[int]]] = {}
        self._logged: set[str] = set()

    def _check_arguments(self) -> None:
        """Every init argument against its type and range (see the class docstring's Raises)."""
        corpus, paths = self.corpus, self.paths
        if corpus not in _CORPORA:
            raise ConfigError(f"corpus must be one of {_CORPORA}, got {corpus!r}")
        if (corpus == "files") != bool(paths):
            raise ConfigError(f"paths must be given exactly when corpus='files' (corpus={corpus!r}, paths={paths!r})")
        check_int("num_workers", self.num_workers, low=0)
        check_bool("pin_memory", self.pin_memory)
        check_bool("shuffle", self.shuffle)
        for split, value in self.limits.items():
            if value is not None:
                check_int({"train": "limit_batches"}.get(split, f"limit_{split}_batches"), value, low=1)
        # Corpus arguments: checked here (DataError, as the corpora raise) rather than at the first corpus_for().
        if self.max_docs is not None:
            check_int("max_docs", self.max_docs, low=1, error=DataError)
        check_number("val_fraction", self.val_fraction, low=0, high=1, error=DataError)
        check_number("test_fraction", self.test_fraction, low=0, high=1 - self.val_fraction, error=DataError)
        check_int("synthetic_num_docs", self.synthetic_num_docs, low=1, error=DataError)
        check_number("synthetic_mean_len", self.synthetic_mean_len, low=1, error=DataError)
        if self.synthetic_distribution not in DISTRIBUTIONS:
            raise DataError(
                f"synthetic_distribution must be one of {DISTRIBUTIONS}, got {self.synthetic_distribution!r}"
            )
        # The validation and test corpora use seed + 1 and seed + 2.
        check_int("seed", self.seed, low=-MAX_SEED, high=MAX_SEED - 2, error=DataError)
        check_packing_args(
            self.seq_len, self.batch_size, pad_id=self.pad_id, vocab_size=VOCAB_SIZE, lookahead=self.lookahead
        )

    @property
    def vocab_size(self) -> int:
        """Vocabulary the batches draw from: the byte tokenizer's ``VOCAB_SIZE``."""
        return VOCAB_SIZE

    def corpus_for(self, split: str) -> Sequence[Sequence[int]]:
        """The documents of ``split`` (``"train"``, ``"val"`` or ``"test"``), built once (files are read lazily)."""
        if split not in self._corpora:
            if self.corpus == "synthetic":
                fraction = {"train": None, "val": self.val_fraction, "test": self.test_fraction}[split]
                num_docs = (
                    self.synthetic_num_docs if fraction is None else max(1, round(self.synthetic_num_docs * fraction))
                )
                self._corpora[split] = SyntheticCorpus(
                    num_docs if self.max_docs is None else min(num_docs, self.max_docs),
                    self.synthetic_mean_len,
                    # A different seed per split: evaluation documents must not repeat the training ones.
                    self.seed + _SPLIT_SEED_OFFSET[split],
                    distribution=self.synthetic_distribution,
                    vocab_size=self.vocab_size,
                )
            else:
                self._corpora[split] = TextCorpus(
                    self.paths if self.corpus == "files" else None,
                    split=split,
                    val_fraction=self.val_fraction,
                    test_fraction=self.test_fraction,
                    max_docs=self.max_docs,
                )
        return self._corpora[split]

    @override
    def setup(self, stage: str) -> None:
        # Listing files here (not in __init__) keeps construction cheap for LightningCLI's argument parsing;
        # bad paths or an empty split still fail before the first step.
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in splits.get(stage, ()):
            if self._has_split(split):
                self.corpus_for(split)

    @override
    def _has_split(self, split: str) -> bool:
        """``val_fraction=0`` (or ``test_fraction=0``) leaves that split out: no loop runs on it."""
        return {"val": self.val_fraction, "test": self.test_fraction}.get(split, 1.0) > 0

    @override
    def _dataset(self, split: str) -> PackedDocumentDataset:
        trainer = self.trainer
        rank, world_size = data_shard(trainer)
        dataset = PackedDocumentDataset(
            self.corpus_for(split),
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            vocab_size=self.vocab_size,
            pad_id=self.pad_id,
            lookahead=self.lookahead,
            shuffle_seed=self.seed if split == "train" and self.shuffle else None,
            rank=rank,
            world_size=world_size,
            limit_batches=self.limits[split],
            uneven="drop" if split == "train" else "fill",
        )
        if split not in self._logged:
            self._logged.add(split)
            rank_zero_info(f"PackedDataModule {split} split, epoch 0: {dataset.plan(0).summary()}")
        return dataset
