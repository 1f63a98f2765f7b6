"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP): save, load with resharding, export.

A checkpoint is a directory, laid out as Lightning's ``ModelParallelStrategy`` writes it (so Lightning's own
``consolidate_checkpoint`` tool reads it too): DCP shards of ``"state_dict"`` (the module) and ``"optimizer_<i>"``
(each optimizer, keyed by parameter names) written by every rank, plus ``meta.pt``, which rank 0 writes with every
other entry of Lightning's checkpoint dict (loops, schedulers, callbacks, the datamodule's state, hyper-parameters).
Loading reshards: a checkpoint written by 2 ranks loads into 1, 2 or 4 (DCP maps saved chunks onto the target's
placements). Nothing here needs a process group: with one process DCP reads and writes locally. A save is atomic
(written beside ``path``, flushed, renamed over it: :mod:`~lightning_llmfast.parallel.atomic`); a load verifies the
digests, each rank its share, and the ranks decide together (:mod:`~lightning_llmfast.parallel.verdict`). Under
expert parallelism with DDP (plain tensors of each rank's experts) ``ep_mesh`` views the experts and their optimizer
state as DTensors over it: each rank writes and reads only its own experts, into the keys and shapes of a
one-process checkpoint (:func:`~lightning_llmfast.expert_parallel.expert_dtensor_state_dict`).

Example::

    save_distributed_checkpoint(checkpoint_dict, "ckpts/step=100.ckpt", rank=trainer.global_rank)
    meta = load_distributed_checkpoint("ckpts/step=100.ckpt", module, optimizers)
    consolidate_checkpoint("ckpts/step=100.ckpt", "model.ckpt")  # one file, for inference
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only
from typing_extensions import override

from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.expert_parallel.state import expert_dtensor_optimizer_state, expert_dtensor_state_dict
from lightning_llmfast.parallel import atomic
from lightning_llmfast.parallel.integrity import verify_shard_digests, write_shard_digests
from lightning_llmfast.parallel.verdict import agree

__all__ = [
    "META_FILENAME",
    "MetadataReader",
    "consolidate_checkpoint",
    "is_distributed_checkpoint",
    "load_checkpoint_meta",
    "load_distributed_checkpoint",
    "model_state",
    "optimizer_state",
    "read_metadata",
    "save_distributed_checkpoint",
]

META_FILENAME = "meta.pt"
"""The file of the non-tensor entries (Lightning's ``_METADATA_FILENAME``)."""

_MODEL_KEY = "state_dict"
_TENSOR_ENTRIES = ("state_dict", "optimizer_states")


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it holds DCP's ``.metadata``).

    Example::

        is_distributed_checkpoint("ckpts/epoch=0-step=5.ckpt")  # True for a sharded checkpoint
    """
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def model_state(module: nn.Module, ep_mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The module's state dict as DCP saves it: sharded DTensors under FSDP2, plain tensors otherwise; with
    ``ep_mesh`` (expert parallelism under DDP) the local experts as DTensor views over it."""
    state = get_model_state_dict(module)
    return state if ep_mesh is None else expert_dtensor_state_dict(module, state, ep_mesh)


def optimizer_state(module: nn.Module, optimizer: Optimizer, ep_mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (sharded like the parameters), so it reshards on load; with
    ``ep_mesh`` the local experts' state as DTensor views over it."""
    state = get_optimizer_state_dict(module, optimizer)
    return state if ep_mesh is None else expert_dtensor_optimizer_state(module, state, ep_mesh)


def save_distributed_checkpoint(checkpoint: dict[str, Any], path: str | Path, *, rank: int) -> None:
    """Write ``checkpoint`` (Lightning's dict, from :func:`model_state`/:func:`optimizer_state`) to ``path``, whole or
    not at all.

    Every rank calls this with the same ``path`` (on a file system they share). Rank 0 clears what an interrupted
    save left beside ``path`` and makes the temporary directory beside it (:mod:`~lightning_llmfast.parallel.atomic`);
    then all write into it: each its own shards (``dcp.save``, which decides together itself) and their digests, rank
    0 also :data:`META_FILENAME`, each flushing what it wrote; once every rank has, rank 0 renames the directory over
    ``path``, and every rank learns that it did. Each of these meeting points is one collective
    (:func:`~lightning_llmfast.parallel.verdict.agree`, bounded by the process group's timeout): any exception on any
    rank (a full disk's ``OSError`` or ``RuntimeError``, a pickling error in the hyper-parameters) raises the same
    :class:`CheckpointError` on every rank, naming the rank and the cause, and no rank is left waiting for it. Until
    the rename ``path`` holds the previous checkpoint, whole: a kill or a failure at any moment costs at most the
    checkpoint being written. ``checkpoint`` is not modified.

    Raises:
        CheckpointError: on every rank, when the save failed on any rank.

    Example::

        save_distributed_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), "last.ckpt", rank=0)
    """
    path = Path(path)
    tmp = atomic.temporary_beside(path)
    what = f"saving {path}"
    agree(_attempt(_prepare, path, tmp) if rank == 0 else None, what)
    tensors: dict[str, Any] = {_MODEL_KEY: checkpoint.get(_MODEL_KEY, {})}
    for index, state in enumerate(checkpoint.get("optimizer_states", [])):
        tensors[_optimizer_key(index)] = state
    try:
        metadata = dcp.save(tensors, checkpoint_id=tmp)  # its shard files and .metadata are fsynced by DCP's writer
    except CheckpointException as err:  # DCP gathered every rank's failure and raises it on every rank
        failed = sorted(err.failures)
        cause = err.failures[failed[0]].exception
        raise CheckpointError(
            f"{what}: rank {failed[0]} failed with {type(cause).__name__}: {cause}"
            f"{f'; rank(s) {failed[1:]} failed too' if len(failed) > 1 else ''}; every rank stops here"
        ) from err
    agree(_attempt(_write_rank_files, checkpoint, tmp, rank, metadata), what)  # every rank flushed its files
    agree(_attempt(_publish, tmp, path) if rank == 0 else None, what)


def _attempt(fn: Callable[..., None], *args: Any) -> Exception | None:
    """``fn(*args)``; whatever it raised (a full disk's ``OSError`` or ``RuntimeError``, a pickling error), for
    :func:`agree`."""
    try:
        fn(*args)
    except Exception as err:
        return err
    return None


def _prepare(path: Path, tmp: Path) -> None:
    """Rank 0, before a save: what an interrupted save left beside ``path`` cleared, the temporary directory made."""
    atomic.clear_stale(path)
    tmp.mkdir(parents=True)


def _write_rank_files(checkpoint: dict[str, Any], tmp: Path, rank: int, metadata: Metadata) -> None:
    """After ``dcp.save``: rank 0 writes :data:`META_FILENAME`; every rank the digests of its files; both flushed."""
    if rank == 0:
        meta = {key: value for key, value in checkpoint.items() if key not in _TENSOR_ENTRIES}
        torch.save(meta, tmp / META_FILENAME)
        atomic.fsync_file(tmp / META_FILENAME)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    extra = (".metadata", META_FILENAME) if rank == 0 else ()
    atomic.fsync_file(write_shard_digests(tmp, rank, extra, world_size=world_size, metadata=metadata))


def _publish(tmp: Path, path: Path) -> None:
    """Rank 0, once every rank has flushed: the directory's entries to the disk, then ``tmp`` renamed over ``path``."""
    atomic.fsync_directory(tmp)
    atomic.move_into_place(tmp, path)


class MetadataReader(dcp.FileSystemReader):
    """DCP's file-system reader with the checkpoint's ``.metadata`` given, read once (by one rank) instead of by every
    rank on every load.

    Args:
        path: the checkpoint directory.
        metadata: its DCP ``Metadata`` (:func:`read_metadata`).

    Example::

        dcp.load(state, storage_reader=MetadataReader(path, read_metadata(path)))
    """

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self.metadata = metadata

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a rank-local metadata file (DCP's fallback): not the shared one
            return super().read_metadata(*args, **kwargs)
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def read_metadata(path: str | Path) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint ``path`` (one read of its ``.metadata``).

    Raises:
        CheckpointError: the file is missing or unreadable.

    Example::

        read_metadata("ckpts/last.ckpt").state_dict_metadata  # {key: tensor or bytes metadata}
    """
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a missing file, a truncated pickle: torch and pickle raise many kinds
        raise CheckpointError(
            f"{path}: unreadable distributed checkpoint metadata ({type(err).__name__}: {err})"
        ) from err


def load_distributed_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    ep_mesh: DeviceMesh | None = None,
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_distributed_checkpoint` into ``module`` and ``optimizers``, resharding.

    Every rank calls this, after the module is sharded (or not: a single process loads into plain tensors) and the
    optimizers exist. Optimizer state is matched by parameter names, so the world size may differ from the save.

    Args:
        path: the checkpoint directory.
        module: the (sharded) model, with the state dict names it was saved under.
        optimizers: loaded in order from ``optimizer_0``, ``optimizer_1``...; ``()`` loads weights only.
        strict: fail on a module key missing from the checkpoint (``False`` loads what is there).
        weights_only: passed to ``torch.load`` for :data:`META_FILENAME` (``None``: torch's default).
        ep_mesh: under expert parallelism with DDP, the mesh the local experts are read over (each rank reads only
            its own experts, in place; :func:`model_state`).

    Returns:
        The non-tensor entries (loops, schedulers, callbacks, datamodule state...), to be restored by Lightning.

    Raises:
        ConfigError: ``path`` is not a distributed checkpoint, or it holds fewer optimizers than given.
        CheckpointError: a file differs from its digest (:mod:`lightning_llmfast.parallel.integrity`): each rank
            verifies its share, and every rank raises if any rank found damage (the others name that rank).

    Example::

        meta = load_distributed_checkpoint("last.ckpt", module, [optimizer])
        meta["global_step"]
    """
    path = Path(path)
    metadata = _verify_together(path)
    saved = metadata.state_dict_metadata
    missing = [i for i in range(len(optimizers)) if not any(k.startswith(_optimizer_key(i) + ".") for k in saved)]
    if missing:
        raise ConfigError(f"{path} holds no state for optimizer(s) {missing}; was it saved with weights only?")
    state: dict[str, Any] = {_MODEL_KEY: model_state(module, ep_mesh)}
    for index, optimizer in enumerate(optimizers):
        state[_optimizer_key(index)] = optimizer_state(module, optimizer, ep_mesh)
    reader = MetadataReader(path, metadata)
    dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    if ep_mesh is not None:  # the module's experts are plain tensors: the views' local parts
        state = tree_map_only(DTensor, lambda t: t.to_local(), state)
    set_model_state_dict(module, state[_MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[_optimizer_key(index)])
    return load_checkpoint_meta(path, weights_only=weights_only)


def load_checkpoint_meta(path: str | Path, *, weights_only: bool | None = None) -> dict[str, Any]:
    """The non-tensor entries of a distributed checkpoint (:data:`META_FILENAME`: loops, schedulers, callbacks,
    hyper-parameters...), without its tensors.

    Args:
        path: the checkpoint directory.
        weights_only: passed to ``torch.load`` (``None``: torch's default).

    Example::

        load_checkpoint_meta("ckpts/last.ckpt")["global_step"]
    """
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    return torch.load(Path(path) / META_FILENAME, map_location="cpu", **kwargs)


def _verify_together(path: Path) -> Metadata:
    """Each rank checks that ``path`` is a distributed checkpoint and verifies its share of the digests
    (:func:`verify_shard_digests`), rank 0 also reads DCP's ``.metadata``; one collective makes every rank go on, or
    every rank raise; the metadata is then broadcast (read once, not by every rank). Returns the metadata."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    error: Exception | None = None
    metadata: list[Metadata | None] = [None]
    try:
        if not is_distributed_checkpoint(path):
            raise ConfigError(f"{path} is not a distributed (DCP) checkpoint directory")
        verify_shard_digests(path, rank, world_size)
        if rank == 0:
            metadata[0] = read_metadata(path)
    except (ConfigError, CheckpointError, OSError) as err:
        error = err
    agree(error, f"resuming from {path}")
    if world_size > 1:
        dist.broadcast_object_list(metadata, src=0)
    assert metadata[0] is not None
    return metadata[0]


def consolidate_checkpoint(path: str | Path, output: str | Path, *, weights_only: bool | None = None) -> Path:
    """Export a distributed checkpoint as one Lightning checkpoint file with the full weights, for inference.

    No process group is needed; the shards are assembled in host memory (the model's full size). The file holds
    ``state_dict`` and the non-tensor entries (hyper-parameters...), no optimizer state, so
    ``LightningModule.load_from_checkpoint(output)`` builds the model from it.

    Args:
        path: the checkpoint directory.
        output: the file to write (its parent directories are created).
        weights_only: passed to ``torch.load`` for :data:`META_FILENAME`.

    Returns:
        ``output`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: ``path`` is not a distributed checkpoint.

    Example::

        consolidate_checkpoint("ckpts/last.ckpt", "export/model.ckpt")
        module = MoEGPTLightningModule.load_from_checkpoint("export/model.ckpt")
    """
    path, output = Path(path), Path(output)
    if not is_distributed_checkpoint(path):
        raise ConfigError(f"{path} is not a distributed (DCP) checkpoint directory")
    metadata = read_metadata(path)
    saved = metadata.state_dict_metadata
    prefix = _MODEL_KEY + "."
    weights = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({_MODEL_KEY: weights}, storage_reader=MetadataReader(path, metadata), no_dist=True)
    checkpoint = load_checkpoint_meta(path, weights_only=weights_only)
    checkpoint[_MODEL_KEY] = weights
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_file_atomically(output, lambda file: torch.save(checkpoint, file))  # never half-written
    return output
