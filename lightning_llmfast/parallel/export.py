"""Export a trained model as a directory ``AutoModelForCausalLM.from_pretrained`` loads, streaming and atomically.

The output is what ``save_pretrained`` writes: sharded safetensors (``model-0000i-of-0000N.safetensors``, per-expert
keys as the family's :class:`~lightning_llmfast.hf.state_dict.StateDictAdapter` says) with
``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and the tokenizer files of the
pretrained directory the model came from. Unless a dtype is asked for, the weights are written in the source
checkpoint's dtype (:func:`export_dtype`; bf16 for a block-FP8 release, whose ``quantization_config`` and
multi-token-prediction layer are not written: the export is the model as trained). The shards are planned from the
tensors' shapes first and then written one at a time, each holding only its own tensors in memory, into a temporary
directory beside the output that is renamed at the end: after a failure or a kill the output either does not exist
or is complete.

Sources:

- :func:`export_checkpoint`: a checkpoint the strategy writes for an ``HFCausalLMModule``: a Lightning ``.ckpt``
  file (memory-mapped, read shard by shard) or a DCP directory written by FSDP2 / expert parallelism / pipeline
  stages on any number of ranks (read shard by shard with ``torch.distributed.checkpoint``, no process group). The
  pretrained directory is the ``model`` hyper-parameter the checkpoint keeps. A ``MoEGPTLightningModule``'s
  checkpoint is written as the Mixtral it is (:mod:`~lightning_llmfast.parallel.moegpt_export`).
- :func:`export_module`: a model in one process (``HFCausalLMModule.save_pretrained``).

Example::

    export_checkpoint("ckpts/last.ckpt", "exported/", dtype=torch.bfloat16, max_shard_size="5GB")
    model = AutoModelForCausalLM.from_pretrained("exported/")
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedConfig
from transformers.utils.hub import convert_file_size_to_int

from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.expert_parallel.state import sharded_moe_blocks
from lightning_llmfast.hf.state_dict import state_dict_adapter
from lightning_llmfast.models import MoEGPTConfig
from lightning_llmfast.parallel.checkpoint import (
    META_FILENAME,
    MetadataReader,
    is_distributed_checkpoint,
    read_metadata,
)
from lightning_llmfast.parallel.integrity import verify_shard_digests
from lightning_llmfast.parallel.moegpt_export import mixtral_config, mixtral_source
from lightning_llmfast.parallel.pipeline_split import KeptLayers
from lightning_llmfast.parallel.pretrained import INDEX_FILENAME

__all__ = ["DTYPES", "TOKENIZER_FILES", "export_checkpoint", "export_dtype", "export_module"]

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
"""``--dtype`` names."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
"""Files of a pretrained directory copied to the export (those present)."""

# The LightningModule holds the transformers model as `self.model`: its state-dict keys start with this.
_MODULE_PREFIX = "model."
_DCP_PREFIX = "state_dict."

Reader = Callable[[list[str]], dict[str, Tensor]]


def export_module(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    source: Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a transformers model held whole in this process as a ``from_pretrained`` directory.

    Args:
        model: the transformers model (its ``config`` is written).
        directory: the output directory; must not exist.
        source: the pretrained directory it was built from (generation config and tokenizer files are copied).
        dtype: weights' dtype on disk (``None``: the source checkpoint's, bf16 for a block-FP8 source;
            :func:`export_dtype`).
        max_shard_size: largest shard (``"5GB"``, ``"500MB"`` or bytes); a larger single tensor is a shard alone.

    Raises:
        ConfigError: this process holds only part of the model (FSDP2's DTensors, an expert-parallel block's
            local experts, or a pipeline stage's layers: save a checkpoint and use :func:`export_checkpoint`), or
            ``directory`` exists.

    Example::

        export_module(module.model, "exported/", source=Path("Qwen3-0.6B"))
    """
    state = model.state_dict()
    # A DTensor (FSDP2), an expert-parallel block (its local experts only, plain tensors under DDP) or a pipeline
    # stage (its layers only) is a part.
    if (
        any(isinstance(t, DTensor) for t in state.values())
        or next(sharded_moe_blocks(model), None) is not None
        or any(isinstance(m, KeptLayers) for m in model.modules())
    ):
        raise ConfigError(
            "save_pretrained needs the whole model in one process; under FSDP2, expert parallelism or pipeline "
            "parallelism this process holds only part of it: save a checkpoint and run python -m "
            "lightning_llmfast.export CHECKPOINT OUT_DIR"
        )
    return _write(model.config, state, lambda keys: {k: state[k] for k in keys}, directory, source, dtype,
                  max_shard_size)  # fmt: skip


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a Lightning ``.ckpt`` file or a DCP checkpoint directory of an ``HFCausalLMModule`` (or of a
    ``MoEGPTLightningModule``, as a Mixtral: :mod:`~lightning_llmfast.parallel.moegpt_export`) as a
    ``from_pretrained`` directory, streaming.

    Args:
        checkpoint: the ``.ckpt`` file or DCP directory (written by any number of ranks, in any pipeline layout).
        directory: the output directory; must not exist.
        dtype: weights' dtype on disk (``None``: the source checkpoint's, bf16 for a block-FP8 source;
            :func:`export_dtype`).
        max_shard_size: largest shard (``"5GB"``, ``"500MB"`` or bytes).

    Returns:
        ``directory``.

    Raises:
        CheckpointError: no such checkpoint, or one that is unreadable, corrupt or holds no model weights.
        ConfigError: its hyper-parameters name no pretrained directory nor a ``MoEGPTConfig`` (the config to
            write), the directory is gone, its family is unsupported, a MoEGPT Mixtral cannot express, or
            ``directory`` exists.

    Example::

        export_checkpoint("ckpts/epoch=0-step=100.ckpt", "exported/", dtype=torch.bfloat16)
    """
    path = Path(checkpoint)
    if is_distributed_checkpoint(path):
        meta, shapes, read = _dcp_source(path)
    elif path.is_file():
        meta, shapes, read = _file_source(path)
    else:
        raise CheckpointError(f"{path}: no such checkpoint (a Lightning .ckpt file or a DCP directory)")
    hyper = meta.get("hyper_parameters") or {}
    source = hyper.get("model")
    if isinstance(hyper.get("config"), MoEGPTConfig):  # MoEGPTLightningModule: written as the Mixtral it is
        mixtral = mixtral_config(hyper["config"])
        shapes, read = mixtral_source(hyper["config"], shapes, read)
        return _write(mixtral, shapes, read, directory, None, dtype, max_shard_size)
    if not isinstance(source, str):
        raise ConfigError(
            f"{path}: its hyper-parameters name no pretrained directory (HFCausalLMModule(model='<dir>')) and no "
            "MoEGPTConfig, so there is no config to export with"
        )
    if not (Path(source) / "config.json").is_file():
        raise ConfigError(f"{path}: its pretrained directory {source} has no config.json any more")
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    return _write(config, shapes, read, directory, Path(source), dtype, max_shard_size)


def _file_source(path: Path) -> tuple[dict[str, Any], dict[str, Any], Reader]:
    try:
        # MoEGPTLightningModule's hyper-parameters hold a MoEGPTConfig, a safe global from its import on.
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError... for a bad file
        raise CheckpointError(f"{path}: unreadable checkpoint file ({err})") from err
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path}: holds no model weights ('state_dict')")
    weights = {k[len(_MODULE_PREFIX) :]: v for k, v in state.items() if k.startswith(_MODULE_PREFIX)}
    return checkpoint, weights, lambda keys: {k: weights[k] for k in keys}


def _dcp_source(path: Path) -> tuple[dict[str, Any], dict[str, Any], Reader]:
    verify_shard_digests(path)
    metadata = read_metadata(path)  # once: every read below plans against it
    saved = metadata.state_dict_metadata
    try:
        meta = torch.load(path / META_FILENAME, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path}: unreadable distributed checkpoint ({err})") from err
    prefix = _DCP_PREFIX + _MODULE_PREFIX
    shapes = {
        key[len(prefix) :]: value
        for key, value in saved.items()
        if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)
    }
    if not shapes:
        raise CheckpointError(f"{path}: holds no model weights")

    def read(keys: list[str]) -> dict[str, Tensor]:
        tensors = {k: torch.empty(tuple(shapes[k].size), dtype=shapes[k].properties.dtype) for k in keys}
        state = {"state_dict": {_MODULE_PREFIX + k: t for k, t in tensors.items()}}
        dcp.load(state, storage_reader=MetadataReader(path, metadata), no_dist=True)
        return tensors

    return meta, {k: _Shape(tuple(v.size), v.properties.dtype) for k, v in shapes.items()}, read


class _Shape:
    """Shape and dtype of a tensor not read yet (what shard planning needs)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype

    def numel(self) -> int:
        return self.shape.numel()


def _write(
    config: PreTrainedConfig,
    tensors: Mapping[str, Any],
    read: Reader,
    directory: str | os.PathLike[str],
    source: Path | None,
    dtype: torch.dtype | None,
    max_shard_size: int | str,
) -> Path:
    out = Path(directory)
    if out.exists():
        raise ConfigError(f"{out} exists; export writes a new directory")
    adapter = state_dict_adapter(config.model_type, (config.architectures or [None])[0])
    keys = _exported_keys(config, tensors)
    dtype = dtype or export_dtype(config, source)
    limit = convert_file_size_to_int(max_shard_size)
    shards = _plan(keys, tensors, dtype, limit)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for index, shard in enumerate(shards):
            name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            hf = adapter.to_hf({k: _cast(t, dtype) for k, t in read(shard).items()})
            save_file({k: t.contiguous() for k, t in hf.items()}, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(hf, name))
            total += sum(t.numel() * t.element_size() for t in hf.values())
            del hf
        index_data = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILENAME).write_text(json.dumps(index_data, indent=2) + "\n")
        _write_configs(config, tmp, source, dtype)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _exported_keys(config: PreTrainedConfig, tensors: Mapping[str, Any]) -> list[str]:
    """The model's state-dict keys in its order, without tied copies (saved once, as ``save_pretrained`` does)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = list(model.state_dict())
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [k for k in expected if k not in tensors and k not in tied]
    if missing:
        raise CheckpointError(f"the checkpoint lacks model tensors {missing[:5]} (another model than its config?)")
    return [k for k in expected if k not in tied]


def _plan(keys: list[str], tensors: Mapping[str, Any], dtype: torch.dtype, limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for key in keys:
        t = tensors[key]
        size = t.numel() * (dtype.itemsize if t.dtype.is_floating_point else t.dtype.itemsize)
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def export_dtype(config: PreTrainedConfig, source: Path | None) -> torch.dtype:
    """The dtype an export writes when none is asked for: the source checkpoint's.

    That is the dtype ``config.json`` of the pretrained directory ``source`` names (``dtype``, or ``torch_dtype`` of
    older files), bf16 for a block-FP8 source (its ``quantization_config``: the weights were dequantized on load);
    without a source (a model built from a config), ``config``'s dtype, else float32.

    Example::

        export_dtype(module.model.config, Path("DeepSeek-V3"))  # torch.bfloat16
    """
    if source is not None and (source / "config.json").is_file():
        declared = json.loads((source / "config.json").read_text())
        if declared.get("quantization_config") is not None:
            return torch.bfloat16
        named = _dtype(declared.get("dtype") or declared.get("torch_dtype"))
        if named is not None:
            return named
    return _dtype(getattr(config, "dtype", None)) or torch.float32


def _dtype(value: Any) -> torch.dtype | None:
    value = getattr(torch, value, None) if isinstance(value, str) else value
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _write_configs(config: PreTrainedConfig, out: Path, source: Path | None, dtype: torch.dtype) -> None:
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config is not changed
    config.dtype = dtype
    # What is written is the model in memory: dequantized, and without the layers transformers does not build
    # (DeepSeek's multi-token prediction, skipped on load).
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    if getattr(config, "num_nextn_predict_layers", 0):
        config.num_nextn_predict_layers = 0
    config.save_pretrained(out)
    generation = source / "generation_config.json" if source is not None else None
    if generation is not None and generation.is_file():
        shutil.copyfile(generation, out / generation.name)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    for name in TOKENIZER_FILES if source is not None else ():
        file = source / name  # type: ignore[operator]
        if file.is_file():
            shutil.copyfile(file, out / name)
