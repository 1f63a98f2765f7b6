"""Pretrained transformers checkpoints read per rank: each rank reads from the safetensors shards only what it holds.

A :class:`PretrainedCheckpoint` is a directory as ``save_pretrained`` writes it (``config.json``, sharded
``*.safetensors`` with ``model.safetensors.index.json``, or one ``model.safetensors``), or as block-FP8 models are
released (DeepSeek-V3/R1: :mod:`~lightning_llmfast.hf.fp8`). Opening it checks the directory, the family
(:func:`~lightning_llmfast.hf.state_dict.state_dict_adapter`) and parses every shard's header once
(:func:`read_header`), keeping where each tensor's bytes lie. Layers past ``num_hidden_layers`` (DeepSeek's
multi-token-prediction layer, ``model.layers.{num_hidden_layers}.*``, which the transformers model does not have) are
left out with one log line naming them.

:meth:`PretrainedCheckpoint.load_into` then fills an already allocated model *after* it was parallelised: for every
parameter and persistent buffer it takes the box this rank holds (a DTensor's local chunk under FSDP2 or FSDP2 x EP,
the local experts of an expert-parallel block under DDP, the whole tensor otherwise), finds the checkpoint tensors
covering it (per-expert matrices for fused expert tensors, :meth:`~lightning_llmfast.hf.state_dict.StateDictAdapter.
pieces`) and reads just the rows of each that overlap it (and, for a quantized matrix, the rows of block scales that
cover them), in file order, through a :class:`~lightning_llmfast.parallel.staging.StagedReader`: batched into one
buffer, copied to the device in one asynchronous copy per batch, then converted on the device to the parameter's
dtype (dequantized first when quantized) and copied into place. No file is memory-mapped, so a rank's resident memory
grows by its share and one buffer of at least its largest read.

torch DCP's ``QuantizedHuggingFaceStorageReader`` dequantizes the same format, but its planner reads checkpoint keys
one to one into state-dict keys (here one per-expert key fills a box of a fused expert tensor), it reads a matrix's
whole scale tensor and dequantizes block by block in a Python loop; the format and formula are shared
(:mod:`~lightning_llmfast.hf.fp8`), the reading is this module's, as it is for bf16 checkpoints.

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
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.expert_parallel.state import expert_parameters
from lightning_llmfast.hf.fp8 import FP8_DTYPES, SCALE_SUFFIX, block_size, dequantize, scale_key, scale_shape
from lightning_llmfast.hf.state_dict import Piece, StateDictAdapter, state_dict_adapter
from lightning_llmfast.parallel.staging import ALIGNMENT, StagedReader

__all__ = [
    "INDEX_FILENAME", "PRETRAINED_ATTRIBUTE", "SINGLE_FILENAME", "STAGING_BYTES", "LoadStats", "PretrainedCheckpoint",
    "TensorEntry", "hold_elsewhere", "loads_every_weight", "pretrained_targets", "read_header",
]  # fmt: skip

INDEX_FILENAME = "model.safetensors.index.json"
"""The index of a sharded checkpoint: ``{"weight_map": {key: shard file}}``."""
SINGLE_FILENAME = "model.safetensors"
"""The one file of an unsharded checkpoint."""
PRETRAINED_ATTRIBUTE = "pretrained_checkpoint"
"""Attribute of a module whose weights are to be read from a :class:`PretrainedCheckpoint` when materialised."""
STAGING_BYTES = 4 << 20
"""Smallest staging buffer of a load (a larger read gets a buffer of its size)."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its safetensors file: dtype, shape and the absolute byte range ``[begin, end)``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors file's header (8 bytes of length, then JSON) without mapping or reading any tensor.

    Raises:
        CheckpointError: a file that is absent, truncated (a tensor past its end) or corrupt, or a tensor of an
            unsupported dtype; naming the file (and the key).

    Example::

        read_header(Path("model-00001-of-00002.safetensors"))["model.embed_tokens.weight"].shape
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(file.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        entries = {}
        for key, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {info['dtype']}")
            dtype, shape = _DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"])
            begin, end = (8 + length + int(o) for o in info["data_offsets"])
            if end - begin != _numel(shape) * dtype.itemsize or end > size:
                raise ValueError(f"tensor {key!r} at bytes {begin}..{end} of a file of {size}")
            entries[key] = TensorEntry(dtype, shape, begin, end)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{path}: truncated or corrupt safetensors shard ({err})") from err
    return entries


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
class LoadStats:
    """What one :meth:`PretrainedCheckpoint.load_into` did on this rank.

    Attributes:
        bytes_read: bytes read from the shards (quantized weights and their scales as stored).
        reads: checkpoint tensors (or row ranges of them) read.
        batches: staging buffers delivered (on CUDA: host-to-device copies).
    """

    bytes_read: int
    reads: int
    batches: int


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """A ``save_pretrained`` directory (or a block-FP8 release), checked, with where each tensor lives.

    Build it with :meth:`open`.

    Attributes:
        directory: the directory.
        config: ``config.json`` as a dict.
        adapter: the family's key table.
        files: checkpoint key -> shard file name (from the index, or the single file).
        shapes: checkpoint key -> shape (from the shard headers).
        dtypes: checkpoint key -> dtype.
        entries: checkpoint key -> where its bytes lie in its file.
        block: the block size of a block-FP8 checkpoint (``None``: not quantized).
        skipped: keys of layers past ``num_hidden_layers`` (multi-token prediction), not loaded.
        elsewhere: model tensor name -> global shape of the tensors other ranks hold (pipeline stages pruned away
            here, :func:`hold_elsewhere`): their keys are expected in the checkpoint, not read here.
    """

    directory: Path
    config: dict[str, Any]
    adapter: StateDictAdapter
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    dtypes: dict[str, torch.dtype] = field(repr=False)
    entries: dict[str, TensorEntry] = field(repr=False, default_factory=dict)
    block: tuple[int, int] | None = None
    skipped: tuple[str, ...] = field(repr=False, default=())
    elsewhere: dict[str, tuple[int, ...]] = field(repr=False, default_factory=dict)

    @classmethod
    def open(cls, directory: str | Path) -> PretrainedCheckpoint:
        """Open and check a pretrained directory (local files only, nothing is downloaded); each shard's header is
        parsed once, here.

        Raises:
            CheckpointError: no such directory, no ``config.json`` or an unreadable one, no safetensors weights, a
                shard named by the index that is absent, truncated or corrupt (naming the file), a key listed in
                the index that its shard does not hold (naming both), or a quantized weight without its scales, or
                with scales of the wrong shape (naming the key).
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
        weight_map = _weight_map(directory)
        names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILENAME]
        headers = {name: read_header(directory / name) for name in names}
        if weight_map is None:
            weight_map = dict.fromkeys(headers[SINGLE_FILENAME], SINGLE_FILENAME)
        entries: dict[str, TensorEntry] = {}
        for key, name in weight_map.items():
            entry = headers[name].get(key)
            if entry is None:
                raise CheckpointError(f"{directory / name}: key {key!r} listed in the index is not in this shard")
            entries[key] = entry
        skipped = _skip_extra_layers(directory, config, weight_map, entries)
        block = block_size(config)
        _check_quantized(directory, weight_map, entries, block)
        shapes = {key: entry.shape for key, entry in entries.items()}
        dtypes = {key: entry.dtype for key, entry in entries.items()}
        return cls(directory, config, adapter, weight_map, shapes, dtypes, entries, block, skipped)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors in the checkpoint (the skipped layers left out)."""
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
                expected.update((piece.key, scale_key(piece.key)))
                if piece.key not in self.files:
                    raise CheckpointError(f"{self.directory}: missing key {piece.key!r} (model tensor {name!r})")
                if self.shapes[piece.key] != piece.shape:
                    raise CheckpointError(
                        f"{self.directory / self.files[piece.key]}: key {piece.key!r} has shape "
                        f"{list(self.shapes[piece.key])}, the model expects {list(piece.shape)} (a checkpoint of "
                        "another size?)"
                    )
        for name, shape in self.elsewhere.items():
            expected.update(
                key for piece in self.adapter.pieces(name, shape) for key in (piece.key, scale_key(piece.key))
            )
        tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in model.named_parameters()
        }
        unexpected = sorted(set(self.files) - expected - {self.adapter.hf_key(name) for name in tied})
        if unexpected:
            shown = ", ".join(f"{key!r} ({self.files[key]})" for key in unexpected[:5])
            more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
            raise CheckpointError(f"{self.directory}: unexpected keys {shown}{more} (not in the model)")

    def load_into(self, model: nn.Module) -> LoadStats:
        """Fill ``model``'s allocated parameters and persistent buffers with the slices this rank holds.

        Call it after the model is parallelised and allocated (:func:`~lightning_llmfast.parallel.fsdp.
        materialize_module` does). Tied parameters are filled once. Non-persistent buffers are not touched.
        Quantized weights are dequantized on the parameters' device, in float32, then cast to their dtype.

        Returns:
            What was read (bytes, tensors, staging batches).

        Raises:
            CheckpointError: from :meth:`check_keys`, or a shard that cannot be read (naming the file).

        Example::

            checkpoint.load_into(model).bytes_read
        """
        held = _held_tensors(model)
        self._check_keys(model, held)
        reads = []
        for tensor in held:
            for piece in self.adapter.pieces(tensor.name, tensor.shape):
                boxes = tensor.box.overlap(piece)
                if boxes is not None:
                    local, inner = boxes
                    reads.append(_Read(self, piece.key, tensor.local[local], inner[1:] if piece.expert else inner))
        reads.sort(key=lambda read: read.ranges[0][:2])  # file by file, in byte order
        device = held[0].local.device if held else torch.device("cpu")
        capacity = max([STAGING_BYTES, *(read.nbytes for read in reads)])
        with torch.no_grad(), StagedReader(device, capacity) as reader:
            for read in reads:
                reader.add(read.ranges, read.finish)
        return LoadStats(reader.bytes_read, len(reads), reader.batches)


class _Read:
    """The rows of one checkpoint tensor (and of its block scales) that overlap a model tensor's local box, and how
    their bytes become that part of the local tensor."""

    def __init__(self, checkpoint: PretrainedCheckpoint, key: str, target: Tensor, source: tuple[slice, ...]) -> None:
        self.target, self.source = target, source
        self.entry = entry = checkpoint.entries[key]
        path = checkpoint.directory / checkpoint.files[key]
        self.rows = (source[0].start, source[0].stop) if entry.shape else (0, 1)
        row_bytes = _numel(entry.shape[1:]) * entry.dtype.itemsize
        self.ranges = [(path, entry.begin + self.rows[0] * row_bytes, (self.rows[1] - self.rows[0]) * row_bytes)]
        self.block = checkpoint.block if entry.dtype in FP8_DTYPES else None
        if self.block is not None:
            scales = checkpoint.entries[scale_key(key)]
            first, last = self.rows[0] // self.block[0], -(-self.rows[1] // self.block[0])
            scale_row = scales.shape[1] * scales.dtype.itemsize
            self.scales = (scales.dtype, (last - first, scales.shape[1]))
            self.ranges.append(
                (checkpoint.directory / checkpoint.files[scale_key(key)], scales.begin + first * scale_row,
                 (last - first) * scale_row)
            )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Staging bytes of its ranges."""
        return sum(-(-n // ALIGNMENT) * ALIGNMENT for _, _, n in self.ranges)

    def finish(self, parts: list[Tensor]) -> None:
        """Its ranges' bytes (on the target's device) into the target: viewed, sliced, dequantized, cast."""
        entry = self.entry
        rows = parts[0].view(entry.dtype).view((self.rows[1] - self.rows[0], *entry.shape[1:]))
        values = rows[(slice(None), *self.source[1:])] if entry.shape else rows.view(())
        if self.block is not None:
            dtype, shape = self.scales
            scales = parts[1].view(dtype).view(shape)
            values = dequantize(values, scales, self.block, row=self.rows[0], col=self.source[1].start)
        self.target.copy_(values.reshape(self.target.shape))


def loads_every_weight(module: nn.Module) -> bool:
    """Whether every parameter and persistent buffer of ``module`` lies in a submodule waiting for pretrained
    weights (:func:`pretrained_targets`): then every rank reads the same bytes, and nothing needs a broadcast.

    Example::

        loads_every_weight(HFCausalLMModule.from_pretrained(directory))  # True
    """
    prefixes = [name for name, _, _ in pretrained_targets(module)]
    if not prefixes:
        return False
    names = [*module.state_dict(keep_vars=True), *(name for name, _ in module.named_parameters())]
    return all(any(not p or name.startswith(p + ".") for p in prefixes) for name in names)


def hold_elsewhere(module: nn.Module, tensors: Mapping[str, tuple[int, ...]]) -> None:
    """Tell the pretrained checkpoints waiting in ``module`` (:func:`pretrained_targets`) that the tensors
    ``tensors`` (names under ``module``, global shapes) are held by other ranks, as pipeline stages pruned away here
    are: their keys are then expected in the checkpoint but not read by this rank.

    Example::

        hold_elsewhere(model, {"model.layers.3.mlp.gate.weight": (4, 32)})  # the stage holding layer 3 reads it
    """
    for prefix, _, checkpoint in pretrained_targets(module):
        start = f"{prefix}." if prefix else ""
        checkpoint.elsewhere.update((n[len(start) :], s) for n, s in tensors.items() if n.startswith(start))


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


def _weight_map(directory: Path) -> dict[str, str] | None:
    """The index's key -> file map, or ``None`` for a single ``model.safetensors`` (its header lists the keys)."""
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
    if (directory / SINGLE_FILENAME).is_file():
        return None
    raise CheckpointError(f"{directory}: no {INDEX_FILENAME} or {SINGLE_FILENAME} (safetensors weights)")


def _skip_extra_layers(
    directory: Path, config: dict[str, Any], weight_map: dict[str, str], entries: dict[str, TensorEntry]
) -> tuple[str, ...]:
    """Drop the keys of layers ``>= num_hidden_layers`` (DeepSeek's multi-token-prediction layers) from both maps,
    logging one line that names the layers; returns the dropped keys."""
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int):
        return ()
    extra = {key: int(m[1]) for key in weight_map if (m := _LAYER.match(key)) is not None and int(m[1]) >= layers}
    skipped = sorted(extra)
    if skipped:
        names = [f"model.layers.{index}" for index in sorted(set(extra.values()))]
        _log.warning(
            "%s: skipping %s (%d tensors): layers past num_hidden_layers=%d (multi-token prediction), which the "
            "transformers model does not have",
            directory, ", ".join(names), len(skipped), layers,
        )  # fmt: skip
        for key in skipped:
            del weight_map[key], entries[key]
    return tuple(skipped)


def _check_quantized(
    directory: Path, weight_map: dict[str, str], entries: dict[str, TensorEntry], block: tuple[int, int] | None
) -> None:
    """Every fp8 matrix has block scales of the right shape, every scale has its matrix, and fp8 means a
    ``quantization_config`` that says the block size."""
    for key, entry in entries.items():
        if key.endswith(SCALE_SUFFIX):
            weight = entries.get(key[: -len(SCALE_SUFFIX)])
            if weight is None or weight.dtype not in FP8_DTYPES:
                raise CheckpointError(f"{directory / weight_map[key]}: scales {key!r} without an fp8 weight")
            continue
        if entry.dtype not in FP8_DTYPES:
            continue
        where = directory / weight_map[key]
        if block is None:
            raise CheckpointError(
                f"{where}: key {key!r} is {entry.dtype} but config.json has no quantization_config (block size)"
            )
        scales = entries.get(scale_key(key))
        if scales is None:
            raise CheckpointError(f"{where}: quantized key {key!r} has no {scale_key(key)!r}")
        if len(entry.shape) != 2:
            raise CheckpointError(f"{where}: quantized key {key!r} has shape {list(entry.shape)}, not a matrix")
        if scales.shape != scale_shape(entry.shape, block):
            raise CheckpointError(
                f"{where}: {scale_key(key)!r} has shape {list(scales.shape)}; a {list(entry.shape)} weight in "
                f"blocks of {list(block)} needs {list(scale_shape(entry.shape, block))}"
            )


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
