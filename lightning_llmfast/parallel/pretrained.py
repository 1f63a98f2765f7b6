"""Pretrained transformers checkpoints read per rank: each rank reads from the safetensors shards only what it holds.

A :class:`PretrainedCheckpoint` is a directory as ``save_pretrained`` writes it (``config.json``, sharded
``*.safetensors`` with ``model.safetensors.index.json``, or one ``model.safetensors``). Opening it checks the
directory, the family (:func:`~lightning_llmfast.hf.state_dict.state_dict_adapter`) and every shard's header.
:meth:`PretrainedCheckpoint.load_into` then fills an already allocated model *after* it was parallelised: for every
parameter and persistent buffer it takes the box this rank holds (a DTensor's local chunk under FSDP2 or FSDP2 x EP,
the local experts of an expert-parallel block under DDP, the whole tensor otherwise), finds the checkpoint tensors
covering it (per-expert matrices for fused expert tensors, :meth:`~lightning_llmfast.hf.state_dict.StateDictAdapter.
pieces`) and reads just their overlapping slices with ``safe_open(...).get_slice``, converted to the parameter's dtype
on copy. Shards are memory-mapped; a mapping is dropped (and reopened) once a budget of bytes has been read through it,
so the file pages a rank touches stay bounded by about its largest tensor, not by the shard size.

:func:`~lightning_llmfast.parallel.fsdp.materialize_module` calls it for a model that carries a checkpoint in its
:data:`PRETRAINED_ATTRIBUTE`, in place of the random initialisation.

Example::

    checkpoint = PretrainedCheckpoint.open("Qwen3-30B-A3B")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint.directory))
    model.pretrained_checkpoint = checkpoint
    parallelize(model, dims, model.model.layers, device=device)  # shards on meta, then loads each rank's slices
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.expert_parallel.state import expert_parameters
from lightning_llmfast.hf.state_dict import Piece, StateDictAdapter, state_dict_adapter

__all__ = ["INDEX_FILENAME", "PRETRAINED_ATTRIBUTE", "SINGLE_FILENAME", "PretrainedCheckpoint", "pretrained_targets"]

INDEX_FILENAME = "model.safetensors.index.json"
"""The index of a sharded checkpoint: ``{"weight_map": {key: shard file}}``."""
SINGLE_FILENAME = "model.safetensors"
"""The one file of an unsharded checkpoint."""
PRETRAINED_ATTRIBUTE = "pretrained_checkpoint"
"""Attribute of a module whose weights are to be read from a :class:`PretrainedCheckpoint` when materialised."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Box:
    """The part of a global tensor one rank holds: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def overlap(self, piece: Piece) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
        """``(slices into the local tensor, slices into the piece's box)`` of their intersection, or ``None``."""
        local, inner = [], []
        for o, s, po, ps in zip(self.offsets, self.sizes, piece.offsets, piece.sizes, strict=True):
            start, stop = max(o, po), min(o + s, po + ps)
            if start >= stop:
                return None
            local.append(slice(start - o, stop - o))
            inner.append(slice(start - po, stop - po))
        return tuple(local), tuple(inner)


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """A ``save_pretrained`` directory, checked, with where each tensor lives and its shape and dtype.

    Build it with :meth:`open`.

    Attributes:
        directory: the directory.
        config: ``config.json`` as a dict.
        adapter: the family's key table.
        files: checkpoint key -> shard file name (from the index, or the single file).
        shapes: checkpoint key -> shape (from the shard headers).
        dtypes: checkpoint key -> dtype.
    """

    directory: Path
    config: dict[str, Any]
    adapter: StateDictAdapter
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    dtypes: dict[str, torch.dtype] = field(repr=False)

    @classmethod
    def open(cls, directory: str | Path) -> PretrainedCheckpoint:
        """Open and check a pretrained directory (local files only, nothing is downloaded).

        Raises:
            CheckpointError: no such directory, no ``config.json`` or an unreadable one, no safetensors weights, a
                shard named by the index that is absent, truncated or corrupt (naming the file), or a key listed in
                the index that its shard does not hold (naming both).
            ConfigError: an unsupported architecture (naming it and the supported families).

        Example::

            checkpoint = PretrainedCheckpoint.open("checkpoints/Mixtral-8x7B")
            checkpoint.adapter.model_type  # "mixtral"
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such pretrained directory")
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{directory}: no config.json (expected a directory written by save_pretrained)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{config_file}: unreadable config ({err})") from err
        architectures = config.get("architectures") or [None]
        adapter = state_dict_adapter(str(config.get("model_type")), architectures[0])
        files = _weight_map(directory)
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, torch.dtype] = {}
        for name in sorted(set(files.values())):
            wanted = [key for key, file in files.items() if file == name]
            with _open(directory / name) as handle:
                held = set(handle.keys())
                for key in wanted:
                    if key not in held:
                        raise CheckpointError(
                            f"{directory / name}: key {key!r} listed in the index is not in this shard"
                        )
                    view = handle.get_slice(key)
                    shapes[key] = tuple(view.get_shape())
                    if view.get_dtype() not in _DTYPES:
                        raise CheckpointError(
                            f"{directory / name}: key {key!r} has unsupported dtype {view.get_dtype()}"
                        )
                    dtypes[key] = _DTYPES[view.get_dtype()]
        return cls(directory, config, adapter, files, shapes, dtypes)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors in the checkpoint."""
        return sum(_numel(shape) * self.dtypes[key].itemsize for key, shape in self.shapes.items())

    def check_keys(self, model: nn.Module) -> None:
        """Check that the checkpoint holds exactly the tensors of ``model`` (global shapes), before reading any.

        Raises:
            CheckpointError: a model tensor's checkpoint key is missing, a checkpoint key belongs to no model tensor
                (unexpected), or a shape differs (a checkpoint of another size); each naming the key and file.
        """
        self._check_keys(model, _held_tensors(model))

    def _check_keys(self, model: nn.Module, held: list[_Held]) -> None:
        expected: set[str] = set()
        for tensor in held:
            name = tensor.name
            for piece in self.adapter.pieces(name, tensor.shape):
                expected.add(piece.key)
                if piece.key not in self.files:
                    raise CheckpointError(f"{self.directory}: missing key {piece.key!r} (model tensor {name!r})")
                if self.shapes[piece.key] != piece.shape:
                    raise CheckpointError(
                        f"{self.directory / self.files[piece.key]}: key {piece.key!r} has shape "
                        f"{list(self.shapes[piece.key])}, the model expects {list(piece.shape)} (a checkpoint of "
                        "another size?)"
                    )
        tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in model.named_parameters()
        }
        unexpected = sorted(set(self.files) - expected - {self.adapter.hf_key(name) for name in tied})
        if unexpected:
            shown = ", ".join(f"{key!r} ({self.files[key]})" for key in unexpected[:5])
            more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
            raise CheckpointError(f"{self.directory}: unexpected keys {shown}{more} (not in the model)")

    def load_into(self, model: nn.Module) -> int:
        """Fill ``model``'s allocated parameters and persistent buffers with the slices this rank holds.

        Call it after the model is parallelised and allocated (:func:`~lightning_llmfast.parallel.fsdp.
        materialize_module` does). Tied parameters are filled once. Non-persistent buffers are not touched.

        Returns:
            The number of bytes read from the shards.

        Raises:
            CheckpointError: from :meth:`check_keys`, or a shard that cannot be read (naming the file).

        Example::

            checkpoint.load_into(model)
        """
        held = _held_tensors(model)
        self._check_keys(model, held)
        by_file: dict[str, list[tuple[Piece, Tensor, Box]]] = {}
        budget = 0
        for tensor in held:
            budget = max(budget, tensor.local.numel() * tensor.local.element_size())
            for piece in self.adapter.pieces(tensor.name, tensor.shape):
                if tensor.box.overlap(piece) is not None:
                    by_file.setdefault(self.files[piece.key], []).append((piece, tensor.local, tensor.box))
        read = 0
        with torch.no_grad():
            for name, pieces in sorted(by_file.items()):
                read += self._read_file(self.directory / name, pieces, max(budget, 1 << 20))
        return read

    def _read_file(self, path: Path, pieces: list[tuple[Piece, Tensor, Box]], budget: int) -> int:
        """Copy the overlaps of ``pieces`` from one shard, reopening its mapping after ``budget`` bytes."""
        total, mapped = 0, 0
        # safe_open has no close(): leaving its context (``__exit__``) drops the memory map.
        handle = _open(path)
        try:
            for piece, local, box in pieces:
                local_slices, inner = box.overlap(piece)  # type: ignore[misc]
                source = inner[1:] if piece.expert else inner
                try:
                    part = handle.get_slice(piece.key)[source]
                except SafetensorError as err:
                    raise CheckpointError(f"{path}: cannot read {piece.key!r} ({err})") from err
                target = local[local_slices]
                target.copy_(part.view(target.shape))
                size = part.numel() * part.element_size()
                total, mapped = total + size, mapped + size
                del part
                if mapped >= budget:
                    handle.__exit__(None, None, None)
                    handle, mapped = _open(path), 0
        finally:
            handle.__exit__(None, None, None)
        return total


def pretrained_targets(module: nn.Module) -> list[tuple[str, nn.Module, PretrainedCheckpoint]]:
    """``(name, submodule, checkpoint)`` of every submodule of ``module`` waiting for pretrained weights.

    Example::

        [name for name, _, _ in pretrained_targets(lightning_module)]  # ["model"]
    """
    found = []
    for name, sub in module.named_modules():
        checkpoint = getattr(sub, PRETRAINED_ATTRIBUTE, None)
        if isinstance(checkpoint, PretrainedCheckpoint):
            found.append((name, sub, checkpoint))
    return found


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILENAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: unreadable index ({err})") from err
        for name in sorted(set(weight_map.values())):
            if not (directory / name).is_file():
                raise CheckpointError(f"{directory / name}: shard listed in {INDEX_FILENAME} does not exist")
        return dict(weight_map)
    single = directory / SINGLE_FILENAME
    if single.is_file():
        with _open(single) as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILENAME)
    raise CheckpointError(f"{directory}: no {INDEX_FILENAME} or {SINGLE_FILENAME} (safetensors weights)")


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors shard ({err})") from err


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class _Held:
    """One model tensor as this rank holds it: state-dict name, global shape, local tensor and its box."""

    name: str
    shape: tuple[int, ...]
    local: Tensor
    box: Box


def _held_tensors(model: nn.Module) -> list[_Held]:
    """Parameters (each tied one once) and persistent buffers, as this rank holds them.

    A DTensor (FSDP2, FSDP2 x EP) holds its local chunk; an expert tensor of a DDP expert-parallel block holds the
    local experts ``start:stop`` of ``E``; anything else is whole.
    """
    persistent = set(model.state_dict(keep_vars=True))
    experts = {name: dispatch for name, _, dispatch in expert_parameters(model)}
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    held = []
    for name, tensor in named:
        if isinstance(tensor, DTensor):
            chunks = tensor.__create_chunk_list__()
            box = (
                Box(tuple(chunks[0].offsets), tuple(chunks[0].sizes))
                if chunks
                else Box((0,) * tensor.dim(), (0,) * tensor.dim())
            )
            held.append(_Held(name, tuple(tensor.shape), tensor.to_local(), box))
        elif name in experts:
            dispatch = experts[name]
            offsets = (dispatch.local_experts.start, *(0,) * (tensor.dim() - 1))
            shape = (dispatch.num_experts, *tensor.shape[1:])
            held.append(_Held(name, shape, tensor, Box(offsets, tuple(tensor.shape))))
        else:
            held.append(_Held(name, tuple(tensor.shape), tensor, Box((0,) * tensor.dim(), tuple(tensor.shape))))
    return held
