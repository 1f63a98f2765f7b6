"""Pipeline parallelism on ``torch.distributed.pipelining``: the layers cut into stages across the ``"pp"`` ranks.

:class:`PipelineConfig` is the validated layout (stages, microbatches, schedule). :class:`PipelineRunner` cuts a model
into balanced stages (:mod:`~lightning_llmfast.parallel.pipeline_split`) through its stage adapter
(:mod:`~lightning_llmfast.parallel.pipeline_stage`: a :class:`~lightning_llmfast.models.MoEGPT` or a transformers
decoder-only causal LM),
prunes it in place to this rank's stages (parameters keep the full model's names), and runs one training batch
through torch's :class:`~torch.distributed.pipelining.PipelineStage` and schedules (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``): no
schedule engine of our own.

What the runner adds to torch's schedules:

- every microbatch's packed metadata is cut from the batch's host-side boundaries once per batch and handed to each
  stage with the batch (an open :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` around the stage's forward
  of that microbatch), never through the pipe;
- the loss is token-weighted over the optimizer step: the schedules' own division by the number of microbatches is
  off, each microbatch adds its summed token losses, and :meth:`PipelineRunner.finish_step` divides the gradients
  by the label tokens of the step's batches over every data-parallel replica (one all-reduce of a count) and sums
  them over the replicas, so they equal one process's on all of those batches; the router's load-balancing loss is
  per microbatch, weighted by its label tokens (as under gradient accumulation), and joins the backward at the
  stage that computed it;
- the step's loss value (the last stage's, plus every stage's router term) is summed over the pipeline's ranks, so
  every rank returns the same value;
- a tied embedding and head live on the first and the last stage under the embedding's name;
  :meth:`PipelineRunner.finish_step` sums their gradients before the optimizer step.
- with a context-parallel group (``cp_group``) each microbatch arrives as this rank's shard of its positions with
  the shard's metadata (cut on the host, ``PackedBatch.context_shard`` of the microbatch's rows): the pipe carries
  only the shard's hidden states, attention gathers keys and values over the group inside each stage, and the token
  losses, router weights and the loss value are taken over the group's label tokens.

Example::

    config = PipelineConfig(size=2, microbatches=4, schedule="1f1b")
    runner = PipelineRunner(model, config, pp_group, device=torch.device("cpu"))  # prunes `model`
    loss = runner.step(batch.input_ids, batch.labels, batch.position_ids, metadata)
    runner.finish_step()  # divide by the step's tokens, sum over replicas and tied copies
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.parallel.pipeline_split import (
    StageModule,
    balanced_cut,
    layer_ranges,
    part,
    prune_stages,
    rank_stages,
    split_metadata,
    stage_costs,
    tied_parameter,
)
from lightning_llmfast.parallel.pipeline_stage import StageAdapter, stage_adapter
from lightning_llmfast.parallel.pretrained import hold_elsewhere
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineConfig",
    "PipelineRunner",
    "bubble_share",
    "single_stage_actions",
    "sum_gradients",
]

SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""The schedule names :class:`PipelineConfig` takes, and the ``torch.distributed.pipelining`` class of each."""

_SINGLE = ("gpipe", "1f1b")  # one stage per rank
_INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline layout, validated at construction.

    Args:
        size: pipeline ranks ``pp`` (``>= 1``).
        microbatches: ``M``, the row microbatches a batch is cut into (``>= 1``; must divide the batch size).
        schedule: one of :data:`SCHEDULES`.
        stages_per_rank: ``v``; ``None``: 1 for ``"gpipe"``/``"1f1b"``, 2 for the interleaved ones and ``"zbv"``.
            ``"gpipe"`` and ``"1f1b"`` take exactly 1, ``"zbv"`` exactly 2.
        layers: the cut by hand: transformer layers per stage (``pp * v`` ints ``>= 1``, in stage order); ``None``:
            balanced by parameters and compute (:func:`~lightning_llmfast.parallel.pipeline_split.balanced_cut`).

    Raises:
        ConfigError: an unknown schedule, a stage count the schedule cannot take, a size or microbatch count that is
            not an int ``>= 1``, microbatches the schedule cannot run (``"1f1b"``: fewer than ``pp``; interleaved:
            not a multiple of ``max(1, M // pp)``), or a ``layers`` that is not ``pp * v`` ints ``>= 1``.

    Example::

        config = PipelineConfig(size=2, microbatches=4, schedule="interleaved_1f1b")
        config.stages_per_rank, config.num_stages  # (2, 4)
    """

    size: int
    microbatches: int
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    layers: Sequence[int] | None = None

    def __post_init__(self) -> None:
        check_int("pipeline size", self.size, low=1)
        check_int("pipeline microbatches", self.microbatches, low=1)
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}")
        default = 1 if self.schedule in _SINGLE else 2
        v = default if self.stages_per_rank is None else check_int("pipeline stages_per_rank", self.stages_per_rank)
        if self.schedule in _SINGLE and v != 1:
            raise ConfigError(f"pipeline schedule {self.schedule!r} takes 1 stage per rank, got stages_per_rank={v}")
        if self.schedule == "zbv" and v != 2:
            raise ConfigError(f"pipeline schedule 'zbv' takes exactly 2 stages per rank, got stages_per_rank={v}")
        if v < 1:
            raise ConfigError(f"pipeline stages_per_rank must be an int >= 1, got {v}")
        object.__setattr__(self, "stages_per_rank", v)
        m, pp = self.microbatches, self.size
        if self.schedule == "1f1b" and m < pp:
            raise ConfigError(f"pipeline schedule '1f1b' needs microbatches >= pipeline size {pp}, got {m}")
        if self.schedule in _INTERLEAVED and m % max(1, m // pp):
            raise ConfigError(
                f"pipeline schedule {self.schedule!r}: microbatches {m} must be a multiple of max(1, {m} // {pp})"
            )
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
                raise ConfigError(f"pipeline layers must be a list of layers per stage, got {self.layers!r}")
            counts = tuple(check_int("pipeline layers entry", n, low=1) for n in self.layers)
            if len(counts) != self.num_stages:
                raise ConfigError(
                    f"pipeline layers gives {len(counts)} stages, the layout has {self.num_stages} "
                    f"(size {pp} x stages_per_rank {v})"
                )
            object.__setattr__(self, "layers", counts)

    @property
    def num_stages(self) -> int:
        """All stages of the pipeline, ``pp * v``."""
        assert self.stages_per_rank is not None
        return self.size * self.stages_per_rank

    @property
    def style(self) -> str:
        """How stages sit on ranks: ``"v"`` for ``"zbv"``, else ``"loop"``."""
        return "v" if self.schedule == "zbv" else "loop"

    def check_world(self, world_size: int) -> None:
        """Raises :class:`ConfigError` unless the pipeline size divides ``world_size``."""
        if world_size % self.size:
            raise ConfigError(f"pipeline size {self.size} must divide the world size {world_size}")

    def check_batch(self, batch_size: int) -> None:
        """Raises :class:`ConfigError` unless the microbatches divide ``batch_size`` rows."""
        if batch_size % self.microbatches:
            raise ConfigError(
                f"pipeline microbatches {self.microbatches} must divide the batch size {batch_size} (row microbatches)"
            )

    def check_layers(self, num_layers: int) -> None:
        """Raises :class:`ConfigError` when the stages outnumber ``num_layers`` or ``layers`` does not sum to it."""
        if self.num_stages > num_layers:
            raise ConfigError(
                f"pipeline: {self.num_stages} stages (size {self.size} x stages_per_rank {self.stages_per_rank}) but "
                f"the model has only {num_layers} layers; each stage needs a layer"
            )
        if self.layers is not None and sum(self.layers) != num_layers:
            raise ConfigError(
                f"pipeline layers {list(self.layers)} sum to {sum(self.layers)}, the model has {num_layers}"
            )


class Action(NamedTuple):
    """One compute action of a schedule's table: ``"F"``, ``"B"`` (full backward), ``"I"`` or ``"W"``."""

    stage_index: int
    computation_type: str
    microbatch_index: int


def single_stage_actions(schedule: str, pp: int, microbatches: int) -> dict[int, list[Action]]:
    """The action table of ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (``pp - 1 - r`` warm-up
    forwards on rank ``r``, then one forward and one backward in turn), as torch's single-stage schedules run them.

    torch's own tables for these two are drawings only (the 1F1B one numbers the last rank's microbatches from 1);
    the multi-stage schedules execute theirs, which :func:`bubble_share` reads as they are.

    Example::

        single_stage_actions("1f1b", 2, 4)[1][:2]  # [Action(1, "F", 0), Action(1, "B", 0)]
    """
    table: dict[int, list[Action]] = {}
    for rank in range(pp):
        forwards = [Action(rank, "F", m) for m in range(microbatches)]
        backwards = [Action(rank, "B", m) for m in range(microbatches)]
        if schedule == "gpipe":
            table[rank] = forwards + backwards
            continue
        warmup = min(pp - 1 - rank, microbatches)
        actions = forwards[:warmup]
        for m in range(warmup, microbatches):
            actions += [forwards[m], backwards[m - warmup]]
        table[rank] = actions + backwards[microbatches - warmup :]
    return table


_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # relative compute of each action (a full backward: twice a forward)


def bubble_share(pipeline_order: dict[int, list[Any]]) -> float:
    """The idle share of a schedule's action table: ``1 - busy / (ranks * makespan)``.

    Each rank runs its actions in order, each as soon as its inputs are there (forward of stage ``s`` after that of
    ``s - 1``; backward of ``s`` after its forward and the backward of ``s + 1``; a weight gradient after its input
    gradient), with a forward, input-gradient and weight-gradient taking 1 and a full backward 2; communication is
    free. The number depends on the schedule only, not on the hardware.

    Args:
        pipeline_order: torch's ``schedule.pipeline_order`` (rank -> actions, ``None`` for an idle slot).

    Example::

        bubble_share(schedule.pipeline_order)  # 0.2 for 1F1B on 2 ranks with 4 microbatches
    """
    queues = {
        rank: [a for a in actions if a is not None and _kind(a) in _COST] for rank, actions in pipeline_order.items()
    }
    last_stage = max((a.stage_index for q in queues.values() for a in q), default=0)
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(queues, 0.0)
    position = dict.fromkeys(queues, 0)
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                action = queue[position[rank]]
                kind, s, m = _kind(action), action.stage_index, action.microbatch_index
                if kind == "F":
                    needs = [(s - 1, "F", m)] if s > 0 else []
                elif kind == "W":
                    needs = [(s, "I", m)]
                else:
                    needs = [(s, "F", m)] + ([(s + 1, "B", m)] if s < last_stage else [])
                ready = [done.get(need) for need in needs]
                if any(t is None for t in ready):
                    break
                start = max([free[rank], *(t for t in ready if t is not None)])
                free[rank] = start + _COST[kind]
                busy += _COST[kind]
                done[(s, kind, m)] = free[rank]
                if kind in ("I", "B"):
                    done[(s, "B", m)] = free[rank]  # what the previous stage waits for
                position[rank] += 1
                progress = True
    if any(position[r] < len(q) for r, q in queues.items()):
        raise ConfigError("pipeline: the schedule's action table has an unsatisfiable dependency")
    makespan = max(free.values(), default=0.0)
    return 1.0 - busy / (len(queues) * makespan) if makespan else 0.0


def _kind(action: Any) -> str:
    kind = action.computation_type
    return str(getattr(kind, "value", kind))


def sum_gradients(params: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Sums the gradients of ``params`` over ``group`` in place: one all-reduce per device and dtype, of the
    gradients flattened into one buffer (the replicas of a pipeline stage, as DDP's buckets would).

    Example::

        sum_gradients([p for p in model.parameters() if p.grad is not None], dims.dp_group)
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in params:
        if param.grad is not None:
            buckets.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
    for _, grads in sorted(buckets.items(), key=lambda item: str(item[0])):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _forward_only(schedule: Any) -> None:
    """Lower ``schedule``'s forwards alone, in its order, for evaluation.

    torch's ``eval()`` of the V-shaped ZBV schedule still runs the table's backward actions of the stages that share a
    rank (and fails on them); its forwards, kept in order, are a valid forward-only table of the same placement.
    """
    order = {
        rank: [a for a in actions if a is not None and _kind(a) == "F"]
        for rank, actions in schedule.pipeline_order.items()
    }
    schedule.pipeline_order = order
    # torch's own lowering (sends and receives placed by simulating the ranks); its validation would ask for the
    # backwards a forward-only table has not.
    schedule.pipeline_order_with_comms = torch_schedules._add_send_recv(
        order, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages
    )


def _check_context_parallel(adapter: StageAdapter, cp_group: dist.ProcessGroup | None) -> StageAdapter:
    """``adapter``, unless its stages would attend only a context-parallel shard's own positions."""
    if cp_group is not None and not adapter.needs_metadata:
        raise ConfigError(
            "pipeline with context parallelism: the stages gather keys and values inside varlen attention from each "
            "microbatch's shard metadata; this model's attention reads only its positions (MoEGPT: use "
            "attention_metadata='cached', the default)"
        )
    return adapter


class _MicrobatchStage(PipelineStage):
    """A :class:`PipelineStage` that opens the microbatch's metadata cache and sets its router-loss weight around
    every forward of the stage (torch names the microbatch ``fwd_chunk_id``)."""

    def __init__(self, runner: PipelineRunner, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._runner = runner

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        submod = self.submod
        assert isinstance(submod, StageModule)
        weights, metas = self._runner.microbatch_state()
        submod.aux_weight = weights[fwd_chunk_id] if weights is not None else None
        if not metas:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        cache = self._runner.cache
        cache.begin(metas[fwd_chunk_id])  # the microbatch's metadata, built once per batch: only opened here
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            cache.end()


class PipelineRunner:
    """Runs training, evaluation and prediction batches of a model through a pipeline schedule over ``group``.

    Construction cuts the model (by :attr:`PipelineConfig.layers`, or balanced) and prunes it in place to this rank's
    stages; schedules are built per microbatch shape on first use.

    Args:
        model: the model, whole and holding its trained values: a :class:`~lightning_llmfast.models.MoEGPT` or a
            transformers decoder-only causal LM (:func:`~lightning_llmfast.parallel.pipeline_stage.stage_adapter`);
            pruned in place.
        config: the layout.
        group: the pipeline's process group (``config.size`` ranks, pipeline index = group rank); ``None`` only with
            ``size == 1``.
        device: this rank's device.
        aux_loss_coef: weight of the router's load-balancing loss (summed over MoE blocks).
        ignore_index: label value that is not a target.
        dp_group: the other replicas of this rank's stages (pipelines reading other batches), or ``None``: their
            gradients are summed and the loss weighted over all of their label tokens in :meth:`finish_step`.
            Under context parallelism: every rank of the stage (``dp x cp``).
        cp_group: the context-parallel group whose ranks hold the other shards of each microbatch (``None``: none).
            The batches are then the microbatches' shards, each with its metadata (:meth:`step`); the token losses
            and the router terms' weights are taken over the group's label tokens.

    Raises:
        ConfigError: a model without a stage adapter (the message says what a split needs), a group whose size is
            not ``config.size``, more stages than layers, a ``layers`` cut that does not sum to the model's layers.

    Example::

        runner = PipelineRunner(module.model, PipelineConfig(2, 4), pp_group, device=device, aux_loss_coef=0.01)
        runner.stages  # e.g. [0] on pipeline rank 0, [1] on rank 1
    """

    def __init__(
        self,
        model: nn.Module,
        config: PipelineConfig,
        group: dist.ProcessGroup | None,
        *,
        device: torch.device,
        aux_loss_coef: float = 0.0,
        ignore_index: int = -100,
        dp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        adapter = _check_context_parallel(stage_adapter(model), cp_group)
        size = dist.get_world_size(group) if group is not None else 1
        if size != config.size:
            raise ConfigError(f"pipeline: the group has {size} ranks, the pipeline size is {config.size}")
        self.config, self.group, self.device, self.dp_group = config, group, device, dp_group
        self.cp_group = cp_group
        """The context-parallel group sharing this rank's microbatches (``None``: none)."""
        self.aux_loss_coef, self.ignore_index = float(aux_loss_coef), ignore_index
        self.rank = dist.get_rank(group) if group is not None else 0
        costs, first, last = stage_costs(adapter)
        config.check_layers(len(costs))
        self.layer_counts: list[int] = (
            list(config.layers)
            if config.layers is not None
            else balanced_cut(costs, config.num_stages, first=first, last=last)
        )
        """Transformer layers of every stage, in stage order."""
        assert config.stages_per_rank is not None
        self.stages: list[int] = rank_stages(config.size, config.stages_per_rank, self.rank, config.style)
        """The stages this rank holds."""
        ranges = layer_ranges(self.layer_counts)
        self.num_stages = config.num_stages
        last_stage = self.num_stages - 1
        tied = tied_parameter(adapter)
        self.tied = tied is not None
        embed = part(adapter, "embed")
        assert embed is not None
        dtype = next(p.dtype for p in embed.parameters() if p.is_floating_point())
        # By name in the embedding: materialising a meta model replaces the parameter objects.
        self._tied_name = next((n for n, p in embed.named_parameters() if p is tied), None)
        self._prune(model, adapter, [i for s in self.stages for i in ranges[s]])
        self.model, self.adapter = model, adapter
        """The model (pruned to this rank's stages) and its stage adapter."""
        self.modules = [
            StageModule(adapter, ranges[s], first=s == 0, last=s == last_stage, dtype=dtype) for s in self.stages
        ]
        self._tied_group = self._make_tied_group() if self.tied else None
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._weights: Tensor | None = None
        self._metas: list[SequenceMetadata] = []
        self.cache = SequenceMetadataCache()
        """The cache the stages' forwards read the microbatch's metadata from (open around each forward)."""
        self._total: Tensor | None = None
        self._step_tokens: Tensor | None = None  # label tokens of the batches since the last finish_step
        self.last_schedule: Any = None
        """The schedule of the latest batch (its ``pipeline_order`` is the action table)."""
        self.last_ce: Tensor | None = None
        """The latest training batch's token-mean cross entropy (its loss without the router terms), the same on
        every rank of the pipeline."""
        self.expert_params: set[int] = set()
        """``id()`` of the plain parameters split over the stage's expert-parallel ranks (set by
        :func:`~lightning_llmfast.parallel.pipeline_layout.parallelize_stages`): not summed over ``dp_group``."""
        self.expert_group: dist.ProcessGroup | None = None
        """The ranks holding this rank's experts, whose expert gradients :meth:`finish_step` sums (``None``: one)."""

    def _prune(self, model: nn.Module, adapter: StageAdapter, keep: list[int]) -> None:
        """Prune ``model`` in place to the layers ``keep`` (this rank's stages' layers) and its ends."""
        shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
        prune_stages(adapter, keep, first=self.has_first, last=self.has_last)
        kept = model.state_dict(keep_vars=True)
        # A model waiting for its pretrained weights reads only this rank's; the other stages' keys are theirs.
        hold_elsewhere(model, {name: shape for name, shape in shapes.items() if name not in kept})

    def _make_tied_group(self) -> dist.ProcessGroup | None:
        """The two ranks holding the first and the last stage, when they differ (ZBV puts both on rank 0)."""
        if self.group is None:
            return None
        ranks = dist.get_process_group_ranks(self.group)
        last_rank = self.last_rank
        if last_rank == 0:
            return None
        pair = [ranks[0], ranks[last_rank]]
        if self.rank not in (0, last_rank):
            return None
        return dist.new_group(pair, use_local_synchronization=True)

    @property
    def has_first(self) -> bool:
        """Whether this rank holds the first stage (the embedding)."""
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        """Whether this rank holds the last stage (the final norm, the head, the loss)."""
        return self.num_stages - 1 in self.stages

    @property
    def bubble(self) -> float | None:
        """:func:`bubble_share` of the latest batch's schedule (``None`` before the first batch)."""
        if self.last_schedule is None:
            return None
        cfg = self.config
        if cfg.schedule in _SINGLE:
            return bubble_share(single_stage_actions(cfg.schedule, cfg.size, cfg.microbatches))
        return bubble_share(self.last_schedule.pipeline_order)

    def microbatch_state(self) -> tuple[Tensor | None, list[SequenceMetadata]]:
        """The current batch's router-loss weight and packed metadata per microbatch."""
        return self._weights, self._metas

    def _schedule(self, rows: int, seq_len: int, ids_dtype: torch.dtype, train: bool, loss: bool = True) -> Any:
        key = (rows, seq_len, ids_dtype, train, loss)
        schedule = self._schedules.get(key)
        if schedule is not None:
            return schedule
        cfg, adapter = self.config, self.adapter
        # Static shapes (no shape inference by a trial forward); an activation that carries a gradient back says so.
        dtype = self.modules[0].dtype
        hidden = torch.empty(rows, seq_len, adapter.hidden_size, dtype=dtype, device="meta", requires_grad=train)
        logits = torch.empty(rows, seq_len, adapter.vocab_size, dtype=dtype, device="meta", requires_grad=train)
        stages = []
        for s, module in zip(self.stages, self.modules, strict=True):
            inputs = torch.empty(rows, seq_len, dtype=ids_dtype, device="meta") if s == 0 else hidden
            outputs = logits if s == self.num_stages - 1 else hidden
            stages.append(
                _MicrobatchStage(
                    self,
                    module,
                    s,
                    self.num_stages,
                    self.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.group,
                )
            )
        cls = getattr(torch_schedules, SCHEDULES[cfg.schedule])
        loss_fn = (self._loss if train else self._eval_loss) if loss else None  # None: the logits alone
        target = stages[0] if cfg.schedule in _SINGLE else stages
        schedule = cls(target, cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
        if not train and cfg.schedule == "zbv":
            _forward_only(schedule)
        self._schedules[key] = schedule
        return schedule

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """A microbatch's summed token losses over the batch's label tokens: the microbatches add up to the batch's
        token mean."""
        assert self._total is not None
        token_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return token_sum / self._total

    def _eval_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return self._loss(logits, labels).detach()

    def _open(
        self,
        labels: Tensor,
        position_ids: Tensor,
        metadata: SequenceMetadata | Sequence[SequenceMetadata] | None,
        train: bool,
        divisor: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """The divisor of the token losses, the microbatches' router-loss weights and metadata; returns this rank's
        label tokens and the batch's (over the context-parallel group)."""
        m = self.config.microbatches
        valid = labels != self.ignore_index
        counts = valid.reshape(m, -1).sum(1).to(torch.float32)
        tokens = counts.sum()
        shared = counts
        if self.cp_group is not None:  # the microbatches' label tokens over every shard of them
            shared = counts.clone()
            dist.all_reduce(shared, group=self.cp_group)
        batch_tokens = shared.sum()
        self._total = batch_tokens.clamp_min(1) if divisor is None else divisor.to(tokens)
        # A router term is batch-wide (the group computes one value per microbatch): each shard weighs its
        # microbatch's tokens over the group equally, as scale_by_token_share does without pipelining.
        share = shared / dist.get_world_size(self.cp_group) if self.cp_group is not None else counts
        self._weights = self.aux_loss_coef * share / self._total if train and self.aux_loss_coef else None
        self._open_metadata(position_ids, metadata)
        return tokens, batch_tokens

    def _open_metadata(
        self, position_ids: Tensor, metadata: SequenceMetadata | Sequence[SequenceMetadata] | None
    ) -> None:
        """The microbatches' packed metadata (when the adapter's attention reads it): the given one per microbatch
        (context-parallel shards), or cut from the batch's."""
        self._metas = []
        if not self.adapter.needs_metadata:
            return
        if isinstance(metadata, Sequence):
            self._metas = list(metadata)
            return
        meta = metadata if metadata is not None else SequenceMetadata.from_position_ids(position_ids)
        self._metas = split_metadata(meta, self.config.microbatches)

    def _close(self) -> None:
        self._metas, self._weights, self._total = [], None, None
        for module in self.modules:
            module.aux_weight = module.aux_total = None

    def _inputs(self, input_ids: Tensor, labels: Tensor, position_ids: Tensor | None) -> Tensor:
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ConfigError(
                f"pipeline: input_ids and labels must be (B, T) of one shape, got {tuple(input_ids.shape)} and "
                f"{tuple(labels.shape)}"
            )
        b, t = input_ids.shape
        self.config.check_batch(b)
        if position_ids is None:
            return torch.arange(t, device=input_ids.device).expand(b, t).contiguous()
        return position_ids.expand(b, t).contiguous() if position_ids.shape[0] != b else position_ids

    def step(
        self,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Tensor | None = None,
        metadata: SequenceMetadata | Sequence[SequenceMetadata] | None = None,
    ) -> Tensor:
        """Forward and backward of one batch through the schedule; gradients accumulate into this rank's parameters.

        Every rank of the pipeline passes the same batch (the first stage reads the tokens, every stage the positions
        and metadata, the last stage the labels).

        Args:
            input_ids: ``(B, T)`` token ids; ``B`` a multiple of the microbatches.
            labels: ``(B, T)`` shifted labels (``ignore_index`` where there is no target).
            position_ids: ``(B, T)`` or ``(1, T)``; ``None``: one sequence per row.
            metadata: the batch's packed boundaries over the ``B * T`` positions (``"cached"`` attention); ``None``:
                built from ``position_ids`` (one host read on an accelerator). Or the metadata of every microbatch,
                in order: under context parallelism each row of the inputs is one microbatch's shard
                (``PackedBatch.context_shard`` of its rows) and each metadata that shard's.

        Returns:
            The batch's loss (token-mean cross entropy plus the router loss weighted by the microbatches' token
            shares), detached, the same on every rank of the pipeline (and of the context-parallel group). The
            gradients are those of the token-loss sum until :meth:`finish_step` divides them by the step's label
            tokens.

        Raises:
            ConfigError: the microbatches do not divide ``B``, or the inputs are not ``(B, T)``.
            MetadataError: a sequence crosses a microbatch boundary.

        Example::

            loss = runner.step(batch.input_ids, batch.labels, batch.position_ids, SequenceMetadata.from_batch(batch))
        """
        return self._run(input_ids, labels, position_ids, metadata, train=True)

    @torch.no_grad()
    def evaluate(
        self,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Tensor | None = None,
        metadata: SequenceMetadata | Sequence[SequenceMetadata] | None = None,
    ) -> Tensor:
        """The batch's token-mean cross entropy, stages forward only; the same on every rank of the pipeline.

        Example::

            val = runner.evaluate(batch.input_ids, batch.labels, batch.position_ids)
        """
        return self._run(input_ids, labels, position_ids, metadata, train=False)

    @torch.no_grad()
    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, metadata: SequenceMetadata | None = None
    ) -> Tensor | None:
        """The batch's logits ``(B, T, vocab)``, stages forward only (no loss): on the rank holding the last stage;
        ``None`` on the others (:func:`~lightning_llmfast.parallel.broadcast.broadcast_tree` shares what the last
        stage makes of them).

        Args:
            input_ids: ``(B, T)`` token ids; ``B`` a multiple of the microbatches.
            position_ids: ``(B, T)`` or ``(1, T)``; ``None``: one sequence per row.
            metadata: the batch's packed boundaries (``"cached"`` attention); ``None``: built from ``position_ids``.

        Raises:
            ConfigError: the microbatches do not divide ``B``, or ``input_ids`` is not ``(B, T)``.
            MetadataError: a sequence crosses a microbatch boundary.

        Example::

            logits = runner.forward(batch.input_ids, batch.position_ids, SequenceMetadata.from_batch(batch))
        """
        positions = self._inputs(input_ids, input_ids, position_ids)
        b, t = input_ids.shape
        schedule = self._schedule(b // self.config.microbatches, t, input_ids.dtype, train=False, loss=False)
        self._open_metadata(positions, metadata)
        try:
            logits = schedule.eval(input_ids, position_ids=positions)
        finally:
            self._close()
        return logits if self.has_last else None

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage (0 under ``"zbv"``'s V)."""
        return 0 if self.config.style == "v" else (self.num_stages - 1) % self.config.size

    def _run(
        self,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Tensor | None,
        meta: SequenceMetadata | Sequence[SequenceMetadata] | None,
        *,
        train: bool,
    ) -> Tensor:
        positions = self._inputs(input_ids, labels, position_ids)
        b, t = input_ids.shape
        schedule = self._schedule(b // self.config.microbatches, t, input_ids.dtype, train=train)
        if train:
            self.last_schedule = schedule
        # Training sums the token losses (finish_step divides by the step's tokens); the values are the batch's mean.
        one = torch.ones((), device=labels.device)
        tokens, batch_tokens = self._open(labels, positions, meta, train, one if train else None)
        assert self._total is not None
        scale = self._total / batch_tokens.clamp_min(1)
        if train:
            self._step_tokens = tokens if self._step_tokens is None else self._step_tokens + tokens
        losses: list[Tensor] = []
        try:
            if train:
                schedule.step(input_ids, target=labels, losses=losses, return_outputs=False, position_ids=positions)
            else:
                schedule.eval(input_ids, target=labels, losses=losses, position_ids=positions)
            ce = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=self.device)
            total = ce
            for module in self.modules:  # the router terms, weighted at each stage (training only)
                if module.aux_total is not None:
                    total = total + module.aux_total.to(total.device)
            values = torch.stack([total, ce.to(total.device)])
            if self.cp_group is not None:  # every shard's token losses and router terms
                dist.all_reduce(values, group=self.cp_group)
            values = values * scale.to(values.device)
        finally:
            self._close()
        values = self._sum_over_pipeline(values)
        if train:
            self.last_ce = values[1]
        return values[0]

    def _sum_over_pipeline(self, value: Tensor) -> Tensor:
        if self.group is not None and self.config.size > 1:
            value = value.to(self.device)
            dist.all_reduce(value, group=self.group)
        return value

    @property
    def tied_holders(self) -> int:
        """Ranks of the pipeline that hold the tied embedding/head weight: 2 when the first and the last stage sit
        on different ranks, else 1 (or 0 on a rank holding neither, or without tied weights)."""
        if not self.tied or not (self.has_first or self.has_last):
            return 0
        return 2 if self._tied_group is not None else 1

    def tied_weight(self) -> Tensor | None:
        """The tied embedding/head weight when this rank holds it, else ``None``."""
        embed = part(self.adapter, "embed")
        return embed.get_parameter(self._tied_name) if self._tied_name is not None and embed is not None else None

    def finish_step(self) -> None:
        """Completes the gradients of an optimizer step (once, after every batch of it, before clipping): divides
        them by the step's label tokens (all its batches, all data-parallel replicas: one all-reduce of a count),
        sums them over the replicas and sums the tied embedding/head gradient of the first and the last stage.

        Example::

            runner.step(...); runner.step(...)  # gradient accumulation
            runner.finish_step()
            optimizer.step()
        """
        tokens, self._step_tokens = self._step_tokens, None
        if tokens is None:
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp_group is not None:
            tokens = tokens.clone()
            dist.all_reduce(tokens, group=self.dp_group)
        factor = 1.0 / tokens.clamp_min(1)
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for param in params:
            assert param.grad is not None
            grad = _local(param.grad)
            grads.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, dtype), group in grads.items():
            torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))
        # FSDP2 summed its (DTensor) gradients over the stage's ranks already; local experts are summed over the
        # ranks holding the same experts, the replicated rest over the stage.
        plain = [p for p in params if not isinstance(p.grad, DTensor)]
        if self.dp_group is not None:
            sum_gradients([p for p in plain if id(p) not in self.expert_params], self.dp_group)
        if self.expert_group is not None:
            sum_gradients([p for p in plain if id(p) in self.expert_params], self.expert_group)
        self._reduce_tied_grads()

    def _reduce_tied_grads(self) -> None:
        """Sums the tied embedding/head gradient of the first and the last stage; nothing to do when one rank holds
        both or the weights are not tied."""
        if self._tied_group is None:
            return
        weight = self.tied_weight()
        assert weight is not None
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        # Under FSDP2 both copies are sharded alike over their stages' ranks: the pair holds the same rows.
        dist.all_reduce(_local(weight.grad), group=self._tied_group)


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (sharing its storage), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
