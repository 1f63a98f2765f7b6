"""``PositionedDataModule``: the training position of planned batch datasets, kept in checkpoints, resumed exactly.

The data modules of this package (``PackedDataModule``, ``PreparedDataModule``) build a
:class:`~lightning_llmfast.data.dataset.PlannedBatchDataset` per split; this base class wires them into Lightning's
loaders, counts the training batches consumed, saves ``(epoch, batches)`` with the dataset's fingerprint, and hands
the position to the next training loader's workers.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llmfast.data import PackedBatch
from lightning_llmfast.data.dataset import PlannedBatchDataset
from lightning_llmfast.errors import DataError

__all__ = ["PositionedDataModule", "PositionedLoader", "data_shard"]

_STATE_VERSION = 1


def data_shard(trainer: Any) -> tuple[int, int]:
    """``(rank, replicas)`` of the stream of batches this process reads: the strategy's
    ``distributed_sampler_kwargs`` (the ranks of a context-parallel group, or the stages of a pipeline, read one
    stream), else the trainer's rank and world; ``(0, 1)`` without a trainer."""
    if trainer is None:
        return 0, 1
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if isinstance(kwargs, dict) and "rank" in kwargs and "num_replicas" in kwargs:
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return trainer.global_rank, trainer.world_size
# The DataLoader workers' start method once a process group is initialised. Not "forkserver": its server and the
# workers it forks outlive a rank killed with SIGKILL (their parent is the server, so the workers' parent watchdog
# never fires) and keep the rank's pipes open; spawned workers are the rank's own children and exit when it dies.
_DISTRIBUTED_WORKERS = "spawn"


class PositionedLoader(DataLoader[PackedBatch]):
    """A ``DataLoader`` that sets its dataset's ``(epoch, start)`` from ``position()`` at every ``iter()``.

    Workers are not persistent: each iteration hands the dataset with its position to fresh workers.

    Example::

        loader = PositionedLoader(dataset, lambda: (epoch, 0), batch_size=None, num_workers=2)
    """

    def __init__(self, dataset: PlannedBatchDataset, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.position = position

    @override
    def __iter__(self) -> Iterator[PackedBatch]:  # type: ignore[override]
        assert isinstance(self.dataset, PlannedBatchDataset)
        self.dataset.set_position(*self.position())
        return super().__iter__()


class PositionedDataModule(LightningDataModule):
    """Base of the data modules whose splits are planned batch datasets: loaders, pinning and exact resume.

    Resuming: :meth:`state_dict` (which Lightning stores in every checkpoint) holds the training position, the epoch
    and the batches every rank has consumed in it (equal on all ranks, so one position; each worker's position
    follows from it), plus the dataset's fingerprint. ``trainer.fit(..., ckpt_path=...)`` then continues with
    exactly the batches the uninterrupted run would have seen; a checkpoint whose fingerprint differs raises
    :class:`~lightning_llmfast.errors.DataError`. The training loader starts fresh workers every epoch (they are
    handed the epoch's position), and the data module counts consumed batches in ``on_before_batch_transfer``,
    which then calls the LightningModule's own hook.

    A subclass sets ``num_workers`` and ``pin_memory`` and implements ``_dataset(split)`` (the split's dataset for
    this trainer's rank and world size) and ``_has_split(split)``.

    Args:
        num_workers: ``DataLoader`` worker processes (0 builds batches in the main process); once a process group
            is initialised they are spawned, never forked from a rank with live communication threads.
        pin_memory: pin batches when training on an accelerator.

    Example::

        class MyData(PositionedDataModule):
            def _dataset(self, split): return PackedDocumentDataset(...)
            def _has_split(self, split): return split == "train"
    """

    def __init__(self, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._train: PlannedBatchDataset | None = None
        self._resume: dict[str, Any] | None = None  # a loaded position, applied at the next training iteration
        self._position: tuple[int, int] | None = None  # (epoch, start) of the current training iteration
        self._consumed = 0  # batches of that epoch the training loop has taken
        self._iterations = 0  # train iterations without a trainer: the epoch

    @abstractmethod
    def _dataset(self, split: str) -> PlannedBatchDataset:
        """The dataset of ``split`` (``"train"``, ``"val"``, ``"test"``) for this trainer's rank and world size."""

    @abstractmethod
    def _has_split(self, split: str) -> bool:
        """Whether ``split`` has data (an evaluation split without any gets no loader, so Lightning skips it)."""

    @override
    def train_dataloader(self) -> DataLoader[PackedBatch]:
        dataset = self._dataset("train")
        self._train = dataset
        if self._resume is not None:
            self._check_fingerprint(self._resume["fingerprint"], dataset.fingerprint())
        return PositionedLoader(dataset, self._next_position, **self._loader_kwargs(persistent=False))

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
        # No loader (an empty list) for a split without data: Lightning then skips its loop.
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
                f"{type(self).__name__}: unreadable data position in the checkpoint (expected version "
                f"{_STATE_VERSION} with keys {sorted(keys)}), got {state_dict!r}"
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

    def _check_fingerprint(self, saved: dict[str, Any], current: dict[str, Any]) -> None:
        differ = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
        if differ:
            details = ", ".join(f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}" for key in differ)
            raise DataError(
                f"{type(self).__name__}: the checkpoint's data position belongs to another configuration ({details}); "
                "resuming would replay or skip documents. Resume with the same data, seq_len, batch_size, packing, "
                "seed and number of processes, or start a new run."
            )

    def _loader_kwargs(self, *, persistent: bool) -> dict[str, Any]:
        trainer = self.trainer
        # Pinning only pays (and only works) when batches go to an accelerator.
        on_accelerator = trainer.strategy.root_device.type != "cpu" if trainer is not None else True
        kwargs: dict[str, Any] = {
            "batch_size": None,  # the dataset yields whole PackedBatch objects
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and on_accelerator and torch.accelerator.is_available(),
            "persistent_workers": persistent and self.num_workers > 0,
        }
        if self.num_workers > 0 and dist.is_available() and dist.is_initialized():
            # A worker forked from a rank inherits its process-group threads' locks in whatever state they were
            # (gloo's, NCCL's) without the threads: it can hang, or abort (exit -6). A spawned worker inherits none.
            kwargs["multiprocessing_context"] = _DISTRIBUTED_WORKERS
        return kwargs
