"""The space a search runs through: the example CLI's dotted keys written into a config (:func:`apply_settings`), read
from it (:func:`get_setting`), read from YAML (:func:`load_space`) or derived from the config and the world
(:func:`default_space`), and the optimizer batch every candidate keeps (:func:`accumulation`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPTConfig
from lightning_llmfast.parallel.pipeline import PipelineConfig

__all__ = [
    "ACCUMULATE",
    "CONTEXT_PARALLEL",
    "MICRO_BATCH",
    "PIPELINE_MICROBATCHES",
    "PIPELINE_PARALLEL",
    "PIPELINE_SCHEDULE",
    "REFERENCE_MODULE",
    "STRATEGY_CLASS",
    "accumulation",
    "apply_settings",
    "canonical_settings",
    "config_global_batch",
    "default_space",
    "get_setting",
    "invalid",
    "load_space",
    "on_cuda",
    "pipeline_invalid",
    "pipeline_layout",
    "world_size",
]

ACCUMULATE = "trainer.accumulate_grad_batches"
MICRO_BATCH = "data.batch_size"
CONTEXT_PARALLEL = "trainer.strategy.init_args.context_parallel_size"
PIPELINE_PARALLEL = "trainer.strategy.init_args.pipeline_parallel_size"
PIPELINE_MICROBATCHES = "trainer.strategy.init_args.pipeline_microbatches"
PIPELINE_SCHEDULE = "trainer.strategy.init_args.pipeline_schedule"
STRATEGY_CLASS = "lightning_llmfast.LLMFastStrategy"
REFERENCE_MODULE = "lightning_llmfast.MoEGPTLightningModule"
"""The reference MoE GPT's LightningModule: the model whose memory is predicted and which pipelining splits."""
STRATEGY = "trainer.strategy.init_args."


def _section(node: dict[str, Any], part: str, key: str) -> dict[str, Any]:
    """``node[part]`` as a section to write into: a class-path section's arguments go under ``init_args``; the
    strategy's name ``"llmfast"`` becomes its class path."""
    if "class_path" in node and part not in ("class_path", "init_args", "dict_kwargs"):
        node = node.setdefault("init_args", {})
    child = node.get(part)
    if child is None:
        child = node[part] = {}
    elif isinstance(child, str) and part == "strategy" and child == "llmfast":
        child = node[part] = {"class_path": STRATEGY_CLASS, "init_args": {}}
    elif not isinstance(child, dict):
        raise ConfigError(f"setting {key}: {part} is {child!r} in the config, not a section")
    return child


def apply_settings(config: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the example-CLI ``config`` with each dotted key of ``settings`` set (sections created as needed).

    Raises:
        ConfigError: a key runs through a value that is not a section (``trainer.strategy.x`` with ``strategy: ddp``).

    Example::

        apply_settings(yaml.safe_load(open("tiny.yaml")), {"data.batch_size": 4, "trainer.accumulate_grad_batches": 2})
    """
    out = copy.deepcopy(dict(config))
    for key, value in settings.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = _section(node, part, key)
        if "class_path" in node and leaf not in ("class_path", "init_args", "dict_kwargs"):
            node = node.setdefault("init_args", {})
        node[leaf] = copy.deepcopy(value)
    return out


def get_setting(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value of a dotted key in an example-CLI config (through ``init_args`` where a section has a class path);
    ``default`` where the config does not set it.

    Example::

        get_setting({"data": {"batch_size": 4}}, "data.batch_size", 8)  # 4
    """
    node: Any = config
    for part in key.split("."):
        if isinstance(node, str) and part == "init_args":
            return default  # "strategy: llmfast": its arguments are the defaults
        if not isinstance(node, Mapping):
            return default
        if part not in node and "init_args" in node:
            node = node["init_args"]
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def load_space(space: Mapping[str, Sequence[Any]] | str | Path) -> dict[str, list[Any]]:
    """The space as a dict of non-empty lists (read from YAML if a path).

    Raises:
        ConfigError: not a mapping of dotted keys to non-empty lists.
    """
    if isinstance(space, (str, Path)):
        try:
            space = yaml.safe_load(Path(space).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"space: cannot read {str(space)!r}: {err}") from None
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(f"space must map dotted keys to lists of values, got {space!r}")
    out = {}
    for key, values in space.items():
        if not isinstance(key, str) or key.split(".")[0] not in ("trainer", "model", "data"):
            raise ConfigError(f"space: {key!r} is not a dotted key of the example CLI (trainer.*, model.*, data.*)")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"space: {key} must list at least one value, got {values!r}")
        out[key] = values
    return out


def world_size(config: Mapping[str, Any]) -> int:
    """The ranks a config trains on: its devices (CUDA's count for ``"auto"`` on a GPU host, else 1) x nodes."""
    devices = get_setting(config, "trainer.devices", "auto")
    nodes = get_setting(config, "trainer.num_nodes", 1)
    if isinstance(devices, list):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif get_setting(config, "trainer.accelerator", "auto") != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
    else:
        count = 1
    return count * int(nodes)


def on_cuda(config: Mapping[str, Any]) -> bool:
    """Whether a config trains on CUDA here."""
    return get_setting(config, "trainer.accelerator", "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def default_space(config: Mapping[str, Any], world: int | None = None, cuda: bool | None = None) -> dict[str, list]:
    """The space searched without ``--space``: from the config and the world.

    Micro-batches from a quarter to twice the config's (powers of two); with several ranks the sharding (DDP, FSDP2,
    and HSDP across nodes), the expert-parallel sizes that divide the world and the experts, with the dispatch
    payload where experts are parallel, and the context-parallel sizes that divide the world and every micro-batch's
    tokens (ranks sharing each batch's positions), and for the reference model the pipeline sizes that divide the
    world and do not outnumber its layers, with 2, 4 or 8 microbatches (those dividing a micro-batch) and the
    ``"1f1b"``, ``"interleaved_1f1b"`` and ``"zbv"`` schedules; on CUDA the router kernels (Triton, PyTorch), the
    offload/recompute plans (none, offload all but the last layer, selective recomputation) and compiling the layers.
    Knobs that do nothing on CPU (offload needs a device, compile takes minutes on a CPU) or with one rank stay out.

    Example::

        default_space(yaml.safe_load(open("tiny.yaml")))  # {"data.batch_size": [2, 4, 8, 16]}
    """
    world = world_size(config) if world is None else world
    cuda = on_cuda(config) if cuda is None else cuda
    micro = int(get_setting(config, MICRO_BATCH, 8))
    space: dict[str, list[Any]] = {MICRO_BATCH: sorted({max(1, micro // 4), max(1, micro // 2), micro, micro * 2})}
    if world > 1:
        nodes = int(get_setting(config, "trainer.num_nodes", 1))
        space["trainer.strategy.init_args.sharding"] = ["ddp", "fsdp", *(["hsdp"] if nodes > 1 else [])]
        experts = int(get_setting(config, "model.config.num_experts", 8))
        sizes = [n for n in range(1, world + 1) if world % n == 0 and experts % n == 0]
        if len(sizes) > 1:
            space["trainer.strategy.init_args.expert_parallel_size"] = sizes
            space["trainer.strategy.init_args.dispatch_dtype"] = [None, "bf16"]
        tokens = min(space[MICRO_BATCH]) * int(get_setting(config, "data.seq_len", 256))
        splits = [n for n in range(1, world + 1) if world % n == 0 and tokens % n == 0]
        if len(splits) > 1:
            space[CONTEXT_PARALLEL] = splits
        layers = int(get_setting(config, "model.config.n_layers", MoEGPTConfig.n_layers))
        stages = [n for n in range(1, min(world, layers) + 1) if world % n == 0]
        counts = [m for m in (2, 4, 8) if any(b % m == 0 for b in space[MICRO_BATCH])]
        if len(stages) > 1 and counts and get_setting(config, "model.class_path", REFERENCE_MODULE) == REFERENCE_MODULE:
            space[PIPELINE_PARALLEL] = stages
            space[PIPELINE_MICROBATCHES] = counts
            space[PIPELINE_SCHEDULE] = ["1f1b", "interleaved_1f1b", "zbv"]
    if cuda:
        space["model.config.router_backend"] = ["triton", "torch"]
        space["trainer.strategy.init_args.offload"] = [False, True, {"offload_layers": 0, "recompute": "selective"}]
        space["model.compile"] = [False, True]
    return space


def _setting(settings: Mapping[str, Any], config: Mapping[str, Any], key: str, default: Any) -> Any:
    """A candidate's value of ``key``: its own setting, else the config's, else ``default`` (also for ``None``)."""
    value = settings.get(key, get_setting(config, key, default))
    return default if value is None else value


def _sharing(settings: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[int, int]:
    """``(cp, pp)``: the ranks of a context-parallel group and of a pipeline, who all read one stream of batches."""
    return int(_setting(settings, config, CONTEXT_PARALLEL, 1)), int(_setting(settings, config, PIPELINE_PARALLEL, 1))


def config_global_batch(config: Mapping[str, Any], world: int) -> int:
    """The config's own sequences per optimizer step: micro-batch x accumulation x streams of batches (the world
    over its context-parallel and pipeline sizes)."""
    cp, pp = _sharing({}, config)
    return int(get_setting(config, MICRO_BATCH, 8)) * int(get_setting(config, ACCUMULATE, 1)) * (world // (cp * pp))


def accumulation(settings: Mapping[str, Any], config: Mapping[str, Any], global_batch: int, world: int) -> str:
    """Sets ``settings[ACCUMULATE]`` so the candidate takes ``global_batch`` sequences a step (the ranks of a
    context-parallel group, and the stages of a pipeline, share their micro-batches); returns why it cannot (``""``
    when it can)."""
    micro = settings.get(MICRO_BATCH, get_setting(config, MICRO_BATCH, 8))
    cp, pp = _sharing(settings, config)
    per_step = int(micro) * max(1, world // (cp * pp))
    if global_batch % per_step:
        settings[ACCUMULATE] = None
        streams = f"{world} ranks" if cp == 1 else f"{world // cp} groups of {cp} context-parallel ranks"
        if pp > 1:
            streams = f"{max(1, world // (cp * pp))} pipelines of {pp} stages" + (f" x cp {cp}" if cp > 1 else "")
        return f"global batch {global_batch} is not a multiple of micro-batch {micro} x {streams}"
    settings[ACCUMULATE] = global_batch // per_step
    return ""


def invalid(settings: Mapping[str, Any]) -> str:
    """Why the strategy would refuse a combination of settings (``""`` if it would not)."""
    ep = settings.get("trainer.strategy.init_args.expert_parallel_size", 1)
    if settings.get("trainer.strategy.init_args.dispatch_dtype") is not None and ep == 1:
        return "dispatch_dtype needs expert_parallel_size > 1"
    return ""


def pipeline_layout(config: Mapping[str, Any]) -> PipelineConfig | None:
    """The pipeline layout of a candidate's (merged) config; ``None`` without pipelining.

    Raises:
        ConfigError: a layout the strategy refuses at construction (an unknown schedule, a stage count it cannot
            take, too few microbatches for ``"1f1b"``, ...).
    """
    pp = int(_setting({}, config, PIPELINE_PARALLEL, 1))
    if pp == 1:
        return None
    return PipelineConfig(
        pp,
        int(_setting({}, config, PIPELINE_MICROBATCHES, 1)),
        str(_setting({}, config, PIPELINE_SCHEDULE, "1f1b")),
        get_setting(config, STRATEGY + "pipeline_stages_per_rank"),
        get_setting(config, STRATEGY + "pipeline_layers"),
    )


def pipeline_invalid(config: Mapping[str, Any], world: int) -> str:
    """Why the strategy would refuse a candidate's (merged) config's pipelining (``""`` if it would not): a layout
    it refuses, a size that does not divide the world, more stages than layers, microbatches that do not divide the
    micro-batch, a model other than the reference MoEGPT, or what pipelining does not compose with (as
    ``LLMFastStrategy`` refuses: offload under a zero-bubble schedule)."""
    try:
        layout = pipeline_layout(config)
        if layout is None:
            return ""
        layout.check_world(world)
        layout.check_layers(int(get_setting(config, "model.config.n_layers", MoEGPTConfig.n_layers)))
        layout.check_batch(int(get_setting(config, MICRO_BATCH, 8)))
    except ConfigError as err:
        return str(err)
    if get_setting(config, "model.class_path", REFERENCE_MODULE) != REFERENCE_MODULE:
        return f"pipeline_parallel_size={layout.size} splits {REFERENCE_MODULE} only"
    if get_setting(config, STRATEGY + "offload") and layout.schedule in ("interleaved_zero_bubble", "zbv"):
        return f"pipeline schedule {layout.schedule!r} does not compose with activation offload"
    return ""


def canonical_settings(settings: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without what does nothing in them: the pipeline's microbatches and schedule without pipelining
    (candidates equal after this are one candidate)."""
    if int(_setting(settings, config, PIPELINE_PARALLEL, 1)) > 1:
        return dict(settings)
    return {k: v for k, v in settings.items() if k not in (PIPELINE_MICROBATCHES, PIPELINE_SCHEDULE)}
