"""Cutting a model into pipeline stages: the balanced cut, the stage-to-rank placement, the in-place pruning and the
stage modules :class:`~torch.distributed.pipelining.PipelineStage` runs.

Everything here reaches the model through its stage adapter
(:class:`~lightning_llmfast.parallel.pipeline_stage.StageAdapter`: where the embedding, the layer list, the final
norm and the head are registered, and how a stage runs forward), never through a family's own attributes.

A model is split at its transformer layers. The cut balances the stages' cost, where a unit's cost is its parameter
count (memory) plus the parameters a token goes through (compute: an MoE block counts ``top_k / num_experts`` of its
experts); the embedding is counted on the first stage, the final norm and the head on the last (a tied head again,
as the last stage holds the shared weight too). Pruning keeps, on each rank, only its stages' modules under the full
model's own names, so ``named_parameters()`` (optimizers, clipping, checkpoints, export) works by name.

Stage ``s`` of ``S = pp * v`` lives on pipeline rank ``s % pp`` (the "loop" placement of the interleaved
schedules) or, for the V-shaped ``"zbv"``, rank ``r`` holds stages ``r`` and ``S - 1 - r``.

Example::

    counts = balanced_cut(layer_costs, stages=4, first=embed_cost, last=head_cost)  # layers per stage
    kept = rank_stages(pp=2, stages_per_rank=2, rank=0, style="loop")               # [0, 2]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError, MetadataError
from lightning_llmfast.moe import GroupedMoE, MoELayer
from lightning_llmfast.parallel.pipeline_stage import StageAdapter
from lightning_llmfast.seqmeta import SequenceMetadata

__all__ = [
    "KeptLayers",
    "StageModule",
    "balanced_cut",
    "indexed_layers",
    "layer_ranges",
    "part",
    "prune_stages",
    "rank_stages",
    "split_metadata",
    "stage_costs",
    "tied_parameter",
]

STYLES = ("loop", "v")


def balanced_cut(costs: Sequence[float], stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Layers per stage that minimise the largest stage cost, every stage holding at least one layer.

    Args:
        costs: the cost of every layer, in order.
        stages: number of stages ``S``; at most ``len(costs)``.
        first: extra cost of the first stage (the embedding).
        last: extra cost of the last stage (final norm and head).

    Returns:
        ``S`` counts summing to ``len(costs)``. Among the cuts with the smallest maximum the earliest boundaries win
        (deterministic on every rank).

    Raises:
        ConfigError: more stages than layers, or fewer than one stage.

    Example::

        balanced_cut([1, 1, 1, 1], 2, first=2)  # [1, 3]
    """
    n = len(costs)
    if stages < 1 or stages > n:
        raise ConfigError(f"pipeline: cannot cut {n} layers into {stages} stages (each stage needs a layer)")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))

    def stage_cost(stage: int, lo: int, hi: int) -> float:
        extra = (first if stage == 0 else 0.0) + (last if stage == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: smallest maximum over stages 0..s-1 holding layers [0, i); cut[s][i] the start of stage s-1.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], stage_cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


def layer_ranges(counts: Sequence[int]) -> list[range]:
    """The layer indices of every stage from the layers per stage.

    Example::

        layer_ranges([1, 3])  # [range(0, 1), range(1, 4)]
    """
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def rank_stages(pp: int, stages_per_rank: int, rank: int, style: str) -> list[int]:
    """The stages pipeline rank ``rank`` holds, in increasing order.

    Args:
        pp: pipeline ranks.
        stages_per_rank: ``v``.
        rank: this rank's index in its pipeline.
        style: ``"loop"`` (stage ``s`` on rank ``s % pp``) or ``"v"`` (rank ``r``: stages ``r`` and ``2pp-1-r``).

    Example::

        rank_stages(2, 2, 0, "v")  # [0, 3]
    """
    if style == "v":
        return sorted({rank, 2 * pp - 1 - rank})
    return [rank + k * pp for k in range(stages_per_rank)]


def split_metadata(meta: SequenceMetadata, parts: int) -> list[SequenceMetadata]:
    """The metadata of ``parts`` equal consecutive slices of the flattened positions (row microbatches), from the
    batch's host-side boundaries only (no device read).

    Raises:
        MetadataError: a sequence crosses a slice boundary (a packed row always starts a segment), or the positions
            do not split into ``parts`` equal slices.

    Example::

        split_metadata(SequenceMetadata.from_lengths([2, 2, 4]), 2)  # [0, 2, 4] and [0, 4]
    """
    total = meta.num_tokens
    if parts < 1 or total % parts:
        raise MetadataError(f"metadata: {total} positions do not split into {parts} equal microbatches")
    size = total // parts
    bounds = [*meta.starts, total]
    index = {value: i for i, value in enumerate(bounds)}  # starts increase strictly except for empty segments
    out = []
    for k in range(parts):
        lo, hi = k * size, (k + 1) * size
        if lo not in index or hi not in index:
            raise MetadataError(
                f"metadata: a sequence crosses the boundary of microbatch {k} (positions {lo}..{hi}); pipeline "
                "microbatches are whole rows and no sequence may cross a row"
            )
        first = min(i for i, value in enumerate(bounds) if value == lo)
        cu = [value - lo for value in bounds[first : index[hi] + 1]]
        out.append(SequenceMetadata(cu, num_tokens=size, device=meta.device))
    return out


def part(adapter: StageAdapter, name: str) -> nn.Module | None:
    """The module registered as the adapter's part ``name`` (one of ``PARTS``); ``None`` once pruned away.

    Example::

        part(adapter, "head")  # model.lm_head
    """
    owner, attribute = adapter.parts[name]
    return cast(nn.Module | None, getattr(owner, attribute, None))


def indexed_layers(adapter: StageAdapter) -> dict[int, nn.Module]:
    """The layers the model holds, by their index in the full model (all of them before pruning).

    Example::

        indexed_layers(adapter)  # {2: layers[2], 3: layers[3]} on a rank pruned to layers 2 and 3
    """
    layers = part(adapter, "layers")
    if isinstance(layers, KeptLayers):
        return dict(zip(layers.indices, layers, strict=True))
    return dict(enumerate(cast(nn.ModuleList, layers)))


def tied_parameter(adapter: StageAdapter) -> nn.Parameter | None:
    """The parameter the embedding and the head share (tied word embeddings), or ``None``.

    Example::

        tied_parameter(adapter) is model.embed.weight  # MoEGPTConfig(tie_embeddings=True)
    """
    embed, head = part(adapter, "embed"), part(adapter, "head")
    if embed is None or head is None:
        return None
    ids = {id(p) for p in embed.parameters()}
    return next((p for p in head.parameters() if id(p) in ids), None)


def _numel(module: nn.Module | None) -> float:
    return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0


def _active_shares(layer: nn.Module) -> dict[int, float]:
    """The share of a token's work each expert parameter of ``layer`` gets: ``top_k / num_experts``."""
    shares: dict[int, float] = {}
    for module in layer.modules():
        experts = getattr(module, "experts", None)
        if isinstance(module, GroupedMoE) and isinstance(experts, nn.Module):
            share = module.config.routing.top_k / module.config.num_experts
            shares.update((id(p), share) for p in experts.parameters())
    return shares


def stage_costs(adapter: StageAdapter) -> tuple[list[float], float, float]:
    """Per-layer costs and the first and last stage's extra cost (see the module docstring).

    A layer's parameters count once for memory and once more for compute, except expert parameters, which a token
    goes through at ``top_k / num_experts`` of their count; the embedding (a lookup) counts once, the final norm and
    the head twice (the head's vocabulary matmul; a tied head again: the last stage holds the weight too).

    Example::

        costs, first, last = stage_costs(stage_adapter(model))
    """
    costs = []
    for layer in indexed_layers(adapter).values():
        shares = _active_shares(layer)
        costs.append(sum(p.numel() * (1.0 + shares.get(id(p), 1.0)) for p in layer.parameters()))
    last = 2.0 * (_numel(part(adapter, "norm")) + _numel(part(adapter, "head")))
    return costs, _numel(part(adapter, "embed")), last


class KeptLayers(nn.ModuleList):
    """The layers of a pruned stack that this rank keeps, registered under their indices in the full model.

    Iteration, ``len`` and positional indexing see the kept layers only (in order); ``named_parameters()`` names them
    as the full model does (``layers.5.attn.qkv.weight``).

    Example::

        kept = KeptLayers({2: model.layers[2], 3: model.layers[3]})
        kept.indices  # (2, 3)
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        nn.Module.__init__(self)
        for index in sorted(layers):
            self.add_module(str(index), layers[index])
        self.indices: tuple[int, ...] = tuple(sorted(layers))

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:  # type: ignore[override]
        modules = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(modules[idx])
        return cast(nn.Module, modules[idx])

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(cast(list[nn.Module], list(self._modules.values())))


def prune_stages(adapter: StageAdapter, keep: Sequence[int], *, first: bool, last: bool) -> None:
    """Prune the adapter's model in place to the layers ``keep`` (full-model indices), the embedding when ``first``
    and the final norm and head when ``last``; every part left registered where the model has it.

    A tied head keeps its weight under the embedding's name: on the last stage the embedding stays registered
    (unused) so that ``named_parameters()`` lists the weight there under that name too.

    Example::

        prune_stages(stage_adapter(model), [2, 3], first=False, last=True)
    """
    tied = tied_parameter(adapter) is not None
    layers = indexed_layers(adapter)
    owner, name = adapter.parts["layers"]
    setattr(owner, name, KeptLayers({i: layers[i] for i in keep}))
    dropped = [] if first or (last and tied) else ["embed"]
    if not last:
        dropped += ["norm", "head"]
    for dropped_part in dropped:
        owner, name = adapter.parts[dropped_part]
        setattr(owner, name, None)


class StageModule(nn.Module):
    """One pipeline stage of a model, run through its :class:`~lightning_llmfast.parallel.pipeline_stage.StageAdapter`:
    the embedding (first stage), some layers, the final norm and head (last stage), registered here too so that the
    stage's ``parameters()`` are what torch's pipeline stage differentiates.

    ``forward(x, position_ids)`` takes the token ids (first stage) or the previous stage's hidden states and the
    microbatch's ``(b, T)`` positions (given to every stage with the batch), and returns hidden states (cast to
    ``dtype``, the dtype the next stage's receive buffer has) or, on the last stage, the logits. The packed metadata
    comes from the active :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` when the adapter reads it (the
    runner opens it on the microbatch's metadata). The router's load-balancing losses of the stage's MoE blocks
    (:class:`~lightning_llmfast.moe.MoELayer`) are attached to the output (:class:`AttachAuxLoss`) with the weight
    ``aux_weight`` the runner sets before each microbatch; their detached value is added to ``aux_total``.

    Example::

        stage = StageModule(stage_adapter(model), [0, 1], first=True, last=False, dtype=torch.float32)
    """

    def __init__(
        self, adapter: StageAdapter, layers: Sequence[int], *, first: bool, last: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.first, self.last, self.dtype = first, last, dtype
        self.embed = part(adapter, "embed") if first else None
        by_index = indexed_layers(adapter)
        self.layers = nn.ModuleList(by_index[i] for i in layers)
        self.norm = part(adapter, "norm") if last else None
        self.head = part(adapter, "head") if last else None
        self.aux_weight: Tensor | None = None
        self.aux_total: Tensor | None = None

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        adapter = self.adapter
        if self.first:
            x = adapter.embed(x)
        inputs = adapter.layer_inputs(x, position_ids)
        for layer in self.layers:
            x = adapter.run_layer(layer, x, inputs)
        aux = [m.stats.aux_loss for layer in self.layers for m in layer.modules() if _has_stats(m)]
        if aux and self.aux_weight is not None:
            value = torch.stack(aux).sum()
            x = AttachAuxLoss.apply(x, value, self.aux_weight)
            share = (value.detach() * self.aux_weight).float()
            self.aux_total = share if self.aux_total is None else self.aux_total + share
        if self.last:
            return adapter.head(x)
        return x.to(self.dtype)


def _has_stats(module: nn.Module) -> bool:
    return isinstance(module, MoELayer) and module.stats is not None


class AttachAuxLoss(torch.autograd.Function):
    """Identity on the hidden states whose backward also sends ``weight`` as the gradient of ``aux``: the stage's
    router loss joins the pipeline's backward without travelling through it (Megatron's aux-loss auto-scaler)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: Tensor, aux: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.aux_dtype = aux.dtype  # type: ignore[attr-defined]
        # A copy, not a view: torch's zero-bubble backward detaches the stage's outputs in place, which a view of
        # the input refuses. One activation per stage and microbatch.
        return hidden.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (weight,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, weight.to(ctx.aux_dtype), None  # type: ignore[attr-defined]
