"""``python -m lightning_llmfast.tune``: search the training settings by short trials and write the fastest config.

The search takes an example-CLI config (``examples/train_moe.py fit --config CFG.yaml``) and a space: the CLI's
dotted keys (``data.batch_size``, ``model.config.router_backend``, ``trainer.strategy.init_args.offload`` ...) mapped
to lists of values (``--space SPACE.yaml``, or :func:`default_space` from the config and the world). Every candidate
keeps the optimizer's batch (``--global-batch`` sequences per optimizer step: ``trainer.accumulate_grad_batches`` is
set per candidate, and one that cannot reach it is pruned), gets a predicted peak memory per device
(:func:`predict_memory`: the sharding plan's parameter, gradient and AdamW bytes plus the saved activations the memory
plan predicts from a measured probe) and, with ``--memory-budget``, is pruned when predicted over it. The others run
the example CLI, each in a process of its own forked from a server that imported torch and Lightning once (a crash,
an OOM or a hang ends one trial; each has a timeout), and log ``train/tokens_per_sec`` and the peak memory through
the package's monitors and a CSV logger; warm-up steps are left out and the trial's rate is the median of the rest.
Successive halving runs every candidate ``--steps`` steps, then the best ``1/eta`` of them ``eta`` times longer, while
more than one goes on, within ``--time-budget`` seconds (a trial running at the deadline is stopped and not recorded).

Written to ``DIR``: ``trials.jsonl`` (one JSON object a trial: :data:`RECORD_FIELDS`; appended and fsynced line by
line, so rerunning the same command after a kill continues the search without repeating a finished trial),
``best.yaml`` (the config with the fastest trial's settings, trainable as it is), ``report.md`` (every trial, best
first, with the error of the memory prediction) and ``report.png`` (tokens/s against peak memory, the pruned apart;
needs the ``plot`` extra, matplotlib). Errors print one line, ``error: ...``, and exit with status 2.

Example::

    python -m lightning_llmfast.tune --config examples/configs/tiny.yaml --out tuned/ --global-batch 16 \\
        --time-budget 600 --steps 4

    result = tune(TuneConfig("examples/configs/tiny.yaml", "tuned/", space={"data.batch_size": [4, 8, 16]}))
    result.best.settings  # {"data.batch_size": 16, "trainer.accumulate_grad_batches": 1}
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import hashlib
import importlib
import itertools
import json
import math
import multiprocessing
import os
import runpy
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import ConfigError, LLMFastError

__all__ = [
    "PRELOAD",
    "RECORD_FIELDS",
    "STATUSES",
    "SubprocessRunner",
    "Trial",
    "TrialLog",
    "TrialRecord",
    "TuneConfig",
    "TuneResult",
    "apply_settings",
    "default_space",
    "main",
    "predict_memory",
    "tune",
    "write_plot",
    "write_report",
]

STATUSES: tuple[str, ...] = ("ok", "failed", "pruned", "timeout")
"""A trial's outcome: measured, crashed (non-zero exit or no rate logged), pruned without running, timed out."""

RECORD_FIELDS: tuple[str, ...] = ("settings", "status", "tokens_per_sec", "predicted_memory", "peak_memory", "reason")
"""The keys of every line of ``trials.jsonl``."""

ACCUMULATE = "trainer.accumulate_grad_batches"
MICRO_BATCH = "data.batch_size"
STRATEGY_CLASS = "lightning_llmfast.LLMFastStrategy"
REFERENCE_MODULE = "lightning_llmfast.MoEGPTLightningModule"
_MONITORS = ("TokenThroughputMonitor", "SystemMetricsMonitor")
_GIB = float(1 << 30)


@dataclass(frozen=True)
class TuneConfig:
    """What :func:`tune` searches, checked at construction.

    Args:
        config: the example-CLI config (a YAML file).
        out: the results directory (created; a rerun with the same arguments continues its search).
        space: dotted key -> list of values, or a YAML file of that mapping; ``None``: :func:`default_space`.
        global_batch: sequences per optimizer step in every trial; ``None``: the config's (micro-batch x
            accumulation x world).
        time_budget: seconds the search may take (this run); ``None``: no limit.
        memory_budget: bytes per device; candidates predicted over it are pruned. ``None``: none pruned.
        steps: measured optimizer steps of the first (shortest) trials; each halving multiplies them by ``eta``.
        warmup_steps: optimizer steps before the measured ones, left out of the rate (at least 1: the first step
            has no rate of its own, it carries one-time costs).
        eta: the halving factor: the best ``ceil(n / eta)`` of a rung go on, ``eta`` times longer.
        trial_timeout: seconds one trial may run (start-up included).
        script: the example CLI; ``None``: ``examples/train_moe.py`` beside the package.

    Raises:
        ConfigError: naming the field, the rule and the value.

    Example::

        TuneConfig("examples/configs/tiny.yaml", "tuned/", global_batch=16, time_budget=600, steps=4)
    """

    config: str | Path
    out: str | Path
    space: Mapping[str, Sequence[Any]] | str | Path | None = None
    global_batch: int | None = None
    time_budget: float | None = None
    memory_budget: int | None = None
    steps: int = 4
    warmup_steps: int = 2
    eta: int = 3
    trial_timeout: float = 600.0
    script: str | Path | None = None

    def __post_init__(self) -> None:
        if self.global_batch is not None:
            check_int("TuneConfig.global_batch", self.global_batch, low=1)
        if self.time_budget is not None:
            check_number("TuneConfig.time_budget", self.time_budget, low=0, low_open=True)
        if self.memory_budget is not None:
            check_int("TuneConfig.memory_budget", self.memory_budget, low=1)
        check_int("TuneConfig.steps", self.steps, low=1)
        check_int("TuneConfig.warmup_steps", self.warmup_steps, low=1)
        check_int("TuneConfig.eta", self.eta, low=2)
        check_number("TuneConfig.trial_timeout", self.trial_timeout, low=0, low_open=True)
        if not Path(self.config).is_file():
            raise ConfigError(f"TuneConfig.config: no such file {str(self.config)!r}")
        if not Path(self.script_path).is_file():
            raise ConfigError(f"TuneConfig.script: no such file {str(self.script_path)!r}")

    @property
    def script_path(self) -> Path:
        """The example CLI the trials run."""
        return Path(self.script) if self.script is not None else Path(__file__).parents[1] / "examples/train_moe.py"


@dataclass(frozen=True)
class TrialRecord:
    """One line of ``trials.jsonl`` (:data:`RECORD_FIELDS`); memory in bytes per device, ``None`` where unknown."""

    settings: dict[str, Any]
    status: str
    tokens_per_sec: float | None = None
    predicted_memory: int | None = None
    peak_memory: int | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"TrialRecord.status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Trial:
    """What a trial runner runs: ``config`` (the candidate's example-CLI config, a dict) for ``warmup_steps +
    steps`` optimizer steps within ``timeout`` seconds, writing its files under ``directory``."""

    settings: dict[str, Any]
    config: dict[str, Any]
    steps: int
    warmup_steps: int
    timeout: float
    directory: Path


@dataclass(frozen=True)
class Measurement:
    """What a trial runner reports: a status of :data:`STATUSES` but ``pruned``, the median rate, the peak memory."""

    status: str
    tokens_per_sec: float | None = None
    peak_memory: int | None = None
    reason: str = ""


TrialRunner = Callable[[Trial], Measurement]
"""Runs one trial (:class:`SubprocessRunner`, or a stand-in in tests)."""


@dataclass
class TuneResult:
    """The search's outcome: every record in log order, the best ``ok`` one of the longest rung, its rung's steps,
    whether the time budget stopped the search, and the files written."""

    records: list[TrialRecord]
    best: TrialRecord | None
    best_steps: int
    stopped_by_budget: bool
    out: Path
    files: list[Path] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- settings and spaces


def _key(settings: Mapping[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True, default=str)


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


def _get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
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


def _world(config: Mapping[str, Any]) -> int:
    devices = _get(config, "trainer.devices", "auto")
    nodes = _get(config, "trainer.num_nodes", 1)
    if isinstance(devices, list):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif _get(config, "trainer.accelerator", "auto") != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
    else:
        count = 1
    return count * int(nodes)


def _on_cuda(config: Mapping[str, Any]) -> bool:
    return _get(config, "trainer.accelerator", "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def default_space(config: Mapping[str, Any], world: int | None = None, cuda: bool | None = None) -> dict[str, list]:
    """The space searched without ``--space``: from the config and the world.

    Micro-batches from a quarter to twice the config's (powers of two); with several ranks the sharding (DDP, FSDP2,
    and HSDP across nodes) and the expert-parallel sizes that divide the world and the experts, with the dispatch
    payload where experts are parallel; on CUDA the router kernels (Triton, PyTorch), the offload/recompute plans
    (none, offload all but the last layer, selective recomputation) and compiling the layers. Knobs that do nothing
    on CPU (offload needs a device, compile takes minutes on a CPU) or with one rank stay out.

    Example::

        default_space(yaml.safe_load(open("tiny.yaml")))  # {"data.batch_size": [2, 4, 8, 16]}
    """
    world = _world(config) if world is None else world
    cuda = _on_cuda(config) if cuda is None else cuda
    micro = int(_get(config, MICRO_BATCH, 8))
    space: dict[str, list[Any]] = {MICRO_BATCH: sorted({max(1, micro // 4), max(1, micro // 2), micro, micro * 2})}
    if world > 1:
        nodes = int(_get(config, "trainer.num_nodes", 1))
        space["trainer.strategy.init_args.sharding"] = ["ddp", "fsdp", *(["hsdp"] if nodes > 1 else [])]
        experts = int(_get(config, "model.config.num_experts", 8))
        sizes = [n for n in range(1, world + 1) if world % n == 0 and experts % n == 0]
        if len(sizes) > 1:
            space["trainer.strategy.init_args.expert_parallel_size"] = sizes
            space["trainer.strategy.init_args.dispatch_dtype"] = [None, "bf16"]
    if cuda:
        space["model.config.router_backend"] = ["triton", "torch"]
        space["trainer.strategy.init_args.offload"] = [False, True, {"offload_layers": 0, "recompute": "selective"}]
        space["model.compile"] = [False, True]
    return space


def _global_batch(config: Mapping[str, Any], world: int) -> int:
    return int(_get(config, MICRO_BATCH, 8)) * int(_get(config, ACCUMULATE, 1)) * world


def _accumulation(settings: Mapping[str, Any], config: Mapping[str, Any], global_batch: int, world: int) -> str:
    """Sets ``settings[ACCUMULATE]`` so the candidate takes ``global_batch`` sequences a step; returns why it cannot
    (``""`` when it can)."""
    micro = settings.get(MICRO_BATCH, _get(config, MICRO_BATCH, 8))
    per_step = int(micro) * world
    if global_batch % per_step:
        settings[ACCUMULATE] = None
        return f"global batch {global_batch} is not a multiple of micro-batch {micro} x {world} ranks"
    settings[ACCUMULATE] = global_batch // per_step
    return ""


def _invalid(settings: Mapping[str, Any]) -> str:
    """Why the strategy would refuse a combination of settings (``""`` if it would not)."""
    ep = settings.get("trainer.strategy.init_args.expert_parallel_size", 1)
    if settings.get("trainer.strategy.init_args.dispatch_dtype") is not None and ep == 1:
        return "dispatch_dtype needs expert_parallel_size > 1"
    return ""


# --------------------------------------------------------------------------------------------- memory prediction


@dataclass(frozen=True)
class _Probe:
    """Saved activations of one sequence: per layer the storages it saves and what recomputing it frees, and the
    bytes saved outside the layers (embedding, final norm, logits, loss)."""

    storages: tuple[tuple[int, ...], ...]
    recompute: tuple[int, ...]
    outside: int


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _data_module(config: Mapping[str, Any]) -> Any:
    """The config's data module, built (data modules only store their settings when built)."""
    data = dict(_get(config, "data", {}) or {})
    cls = _import(data.pop("class_path", "lightning_llmfast.PackedDataModule"))
    return cls(**(data.get("init_args", data) or {}))


def _model_config(config: Mapping[str, Any]) -> Any:
    """The reference model's ``MoEGPTConfig`` of an example-CLI config, its vocabulary taken from the data."""
    from lightning_llmfast.models import MoEGPTConfig

    fields = dict(_get(config, "model.config", {}) or {})
    fields.pop("vocab_size", None)
    return MoEGPTConfig(**fields, vocab_size=_data_module(config).vocab_size)


def _probe_model(model_config: Any) -> tuple[nn.Module, list[int]]:
    """One layer of each kind of the model (a dense layer if it has any, an MoE layer if it has any), and for every
    layer of the full model the index of its probed kind."""
    from lightning_llmfast.models import MoEGPT

    n = model_config.n_layers
    dense = set(model_config.dense_layers)
    kinds = sorted({i in dense for i in range(n)}, reverse=True)  # dense first
    probe_config = dataclasses.replace(model_config, n_layers=len(kinds), dense_layers=[0] if kinds[0] else [])
    return MoEGPT(probe_config), [kinds.index(i in dense) for i in range(n)]


class _SavedBytes:
    """Counts each storage autograd saves once, attributed to the layer running (``-1``: outside the layers)."""

    def __init__(self, layers: int) -> None:
        self.layer = -1
        self.storages: list[list[int]] = [[] for _ in range(layers)]
        self.outside = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen and t.device.type != "meta":
            self._seen.add(storage.data_ptr())
            if self.layer >= 0:
                self.storages[self.layer].append(storage.nbytes())
            else:
                self.outside += storage.nbytes()
        return t


def _measure_probe(config: Mapping[str, Any]) -> tuple[_Probe, list[int]]:
    """Run the probe model's forward and backward on one CPU sequence; count its saved activations per layer."""
    from lightning_llmfast.offload.must_save import MustSaveCounter

    model_config = _model_config(config)
    if model_config.router_backend in ("auto", "triton"):  # on CPU: the kernels' PyTorch reference saves the same
        model_config = dataclasses.replace(model_config, router_backend="torch")
    torch.manual_seed(0)
    model, kinds = _probe_model(model_config)
    seq_len = int(_get(config, "data.seq_len", 256))
    counter = _SavedBytes(len(model.layers))
    keeps = [0] * len(model.layers)
    modes: dict[int, Any] = {}

    def enter(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            counter.layer = index
            modes[index] = MustSaveCounter().__enter__()
            modes[index].note_inputs([a for a in args if isinstance(a, torch.Tensor)])

        return hook

    def leave(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            modes[index].__exit__(None, None, None)
            keeps[index] = modes[index].kept_bytes
            counter.layer = -1

        return hook

    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(enter(index))
        layer.register_forward_hook(leave(index))
    ids = torch.randint(0, model_config.vocab_size, (1, seq_len))
    bf16 = "bf16" in str(_get(config, "trainer.precision", "32"))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    saved = [sum(s) for s in counter.storages]
    recompute = tuple(max(0, min(s, s - k)) for s, k in zip(saved, keeps))
    return _Probe(tuple(tuple(s) for s in counter.storages), recompute, counter.outside), kinds


def _model_states(config: Mapping[str, Any], world: int) -> int:
    """Parameter, gradient and AdamW bytes of the most loaded rank, from the sharding plan's per-rank shares."""
    from lightning_llmfast.models import MoEGPT
    from lightning_llmfast.plan import formula_plan, param_shapes

    with torch.device("meta"):
        module = nn.ModuleDict({"model": MoEGPT(_model_config(config))})
    shapes = param_shapes(module, list(module["model"].layers))
    ep = int(_get(config, "trainer.strategy.init_args.expert_parallel_size", 1))
    sharding = _get(config, "trainer.strategy.init_args.sharding", "ddp")
    if sharding == "ddp":
        held = sum(math.prod(p.shape) * p.element_size // (ep if p.expert else 1) for p in shapes)
        return 4 * held  # the parameters, their gradients, two AdamW moments
    group = world // int(_get(config, "trainer.num_nodes", 1)) if sharding == "hsdp" else world
    plan = formula_plan("tune", shapes, group, ep, compute_bytes=4, a2a_bytes=0)
    return max(r.dense_params + r.expert_params + r.grads + r.optimizer for r in plan.ranks)


def _activations(config: Mapping[str, Any], probe: _Probe, kinds: Sequence[int]) -> int:
    """Peak saved activations of one micro-batch under the candidate's offload setting (the memory plan's model)."""
    from lightning_llmfast.offload import OffloadConfig
    from lightning_llmfast.offload.memory_plan import predict_peak
    from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile

    micro = int(_get(config, MICRO_BATCH, 8))
    layers = tuple(
        LayerProfile(micro * sum(probe.storages[k]), micro * probe.recompute[k], 1.0, 1.0, 1.0,
                     tuple(micro * s for s in probe.storages[k]))
        for k in kinds
    )  # fmt: skip
    offload = _get(config, "trainer.strategy.init_args.offload")
    settings = OffloadConfig(**offload) if isinstance(offload, dict) else OffloadConfig() if offload else None
    choices, freed = ["keep"] * len(layers), [0] * len(layers)
    runs = settings is not None and (_on_cuda(config) or settings.force)
    if runs and settings.plan is None and settings.offload_layers != "auto":
        eligible = max(0, len(layers) - settings.keep_last_layers)
        count = eligible if settings.offload_layers is None else min(settings.offload_layers, eligible)
        for i, layer in enumerate(layers):
            if i < count:  # the storages under min_offload_bytes stay
                choices[i] = "offload"
                freed[i] = sum(b for b in layer.storages if b >= settings.min_offload_bytes)
            elif settings.recompute == "selective":
                choices[i], freed[i] = "recompute", layer.recompute_bytes
    prefetch = settings.prefetch_layers if settings is not None else 1
    profile = MemoryProfile(layers, bandwidth_bytes_per_ms=1.0)
    return micro * probe.outside + predict_peak(profile, choices, freed, prefetch)


def predict_memory(
    config: Mapping[str, Any], world: int, probes: dict[str, tuple[_Probe, list[int]]] | None = None
) -> int | None:
    """Predicted peak bytes per device of a candidate's config: the most loaded rank's parameters, gradients and
    AdamW moments (the sharding plan, :func:`~lightning_llmfast.plan.formula_plan`) plus its micro-batch's saved
    activations at their peak (:func:`~lightning_llmfast.offload.memory_plan.predict_peak` on a profile measured
    once per model config: one sequence through one layer of each kind on CPU, scaled by the micro-batch; auto
    offload plans are predicted at their upper bound, keeping everything). ``None`` for a model other than the
    reference MoE GPT, or a config the prediction cannot build (the trial then tells).

    Example::

        predict_memory(apply_settings(config, {"data.batch_size": 4}), world=1)
    """
    if _get(config, "model.class_path", REFERENCE_MODULE) != REFERENCE_MODULE:
        return None
    probes = {} if probes is None else probes
    try:
        model_key = _key({"model": _get(config, "model.config", {}), "data": _get(config, "data", {}),
                          "precision": _get(config, "trainer.precision")})  # fmt: skip
        if model_key not in probes:
            probes[model_key] = _measure_probe(config)
        return _model_states(config, world) + _activations(config, *probes[model_key])
    except (LLMFastError, TypeError, ValueError, RuntimeError):  # a config the model refuses: the trial will say why
        return None


# --------------------------------------------------------------------------------------------- trials


class TrialLog:
    """``trials.jsonl``: one :class:`TrialRecord` a line, appended, flushed and fsynced one by one.

    A line cut short by a kill (the last one, without its newline or unparsable) is dropped from the file when it
    is read; a damaged line before it is an error.

    Example::

        log = TrialLog(Path("tuned/trials.jsonl"))
        log.append(TrialRecord({"data.batch_size": 4}, "ok", 1234.0, 1 << 30, 1 << 30))
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[TrialRecord]:
        """Every complete record, in the order written.

        Raises:
            ConfigError: a line other than the last is not a trial record.
        """
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        complete = lines[:-1]  # the part after the last newline is cut short (or empty)
        records = []
        for number, line in enumerate(complete, 1):
            try:
                records.append(TrialRecord(**json.loads(line)))
            except (ValueError, TypeError) as err:
                if number < len(complete):
                    raise ConfigError(f"{self.path}: line {number} is not a trial record ({err})") from None
                complete = complete[:-1]  # the last line, written in part
        good = sum(len(line) + 1 for line in complete)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return records

    def append(self, record: TrialRecord) -> None:
        """Write ``record`` as one line and fsync it."""
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(record), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _callbacks(trainer: dict[str, Any]) -> list[Any]:
    """The config's callbacks less the monitors a trial configures itself, plus those monitors logging each step."""
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    kept = [c for c in callbacks if not (isinstance(c, dict) and str(c.get("class_path", "")).endswith(_MONITORS))]
    return kept + [
        {"class_path": f"lightning_llmfast.{name}", "init_args": {"log_every_n_steps": 1}} for name in _MONITORS
    ]


def trial_config(trial: Trial) -> dict[str, Any]:
    """The config a trial runs: the candidate's, for ``warmup_steps + steps`` optimizer steps, every step logged to
    a CSV file under the trial's directory, no validation, checkpoints, progress bar or model summary."""
    config = copy.deepcopy(trial.config)
    trainer = config.setdefault("trainer", {})
    for key in ("val_check_interval", "check_val_every_n_epoch", "max_epochs", "max_time"):
        trainer.pop(key, None)
    trainer.update(
        max_steps=trial.warmup_steps + trial.steps, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(trial.directory), "name": "csv", "version": 0}},
    )  # fmt: skip
    trainer["callbacks"] = _callbacks(trainer)
    return config


def read_metrics(path: Path, steps: int) -> Measurement:
    """The median of the last ``steps`` logged ``train/tokens_per_sec`` and the peak memory (CUDA's
    ``train/peak_memory``, else the peak RSS) of a trial's ``metrics.csv``."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["train/tokens_per_sec"]) for r in rows if r.get("train/tokens_per_sec")]
    device = [float(r["train/peak_memory"]) for r in rows if r.get("train/peak_memory")]
    host = [float(r["train/host_peak_rss"]) for r in rows if r.get("train/host_peak_rss")]
    peak = round(max(device or host) * _GIB) if device or host else None
    if len(rates) < steps:
        return Measurement("failed", None, peak, f"logged {len(rates)} rates, {steps} wanted")
    return Measurement("ok", statistics.median(rates[-steps:]), peak)


PRELOAD: tuple[str, ...] = (
    "torch", "torch._dynamo", "torch.optim", "lightning.pytorch", "lightning.pytorch.cli", "lightning_llmfast",
    "lightning_llmfast.cli",
)  # fmt: skip
"""What the trial server imports once: a fresh interpreter spends most of a short trial importing them (about 10 s on
the 2-core development VM, 2026-12-06; ``torch._dynamo`` is imported by the optimizer's first step)."""


def _run_trial(script: str, config: str, stdout: str, stderr: str, environ: dict[str, str]) -> None:
    """A trial process: its own session (the runner kills the group, DDP's children included), the runner's
    environment of now (the server's is that of its start), its output to the trial's files, the example CLI run as
    ``python SCRIPT fit --config CONFIG`` would run it."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, "fit", "--config", config]  # Lightning's DDP launcher re-runs sys.argv for the other ranks
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


class SubprocessRunner:
    """Runs a trial as ``python SCRIPT fit --config DIR/config.yaml`` in a process of its own, forked from a server
    that imported :data:`PRELOAD` once (multiprocessing's ``forkserver``), so a trial pays for its configuration and
    steps, not for the interpreter's start-up; kills the trial's process group at its timeout.

    Args:
        script: the example CLI.
        preload: the modules the server imports. The server starts here, once per process, and serves every
            trial after (so its start counts in the search's time budget, not in a trial's timeout).

    Example::

        runner = SubprocessRunner(Path("examples/train_moe.py"))
        measurement = runner(trial)  # Measurement("ok", tokens_per_sec=..., peak_memory=...)
    """

    def __init__(self, script: Path, preload: Sequence[str] = PRELOAD) -> None:
        self.script = Path(script).resolve()
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))
        ready = self._context.Process(target=os.getpid)  # returns once the server has imported ``preload``
        ready.start()
        ready.join()

    def __call__(self, trial: Trial) -> Measurement:
        """Run ``trial``; its stdout and stderr go to ``stdout.txt``/``stderr.txt`` in its directory."""
        shutil.rmtree(trial.directory, ignore_errors=True)
        trial.directory.mkdir(parents=True)
        path = trial.directory / "config.yaml"
        path.write_text(yaml.safe_dump(trial_config(trial), sort_keys=False))
        files = [str(trial.directory / name) for name in ("stdout.txt", "stderr.txt")]
        process = self._context.Process(target=_run_trial, args=(str(self.script), str(path), *files, dict(os.environ)))
        process.start()
        process.join(trial.timeout)
        if process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.kill()
            process.join()
            return Measurement("timeout", reason=f"no result within {trial.timeout:.0f}s")
        if process.exitcode != 0:
            lines = (trial.directory / "stderr.txt").read_text(errors="replace").strip().splitlines()
            last = lines[-1] if lines else ""
            return Measurement("failed", reason=f"exit status {process.exitcode}: {last[-300:]}")
        found = sorted(trial.directory.rglob("metrics.csv"))
        if not found:
            return Measurement("failed", reason="no metrics.csv written")
        return read_metrics(found[0], trial.steps)


# --------------------------------------------------------------------------------------------- the search


@dataclass
class _Candidate:
    settings: dict[str, Any]
    predicted: int | None
    pruned: str


def _candidates(
    tc: TuneConfig, config: dict[str, Any], space: dict[str, list[Any]], world: int
) -> tuple[list[_Candidate], int]:
    """Every point of the space with its accumulation, predicted memory and pruning reason; the global batch."""
    if tc.global_batch is not None and ACCUMULATE in space:
        raise ConfigError(f"space sets {ACCUMULATE}, which --global-batch sets per candidate; drop one of them")
    global_batch = tc.global_batch if tc.global_batch is not None else _global_batch(config, world)
    probes: dict[str, tuple[_Probe, list[int]]] = {}
    out = []
    for values in itertools.product(*space.values()):
        settings = dict(zip(space, values))
        reason = _invalid(settings)
        if ACCUMULATE not in space:
            reason = _accumulation(settings, config, global_batch, world) or reason
        predicted = None
        if not _invalid(settings):
            merged = apply_settings(config, {k: v for k, v in settings.items() if v is not None or k != ACCUMULATE})
            predicted = predict_memory(merged, world, probes)
        if not reason and tc.memory_budget is not None and predicted is not None and predicted > tc.memory_budget:
            reason = f"predicted {predicted:,} bytes > memory budget {tc.memory_budget:,}"
        out.append(_Candidate(settings, predicted, reason))
    return out, global_batch


def _identity(tc: TuneConfig, config_text: str, space: dict[str, list[Any]], global_batch: int) -> dict[str, Any]:
    return {
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "space": space,
        "global_batch": global_batch,
        "memory_budget": tc.memory_budget,
        "steps": tc.steps,
        "warmup_steps": tc.warmup_steps,
        "eta": tc.eta,
    }


def _check_identity(out: Path, identity: dict[str, Any]) -> None:
    """``DIR/search.json`` records what the search is; a rerun must be the same search to continue it."""
    path = out / "search.json"
    text = json.dumps(identity, sort_keys=True, indent=1, default=str)
    if path.exists():
        held = json.loads(path.read_text())
        differ = sorted(k for k in set(held) | set(identity) if held.get(k) != json.loads(text).get(k))
        if differ:
            raise ConfigError(f"{out} holds another search ({', '.join(differ)} differ); use a new --out")
        return
    _write_atomic(path, text)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pruned_record(candidate: _Candidate) -> TrialRecord:
    return TrialRecord(candidate.settings, "pruned", None, candidate.predicted, None, candidate.pruned)


class _Search:
    """Successive halving over the candidates, resuming from the records of an earlier run of the same search."""

    def __init__(
        self, tc: TuneConfig, config: dict[str, Any], runner: TrialRunner, log: TrialLog, start: float
    ) -> None:
        self.tc, self.config, self.runner, self.log = tc, config, runner, log
        self.records = log.read()
        self.done: dict[str, list[TrialRecord]] = {}
        for record in self.records:
            self.done.setdefault(_key(record.settings), []).append(record)
        self.rungs: list[list[tuple[TrialRecord, int]]] = []  # per rung: (record, measured steps)
        self.deadline = start + tc.time_budget if tc.time_budget is not None else math.inf
        self.stopped = False

    def _record(
        self, settings: dict[str, Any], rung: int, make: Callable[[], TrialRecord | None]
    ) -> TrialRecord | None:
        """The candidate's record of ``rung``: from the earlier run's log if there (its ``rung``-th), else made and
        appended."""
        held = self.done.setdefault(_key(settings), [])
        if len(held) > rung:
            return held[rung]
        record = make()
        if record is not None:
            held.append(record)
            self.records.append(record)
            self.log.append(record)
        return record

    def _measure(self, candidate: _Candidate, steps: int) -> TrialRecord | None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.stopped = True
            return None
        timeout = min(self.tc.trial_timeout, remaining)
        name = hashlib.sha256(_key(candidate.settings).encode()).hexdigest()[:12]
        merged = apply_settings(self.config, candidate.settings)
        trial = Trial(candidate.settings, merged, steps, self.tc.warmup_steps, timeout,
                      Path(self.tc.out) / "runs" / f"{name}-s{steps}")  # fmt: skip
        measured = self.runner(trial)
        if measured.status == "timeout" and timeout < self.tc.trial_timeout:
            self.stopped = True  # stopped by the time budget, not by its own timeout: not a finished trial
            return None
        return TrialRecord(candidate.settings, measured.status, measured.tokens_per_sec, candidate.predicted,
                           measured.peak_memory, measured.reason)  # fmt: skip

    def run(self, candidates: list[_Candidate]) -> None:
        """Prune, then rung after rung while more than one candidate goes on, within the budget."""
        alive = []
        for c in candidates:
            if c.pruned:
                self._record(c.settings, 0, lambda c=c: _pruned_record(c))
            else:
                alive.append(c)
        steps, rung = self.tc.steps, 0
        while alive and not self.stopped:
            results = []
            for c in alive:
                record = self._record(c.settings, rung, lambda c=c, steps=steps: self._measure(c, steps))
                if record is None:
                    break
                results.append((c, record))
            measured = [(c, r) for c, r in results if r.status == "ok"]
            if measured:  # a rung cut short by the budget still ranks what it measured
                self.rungs.append([(r, steps) for _, r in measured])
            keep = math.ceil(len(measured) / self.tc.eta)
            if keep <= 1 or self.stopped:
                break  # the fastest of this rung wins
            measured.sort(key=lambda cr: -float(cr[1].tokens_per_sec or 0.0))
            alive = [c for c, _ in measured[:keep]]
            steps, rung = steps * self.tc.eta, rung + 1

    def best(self) -> tuple[TrialRecord | None, int]:
        """The fastest ``ok`` trial of the longest rung that measured any, and that rung's steps."""
        if not self.rungs:
            return None, 0
        rung = self.rungs[-1]
        record, steps = max(rung, key=lambda rs: float(rs[0].tokens_per_sec or 0.0))
        return record, steps


def tune(config: TuneConfig, runner: TrialRunner | None = None) -> TuneResult:
    """Search ``config``'s space; write ``trials.jsonl``, ``best.yaml``, ``report.md`` and ``report.png`` under
    ``config.out`` (see the module's docstring).

    Args:
        config: what to search.
        runner: runs one trial; default :class:`SubprocessRunner` on ``config.script_path``.

    Raises:
        ConfigError: an unreadable config or space, a setting that does not fit the config, or an ``out`` directory
            holding another search.

    Example::

        result = tune(TuneConfig("tiny.yaml", "tuned/", space={"data.batch_size": [4, 8]}, global_batch=16))
    """
    start = time.monotonic()
    text = Path(config.config).read_text()
    try:
        base = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{config.config}: not YAML: {err}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{config.config}: not an example-CLI config (a mapping), got {type(base).__name__}")
    world = _world(base)
    space = load_space(config.space) if config.space is not None else default_space(base, world)
    candidates, global_batch = _candidates(config, base, space, world)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_identity(out, _identity(config, text, space, global_batch))
    search = _Search(
        config, base, runner or SubprocessRunner(config.script_path), TrialLog(out / "trials.jsonl"), start
    )
    search.run(candidates)
    best, steps = search.best()
    result = TuneResult(search.records, best, steps, search.stopped, out)
    if best is not None:
        _write_atomic(out / "best.yaml", yaml.safe_dump(apply_settings(base, best.settings), sort_keys=False))
        result.files.append(out / "best.yaml")
    result.files.append(write_report(out / "report.md", search.records, search.rungs, result, world))
    plot = write_plot(out / "report.png", search.records, config.memory_budget)
    if plot is not None:
        result.files.append(plot)
    return result


# --------------------------------------------------------------------------------------------- the report


def _mib(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / (1 << 20):,.1f}"


def _order(records: Sequence[TrialRecord], rungs: Sequence[Sequence[tuple[TrialRecord, int]]]) -> list[tuple]:
    """``(record, steps)`` best first: measured trials by their steps (the longest first), then rate; then timed
    out, failed, pruned."""
    steps = {id(r): s for rung in rungs for r, s in rung}
    rank = {"ok": 0, "timeout": 1, "failed": 2, "pruned": 3}
    return sorted(
        ((r, steps.get(id(r))) for r in records),
        key=lambda rs: (rank[rs[0].status], -(rs[1] or 0), -(rs[0].tokens_per_sec or 0.0)),
    )


def write_report(
    path: Path,
    records: Sequence[TrialRecord],
    rungs: Sequence[Sequence[tuple[TrialRecord, int]]],
    result: TuneResult,
    world: int,
) -> Path:
    """``report.md``: every trial, best first, with the prediction error of memory ``(predicted - peak) / peak``.

    Example::

        write_report(Path("tuned/report.md"), result.records, rungs, result, world=1)
    """
    lines = ["# tune report", ""]
    if result.best is not None:
        lines += [f"Best: {result.best.tokens_per_sec:,.0f} tokens/s over {result.best_steps} measured steps with "
                  f"`{json.dumps(result.best.settings)}` (`best.yaml`).", ""]  # fmt: skip
    else:
        lines += ["No trial measured a rate.", ""]
    if result.stopped_by_budget:
        lines += ["The time budget stopped the search; rerun the same command to continue it.", ""]
    errors = [(r.predicted_memory - r.peak_memory) / r.peak_memory for r in records
              if r.status == "ok" and r.predicted_memory and r.peak_memory]  # fmt: skip
    memory = "peak RSS of the trial process" if not torch.cuda.is_available() else "max_memory_allocated"
    if errors:
        lines += [f"Memory prediction error (predicted - measured) / measured over {len(errors)} measured trials: "
                  f"median {statistics.median(errors):+.1%}, range {min(errors):+.1%} to {max(errors):+.1%} "
                  f"(measured: {memory}; world {world}).", ""]  # fmt: skip
    lines += ["| # | status | steps | tokens/s | predicted MiB | peak MiB | error | settings | reason |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, (r, steps) in enumerate(_order(records, rungs), 1):
        error = ""
        if r.predicted_memory and r.peak_memory:
            error = f"{(r.predicted_memory - r.peak_memory) / r.peak_memory:+.1%}"
        rate = "" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}"
        settings = ", ".join(f"{k}={v}" for k, v in r.settings.items())
        lines.append(f"| {i} | {r.status} | {steps or ''} | {rate} | {_mib(r.predicted_memory)} | "
                     f"{_mib(r.peak_memory)} | {error} | {settings} | {r.reason.replace('|', '/')} |")  # fmt: skip
    _write_atomic(path, "\n".join(lines) + "\n")
    return path


def write_plot(path: Path, records: Sequence[TrialRecord], memory_budget: int | None = None) -> Path | None:
    """``report.png``: tokens/s against measured peak memory of the measured trials; the pruned apart, below, at
    their predicted memory. Returns ``None`` (and says so on stderr) without matplotlib (the ``plot`` extra).

    Example::

        write_plot(Path("tuned/report.png"), result.records, memory_budget=8 << 30)
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tune: report.png not written: matplotlib is missing (pip install 'lightning-llmfast[plot]')",
              file=sys.stderr)  # fmt: skip
        return None
    ok = [r for r in records if r.status == "ok" and r.peak_memory and r.tokens_per_sec]
    pruned = [r for r in records if r.status == "pruned" and r.predicted_memory]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[4, 1])
    top.scatter([r.peak_memory / (1 << 20) for r in ok], [r.tokens_per_sec for r in ok], label="measured")
    top.set_ylabel("tokens/s")
    top.set_title("tune: tokens/s against peak memory")
    bottom.scatter([r.predicted_memory / (1 << 20) for r in pruned], [0] * len(pruned), marker="x", color="C3",
                   label="pruned (predicted memory)")  # fmt: skip
    bottom.set_yticks([])
    bottom.set_xlabel("peak memory per device, MiB (pruned: predicted)")
    for axis in (top, bottom):
        if memory_budget is not None:
            axis.axvline(memory_budget / (1 << 20), color="grey", linestyle="--", label="memory budget")
        axis.legend(loc="best", fontsize="small")
    figure.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------- the command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_llmfast.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="an example-CLI config (examples/train_moe.py fit --config)")
    parser.add_argument("--out", required=True, help="the results directory (rerun to continue a killed search)")
    parser.add_argument("--space", default=None, help="YAML: dotted keys to lists of values (default: from the config)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step in every trial")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds the search may take")
    parser.add_argument("--memory-budget", type=int, default=None, help="bytes per device; prunes predicted over")
    parser.add_argument("--steps", type=int, default=4, help="measured steps of the first trials (default 4)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out before them (default 2)")
    parser.add_argument("--eta", type=int, default=3, help="halving factor (default 3)")
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds a trial may run (default 600)")
    parser.add_argument("--script", default=None, help="the example CLI (default: examples/train_moe.py)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit status (0, or 2 after printing ``error: ...``).

    Example::

        main(["--config", "examples/configs/tiny.yaml", "--out", "tuned/", "--time-budget", "600"])
    """
    args = _parser().parse_args(argv)
    try:
        result = tune(
            TuneConfig(
                args.config, args.out, space=args.space, global_batch=args.global_batch, time_budget=args.time_budget,
                memory_budget=args.memory_budget, steps=args.steps, warmup_steps=args.warmup_steps, eta=args.eta,
                trial_timeout=args.trial_timeout, script=args.script,
            )
        )  # fmt: skip
    except (LLMFastError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = {s: sum(r.status == s for r in result.records) for s in STATUSES}
    print(f"tune: {len(result.records)} trials ({', '.join(f'{n} {s}' for s, n in counts.items())})"
          + (", stopped by the time budget" if result.stopped_by_budget else ""))  # fmt: skip
    if result.best is not None:
        print(f"best: {result.best.tokens_per_sec:,.0f} tokens/s {json.dumps(result.best.settings)}")
    for path in result.files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
