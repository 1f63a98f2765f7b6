"""``PreparedDataModule``: train on datasets written by ``python -m lightning_llmfast.prepare``, memory-mapped.

The rows were packed offline (or, for a length the data was not prepared with, from the document index when the
module is set up, then cached beside the data); this module only deals them (see
:class:`~lightning_llmfast.data.PreparedBatches`) and keeps the position (see
:class:`~lightning_llmfast.datamodules.PositionedDataModule`).
"""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_llmfast._checks import check_bool, check_int
from lightning_llmfast.data.prepared import SPLITS, PreparedBatches, PreparedDataset
from lightning_llmfast.datamodules.positioned import PositionedDataModule, data_shard
from lightning_llmfast.errors import ConfigError, DataError

__all__ = ["PreparedDataModule", "model_vocab_size"]


def model_vocab_size(module: nn.Module) -> int | None:
    """The number of token ids ``module`` embeds, or ``None`` when it does not say.

    Looks at the input embedding of a transformers model (the module itself or its ``model`` attribute), else at a
    ``config.vocab_size`` (the reference ``MoEGPTLightningModule``).

    Example::

        model_vocab_size(HFCausalLMModule(config))  # config.vocab_size, or the resized embedding's rows
    """
    for candidate in (module, getattr(module, "model", None)):
        embeddings = getattr(candidate, "get_input_embeddings", None)
        if callable(embeddings) and isinstance(found := embeddings(), nn.Embedding):
            return found.num_embeddings
    for candidate in (module, getattr(module, "model", None)):
        vocab = getattr(getattr(candidate, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            return vocab
    return None


class PreparedDataModule(PositionedDataModule):
    """Batches of pre-packed rows from one or several prepared directories, equal on every rank, resumable.

    Every rank reads the same memory-mapped files and computes the same epoch plan: equal, disjoint batches per rank
    (DDP, FSDP2, expert parallel alike: the data module only sees global rank and world size), a new order every
    epoch drawn from ``(seed, epoch)``, and the position in every checkpoint (a checkpoint of other data, packing,
    seed, weights or world size is refused). ``path=[a, b], weights=[0.7, 0.3]`` blends directories prepared with
    the same tokenizer. Validation uses each directory's validation split (whole documents, chosen at prepare time)
    in order; a directory prepared with ``--val-fraction 0`` gives no validation.

    Args:
        path: a prepared directory, or a list of them.
        seq_len: tokens per row, any length: one given to ``prepare --seq-len`` is read as packed then, another is
            packed from the document index in :meth:`prepare_data` (once per node, seconds per million documents, no
            token read) and cached beside the data for every rank, worker and later run (checked in full before use);
            on a read-only directory each rank packs it once, in :meth:`setup`, and its workers open that copy.
        batch_size: rows per batch.
        num_workers: ``DataLoader`` worker processes (0 reads in the main process).
        seed: seed of the epoch orders.
        weights: share of each directory in the training rows (``None``: their sizes).
        pin_memory: pin batches when training on an accelerator.
        limit_batches: at most this many training batches per rank and epoch.
        limit_val_batches: at most this many validation batches per rank.
        pad_id: token id of padding; default the tokenizer's pad token, else its EOS.

    Raises:
        ConfigError: ``num_workers``, ``pin_memory`` or a ``limit_*`` not of its type and range, or no ``path``.
        DataError: at :meth:`setup`: an incomplete or damaged directory (naming the file), bad ``weights``,
            directories from different tokenizers, or a model whose vocabulary is smaller than the data's.

    Example::

        # python -m lightning_llmfast.prepare --input corpus.jsonl --tokenizer tok/ --output prepared/ --seq-len 2048
        import lightning as L
        from lightning_llmfast import HFCausalLMModule, PreparedDataModule

        data = PreparedDataModule(path="prepared/", seq_len=2048, batch_size=8)
        L.Trainer(strategy="llmfast", max_steps=1000).fit(HFCausalLMModule(model), datamodule=data)
    """

    def __init__(
        self,
        path: str | list[str],
        seq_len: int = 2048,
        batch_size: int = 8,
        num_workers: int = 2,
        seed: int = 0,
        weights: list[float] | None = None,
        pin_memory: bool = True,
        limit_batches: int | None = None,
        limit_val_batches: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        super().__init__(num_workers, pin_memory)
        self.save_hyperparameters()
        paths = [path] if isinstance(path, str) else list(path)
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(f"path must be a prepared directory or a non-empty list of them, got {path!r}")
        check_int("num_workers", num_workers, low=0)
        check_bool("pin_memory", pin_memory)
        check_int("seed", seed, low=0, high=2**64 - 1)
        for name, value in (("limit_batches", limit_batches), ("limit_val_batches", limit_val_batches)):
            if value is not None:
                check_int(name, value, low=1)
        self.paths, self.seq_len, self.batch_size = paths, seq_len, batch_size
        self.seed, self.weights, self.pad_id = seed, weights, pad_id
        self.limits = {"train": limit_batches, "val": limit_val_batches}
        self._sources: list[PreparedDataset] | None = None
        self._logged: set[str] = set()

    @property
    def sources(self) -> list[PreparedDataset]:
        """The prepared directories, opened (manifest read, file sizes checked) on first use."""
        if self._sources is None:
            self._sources = [PreparedDataset(p) for p in self.paths]
        return self._sources

    @property
    def vocab_size(self) -> int:
        """Vocabulary of the data's tokenizer (the largest among the directories)."""
        return max(source.vocab_size for source in self.sources)

    @override
    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before any rank's setup: a row length the data was not
        # prepared with is packed and cached beside the data there, once, and every rank's setup then opens it.
        for source in self.sources:
            for split in SPLITS:
                source.layout(self.seq_len, split)

    @override
    def setup(self, stage: str) -> None:
        # Opening here (not in __init__) keeps construction cheap for LightningCLI's argument parsing; a damaged
        # directory or a too small model still fail before the first step, and a new length is packed (and cached)
        # here, in the main process, before any DataLoader worker starts.
        if stage == "fit":
            self._dataset("train")
        for source in self.sources:
            source.layout(self.seq_len, "train")
        trainer = self.trainer
        module = trainer.lightning_module if trainer is not None else None
        vocab = model_vocab_size(module) if module is not None else None
        if vocab is not None and vocab < self.vocab_size:
            raise DataError(
                f"PreparedDataModule: the model embeds {vocab} token ids but the data's tokenizer has "
                f"{self.vocab_size} ({', '.join(self.paths)}); build the model with vocab_size >= {self.vocab_size}"
            )

    @override
    def _has_split(self, split: str) -> bool:
        if split == "train":
            return True
        return split == "val" and any(source.layout(self.seq_len, "val").num_rows for source in self.sources)

    @override
    def _dataset(self, split: str) -> PreparedBatches:
        trainer = self.trainer
        rank, world_size = data_shard(trainer)
        train = split == "train"
        dataset = PreparedBatches(
            self.sources, split, seq_len=self.seq_len, batch_size=self.batch_size,
            weights=self.weights if train else None, shuffle_seed=self.seed if train else None, pad_id=self.pad_id,
            rank=rank, world_size=world_size, limit_batches=self.limits[split], uneven="drop" if train else "fill",
        )  # fmt: skip
        if split not in self._logged:
            self._logged.add(split)
            rank_zero_info(f"PreparedDataModule {split} split, epoch 0: {dataset.plan(0).summary()}")
        return dataset
