"""Hierarchical expert-parallel dispatch (DeepSeek-V3, DeepEP): a token crosses the node boundary at most once per
destination node and is fanned out to its experts inside that node.

The ``W`` ranks of the expert-parallel group sit on ``N`` nodes of ``L`` ranks each (group ranks ``n * L`` to
``(n + 1) * L - 1`` on node ``n``). Experts are contiguous per rank, so node ``n`` holds the ``L * E_l`` experts from
``n * L * E_l`` on. :func:`node_groups` makes two families of sub-groups of the group: the *inter-node* groups (the
ranks of one local index ``l``, one per node) and the *intra-node* groups (the ranks of one node).

:class:`HierarchicalDispatcher` moves a token in two hops:

1. Across nodes: each token's kept pairs are keyed by the node of their expert and the first pair of every
   (token, node) is kept. The token's row goes once to the rank of its own local index on each destination node
   (over the inter-node group), encoded in the dispatch payload, with its ``k`` fp32 combine weights and ``k`` int32
   expert ids appended to the same row (one exchange; the weights' gradients come back appended to the rows'
   gradients).
2. Inside the node: the intermediate rank gathers the arrived rows, still encoded (fp8 is decoded only by the
   expert's rank), once per pair whose expert is on this node, and sends them to the experts' ranks over the
   intra-node group.
3. The combine weights and sums each token's outputs on the intermediate rank, sends the one sum per (token, node)
   back across the boundary and adds them up at home.

Before the hops, one all-to-all over the whole group gives every rank every rank's pairs per expert, tokens per node,
valid tokens and signature: the split sizes of both hops (one host read per layer and forward, which
:attr:`AllToAllDispatcher.host_syncs` counts) and the batch-wide counts of the balance loss (no all-reduce). A
forward runs five all-to-alls (the handshake, two hops out, two back), a backward four. Outputs and gradients equal
the flat dispatch's up to the order of the float sums (a token's outputs are summed per node, then over the nodes);
the tokens are encoded once, as the flat dispatch encodes them. With a capacity limit the plan's drops are honoured
(dropped pairs never leave home) but the splits are not fixed.

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
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.dispatchers import AllToAllDispatcher, AllToAllDroplessDispatcher
from lightning_llmfast.expert_parallel.exchange import masked_gather, stage_to_device
from lightning_llmfast.expert_parallel.payload import DispatchPayload, _decode, _encode, exchange, wire_row_bytes
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.kernels import resolve_backend
from lightning_llmfast.moe.kernels.plan import routing_plan
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import permute, plan_indices, unpermute

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


class _Splits(NamedTuple):
    """Rows one dispatch sends and receives per rank of each sub-group (read on the host once, combine reversed).

    Attributes:
        across_send: token rows to each node (inter-group rank), this rank's tokens once per node.
        across_recv: token rows from each node.
        within_send: pair rows to each rank of this node (intra-group rank), from the rows that arrived across.
        within_recv: pair rows from each rank of this node.
    """

    across_send: list[int]
    across_recv: list[int]
    within_send: list[int]
    within_recv: list[int]


class _Route:
    """What the two hops of one dispatch share between their forward and backward (no autograd state).

    Attributes:
        splits: the hops' split sizes.
        inter, intra: the sub-groups of the hops.
        payload: the wire of the tokens (forward) and of the outputs and gradients.
        first_expert: the first expert of this rank's node; ``per_node``: experts a node holds.
        backend: the permutations' kernels.
        inside: the plan of the pairs inside the node, set by the forward of the hops (the combine needs it).
    """

    def __init__(self, dispatcher: HierarchicalDispatcher, splits: _Splits, backend: str) -> None:
        self.splits, self.payload, self.backend = splits, dispatcher.payload, backend
        self.inter, self.intra = dispatcher.node_layout.inter, dispatcher.node_layout.intra
        self.per_node = dispatcher.num_experts // dispatcher.node_layout.num_nodes
        self.first_expert = dispatcher.node * self.per_node
        self.inside: RoutingPlan | None = None

    def plan_inside(self, weights: Tensor, codes: Tensor) -> RoutingPlan:
        """The arrived rows' pairs on this node keyed by the node's expert index (the rest left out)."""
        local = codes.long() - self.first_expert
        on_node = (local >= 0) & (local < self.per_node)
        return _keyed_plan(torch.where(on_node, local, self.per_node), weights, self.per_node, self.backend)


def _as_bytes(rows: Tensor) -> Tensor:
    """``(R, C)`` rows of any dtype as their ``(R, C * itemsize)`` bytes."""
    return rows.contiguous().view(torch.uint8)


def _wire_dtype(wire: str | None, dtype: torch.dtype) -> torch.dtype:
    """The element type :func:`~lightning_llmfast.expert_parallel.payload.exchange` puts a ``wire`` row in."""
    return {"fp8": torch.uint8, "bf16": torch.bfloat16}.get(wire or "", dtype)


def _split_bytes(packed: Tensor, width: int, wire_dtype: torch.dtype, *riders: torch.dtype) -> list[Tensor]:
    """Cut packed byte rows into the wire rows (``width`` bytes) and ``k``-wide rider columns of ``riders``' types."""
    top_k = (packed.shape[1] - width) // (4 * len(riders))
    parts = packed.split([width, *(4 * top_k for _ in riders)], dim=1)
    return [part.contiguous().view(kind) for part, kind in zip(parts, (wire_dtype, *riders), strict=True)]


def _swap(rows: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """One all-to-all of rows already on the wire (called inside :class:`_TwoHops`, where autograd is off)."""
    return exchange(rows, out_splits, in_splits, group, wire=None, grad_wire=None)


class _TwoHops(torch.autograd.Function):
    """The tokens' way out: across the nodes with their weights and expert ids, then inside the node, never decoded
    in between.

    Forward: the rows are encoded once (``payload.dispatch``) and travel across as bytes with the ``k`` fp32 weights
    and ``k`` int32 expert ids of their token appended (one exchange); the intermediate rank gathers the encoded rows
    into its node's pairs (a row once per expert of its token on the node) and sends them on; the expert's rank
    decodes. Backward: the rows' gradients come back inside the node (``payload.combine``), are summed per arrived
    row, and cross back with the weights' gradients appended (fp32), in one exchange per hop again.
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weights: Tensor, codes: Tensor, route: _Route) -> tuple[Tensor, Tensor]:
        splits, wire = route.splits, route.payload.dispatch
        ctx.route, ctx.dtype = route, rows.dtype
        packed = torch.cat([_as_bytes(_encode(rows, wire)), _as_bytes(weights), _as_bytes(codes)], dim=1)
        arrived = _swap(packed, splits.across_recv, splits.across_send, route.inter)
        width = wire_row_bytes(wire, rows.shape[1], rows.dtype)
        tokens, weights, codes = _split_bytes(arrived, width, _wire_dtype(wire, rows.dtype), torch.float32, torch.int32)
        route.inside = route.plan_inside(weights, codes)
        pairs = tokens.index_select(0, plan_indices(route.inside).tokens[: sum(splits.within_send)])
        return _decode(_swap(pairs, splits.within_recv, splits.within_send, route.intra), wire, rows.dtype), weights

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor, grad_weights: Tensor) -> tuple[Tensor, Tensor, None, None]:
        route, dtype = ctx.route, ctx.dtype
        splits, wire, inside = route.splits, route.payload.combine, route.inside
        assert inside is not None
        back = _swap(_encode(grad_rows, wire), splits.within_send, splits.within_recv, route.intra)
        back = F.pad(_decode(back, wire, dtype), (0, 0, 0, inside.num_rows - back.shape[0]))
        summed = unpermute(back, inside._replace(weights=torch.ones_like(inside.weights)), backend=route.backend)
        packed = torch.cat([_as_bytes(_encode(summed, wire)), _as_bytes(grad_weights.float())], dim=1)
        home = _swap(packed, splits.across_send, splits.across_recv, route.inter)
        width = wire_row_bytes(wire, grad_rows.shape[1], dtype)
        grad_home, grad_weights = _split_bytes(home, width, _wire_dtype(wire, dtype), torch.float32)
        return _decode(grad_home, wire, dtype), grad_weights, None, None


class _Combine(NamedTuple):
    """What the combine needs: the plans of both hops, the expert-major row maps and the split sizes."""

    across: RoutingPlan
    inside: RoutingPlan
    maps: tuple[Tensor, Tensor]
    splits: _Splits


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
        node_layout: ``groups``.
        node: this rank's node; ``local_index``: its rank inside the node.
        traffic: the bytes both hops have sent so far (the weights and expert ids that cross with the tokens
            included): across the boundary by the hop between the nodes, inside the node by the other.

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
        self.node_layout = groups
        self.node, self.local_index = place

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        source = self._start(x, plan, x_compute)
        backend = resolve_backend(self.backend, source.device)
        across, codes = self._across_plan(plan, backend)
        splits, by_source = self._handshake(plan, across, self._signature(source))
        self._count_hops(splits, source, plan.top_k)
        sent = sum(splits.across_send)
        rows = permute(source, across, backend=backend)[:sent]
        weights = permute(plan.weights.float(), across, backend=backend)[:sent]
        codes = codes.index_select(0, plan_indices(across).tokens[:sent])
        route = _Route(self, splits, backend)
        received, weights = _TwoHops.apply(rows, weights, codes, route)
        assert route.inside is not None
        # Received rows are grouped by (rank of the node, local expert); the grouped GEMM wants (local expert, rank).
        order, inverse = AllToAllDroplessDispatcher._expert_major(by_source, received.shape[0])
        grouped = masked_gather(received, order, None, inverse, None)
        offsets = F.pad(by_source.sum(dim=0).cumsum(0), (1, 0)).to(torch.int32)
        ctx = _Combine(across, route.inside._replace(weights=weights), (inverse, order), splits)
        return ExpertRows(grouped, offsets, False, self._backend(grouped)), ctx

    def combine(self, rows: Tensor, ctx: _Combine) -> Tensor:
        """Weight and sum each token's outputs inside each node, send the sums home and add them up: ``(T, H)``."""
        inverse, order = ctx.maps
        splits, wire, backend = ctx.splits, self.payload.combine, self._backend(rows)
        layout = self.node_layout
        back = masked_gather(rows, inverse, None, order, None)
        back = exchange(back, splits.within_send, splits.within_recv, layout.intra, wire=wire, grad_wire=wire)
        summed = unpermute(F.pad(back, (0, 0, 0, ctx.inside.num_rows - back.shape[0])), ctx.inside, backend=backend)
        home = exchange(summed, splits.across_send, splits.across_recv, layout.inter, wire=wire, grad_wire=wire)
        return unpermute(F.pad(home, (0, 0, 0, ctx.across.num_rows - home.shape[0])), ctx.across, backend=backend)

    def _across_plan(self, plan: RoutingPlan, backend: str) -> tuple[RoutingPlan, Tensor]:
        """The plan of the hop across: each token's kept pairs keyed by their expert's node, the first of every node
        kept (unweighted: the home sum over the nodes); and the ``(T, k)`` int32 expert ids (-1: dropped, masked)."""
        num_nodes, top_k = self.node_layout.num_nodes, plan.top_k
        node = plan.expert_ids.long() // (self.num_experts // num_nodes)
        valid = plan.kept if plan.padded else torch.ones_like(node, dtype=torch.bool)
        earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=node.device).tril(-1)  # [s, s'] for s' < s
        repeated = (node.unsqueeze(2) == node.unsqueeze(1)) & earlier & valid.unsqueeze(1)
        first = valid & ~repeated.any(dim=2)
        ones = torch.ones_like(plan.weights, dtype=torch.float32)
        across = _keyed_plan(torch.where(first, node, num_nodes), ones, num_nodes, backend)
        return across, torch.where(valid, plan.expert_ids, -1).to(torch.int32)

    def _handshake(self, plan: RoutingPlan, across: RoutingPlan, signature: list[int]) -> tuple[_Splits, Tensor]:
        """Every rank's pairs per expert (with a capacity limit, also before it: the balance loss counts those),
        tokens per node, valid tokens and signature to every rank of the group: one all-to-all and the one host read
        of the dispatch. Sets :attr:`global_stats` (the balance loss's counts).

        Returns:
            The split sizes of both hops, and ``(L, E_l)`` the rows this rank receives from each rank of its node per
            local expert (on the device).
        """
        num_nodes, per_node = self.node_layout.num_nodes, self.node_layout.ranks_per_node
        num_experts, world = self.num_experts, self.world
        counts = [plan.tokens_per_expert.to(torch.int64)]
        if plan.capacity is not None and plan.routed_per_expert is not None:  # the loss counts the dropped pairs too
            counts.append(plan.routed_per_expert.to(torch.int64))
        to_nodes = across.tokens_per_expert.to(torch.int64)
        header = stage_to_device([plan.num_tokens, *signature], to_nodes.device)  # pinned, non-blocking
        if plan.token_mask is not None:  # padding counts in no loss: the valid tokens, counted on the device
            header = torch.cat([plan.token_mask.sum(dtype=torch.int64).view(1), header[1:]])
        send = torch.cat([*counts, to_nodes, header]).expand(world, -1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # pairs[n, l, m, l', e]: rank (n, l)'s pairs for the e-th expert of rank (m, l').
        pairs = recv[:, :num_experts].view(num_nodes, per_node, num_nodes, per_node, self.num_local)
        node, mine, start = self.node, self.local_index, len(counts) * num_experts
        from_nodes = recv[:, start : start + num_nodes].view(num_nodes, per_node, num_nodes)
        by_source = pairs[:, :, node, mine].sum(dim=0)
        onward = pairs[:, mine, node].sum(dim=(0, 2))
        tail = start + num_nodes + 1
        # NOTE: host sync, the one of the hierarchical dispatch (once per layer and forward; the combine and the
        # backward reuse these splits).
        host = torch.cat([to_nodes, from_nodes[:, mine, node], onward, by_source.sum(dim=1), recv[:, tail:].flatten()])
        host = host.tolist()
        self.host_syncs += 1
        cut = [num_nodes, 2 * num_nodes, 2 * num_nodes + per_node, 2 * num_nodes + 2 * per_node]
        width = len(signature)
        received = [host[cut[3] + width * i : cut[3] + width * (i + 1)] for i in range(world)]
        if any(r != signature for r in received):
            self._raise_disagreement("dtype, hidden size or dispatch payload", received)
        self.global_stats = torch.cat([recv[:, start - num_experts : start], recv[:, tail - 1 : tail]], 1).sum(0)
        splits = _Splits(host[: cut[0]], host[cut[0] : cut[1]], host[cut[1] : cut[2]], host[cut[2] : cut[3]])
        self.send_rows, self.recv_rows = sum(splits.across_send), sum(splits.within_recv)
        return splits, by_source

    def _count_hops(self, splits: _Splits, rows: Tensor, top_k: int) -> None:
        """Add a forward's bytes to :attr:`traffic`: across the boundary the hop between the nodes (the token rows
        with ``8 k`` bytes of weights and expert ids, the sums back), inside the node the other hop."""
        hidden, dtype, payload = rows.shape[1], rows.dtype, self.payload
        out, back = wire_row_bytes(payload.dispatch, hidden, dtype), wire_row_bytes(payload.combine, hidden, dtype)
        across, inside = range(self.node_layout.num_nodes), (0,) * self.node_layout.ranks_per_node
        self.traffic.add(across, self.node, splits.across_send, out + 8 * top_k)
        self.traffic.add(across, self.node, splits.across_recv, back)
        self.traffic.add(inside, self.local_index, splits.within_send, out)
        self.traffic.add(inside, self.local_index, splits.within_recv, back)


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
