"""Hierarchical expert-parallel dispatch (DeepSeek-V3, DeepEP): a token crosses the node boundary at most once per
destination node and is fanned out to its experts inside that node.

The ``W`` ranks of the expert-parallel group sit on ``N`` nodes of ``L`` ranks each (group ranks ``n * L`` to
``(n + 1) * L - 1`` on node ``n``). Experts are contiguous per rank, so node ``n`` holds the ``L * E_l`` experts from
``n * L * E_l`` on. :func:`node_groups` makes two families of sub-groups of the group: the *inter-node* groups (the
ranks of one local index ``l``, one per node) and the *intra-node* groups (the ranks of one node).

:class:`HierarchicalDispatcher` composes two flat dispatches (:class:`AllToAllDroplessDispatcher`), one per level:

1. Across nodes: each token's kept pairs are keyed by the node of their expert and the first pair of every
   (token, node) is kept: a routing plan over ``N`` "experts", the nodes. The flat dispatch of that plan over the
   inter-node group sends every token once to the rank of its own local index on each destination node, and the
   token's ``k`` combine weights and expert ids travel with it on the same splits (the weights are differentiable:
   their gradients come back the same way).
2. Inside the node: the received rows, with the pairs whose expert is on this node, make a routing plan over the
   node's experts; the flat dispatch of that plan over the intra-node group brings them to their experts, and its
   combine weights and sums each row's outputs there.
3. The combine of step 1 sends each (token, node) sum back across the boundary and adds them up at home.

Outputs and gradients equal the flat dispatch's up to the order of the float sums (a token's outputs are summed per
node, then over the nodes). Every dispatch reads split sizes on the host twice (one read per level, each one
:attr:`AllToAllDispatcher.host_syncs` counts), with or without a capacity limit: the drops of a capacity plan are
honoured (dropped pairs never leave home) but the splits are not fixed. A quantized payload is applied at each level
(tokens are encoded before the node hop and again before the hop inside the node; sums come back in the combine
payload from each level), so its rounding error can add up twice.

Example::

    groups = node_groups(ep_group, ranks_per_node=8, timeout=timedelta(minutes=5))  # every rank of the world
    block.set_dispatcher(HierarchicalDispatcher(ep_group, num_experts=256, groups=groups))
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.dispatchers import (
    AllToAllDispatcher,
    AllToAllDroplessDispatcher,
    global_aux_loss,
)
from lightning_llmfast.expert_parallel.exchange import masked_gather
from lightning_llmfast.expert_parallel.payload import DispatchPayload, exchange
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.kernels import resolve_backend
from lightning_llmfast.moe.kernels.plan import routing_plan
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import permute

__all__ = ["HierarchicalDispatcher", "NodeGroups", "check_node_limited", "group_nodes", "node_groups"]


class NodeGroups(NamedTuple):
    """The node layout of an expert-parallel group and its two sub-groups (built by :func:`node_groups`).

    Attributes:
        nodes: the node (``0 .. N - 1``) of each rank of the group, in group-rank order.
        inter: this rank's inter-node group: the ranks of its local index, one per node (its rank there: the node).
        intra: this rank's intra-node group: the ranks of its node (its rank there: the local index).
    """

    nodes: tuple[int, ...]
    inter: dist.ProcessGroup
    intra: dist.ProcessGroup

    @property
    def num_nodes(self) -> int:
        """``N``, the nodes the group spans."""
        return self.nodes[-1] + 1

    @property
    def ranks_per_node(self) -> int:
        """``L``, the group's ranks on each node."""
        return len(self.nodes) // self.num_nodes


def group_nodes(ranks: Sequence[int], ranks_per_node: int) -> tuple[int, ...]:
    """The node (``0 .. N - 1``) of each of a group's global ``ranks``: node of global rank ``g`` is
    ``g // ranks_per_node``.

    Raises:
        ConfigError: ``ranks_per_node < 1``, or the group's ranks do not fill its nodes in equal, contiguous runs of
            ascending ranks (hierarchical dispatch needs the same number of the group's ranks on every node).

    Example::

        group_nodes([0, 1, 2, 3], ranks_per_node=2)  # (0, 0, 1, 1)
    """
    if ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    hosts = [rank // ranks_per_node for rank in ranks]
    order = sorted(set(hosts))
    nodes = tuple(order.index(host) for host in hosts)
    runs = [nodes.count(node) for node in range(len(order))]
    if list(ranks) != sorted(ranks) or len(set(runs)) != 1:
        raise ConfigError(
            f"the expert-parallel group's ranks {list(ranks)} must span whole nodes in equal runs of ascending ranks "
            f"({ranks_per_node} processes per node put them on nodes {hosts})"
        )
    return nodes


def node_groups(group: dist.ProcessGroup, ranks_per_node: int, *, timeout: timedelta | None = None) -> NodeGroups:
    """The inter- and intra-node sub-groups of ``group``: a collective over the whole world (every rank calls it,
    each with its own expert-parallel group; the groups must partition the world).

    Args:
        group: this rank's expert-parallel group.
        ranks_per_node: processes per node (global rank ``g`` runs on node ``g // ranks_per_node``).
        timeout: the sub-groups' collective timeout (``None``: torch's default).

    Raises:
        ConfigError: from :func:`group_nodes`, for this rank's or another rank's group.

    Example::

        groups = node_groups(dims.ep_mesh.get_group(), ranks_per_node=8, timeout=timedelta(minutes=5))
    """
    ranks = dist.get_process_group_ranks(group)
    nodes = group_nodes(ranks, ranks_per_node)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    intra, inter = [], []
    for layout in sorted({tuple(theirs) for theirs in everyone}):
        per_node = len(layout) // (group_nodes(layout, ranks_per_node)[-1] + 1)
        intra += [list(layout[start : start + per_node]) for start in range(0, len(layout), per_node)]
        inter += [list(layout[local::per_node]) for local in range(per_node)]
    mine_intra, _ = dist.new_subgroups_by_enumeration(intra, timeout=timeout)
    mine_inter, _ = dist.new_subgroups_by_enumeration(inter, timeout=timeout)
    return NodeGroups(nodes, mine_inter, mine_intra)


def check_node_limited(routing: RoutingConfig, num_experts: int, num_nodes: int, owner: str = "MoE block") -> None:
    """Group-limited routing bounds each token to ``topk_groups`` nodes only if every group lies inside one node.

    Experts are contiguous per rank, so node ``n`` holds ``E / N`` contiguous experts and routing group ``g`` the
    ``E / num_groups`` from ``g * E / num_groups`` on: each group falls inside a node when ``num_groups`` is a
    multiple of ``N`` (``num_groups = N``: the groups are the nodes, DeepSeek-V3's node-limited routing).

    Raises:
        ConfigError: ``routing`` is group-limited and its groups straddle nodes.

    Example::

        check_node_limited(RoutingConfig(top_k=8, num_groups=8, topk_groups=4), 256, num_nodes=8)
    """
    groups = routing.num_groups
    if groups is not None and groups % num_nodes:
        raise ConfigError(
            f"{owner}: group-limited routing with num_groups={groups} over {num_experts} experts does not align "
            f"with the {num_nodes} nodes of the expert-parallel group ({num_experts // num_nodes} contiguous experts "
            f"each): groups straddle nodes, so topk_groups={routing.topk_groups} bounds no token's nodes; set "
            f"num_groups to a multiple of {num_nodes} (num_groups={num_nodes}: one group per node)"
        )


class _Levels(NamedTuple):
    """The contexts of a hierarchical dispatch: the across-nodes and the inside-the-node flat dispatches."""

    across: Any
    within: Any


class HierarchicalDispatcher(AllToAllDispatcher):
    """Expert parallelism over nodes: a token crosses the boundary once per destination node (module docstring).

    Args:
        group: the expert-parallel process group (its ranks fill whole nodes equally, in ascending order).
        num_experts: ``E`` (global; divisible by the group's size).
        groups: the group's node layout and sub-groups (:func:`node_groups`).
        loss_group: the ranks whose tokens form one batch for the balance loss (default: the world).
        backend: the permutation's and the experts' kernels (``"auto"``, ``"torch"``, ``"triton"``).
        payload: what the exchanges put on the wire, at both levels.

    Attributes:
        across: the flat dispatch between the nodes (over ``groups.inter``, the nodes as its experts).
        within: the flat dispatch inside the node (over ``groups.intra``, the node's experts).
        traffic: the bytes both levels have sent so far (the weights and expert ids that cross with the tokens
            included): across the boundary only in :attr:`across`, inside the node only in :attr:`within`.

    Raises:
        ConfigError: ``groups`` is not a layout of ``group`` with this rank at its place.

    Example::

        dispatcher = HierarchicalDispatcher(group, 8, node_groups(group, ranks_per_node=2))
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        groups: NodeGroups,
        loss_group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        payload: DispatchPayload | None = None,
    ) -> None:
        super().__init__(group, num_experts, loss_group, backend, payload, groups.nodes)
        num_nodes, per_node = groups.num_nodes, groups.ranks_per_node
        place = (dist.get_rank(groups.inter), dist.get_rank(groups.intra))
        if place != (self.rank // per_node, self.rank % per_node) or num_nodes * per_node != self.world:
            raise ConfigError(
                f"rank {self.rank} of an expert-parallel group of {self.world} ranks on {num_nodes} nodes has rank "
                f"{place} in the (inter, intra)-node groups it was given: they are not this group's"
            )
        self.across = AllToAllDroplessDispatcher(
            groups.inter, num_nodes, loss_group, backend, payload, nodes=range(num_nodes)
        )
        self.within = AllToAllDroplessDispatcher(groups.intra, num_experts // num_nodes, loss_group, backend, payload)
        self.across.traffic = self.within.traffic = self.traffic

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        source = self._start(x, plan, x_compute)
        backend = resolve_backend(self.backend, source.device)
        num_nodes, top_k = self.across.num_experts, plan.top_k
        per_node = self.within.num_experts
        # Across: each token's kept pairs keyed by their expert's node, the first one of every node kept.
        node = plan.expert_ids.long() // per_node
        valid = plan.kept if plan.padded else torch.ones_like(node, dtype=torch.bool)
        earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=node.device).tril(-1)  # [s, s'] for s' < s
        repeated = (node.unsqueeze(2) == node.unsqueeze(1)) & earlier & valid.unsqueeze(1)
        first = valid & ~repeated.any(dim=2)
        ones = torch.ones_like(plan.weights, dtype=torch.float32)  # the home sum over the nodes, unweighted
        node_plan = _keyed_plan(torch.where(first, node, num_nodes), ones, num_nodes, backend)
        sent, across = self.across.dispatch(source, node_plan)
        # The token's weights and expert ids ride on the same splits: ids as float32 (exact below 2**24), -1 where a
        # pair was dropped or masked.
        ids = torch.where(valid, plan.expert_ids.long(), -1).to(torch.float32)
        riders = permute(torch.cat([plan.weights.float(), ids], dim=1), node_plan, backend=backend)
        inverse, order = across.maps
        arrived = exchange(
            riders[: self.across.send_rows], across.out_splits, across.in_splits, self.across.group, wire=None,
            grad_wire=None,
        )  # fmt: skip
        arrived = masked_gather(arrived, order, None, inverse, None)
        self.traffic.add(self.across.nodes, self.across.rank, across.in_splits, riders.shape[1] * riders.itemsize)
        weights, ids = arrived.split(top_k, dim=1)
        # Within: the pairs of the arrived rows whose expert is on this node, keyed by the node's expert index.
        local = ids.detach().long() - self.across.rank * per_node
        on_node = (local >= 0) & (local < per_node)
        expert_plan = _keyed_plan(torch.where(on_node, local, per_node), weights, per_node, backend)
        rows, within = self.within.dispatch(sent.rows, expert_plan)
        self.host_syncs = self.across.host_syncs + self.within.host_syncs
        self.send_rows, self.recv_rows = self.across.send_rows, self.within.recv_rows
        return rows, _Levels(across, within)

    def combine(self, rows: Tensor, ctx: _Levels) -> Tensor:
        """Weight and sum each token's outputs inside each node, send the sums home and add them up: ``(T, H)``."""
        return self.across.combine(self.within.combine(rows, ctx.within), ctx.across)

    def batch_aux_loss(self, plan: RoutingPlan) -> Tensor:
        """This rank's share of the balance loss of the whole batch over ``loss_group`` (one all-reduce)."""
        return global_aux_loss(plan, self.loss_group)


def _keyed_plan(keys: Tensor, weights: Tensor, num_experts: int, backend: str) -> RoutingPlan:
    """The dropless :class:`RoutingPlan` of ``(T, k)`` pairs keyed by expert, ``num_experts`` for pairs left out.

    Every token is marked valid so that the plan counts as padded: its left-out pairs sort last and are not kept.
    """
    num_tokens, top_k = keys.shape
    counted = routing_plan(keys.reshape(-1), num_experts + 1, num_experts, None, top_k, backend=backend, rows=False)
    zero = weights.new_zeros(())
    return RoutingPlan(
        expert_ids=keys.to(torch.int32),
        weights=weights,
        tokens_per_expert=counted.tokens_per_expert,
        offsets=counted.offsets,
        permutation=counted.permutation,
        kept=counted.kept.view(num_tokens, top_k),
        num_dropped=counted.num_dropped,
        aux_loss=zero,
        z_loss=zero,
        nonfinite=None,
        capacity=None,
        num_experts=num_experts,
        top_k=top_k,
        routed_per_expert=counted.routed,
        token_mask=torch.ones(num_tokens, dtype=torch.bool, device=keys.device),
    )
