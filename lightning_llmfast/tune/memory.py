"""Predicted peak memory per device of a candidate, before it runs (:func:`predict_memory`): the sharding plan's
model states plus the saved activations the memory plan predicts from a probe measured once per model config."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_llmfast.errors import LLMFastError
from lightning_llmfast.tune.records import settings_key
from lightning_llmfast.tune.space import (
    CONTEXT_PARALLEL,
    MICRO_BATCH,
    REFERENCE_MODULE,
    STRATEGY,
    get_setting,
    on_cuda,
    pipeline_layout,
)

__all__ = ["REFERENCE_MODULE", "Probe", "measure_probe", "predict_memory"]


@dataclass(frozen=True)
class Probe:
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
    data = dict(get_setting(config, "data", {}) or {})
    cls = _import(data.pop("class_path", "lightning_llmfast.PackedDataModule"))
    return cls(**(data.get("init_args", data) or {}))


def _model_config(config: Mapping[str, Any]) -> Any:
    """The reference model's ``MoEGPTConfig`` of an example-CLI config, its vocabulary taken from the data."""
    from lightning_llmfast.models import MoEGPTConfig

    fields = dict(get_setting(config, "model.config", {}) or {})
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


def _measure_probe(config: Mapping[str, Any]) -> tuple[Probe, list[int]]:
    """:func:`measure_probe` of an example-CLI config's model, sequence length and precision."""
    seq_len = int(get_setting(config, "data.seq_len", 256))
    bf16 = "bf16" in str(get_setting(config, "trainer.precision", "32"))
    return measure_probe(_model_config(config), seq_len, bf16=bf16)


def measure_probe(model_config: Any, seq_len: int, *, bf16: bool = False) -> tuple[Probe, list[int]]:
    """Run one layer of each kind of a ``MoEGPTConfig``'s model forward and backward on one CPU sequence of
    ``seq_len`` tokens; count its saved activations per layer. Returns the :class:`Probe` and, for every layer of the
    full model, the index of its probed kind.

    Example::

        probe, kinds = measure_probe(MoEGPTConfig(n_layers=8), 256)
        per_layer = [sum(probe.storages[k]) for k in kinds]  # bytes one sequence saves in each layer
    """
    from lightning_llmfast.offload.must_save import MustSaveCounter

    if model_config.router_backend in ("auto", "triton"):  # on CPU: the kernels' PyTorch reference saves the same
        model_config = dataclasses.replace(model_config, router_backend="torch")
    torch.manual_seed(0)
    model, kinds = _probe_model(model_config)
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
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    saved = [sum(s) for s in counter.storages]
    recompute = tuple(max(0, min(s, s - k)) for s, k in zip(saved, keeps))
    return Probe(tuple(tuple(s) for s in counter.storages), recompute, counter.outside), kinds


def _model_states(config: Mapping[str, Any], world: int) -> int:
    """Parameter, gradient and AdamW bytes of the most loaded rank, from the sharding plan's per-rank shares."""
    from lightning_llmfast.models import MoEGPT
    from lightning_llmfast.plan import formula_plan, param_shapes

    with torch.device("meta"):
        module = nn.ModuleDict({"model": MoEGPT(_model_config(config))})
    shapes = param_shapes(module, list(module["model"].layers))
    ep = int(get_setting(config, "trainer.strategy.init_args.expert_parallel_size", 1))
    sharding = get_setting(config, "trainer.strategy.init_args.sharding", "ddp")
    if sharding == "ddp":
        held = sum(math.prod(p.shape) * p.element_size // (ep if p.expert else 1) for p in shapes)
        return 4 * held  # the parameters, their gradients, two AdamW moments
    group = world // int(get_setting(config, "trainer.num_nodes", 1)) if sharding == "hsdp" else world
    plan = formula_plan("tune", shapes, group, ep, compute_bytes=4, a2a_bytes=0)
    return max(r.dense_params + r.expert_params + r.grads + r.optimizer for r in plan.ranks)


def _activations(config: Mapping[str, Any], probe: Probe, kinds: Sequence[int]) -> int:
    """Peak saved activations of one micro-batch under the candidate's offload setting (the memory plan's model)."""
    from lightning_llmfast.offload import OffloadConfig
    from lightning_llmfast.offload.memory_plan import predict_peak
    from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile

    micro = int(get_setting(config, MICRO_BATCH, 8))
    layers = tuple(
        LayerProfile(micro * sum(probe.storages[k]), micro * probe.recompute[k], 1.0, 1.0, 1.0,
                     tuple(micro * s for s in probe.storages[k]))
        for k in kinds
    )  # fmt: skip
    offload = get_setting(config, "trainer.strategy.init_args.offload")
    settings = OffloadConfig(**offload) if isinstance(offload, dict) else OffloadConfig() if offload else None
    choices, freed = ["keep"] * len(layers), [0] * len(layers)
    runs = settings is not None and (on_cuda(config) or settings.force)
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


def _context_share(config: Mapping[str, Any], activations: int) -> int:
    """A rank's saved activations under context parallelism: its ``1 / cp`` of the micro-batch's positions, plus the
    keys and values every layer's attention gathers and saves for backward: each piece of a document keeps that
    document's keys up to its end, ``N (1 + 1 / (2 cp))`` rows on the busiest rank of a zigzag split."""
    cp = int(get_setting(config, CONTEXT_PARALLEL, 1) or 1)
    if cp == 1:
        return activations
    model = _model_config(config)
    tokens = int(get_setting(config, MICRO_BATCH, 8)) * int(get_setting(config, "data.seq_len", 256))
    kv_bytes = 2 * model.n_kv_heads * (model.hidden_size // model.n_heads) * 4  # fp32 K and V of one token
    rows = tokens + -(-tokens // (2 * cp))
    return -(-activations // cp) + model.n_layers * rows * kv_bytes


def _pipeline_stages(config: Mapping[str, Any], world: int, probe: Probe, kinds: Sequence[int]) -> int | None:
    """Under pipelining: the most loaded pipeline rank's bytes (its stages' parameters, gradients and AdamW moments
    and the activations of its microbatches in flight at their peak:
    :func:`~lightning_llmfast.parallel.pipeline_memory.stage_memory`); ``None`` without pipelining."""
    from lightning_llmfast.models import MoEGPT
    from lightning_llmfast.parallel.pipeline_memory import stage_memory

    layout = pipeline_layout(config)
    if layout is None:
        return None
    with torch.device("meta"):
        model = MoEGPT(_model_config(config))
    rows = int(get_setting(config, MICRO_BATCH, 8)) // layout.microbatches  # one microbatch's sequences
    layers = [rows * sum(probe.storages[k]) for k in kinds]
    # Under sharding="fsdp" a stage's parameters, gradients and moments are sharded over its world / pp ranks; under
    # "hsdp" and expert parallelism the replicated stage is kept as an upper bound.
    shards = world // layout.size if get_setting(config, STRATEGY + "sharding", "ddp") == "fsdp" else 1
    rows_bytes = stage_memory(model, layout, layers, head_activations=rows * probe.outside)
    return max(-(-(r.params + r.grads + r.optimizer) // shards) + r.activations for r in rows_bytes)


def predict_memory(
    config: Mapping[str, Any], world: int, probes: dict[str, tuple[Probe, list[int]]] | None = None
) -> int | None:
    """Predicted peak bytes per device of a candidate's config: the most loaded rank's parameters, gradients and
    AdamW moments (the sharding plan, :func:`~lightning_llmfast.plan.formula_plan`) plus its micro-batch's saved
    activations at their peak (:func:`~lightning_llmfast.offload.memory_plan.predict_peak` on a profile measured
    once per model config: one sequence through one layer of each kind on CPU, scaled by the micro-batch; auto
    offload plans are predicted at their upper bound, keeping everything). Under pipelining
    (``pipeline_parallel_size > 1``), per stage: the most loaded pipeline rank's stages and its microbatches in
    flight, from the same profile. ``None`` for a model other than the reference MoE GPT, or a config the
    prediction cannot build (the trial then tells).

    Example::

        predict_memory(apply_settings(config, {"data.batch_size": 4}), world=1)
    """
    if get_setting(config, "model.class_path", REFERENCE_MODULE) != REFERENCE_MODULE:
        return None
    probes = {} if probes is None else probes
    try:
        model_key = settings_key(
            {key.split(".")[-1]: get_setting(config, key) for key in ("model.config", "data", "trainer.precision")}
        )
        if model_key not in probes:
            probes[model_key] = _measure_probe(config)
        staged = _pipeline_stages(config, world, *probes[model_key])
        if staged is not None:
            return staged
        return _model_states(config, world) + _context_share(config, _activations(config, *probes[model_key]))
    except (LLMFastError, TypeError, ValueError, RuntimeError):  # a config the model refuses: the trial will say why
        return None
