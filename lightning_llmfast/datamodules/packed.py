"""``PackedDataModule``: packed batches built in ``DataLoader`` workers, equal on every rank, resumable, pinned.

The Lightning layer only wires things: corpora, packing and the per-epoch plan live in :mod:`lightning_llmfast.data`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import (
    DEFAULT_LOOKAHEAD,
    VOCAB_SIZE,
    PackedBatch,
    PackedDocumentDataset,
    SyntheticCorpus,
    TextCorpus,
    check_packing_args,
)
from lightning_llmfast.data.corpus import DISTRIBUTIONS, MAX_SEED
from lightning_llmfast.errors import ConfigError, DataError

__all__ = ["PackedDataModule", "PackedDocumentDataset"]

_CORPORA = ("stdlib", "synthetic", "files")
_SPLIT_SEED_OFFSET = {"train": 0, "val": 1, "test": 2}
_STATE_VERSION = 1


class _PositionedLoader(DataLoader[PackedBatch]):
    """A ``DataLoader`` that sets its dataset's ``(epoch, start)`` from ``position()`` at every ``iter()``.

    Workers are not persistent: each iteration pickles the dataset with its position into fresh workers.
    """

    def __init__(self, dataset: PackedDocumentDataset, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.position = position

    @override
    def __iter__(self) -> Iterator[PackedBatch]:  # type: ignore[override]
        assert isinstance(self.dataset, PackedDocumentDataset)
        self.dataset.set_position(*self.position())
        return super().__iter__()


class PackedDataModule(LightningDataModule):
    """Packed documents for training, validation, test and predict, packed in worker processes, pinned.

    Every init argument is a plain type, so ``LightningCLI`` fills it from YAML (``data: {seq_len: 256, ...}``).
    Each epoch is planned from document lengths on every rank alike (see
    :class:`~lightning_llmfast.data.PackedDocumentDataset`): every rank gets the same number of batches for any
    corpus size, ``num_workers`` and ``limit_*``, and no document is packed twice in an epoch. Training drops the
    last incomplete round of batches (less than one batch per rank); validation, test and predict fill it with
    batches whose labels are all ignored (``documents`` of ``-1``), so no rank is left without a batch. What is
    dropped or filled is logged once per split. With ``shuffle=True`` each epoch visits a new permutation seeded by
    ``(seed, epoch)``.

    Resuming: :meth:`state_dict` (which Lightning stores in every checkpoint) holds the training position, the epoch
    and the batches every rank has consumed in it (equal on all ranks, so one position; each worker's position
    follows from it), plus what the position is valid for. ``trainer.fit(..., ckpt_path=...)`` then continues with
    exactly the batches the uninterrupted run would have seen. A checkpoint from another corpus, ``seq_len``,
    ``batch_size``, packing, seed or world size raises :class:`~lightning_llmfast.errors.DataError`. The training
    loader starts fresh workers every epoch (they are handed the epoch's position), and the data module counts
    consumed batches in ``on_before_batch_transfer``, which then calls the LightningModule's own hook.

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
        super().__init__()
        self.save_hyperparameters()
        self.corpus, self.paths = corpus, paths
        self.seq_len, self.batch_size = seq_len, batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.max_docs, self.val_fraction, self.test_fraction = max_docs, val_fraction, test_fraction
        self.synthetic_num_docs = synthetic_num_docs
        self.synthetic_mean_len = synthetic_mean_len
        self.synthetic_distribution = synthetic_distribution
        self.seed, self.shuffle = seed, shuffle
        self.limits = {"train": limit_batches, "val": limit_val_batches, "test": limit_test_batches}
        self.pad_id, self.lookahead = pad_id, lookahead
        self._check_arguments()
        self._corpora: dict[str, Sequence[Sequence[int]]] = {}
        self._train: PackedDocumentDataset | None = None
        self._resume: dict[str, Any] | None = None  # a loaded position, applied at the next training iteration
        self._position: tuple[int, int] | None = None  # (epoch, start) of the current training iteration
        self._consumed = 0  # batches of that epoch the training loop has taken
        self._logged: set[str] = set()
        self._iterations = 0  # train iterations without a trainer: the epoch

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

    def _has_split(self, split: str) -> bool:
        """``val_fraction=0`` (or ``test_fraction=0``) leaves that split out: no loop runs on it."""
        return {"val": self.val_fraction, "test": self.test_fraction}.get(split, 1.0) > 0

    @override
    def train_dataloader(self) -> DataLoader[PackedBatch]:
        dataset = self._dataset("train")
        self._train = dataset
        if self._resume is not None:
            self._check_fingerprint(self._resume["fingerprint"], dataset.fingerprint())
        return _PositionedLoader(dataset, self._next_position, **self._loader_kwargs(persistent=False))

    @override
    def val_dataloader(self) -> DataLoader[PackedBatch] | list[DataLoader[PackedBatch]]:
        return self._eval_loader("val", persistent=True)

    @override
    def test_dataloader(self) -> DataLoader[PackedBatch] | list[DataLoader[PackedBatch]]:
        return self._eval_loader("test", persistent=True)

    @override
    def predict_dataloader(self) -> DataLoader[PackedBatch] | list[DataLoader[PackedBatch]]:
        return self._eval_loader("test", persistent=False)

    def _eval_loader(self, split: str, *, persistent: bool) -> DataLoader[PackedBatch] | list[DataLoader[PackedBatch]]:
        # No loader (an empty list) for a split of fraction 0: Lightning then skips its loop.
        if not self._has_split(split):
            return []
        return DataLoader(self._dataset(split), **self._loader_kwargs(persistent=persistent))

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training position (epoch, batches consumed per rank) and what it is valid for; ``{}`` before fit."""
        if self._train is None:
            return {}
        if self._position is None:  # loaded, not yet iterated: keep what was loaded
            return dict(self._resume) if self._resume is not None else {}
        return {
            "version": _STATE_VERSION,
            "epoch": self._position[0],
            "batches": self._consumed,
            "fingerprint": self._train.fingerprint(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`; checked against this run's configuration when training starts."""
        if not state_dict:
            return
        keys = {"version", "epoch", "batches", "fingerprint"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys or state_dict["version"] != _STATE_VERSION:
            raise DataError(
                f"PackedDataModule: unreadable data position in the checkpoint (expected version {_STATE_VERSION} "
                f"with keys {sorted(keys)}), got {state_dict!r}"
            )
        self._resume = dict(state_dict)
        self._position = None

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called once per batch the training loop consumes (not per batch prefetched): the resume position.
        trainer = self.trainer
        if trainer is None:
            return batch
        if trainer.training:
            self._consumed += 1
        # Lightning calls only the data module's hook when both define one: keep the module's own in the chain.
        return trainer.lightning_module.on_before_batch_transfer(batch, dataloader_idx)

    def _next_position(self) -> tuple[int, int]:
        """``(epoch, start)`` of the training iteration that begins now."""
        trainer = self.trainer
        if trainer is None:
            epoch, self._iterations = self._iterations, self._iterations + 1
        else:
            epoch = trainer.current_epoch
        resume, self._resume = self._resume, None
        position = (epoch, 0)
        if resume is not None and epoch <= resume["epoch"]:
            assert self._train is not None
            if resume["batches"] >= self._train.plan(resume["epoch"]).per_rank:
                # Saved after the epoch's last batch: the next batches are the next epoch's (Lightning may still
                # count the finished epoch when it asks for them).
                position = (resume["epoch"] + 1, 0)
            else:
                position = (resume["epoch"], resume["batches"])
        self._position, self._consumed = position, position[1]
        return position

    @staticmethod
    def _check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
        differ = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
        if differ:
            details = ", ".join(f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}" for key in differ)
            raise DataError(
                f"PackedDataModule: the checkpoint's data position belongs to another configuration ({details}); "
                "resuming would replay or skip documents. Resume with the same corpus, seq_len, batch_size, packing, "
                "seed and number of processes, or start a new run."
            )

    def _dataset(self, split: str) -> PackedDocumentDataset:
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
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

    def _loader_kwargs(self, *, persistent: bool) -> dict[str, Any]:
        trainer = self.trainer
        # Pinning only pays (and only works) when batches go to an accelerator.
        on_accelerator = trainer.strategy.root_device.type != "cpu" if trainer is not None else True
        return {
            "batch_size": None,  # the dataset yields whole PackedBatch objects
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and on_accelerator and torch.accelerator.is_available(),
            "persistent_workers": persistent and self.num_workers > 0,
        }
