"""A sharding plan at any scale without the hardware: the strategy's real FSDP2 x EP layout on a fake process group.

:func:`sharding_plan` builds the model on the meta device (nothing allocated), joins torch's fake process group
(collectives are no-ops, thousands of ranks in one process), applies :func:`~lightning_llmfast.parallel.parallelize`
exactly as :class:`~lightning_llmfast.LLMFastStrategy` does under ``sharding="fsdp"``, and reads every rank's share
of every parameter from the resulting DTensors. :func:`formula_plan` computes the same rows in closed form
(``docs/distributed.md`` states it); a test holds the two equal.

Per rank: parameter bytes (dense and routed experts), gradient bytes (as the parameters) and AdamW state bytes (two
fp32 moments). Per step and rank: bytes received by FSDP2's all-gathers (in the compute dtype; every group gathered
in forward and again in backward, the roots included, except the last layer's own group, once), bytes sent by its
reduce-scatters (in the reduce dtype, once per group) and the expected all-to-all bytes of the token exchange
(dispatch and combine, forward and backward, the ``(ep - 1) / ep`` of the rows that leave the rank under uniform
routing). With ``--pp`` (the reference model only): per pipeline rank, the parameters, gradients and AdamW
states of its stages and the peak activations of its microbatches in flight (:func:`pipeline_plan`). With ``--nodes``
(``world = nodes * gpus_per_node``): the all-to-all bytes that cross the node boundary
per token and per step, flat against hierarchical dispatch (:class:`InterNodeBytes`); with ``--link-gbps`` and
``--tflops``: per MoE layer, that exchange's time against the expert GEMMs' time (:class:`ExchangeOverlap`).

Example::

    python -m lightning_llmfast.plan deepseek-v3 --world 256 --ep 64
    python -m lightning_llmfast.plan deepseek-v3 --nodes 32 --gpus-per-node 8 --ep 64  # + inter-node bytes
    python -m lightning_llmfast.plan deepseek-v3 --nodes 8 --ep 64 --link-gbps 400 --tflops 400  # + can it hide?
    python -m lightning_llmfast.plan reference --pp 4 --microbatches 8 --schedule 1f1b --batch 8  # per stage

    plan = sharding_plan("qwen3-235b-a22b", world=256, ep=64)
    plan.ranks[0].expert_params  # bytes of routed-expert parameters on rank 0
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel import grouped_moe_blocks
from lightning_llmfast.expert_parallel.hierarchical import check_node_limited
from lightning_llmfast.expert_parallel.payload import WIRES, DispatchPayload, wire_row_bytes
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.fsdp import expert_shard_dim
from lightning_llmfast.parallel.layout import parallelize
from lightning_llmfast.parallel.pipeline import SCHEDULES, PipelineConfig
from lightning_llmfast.parallel.pipeline_memory import StageBytes, stage_memory

__all__ = [
    "PRESETS",
    "ExchangeOverlap",
    "InterNodeBytes",
    "ParamShape",
    "PipelinePlan",
    "RankBytes",
    "ShardingPlan",
    "a2a_bytes",
    "expected_remote_nodes",
    "exchange_overlap",
    "expected_remote_pairs",
    "formula_plan",
    "inter_node_bytes",
    "main",
    "param_shapes",
    "pipeline_plan",
    "sharding_plan",
]

ADAM_STATES = 2
"""AdamW keeps two moments per parameter element, in the parameters' dtype (fp32 master weights)."""


def _presets() -> dict[str, Any]:
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    from lightning_llmfast.models import MoEGPTConfig

    return {
        "deepseek-v3": lambda: DeepseekV3Config(),  # 671B: 61 layers, 256 routed experts, 8 active, 1 shared
        "qwen3-235b-a22b": lambda: Qwen3MoeConfig(
            hidden_size=4096,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
        ),
        "mixtral-8x22b": lambda: MixtralConfig(
            hidden_size=6144,
            num_hidden_layers=56,
            num_attention_heads=48,
            num_key_value_heads=8,
            intermediate_size=16384,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32768,
        ),
        "reference": MoEGPTConfig,
    }


PRESETS: tuple[str, ...] = ("deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "reference")
"""Model names :func:`sharding_plan` builds from configs written here (nothing is downloaded)."""


@dataclass(frozen=True)
class ParamShape:
    """One parameter as the plan sees it: global shape, bytes per element, routed expert or dense, gathers/step."""

    name: str
    shape: tuple[int, ...]
    element_size: int
    expert: bool
    gathers: int


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds, in bytes."""

    rank: int
    dense_params: int
    expert_params: int
    grads: int
    optimizer: int


@dataclass(frozen=True)
class InterNodeBytes:
    """Expected all-to-all bytes that cross the node boundary, flat against hierarchical dispatch.

    Attributes:
        nodes: nodes the expert-parallel group spans (``ep / gpus_per_node``, at least 1).
        max_nodes: other nodes a token can reach (``topk_groups`` under node-aligned group-limited routing).
        remote_pairs: flat: expected (token, expert on another node) pairs per token.
        remote_nodes: hierarchical: expected (token, other node) pairs per token.
        flat_per_token: flat bytes per token and MoE layer (forward and backward).
        hierarchical_per_token: hierarchical bytes per token and MoE layer (its weights and expert ids included).
        flat_per_step: flat bytes per rank and step (all MoE layers).
        hierarchical_per_step: hierarchical bytes per rank and step.
    """

    nodes: int
    max_nodes: int
    remote_pairs: float
    remote_nodes: float
    flat_per_token: float
    hierarchical_per_token: float
    flat_per_step: float
    hierarchical_per_step: float

    def table(self) -> str:
        """The two dispatches side by side, as text."""
        return "\n".join([
            f"inter-node all-to-all (expected; EP spans {self.nodes} nodes, a token reaches at most "
            f"{self.max_nodes} others):",
            "dispatch      remote/token  bytes/token/layer  GB/rank/step",
            f"flat          {self.remote_pairs:12.3f} {self.flat_per_token:18.0f} {self.flat_per_step / 1e9:13.3f}",
            f"hierarchical  {self.remote_nodes:12.3f} {self.hierarchical_per_token:18.0f} "
            f"{self.hierarchical_per_step / 1e9:13.3f}",
        ])  # fmt: skip


def expected_remote_pairs(num_experts: int, top_k: int, nodes: int) -> float:
    """Flat dispatch: expected experts of a token on nodes other than its own, ``k (N - 1) / N``.

    Each chosen expert is on any of the ``N`` nodes alike (routing is symmetric in the experts, and the groups of
    group-limited routing are too), whatever the selection rule.

    Example::

        expected_remote_pairs(256, 8, nodes=8)  # 7.0
    """
    return top_k * (nodes - 1) / nodes


def expected_remote_nodes(
    num_experts: int, top_k: int, nodes: int, num_groups: int | None = None, topk_groups: int | None = None
) -> float:
    """Hierarchical dispatch: expected nodes other than its own that a token reaches, ``(N - 1) P(node n hit)``.

    The routing model: the token's ``k`` experts uniform among the ``E`` experts (the top-k of exchangeable scores),
    or, with group-limited routing, ``topk_groups`` of the ``num_groups`` groups uniform and the ``k`` experts uniform
    among theirs (groups inside nodes: :func:`~lightning_llmfast.expert_parallel.hierarchical.check_node_limited`).
    A node ``n`` holding ``j`` of the chosen groups is missed with probability ``C((M - j) s, k) / C(M s, k)``
    (``s = E / G`` experts a group), ``j`` hypergeometric; without groups, ``C(E - E / N, k) / C(E, k)``.

    Example::

        expected_remote_nodes(256, 8, nodes=8, num_groups=8, topk_groups=4)
    """
    if nodes == 1:
        return 0.0
    if num_groups is None or topk_groups is None:
        missed = math.comb(num_experts - num_experts // nodes, top_k) / math.comb(num_experts, top_k)
    else:
        per_node, size = num_groups // nodes, num_experts // num_groups
        pool, choices = math.comb(topk_groups * size, top_k), math.comb(num_groups, topk_groups)
        missed = sum(
            math.comb(per_node, j) * math.comb(num_groups - per_node, topk_groups - j) / choices
            * math.comb((topk_groups - j) * size, top_k) / pool
            for j in range(min(per_node, topk_groups) + 1)
        )  # fmt: skip
    return (nodes - 1) * (1 - missed)


def inter_node_bytes(
    routing: RoutingConfig,
    num_experts: int,
    hidden: int,
    *,
    ep: int,
    gpus_per_node: int,
    tokens_per_rank: int,
    moe_layers: int,
    compute_bytes: int = 2,
    payload: DispatchPayload | None = None,
) -> InterNodeBytes:
    """Expected bytes a rank sends across the node boundary, flat against hierarchical dispatch.

    A row crossing the boundary costs what it costs in :func:`a2a_bytes` (dispatch, combine; forward, backward);
    the hierarchical dispatch's rows also carry the token's ``k`` weights and expert ids, ``8 k`` bytes, forward, and
    the weights' gradients, ``4 k`` bytes, backward. Flat sends :func:`expected_remote_pairs` rows a token,
    hierarchical :func:`expected_remote_nodes`.

    Raises:
        ConfigError: ``ep`` spans part of a node or nodes unequally, or group-limited routing whose groups straddle
            nodes.

    Example::

        inter_node_bytes(RoutingConfig(top_k=8), 256, 7168, ep=64, gpus_per_node=8, tokens_per_rank=4096,
                         moe_layers=58)
    """
    if ep > gpus_per_node and ep % gpus_per_node:
        raise ConfigError(f"ep={ep} must fill whole nodes of {gpus_per_node} GPUs (a multiple of it, or within one)")
    nodes = max(ep // gpus_per_node, 1)
    check_node_limited(routing, num_experts, nodes)
    top_k, groups, chosen = routing.top_k, routing.num_groups, routing.topk_groups
    payload = payload or DispatchPayload()
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[compute_bytes]
    row = wire_row_bytes(payload.dispatch, hidden, dtype) + 3 * wire_row_bytes(payload.combine, hidden, dtype)
    pairs = expected_remote_pairs(num_experts, top_k, nodes)
    reached = expected_remote_nodes(num_experts, top_k, nodes, groups, chosen)
    flat, hierarchical = pairs * row, reached * (row + 12 * top_k)
    steps = tokens_per_rank * moe_layers
    max_nodes = min(nodes - 1, chosen if chosen is not None else top_k)
    return InterNodeBytes(nodes, max_nodes, pairs, reached, flat, hierarchical, flat * steps, hierarchical * steps)


@dataclass(frozen=True)
class ExchangeOverlap:
    """Per MoE layer and rank: the expected inter-node exchange time at a link bandwidth against the routed experts'
    grouped-GEMM time at a throughput, forward and backward, for flat and hierarchical dispatch.

    The exchange can hide behind the GEMMs (``ep_overlap``) when its time is at most theirs: ``ratio <= 1``.

    Attributes:
        link_gbps: the inter-node bandwidth of one rank (Gbit/s, each way).
        tflops: the expert GEMMs' throughput of one rank (dense TFLOP/s).
        gemm_ms: ``(forward, backward)`` milliseconds of the expert GEMMs.
        flat_ms: ``(forward, backward)`` milliseconds of flat dispatch's inter-node exchanges.
        hierarchical_ms: the same for hierarchical dispatch.
    """

    link_gbps: float
    tflops: float
    gemm_ms: tuple[float, float]
    flat_ms: tuple[float, float]
    hierarchical_ms: tuple[float, float]

    def table(self) -> str:
        """Exchange against GEMM time per dispatch and direction, as text."""
        lines = [
            f"per MoE layer and rank at {self.link_gbps:g} Gbit/s across nodes, {self.tflops:g} TFLOP/s in the "
            "expert GEMMs (expected):",
            "dispatch      pass      exchange_ms  gemm_ms  ratio  hides",
        ]
        for name, times in (("flat", self.flat_ms), ("hierarchical", self.hierarchical_ms)):
            for index, direction in enumerate(("forward", "backward")):
                exchange, gemm = times[index], self.gemm_ms[index]
                ratio, hides = exchange / gemm, "yes" if exchange <= gemm else "no"
                lines.append(f"{name:<13} {direction:<9} {exchange:11.3f} {gemm:8.3f} {ratio:6.2f}  {hides}")
        return "\n".join(lines)


def exchange_overlap(
    routing: RoutingConfig,
    num_experts: int,
    hidden: int,
    ffn: int,
    *,
    ep: int,
    gpus_per_node: int,
    tokens_per_rank: int,
    link_gbps: float,
    tflops: float,
    compute_bytes: int = 2,
    payload: DispatchPayload | None = None,
) -> ExchangeOverlap:
    """Whether the inter-node exchange of an MoE layer can hide behind its expert GEMMs, per rank.

    GEMMs: a (token, expert) pair costs ``6 H F`` FLOPs forward (SwiGLU: ``H -> 2 F`` and ``F -> H``) and twice that
    backward; a rank's experts process ``T k`` pairs on average. Exchange: the expected inter-node rows of
    :func:`inter_node_bytes`, forward ``dispatch + combine`` (hierarchical: ``+ 8 k`` bytes of weights and ids),
    backward two ``combine`` rows (hierarchical: ``+ 4 k`` bytes of the weights' gradients), sent at ``link_gbps``.
    Rows between ranks of one node are left out (they travel on the node's faster links).

    Raises:
        ConfigError: ``link_gbps`` or ``tflops`` not a positive finite number, or from :func:`inter_node_bytes`.

    Example::

        exchange_overlap(RoutingConfig(top_k=8), 256, 7168, 2048, ep=64, gpus_per_node=8, tokens_per_rank=4096,
                         link_gbps=400, tflops=400)
    """
    for name, value in (("link_gbps", link_gbps), ("tflops", tflops)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
    nodes = inter_node_bytes(
        routing, num_experts, hidden, ep=ep, gpus_per_node=gpus_per_node, tokens_per_rank=tokens_per_rank,
        moe_layers=1, compute_bytes=compute_bytes, payload=payload,
    )  # fmt: skip
    payload = payload or DispatchPayload()
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[compute_bytes]
    out, back = wire_row_bytes(payload.dispatch, hidden, dtype), wire_row_bytes(payload.combine, hidden, dtype)
    top_k = routing.top_k

    def ms(rows: float, row_bytes: float) -> float:
        return tokens_per_rank * rows * row_bytes * 8 / (link_gbps * 1e9) * 1e3

    forward = tokens_per_rank * top_k * 6 * hidden * ffn / (tflops * 1e12) * 1e3
    return ExchangeOverlap(
        link_gbps, tflops, (forward, 2 * forward),
        (ms(nodes.remote_pairs, out + back), ms(nodes.remote_pairs, 2 * back)),
        (ms(nodes.remote_nodes, out + back + 8 * top_k), ms(nodes.remote_nodes, 2 * back + 4 * top_k)),
    )  # fmt: skip


@dataclass(frozen=True)
class ShardingPlan:
    """Per-rank memory and per-step communication of a layout (see the module docstring for the definitions)."""

    model: str
    world: int
    ep: int
    params: int
    ranks: tuple[RankBytes, ...]
    all_gather: tuple[int, ...]
    reduce_scatter: tuple[int, ...]
    all_to_all: int
    inter_node: InterNodeBytes | None = None
    overlap: ExchangeOverlap | None = None

    def rows(self) -> list[tuple[int, ...]]:
        """Per rank: ``(dense, expert, grads, optimizer, all-gather, reduce-scatter)`` bytes."""
        return [self._row(index) for index in range(len(self.ranks))]

    def table(self) -> str:
        """Rows of distinct ranks (equal neighbours collapsed) and the step's communication, as text."""
        lines = [f"{self.model}: {self.params / 1e9:.2f}B parameters, world {self.world}, ep {self.ep}, "
                 f"edp {self.world // self.ep}", "ranks      dense_GB  expert_GB  grads_GB  adam_GB  "
                 "all_gather_GB  reduce_scatter_GB"]  # fmt: skip
        start = 0
        for index in range(1, len(self.ranks) + 1):
            if index == len(self.ranks) or self._row(index) != self._row(start):
                r = self.ranks[start]
                span = f"{start}" if index - 1 == start else f"{start}-{index - 1}"
                lines.append(
                    f"{span:<10} {r.dense_params / 1e9:8.3f} {r.expert_params / 1e9:10.3f} {r.grads / 1e9:9.3f} "
                    f"{r.optimizer / 1e9:8.3f} {self.all_gather[start] / 1e9:14.3f} "
                    f"{self.reduce_scatter[start] / 1e9:18.3f}"
                )
                start = index
        lines.append(f"all-to-all per rank and step (expected, uniform routing): {self.all_to_all / 1e9:.3f} GB")
        if self.inter_node is not None:
            lines.append(self.inter_node.table())
        if self.overlap is not None:
            lines.append(self.overlap.table())
        return "\n".join(lines)

    def _row(self, index: int) -> tuple[int, ...]:
        r = self.ranks[index]
        return (r.dense_params, r.expert_params, r.grads, r.optimizer, self.all_gather[index],
                self.reduce_scatter[index])  # fmt: skip


def _chunk(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``rows`` are cut in chunks of ``ceil(rows / parts)`` (``torch.chunk``)."""
    size = math.ceil(rows / parts)
    return max(0, min(size, rows - index * size))


def _expert_rows(shape: tuple[int, ...], ep: int, edp: int) -> tuple[int, int]:
    """``(n, row)`` of a routed-expert parameter: its ``E / ep`` local experts cut along the dimension FSDP2 shards
    them on over ``edp`` (:func:`~lightning_llmfast.parallel.fsdp.expert_shard_dim`): ``n`` slices of ``row``."""
    local = (shape[0] // ep, *shape[1:])
    n = local[expert_shard_dim(local, edp)]
    return n, math.prod(local) // n


def formula_plan(
    name: str, shapes: Sequence[ParamShape], world: int, ep: int, *, compute_bytes: int, a2a_bytes: int
) -> ShardingPlan:
    """The plan in closed form (``docs/distributed.md``), from the unsharded shapes alone.

    Rank ``r`` holds, of a dense parameter with ``d0`` rows, ``chunk(d0, world, r)`` rows; of a routed-expert
    parameter with ``E`` experts, ``chunk(n, edp, r // ep)`` slices of its ``E / ep`` local experts cut along the
    dimension FSDP2 shards them on (``n = E / ep`` experts when ``edp`` divides it, else the ``n`` entries of the
    first other dimension it divides: :func:`~lightning_llmfast.parallel.fsdp.expert_shard_dim`), where
    ``chunk(n, p, i) = clamp(n - i * ceil(n / p), 0, ceil(n / p))``. All-gathers receive ``gathers * (g - 1) *
    ceil(n / g) * row`` elements per parameter (``g`` the FSDP group: ``world`` dense, ``edp`` experts; ``n`` the rows
    or slices before FSDP), reduce-scatters send ``(g - 1) * ceil(n / g) * row`` in fp32.

    Example::

        formula_plan("m", shapes, world=256, ep=64, compute_bytes=2, a2a_bytes=a2a)
    """
    edp = world // ep
    ranks, gathers, scatters = [], [], []
    for rank in range(world):
        dense = expert = gathered = scattered = 0
        for p in shapes:
            if p.expert:
                (n, row), g, index = _expert_rows(p.shape, ep, edp), edp, rank // ep
            else:
                n, row, g, index = p.shape[0], math.prod(p.shape[1:]), world, rank
            local = _chunk(n, g, index) * row * p.element_size
            expert, dense = (expert + local, dense) if p.expert else (expert, dense + local)
            padded = math.ceil(n / g) * row * (g - 1)
            gathered += p.gathers * padded * compute_bytes
            scattered += padded * 4
        held = dense + expert
        ranks.append(RankBytes(rank, dense, expert, held, ADAM_STATES * held))
        gathers.append(gathered)
        scatters.append(scattered)
    params = sum(math.prod(p.shape) for p in shapes)
    return ShardingPlan(name, world, ep, params, tuple(ranks), tuple(gathers), tuple(scatters), a2a_bytes)


def a2a_bytes(
    tokens_per_rank: int,
    top_k: int,
    hidden: int,
    compute_bytes: int,
    ep: int,
    moe_layers: int,
    payload: DispatchPayload | None = None,
) -> int:
    """Expected all-to-all bytes per rank and step: 4 exchanges (dispatch, combine; forward, backward) per MoE layer
    of ``tokens * top_k`` rows of ``hidden`` elements, ``(ep - 1) / ep`` of them leaving the rank. A row takes
    :func:`~lightning_llmfast.expert_parallel.payload.wire_row_bytes` of the payload's wire: ``payload.dispatch``
    for the forward dispatch, ``payload.combine`` for the other three (``None``: ``compute_bytes`` an element)."""
    payload = payload or DispatchPayload()
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[compute_bytes]
    row = wire_row_bytes(payload.dispatch, hidden, dtype) + 3 * wire_row_bytes(payload.combine, hidden, dtype)
    return tokens_per_rank * top_k * row * (ep - 1) // ep * moe_layers


def _build(name: str, backend: str) -> tuple[nn.Module, list[nn.Module], int, int, int]:
    """The model on the meta device, its layer stack, and (MoE layers, top_k, hidden size)."""
    from lightning_llmfast.moe.adapters import swap_moe_blocks

    config = _presets()[name]()
    with torch.device("meta"):
        if name == "reference":
            from lightning_llmfast.models import MoEGPT

            model: nn.Module = nn.ModuleDict({"model": MoEGPT(config)})
            layers = list(model["model"].layers)
            moe_layers = config.n_layers - len(config.dense_layers)
            return model, layers, moe_layers, config.top_k, config.hidden_size
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    moe_layers = swap_moe_blocks(model, backend=backend)
    return model, list(model.model.layers), moe_layers, config.num_experts_per_tok, config.hidden_size


def param_shapes(module: nn.Module, layers: Sequence[nn.Module]) -> list[ParamShape]:
    """Every parameter's plan entry, from the unsharded ``module`` (its MoE blocks grouped).

    Routed experts: the parameters of a grouped MoE block's ``experts``. Gathered once per step: the last layer's own
    group, which stays gathered from its forward to its backward (its MoE block's groups twice, as every other group,
    the roots included: they are resharded after forward).

    Example::

        shapes = param_shapes(model, list(model.model.layers))
    """
    moe = {id(p): name for _, block in grouped_moe_blocks(module) for name, p in block.named_parameters()}
    last = {id(p) for p in layers[-1].parameters()} if layers else set()
    out = []
    for name, p in module.named_parameters():
        expert = moe.get(id(p), "").startswith("experts.")
        once = id(p) in last and id(p) not in moe
        out.append(ParamShape(name, tuple(p.shape), p.element_size(), expert, 1 if once else 2))
    return out


def _measured_rows(module: nn.Module, shapes: Sequence[ParamShape], world: int) -> list[tuple[int, int, int, int]]:
    """``(dense, expert, gathered, scattered)`` bytes per rank, read from each DTensor's mesh and placements."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rows = [[0, 0, 0, 0] for _ in range(world)]
    params = dict(module.named_parameters())
    cache: dict[Any, list[int]] = {}
    for p in shapes:
        param = params[p.name]
        if not isinstance(param, DTensor):
            raise ConfigError(f"sharding plan: {p.name} was not sharded")
        mesh, placements = param.device_mesh, param.placements
        key = (p.shape, id(mesh), tuple(placements))
        if key not in cache:
            layout = mesh.mesh
            coords = {int(r): (layout == r).nonzero()[0].tolist() for r in layout.flatten()}
            cache[key] = [
                math.prod(_compute_local_shape_and_global_offset(p.shape, layout.shape, coords[r], placements, True)[0])
                for r in range(world)
            ]
        local = cache[key]
        group = mesh.size(0)  # FSDP's dimension comes first
        padded = max(local) * (group - 1)
        for rank in range(world):
            rows[rank][1 if p.expert else 0] += local[rank] * p.element_size
            rows[rank][2] += p.gathers * padded
            rows[rank][3] += padded
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _across_nodes(
    config: Any, hidden: int, moe_layers: int, link: tuple[float | None, float | None], **nodes: Any
) -> tuple[InterNodeBytes, ExchangeOverlap | None]:
    """A block config's inter-node bytes and, given ``link = (link_gbps, tflops)``, its exchange against GEMM times."""
    inter_node = inter_node_bytes(config.routing, config.num_experts, hidden, moe_layers=moe_layers, **nodes)
    link_gbps, tflops = link
    if link_gbps is None or tflops is None:
        return inter_node, None
    overlap = exchange_overlap(
        config.routing, config.num_experts, hidden, config.ffn_size, link_gbps=link_gbps, tflops=tflops, **nodes
    )
    return inter_node, overlap


def sharding_plan(
    name: str,
    world: int,
    ep: int,
    *,
    tokens_per_rank: int = 4096,
    compute_bytes: int = 2,
    backend: str = "torch",
    dispatch_dtype: str | DispatchPayload | None = None,
    gpus_per_node: int | None = None,
    link_gbps: float | None = None,
    tflops: float | None = None,
) -> ShardingPlan:
    """Apply the strategy's FSDP2 x EP sharding to the meta-device model on a fake process group; read the bytes.

    Args:
        name: one of :data:`PRESETS`.
        world: ranks (``>= 2``).
        ep: expert-parallel size; must divide ``world`` and every MoE block's experts.
        tokens_per_rank: tokens per rank and step, for the all-to-all bytes.
        compute_bytes: bytes of the compute dtype (all-gathers and the token exchange; 2 for ``"bf16-mixed"``).
        backend: routing kernels of the swapped MoE blocks.
        dispatch_dtype: the all-to-all payload, as ``LLMFastStrategy(dispatch_dtype=...)`` takes it.
        gpus_per_node: ranks per node: adds the inter-node bytes of flat and hierarchical dispatch
            (:func:`inter_node_bytes`, from the first MoE block's routing); ``None``: not computed.
        link_gbps, tflops: with ``gpus_per_node``: adds each MoE layer's inter-node exchange time at ``link_gbps``
            against its expert GEMM time at ``tflops`` (:func:`exchange_overlap`).

    Returns:
        The :class:`ShardingPlan`; nothing is allocated and no process group stays behind.

    Raises:
        ConfigError: an unknown model, a layout that does not fit, a process group already initialised, or only one
            of ``link_gbps`` and ``tflops`` (or either without ``gpus_per_node``).

    Example::

        print(sharding_plan("deepseek-v3", world=256, ep=64).table())
    """
    if name not in PRESETS:
        raise ConfigError(f"sharding plan: model must be one of {PRESETS}, got {name!r}")
    if (link_gbps is None) != (tflops is None) or (link_gbps is not None and gpus_per_node is None):
        raise ConfigError("sharding plan: link_gbps and tflops go together, with gpus_per_node (the nodes)")
    dims = ParallelDims(world, "fsdp", ep)
    payload = DispatchPayload.of(dispatch_dtype)
    if dist.is_initialized():
        raise ConfigError("sharding plan: runs on its own fake process group; one is already initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        module, layers, moe_layers, top_k, hidden = _build(name, backend)
        shapes = param_shapes(module, layers)
        block = grouped_moe_blocks(module)[0][1]
        inter_node, overlap = None, None
        if gpus_per_node is not None:
            nodes = {"ep": ep, "gpus_per_node": gpus_per_node, "tokens_per_rank": tokens_per_rank,
                     "compute_bytes": compute_bytes, "payload": payload}  # fmt: skip
            inter_node, overlap = _across_nodes(block.config, hidden, moe_layers, (link_gbps, tflops), **nodes)
        dims.build_mesh("cpu")
        parallelize(module, dims, layers, device=torch.device("meta"), dispatch=payload)
        measured = _measured_rows(module, shapes, world)
    finally:
        dist.destroy_process_group()
    a2a = a2a_bytes(tokens_per_rank, top_k, hidden, compute_bytes, ep, moe_layers, payload)
    ranks = tuple(RankBytes(r, d, e, d + e, ADAM_STATES * (d + e)) for r, (d, e, _, _) in enumerate(measured))
    gathered = tuple(g * compute_bytes for _, _, g, _ in measured)
    scattered = tuple(s * 4 for _, _, _, s in measured)
    params = sum(math.prod(p.shape) for p in shapes)
    return ShardingPlan(name, world, ep, params, ranks, gathered, scattered, a2a, inter_node, overlap)


@dataclass(frozen=True)
class PipelinePlan:
    """Per pipeline rank: what its stages hold (:class:`~lightning_llmfast.parallel.pipeline_memory.StageBytes`)
    for a batch of ``batch_size`` rows of ``seq_len`` tokens cut into the layout's microbatches."""

    model: str
    config: PipelineConfig
    batch_size: int
    seq_len: int
    ranks: tuple[StageBytes, ...]

    def table(self) -> str:
        """One row per pipeline rank, as text."""
        cfg = self.config
        lines = [
            f"{self.model}: pipeline {cfg.size} x {cfg.stages_per_rank} stages, {cfg.schedule}, {cfg.microbatches} "
            f"microbatches of {self.batch_size // cfg.microbatches} x {self.seq_len} tokens",
            "rank  stages    layers  params_GB  grads_GB  adam_GB  in_flight  activations_GB  total_GB",
        ]
        for r in self.ranks:
            stages = ",".join(map(str, r.stages))
            lines.append(
                f"{r.rank:<5} {stages:<9} {len(r.layers):6d} {r.params / 1e9:10.3f} {r.grads / 1e9:9.3f} "
                f"{r.optimizer / 1e9:8.3f} {r.in_flight:10d} {r.activations / 1e9:15.3f} {r.total / 1e9:9.3f}"
            )
        return "\n".join(lines)


def pipeline_plan(
    name: str,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    stages_per_rank: int | None = None,
    batch_size: int = 8,
    seq_len: int = 256,
    bf16: bool = False,
) -> PipelinePlan:
    """Per-stage memory of the reference model under ``LLMFastStrategy(pipeline_parallel_size=pp, ...)``.

    Parameters, fp32 gradients and two fp32 AdamW moments of each rank's stages (the strategy's balanced cut), and
    the activations of its microbatches in flight at their peak, read from the schedule's action table
    (:func:`~lightning_llmfast.parallel.pipeline_memory.stage_memory`); what a microbatch saves in each layer is
    measured once on one CPU sequence through one layer of each kind
    (:func:`~lightning_llmfast.tune.memory.measure_probe`) and scaled by the microbatch's rows. Each stage is
    replicated over its data-parallel ranks (pipelining composes with DDP), so the rows hold at any world size.

    Raises:
        ConfigError: a model other than ``"reference"`` (only MoEGPT splits into stages), a layout the strategy
            refuses (:class:`~lightning_llmfast.parallel.pipeline.PipelineConfig`), microbatches that do not divide
            ``batch_size``, or more stages than layers.

    Example::

        print(pipeline_plan("reference", pp=2, microbatches=4, schedule="zbv").table())
    """
    from lightning_llmfast.models import MoEGPT
    from lightning_llmfast.tune.memory import measure_probe

    if name != "reference":
        raise ConfigError(f"pipeline plan: only the 'reference' MoEGPT splits into pipeline stages, got {name!r}")
    config = PipelineConfig(pp, microbatches, schedule, stages_per_rank)
    config.check_batch(batch_size)
    model_config = _presets()[name]()
    with torch.device("meta"):
        model = MoEGPT(model_config)
    config.check_layers(len(model.layers))
    probe, kinds = measure_probe(model_config, seq_len, bf16=bf16)
    rows = batch_size // microbatches
    layers = [rows * sum(probe.storages[k]) for k in kinds]
    ranks = stage_memory(model, config, layers, head_activations=rows * probe.outside)
    return PipelinePlan(name, config, batch_size, seq_len, tuple(ranks))


def main(argv: Sequence[str] | None = None) -> ShardingPlan | PipelinePlan:
    """``python -m lightning_llmfast.plan MODEL --world W --ep N [--tokens T] [--dispatch-dtype D] [--nodes N
    [--gpus-per-node G] [--link-gbps B --tflops F]]``: print it (``--nodes``: ``world = N * G`` and the inter-node
    bytes; ``--link-gbps``/``--tflops``: each MoE layer's exchange time against its expert GEMM time). Bad values
    exit with a message (argparse's usage error), not a traceback."""
    parser = argparse.ArgumentParser(prog="python -m lightning_llmfast.plan", description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=PRESETS)
    parser.add_argument("--world", type=int, default=None, help="ranks (default 256, or nodes * gpus-per-node)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes: adds the inter-node bytes, flat vs hier.")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (with --nodes)")
    parser.add_argument("--ep", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step")
    parser.add_argument("--dispatch-dtype", choices=WIRES, default=None, help="all-to-all dispatch payload")
    parser.add_argument("--link-gbps", type=float, default=None, help="inter-node Gbit/s per rank (with --nodes)")
    parser.add_argument("--tflops", type=float, default=None, help="expert GEMM TFLOP/s per rank (with --link-gbps)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages: per-stage memory instead (reference)")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: --pp)")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="pipeline schedule")
    parser.add_argument("--stages-per-rank", type=int, default=None, help="pipeline stages per rank")
    parser.add_argument("--batch", type=int, default=8, help="rows a pipeline's batch holds (with --pp)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a row holds (with --pp)")
    args = parser.parse_args(argv)
    if args.pp > 1:
        try:
            pipeline = pipeline_plan(
                args.model, args.pp, args.microbatches or args.pp, args.schedule,
                stages_per_rank=args.stages_per_rank, batch_size=args.batch, seq_len=args.seq_len,
            )  # fmt: skip
        except ConfigError as error:
            parser.error(str(error))
        print(pipeline.table())
        return pipeline
    world = args.world if args.world is not None else 256
    gpus_per_node = None
    if args.nodes is not None:
        gpus_per_node = args.gpus_per_node
        world = args.nodes * gpus_per_node
        if args.world is not None and args.world != world:
            parser.error(f"--world {args.world} is not --nodes {args.nodes} x --gpus-per-node {gpus_per_node}")
    if (args.link_gbps is None) != (args.tflops is None) or (args.link_gbps is not None and args.nodes is None):
        parser.error("--link-gbps and --tflops go together, with --nodes")
    try:
        plan = sharding_plan(
            args.model, world, args.ep, tokens_per_rank=args.tokens, dispatch_dtype=args.dispatch_dtype,
            gpus_per_node=gpus_per_node, link_gbps=args.link_gbps, tflops=args.tflops,
        )  # fmt: skip
    except ConfigError as error:
        parser.error(str(error))
    print(plan.table())
    return plan


if __name__ == "__main__":
    main()
