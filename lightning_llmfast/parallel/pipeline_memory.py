"""Per-stage memory of a pipelined :class:`~lightning_llmfast.models.MoEGPT`, predicted without running it.

Each pipeline rank holds the parameters of its stages (the balanced cut of
:mod:`~lightning_llmfast.parallel.pipeline_split`, or the cut by hand): its layers, the embedding on the rank of the
first stage, the final norm and the head on the rank of the last (a tied embedding and head on both, once on a rank
holding both), their gradients (as the parameters) and the optimizer's states (AdamW: two per element).

Its activations are those of the microbatches in flight: a stage keeps what a microbatch's forward saved until that
microbatch's backward frees it (its weight-gradient step ``W`` under the zero-bubble schedules, which still needs
the saved inputs after the input-gradient step ``I``). The peak is read from the schedule's own action table,
replayed in each rank's order: under GPipe every one of the ``M`` microbatches is in flight at once; under 1F1B rank
``r`` holds at most ``min(P - r, M)`` (the first rank ``P``); the interleaved and V schedules as torch's tables say
(:func:`schedule_actions`; they are built on a fake process group, nothing is allocated).

Example::

    with torch.device("meta"):
        model = MoEGPT(config)
    rows = stage_memory(model, PipelineConfig(4, 8, "1f1b"), layer_activations=[2**20] * config.n_layers)
    max(row.total for row in rows)  # bytes of the most loaded pipeline rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models.model import MoEGPT
from lightning_llmfast.parallel.pipeline import SCHEDULES, Action, PipelineConfig, _kind, single_stage_actions
from lightning_llmfast.parallel.pipeline_split import balanced_cut, layer_ranges, part, rank_stages, stage_costs
from lightning_llmfast.parallel.pipeline_stage import MoEGPTStageAdapter

__all__ = ["StageBytes", "in_flight_peak", "schedule_actions", "stage_memory"]

ADAM_STATES = 2
"""AdamW keeps two moments per parameter element."""


@dataclass(frozen=True)
class StageBytes:
    """What one pipeline rank holds, in bytes.

    Attributes:
        rank: the pipeline rank.
        stages: its stages.
        layers: the transformer layers of its stages.
        params: parameter bytes (its layers; the embedding with the first stage, the final norm and head with the
            last).
        grads: gradient bytes (as the parameters).
        optimizer: optimizer-state bytes.
        in_flight: the most microbatches whose forward it has run and whose backward it has not, at once (summed
            over its stages).
        activations: the saved activations at that peak.
    """

    rank: int
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    params: int
    grads: int
    optimizer: int
    in_flight: int
    activations: int

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer states and peak activations."""
        return self.params + self.grads + self.optimizer + self.activations


def schedule_actions(config: PipelineConfig) -> dict[int, list[Action]]:
    """The compute actions of ``config``'s schedule per pipeline rank, in order (``"F"``, ``"B"``, ``"I"``, ``"W"``).

    ``"gpipe"`` and ``"1f1b"`` as torch's single-stage schedules run them
    (:func:`~lightning_llmfast.parallel.pipeline.single_stage_actions`); the multi-stage ones are torch's own table,
    built on a fake process group with stand-in stages (nothing allocated, no process group left behind).

    Raises:
        ConfigError: a multi-stage schedule while a process group is initialised (the fake one needs the default
            slot).

    Example::

        schedule_actions(PipelineConfig(2, 4, "interleaved_1f1b"))[0][:3]  # 0F0, 0F1, 2F0
    """
    size, m = config.size, config.microbatches
    if config.stages_per_rank == 1:
        return single_stage_actions(config.schedule, size, m)
    if dist.is_initialized():
        raise ConfigError("pipeline plan: builds the schedule on its own fake process group; one is initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert config.stages_per_rank is not None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        x = torch.empty(1, 1, device="meta")
        stages = [
            PipelineStage(nn.Identity(), s, config.num_stages, torch.device("cpu"), input_args=x, output_args=x)
            for s in rank_stages(size, config.stages_per_rank, 0, config.style)
        ]
        cls = getattr(torch_schedules, SCHEDULES[config.schedule])
        order = cls(stages, m, loss_fn=lambda out, target: out, scale_grads=False).pipeline_order
    finally:
        dist.destroy_process_group()
    return {
        rank: [Action(a.stage_index, _kind(a), a.microbatch_index) for a in actions if a is not None]
        for rank, actions in order.items()
    }


def in_flight_peak(actions: Sequence[Action], stage_bytes: dict[int, int]) -> tuple[int, int]:
    """``(microbatches, bytes)`` at the peak of a rank's saved activations over its actions in order.

    A forward of stage ``s`` adds ``stage_bytes[s]``; its backward (``"B"``, or ``"W"`` when the schedule splits it
    into ``"I"`` and ``"W"``) frees them. ``microbatches`` counts the (stage, microbatch) pairs held at that peak.

    Example::

        in_flight_peak(schedule_actions(config)[0], {0: 1000})  # (2, 2000) for 1F1B on 2 ranks
    """
    split = any(a.computation_type == "W" for a in actions)
    held, count, best = 0, 0, (0, 0)
    for action in actions:
        kind, size = action.computation_type, stage_bytes[action.stage_index]
        if kind == "F":
            held, count = held + size, count + 1
            best = max(best, (held, count))
        elif kind == ("W" if split else "B"):
            held, count = held - size, count - 1
    return best[1], best[0]


def stage_memory(
    model: MoEGPT,
    config: PipelineConfig,
    layer_activations: Sequence[int],
    *,
    head_activations: int = 0,
    optimizer_states: int = ADAM_STATES,
) -> list[StageBytes]:
    """Per pipeline rank: parameters, gradients, optimizer states and peak activations of its stages.

    Args:
        model: the whole model (on the meta device: only shapes are read).
        config: the layout (its ``layers`` cut, or the balanced one the strategy makes).
        layer_activations: bytes one microbatch's forward saves in each layer (``n_layers`` entries).
        head_activations: bytes one microbatch saves outside the layers (final norm, logits, loss; the embedding
            saves only the token ids), on the last stage.
        optimizer_states: optimizer states per parameter element, in the parameters' dtype.

    Raises:
        ConfigError: more stages than layers, a cut that does not sum to the layers, or ``layer_activations`` not
            one entry per layer.

    Example::

        rows = stage_memory(model, PipelineConfig(2, 4), layer_activations=[1 << 20] * 4, head_activations=1 << 22)
    """
    n = len(model.layers)
    config.check_layers(n)
    if len(layer_activations) != n:
        raise ConfigError(f"pipeline plan: {len(layer_activations)} layer activation sizes for {n} layers")
    adapter = MoEGPTStageAdapter(model)
    costs, first, last = stage_costs(adapter)
    counts = list(config.layers) if config.layers is not None else balanced_cut(
        costs, config.num_stages, first=first, last=last
    )  # fmt: skip
    ranges = layer_ranges(counts)
    final = config.num_stages - 1
    act = {
        s: sum(layer_activations[i] for i in r) + (head_activations if s == final else 0) for s, r in enumerate(ranges)
    }
    table = schedule_actions(config)
    rows = []
    assert config.stages_per_rank is not None
    for rank in range(config.size):
        stages = rank_stages(config.size, config.stages_per_rank, rank, config.style)
        layers = tuple(i for s in stages for i in ranges[s])
        modules: list[nn.Module | None] = [model.layers[i] for i in layers]
        if 0 in stages:
            modules.append(part(adapter, "embed"))
        if final in stages:
            modules += [part(adapter, "norm"), part(adapter, "head")]
        # A tied weight once.
        unique = {id(p): p for module in modules if module is not None for p in module.parameters()}
        params = sum(p.numel() * p.element_size() for p in unique.values())
        in_flight, activations = in_flight_peak(table[rank], act)
        rows.append(
            StageBytes(rank, tuple(stages), layers, params, params, optimizer_states * params, in_flight, activations)
        )
    return rows
