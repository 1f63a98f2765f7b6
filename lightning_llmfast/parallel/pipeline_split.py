"""Cutting a model into pipeline stages: the balanced cut, the stage-to-rank placement, the in-place pruning and the
stage modules :class:`~torch.distributed.pipelining.PipelineStage` runs.

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
from lightning_llmfast.models.model import MoEGPT, dense_document_mask, rope_tables
from lightning_llmfast.moe import MoELayer
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

__all__ = [
    "KeptLayers",
    "MoEGPTStage",
    "balanced_cut",
    "layer_ranges",
    "moegpt_costs",
    "prune_moegpt",
    "rank_stages",
    "split_metadata",
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


def _active_share(config: object, name: str) -> float:
    top_k, experts = getattr(config, "top_k", 1), getattr(config, "num_experts", 1)
    return top_k / experts if ".experts." in f".{name}" else 1.0


def moegpt_costs(model: MoEGPT) -> tuple[list[float], float, float]:
    """Per-layer costs and the first and last stage's extra cost of a :class:`MoEGPT` (see the module docstring).

    Example::

        costs, first, last = moegpt_costs(model)
    """
    config = model.config
    costs = []
    for layer in model.layers:
        total = 0.0
        for name, param in layer.named_parameters():
            total += param.numel() * (1.0 + _active_share(config, name))
        costs.append(total)
    embed = float(model.embed.weight.numel())  # a lookup: memory, no matmul
    head = float(model.lm_head.weight.numel()) * 2.0 + model.norm.weight.numel() * 2.0
    return costs, embed, head


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


def prune_moegpt(model: MoEGPT, keep: Sequence[int], *, first: bool, last: bool) -> None:
    """Prune ``model`` in place to the layers ``keep`` (full-model indices), the embedding when ``first`` and the
    final norm and head when ``last``.

    A tied head keeps its weight under the embedding's name: on the last stage the embedding module stays registered
    (unused) so that ``named_parameters()`` lists ``embed.weight`` there too.

    Example::

        prune_moegpt(model, [2, 3], first=False, last=True)
    """
    tied = model.lm_head.weight is model.embed.weight
    model.layers = KeptLayers({i: model.layers[i] for i in keep})
    if not (first or (last and tied)):
        model.embed = None  # type: ignore[assignment]
    if not last:
        model.norm = None  # type: ignore[assignment]
        model.lm_head = None  # type: ignore[assignment]


class MoEGPTStage(nn.Module):
    """One pipeline stage of a :class:`MoEGPT`: the embedding (first stage), some layers, the final norm and head
    (last stage).

    ``forward(x, position_ids)`` takes the token ids (first stage) or the previous stage's hidden states and the
    microbatch's ``(b, T)`` positions (given to every stage with the batch), and returns hidden states (cast to
    ``dtype``, the dtype the next stage's receive buffer has) or, on the last stage, the logits. In ``"cached"``
    attention mode the packed metadata comes from the active
    :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` (the runner opens it on the microbatch's metadata).
    The router's load-balancing loss of the stage's MoE blocks is attached to the output (:class:`AttachAuxLoss`) with
    the weight ``aux_weight`` the runner sets before each microbatch; its detached value is added to ``aux_total``.

    Example::

        stage = MoEGPTStage(model, [0, 1], first=True, last=False, dtype=torch.float32)
    """

    def __init__(self, model: MoEGPT, layers: Sequence[int], *, first: bool, last: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last, self.dtype = first, last, dtype
        self.embed = model.embed if first else None
        kept = model.layers
        by_index = dict(zip(kept.indices, kept, strict=True)) if isinstance(kept, KeptLayers) else dict(enumerate(kept))
        self.layers = nn.ModuleList(by_index[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.aux_weight: Tensor | None = None
        self.aux_total: Tensor | None = None

    def _metadata(self, x: Tensor, position_ids: Tensor) -> SequenceMetadata | Tensor | None:
        mode = self.config.attention_metadata
        if mode == "dense":
            return dense_document_mask(position_ids)
        if mode == "cached":
            cache = active_cache()
            if cache is None:
                return SequenceMetadata.from_position_ids(position_ids)
            return cache.get(x)
        return None

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        meta = self._metadata(x, position_ids)
        rope = rope_tables(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, rope, position_ids, meta)
        aux = [m.stats.aux_loss for m in (layer.ffn for layer in self.layers) if _has_stats(m)]
        if aux and self.aux_weight is not None:
            value = torch.stack(aux).sum()
            x = AttachAuxLoss.apply(x, value, self.aux_weight)
            share = (value.detach() * self.aux_weight).float()
            self.aux_total = share if self.aux_total is None else self.aux_total + share
        if self.lm_head is not None:
            assert self.norm is not None
            return self.lm_head(self.norm(x))
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
