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
the tokens are encoded once, as the flat dispatch encodes them.

With a capacity limit (``C`` pairs per expert and source rank, the plan's drops, as the flat capacity dispatch: dropped
pairs never leave home) the shapes are fixed, whatever the routing: a token reaches a node only through a kept pair
there, so each rank sends each node one block of ``min(T, E / N * C)`` token rows, and an intermediate rank forwards
at most ``C`` pairs per expert from each node, so it sends each rank of its node one block of ``N * E_l * C`` pair
rows (free rows are zeros, with no expert). Every rank must then have the same ``T`` and ``C`` (checked with the
handshake's host read: ranks that differ all raise). The expert's rank runs its experts on the pairs, the free rows
last (``ExpertRows.padded``).

Overlap (``overlap_chunks``, :func:`~lightning_llmfast.expert_parallel.set_ep_overlap`): the tokens travel in chunks
of destination nodes. Chunk ``c`` covers a range of offsets ``o``: every rank sends the tokens bound for node
``(node + o) % N`` and receives those of node ``(node - o) % N`` (the first chunk holds offset 0, the rank's own
node: nothing crosses the boundary). The handshake already gives every rank its rows per source node at both hops,
so every chunk's split sizes come from the one host read, and a chunk carries exactly the rows the whole exchange
would (same bytes; with a capacity limit one chunk of every node, whose blocks are sized for every node's tokens).
:func:`~lightning_llmfast.expert_parallel.overlap.exchange_routes` issues every chunk's hop
across first; then, chunk by chunk, the hop inside the node, the experts, the return inside the node and the weighted
sums run while the later chunks cross the boundary, and each chunk's sums are sent home at once; the shared experts
and the balance loss run while the last sums travel. A token reaches each node in exactly one chunk, so its per-node
sums and its sum at home add the same numbers in the same order as without chunks. The backward mirrors it. Every
exchange is stamped by the dispatcher's :attr:`~AllToAllDispatcher.timer` (``comm/a2a_ms``, ``comm/a2a_exposed_ms``).

Example::

    groups = node_groups(ep_group, ranks_per_node=8, timeout=timedelta(minutes=5))  # every rank of the world
    block.set_dispatcher(HierarchicalDispatcher(ep_group, num_experts=256, groups=groups))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.dispatchers import AllToAllDispatcher, AllToAllDroplessDispatcher
from lightning_llmfast.expert_parallel.exchange import (
    BlockMaps,
    InFlight,
    all_to_all_async,
    block_maps,
    masked_gather,
    stage_to_device,
)
from lightning_llmfast.expert_parallel.overlap import ChunkRoutes, chunk_count, exchange_routes, split_evenly
from lightning_llmfast.expert_parallel.payload import (
    DispatchPayload,
    Route,
    _decode,
    _encode,
    exchange,
    exchange_route,
    start_route,
    wire_row_bytes,
)
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.kernels import resolve_backend
from lightning_llmfast.moe.kernels.plan import routing_plan
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import permute, plan_indices, unpermute

__all__ = ["HierarchicalDispatcher", "NodeGroups", "check_node_limited", "group_nodes", "node_groups"]

_Side = TypeVar("_Side")


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
    """Rows one chunk's dispatch sends and receives per rank of each sub-group (its combine reverses them).

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


class _Counts(NamedTuple):
    """What the handshake tells a rank, per source node of the tokens, so that any set of source nodes (a chunk)
    has its split sizes without another host read.

    Attributes:
        across_send: token rows to each node.
        across_recv: token rows from each node.
        onward: ``[n][l]`` pair rows this rank forwards to rank ``l`` of its node, of tokens from node ``n``.
        inward: ``[n][l]`` pair rows this rank receives from rank ``l`` of its node, of tokens from node ``n``.
        by_source: ``(N, L, E_l)`` those rows per local expert (on the device).
        pairs: valid pairs of the whole group (every rank has the same number).
    """

    across_send: list[int]
    across_recv: list[int]
    onward: list[list[int]]
    inward: list[list[int]]
    by_source: Tensor
    pairs: int

    def select(self, offsets: Sequence[int], node: int) -> tuple[_Splits, Tensor, list[int]]:
        """The splits of the chunk whose tokens travel ``offsets`` nodes on (node ``(node + o) % N`` receives this
        rank's tokens, node ``(node - o) % N`` sends it its own), its ``(L, E_l)`` received rows per rank of the
        node and local expert, and its destination nodes in order."""
        num_nodes = len(self.across_send)
        sources = sorted((node - o) % num_nodes for o in offsets)
        dests = {(node + o) % num_nodes for o in offsets}
        per_node = len(self.onward[0])
        splits = _Splits(
            [rows if m in dests else 0 for m, rows in enumerate(self.across_send)],
            [rows if m in sources else 0 for m, rows in enumerate(self.across_recv)],
            [sum(self.onward[n][local] for n in sources) for local in range(per_node)],
            [sum(self.inward[n][local] for n in sources) for local in range(per_node)],
        )
        return splits, torch.stack([self.by_source[n] for n in sources]).sum(dim=0), sorted(dests)


class _Outward(Route):
    """One chunk of tokens on its way out: across the nodes with their weights and expert ids, then inside the node,
    never decoded in between (:func:`~lightning_llmfast.expert_parallel.payload.start_route`).

    :meth:`send` encodes the rows once (``payload.dispatch``) and issues the hop across with the ``k`` fp32 weights
    and ``k`` int32 expert ids of their token appended (one exchange); :meth:`receive` waits for it, gathers the
    still encoded rows into this node's pairs (a row once per expert of its token on the node), sends them on and
    returns them decoded, with the arrived weights. The backward comes back the same way: :meth:`send_back` returns
    the rows' gradients inside the node (``payload.combine``), sums them per arrived row and issues the hop across
    with the weights' gradients appended (fp32); :meth:`receive_back` waits for it. The hop inside the node runs
    in the half that waits (a node's links are the fast ones); the hop across is the one in flight.

    Attributes:
        inside: the plan of the pairs inside the node, set by :meth:`receive` (the combine needs it).
    """

    def __init__(
        self, dispatcher: HierarchicalDispatcher, splits: _Splits, codes: Tensor, backend: str, block: int | None
    ) -> None:
        self.splits, self.codes, self.payload, self.backend = splits, codes, dispatcher.payload, backend
        self.block, self.local_experts = block, dispatcher.num_local
        self.pairs: BlockMaps | None = None
        self.inter, self.intra = dispatcher.node_layout.inter, dispatcher.node_layout.intra
        self.timer = dispatcher.timer
        self.per_node = dispatcher.num_experts // dispatcher.node_layout.num_nodes
        self.first_expert = dispatcher.node * self.per_node
        self.inside: RoutingPlan | None = None
        self.dtype, self.hidden = torch.float32, 0
        self.inflight: InFlight | None = None

    def send(self, *inputs: Tensor) -> None:
        rows, weights = inputs
        self.dtype, self.hidden = rows.dtype, rows.shape[1]
        encoded = _encode(rows, self.payload.dispatch)
        packed = torch.cat([_as_bytes(encoded), _as_bytes(weights), _as_bytes(self.codes)], dim=1)
        self._issue(packed, self.inter, self.splits.across_recv, self.splits.across_send)

    def receive(self) -> tuple[Tensor, ...]:
        wire, splits = self.payload.dispatch, self.splits
        arrived = self._take()
        width = wire_row_bytes(wire, self.hidden, self.dtype)
        tokens, weights, codes = _split_bytes(arrived, width, _wire_dtype(wire, self.dtype), torch.float32, torch.int32)
        self.inside = inside = self._plan_inside(weights, codes)
        if self.block is None:
            pairs = tokens.index_select(0, plan_indices(inside).tokens[: sum(splits.within_send)])
        else:  # fixed blocks of pairs per expert rank of the node
            self.pairs = block_maps(inside.offsets[:: self.local_experts], self.block, inside.num_rows)
            pairs = self.pairs.pad(tokens.index_select(0, plan_indices(inside).tokens))
        received = all_to_all_async(pairs, splits.within_recv, splits.within_send, self.intra, self.timer).wait()
        return _decode(received, wire, self.dtype), weights

    def send_back(self, *grads: Tensor) -> None:
        grad_rows, grad_weights = grads
        wire, splits, inside = self.payload.combine, self.splits, self.inside
        assert inside is not None
        back = all_to_all_async(
            _encode(grad_rows, wire), splits.within_send, splits.within_recv, self.intra, self.timer
        )
        back = _inside_rows(_decode(back.wait(), wire, self.dtype), inside, self.pairs)
        summed = unpermute(back, inside._replace(weights=torch.ones_like(inside.weights)), backend=self.backend)
        packed = torch.cat([_as_bytes(_encode(summed, wire)), _as_bytes(grad_weights.float())], dim=1)
        self._issue(packed, self.inter, splits.across_send, splits.across_recv)

    def receive_back(self) -> tuple[Tensor, ...]:
        wire = self.payload.combine
        width = wire_row_bytes(wire, self.hidden, self.dtype)
        grad_home, grad_weights = _split_bytes(self._take(), width, _wire_dtype(wire, self.dtype), torch.float32)
        return _decode(grad_home, wire, self.dtype), grad_weights

    def _plan_inside(self, weights: Tensor, codes: Tensor) -> RoutingPlan:
        """The arrived rows' pairs on this node keyed by the node's expert index (the rest left out)."""
        local = codes.long() - self.first_expert
        on_node = (local >= 0) & (local < self.per_node)
        return _keyed_plan(torch.where(on_node, local, self.per_node), weights, self.per_node, self.backend)

    def _issue(self, rows: Tensor, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]) -> None:
        self.inflight = all_to_all_async(rows, out_splits, in_splits, group, self.timer)

    def _take(self) -> Tensor:
        inflight, self.inflight = self.inflight, None  # the wire buffer is not kept past its decode
        assert inflight is not None, "a hop was finished before it was started"
        return inflight.wait()


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


class _Fixed(NamedTuple):
    """The fixed shapes of a capacity dispatch: the splits of both hops (one block of token rows per node, one block
    of ``inside`` pair rows per rank of the node) and the maps of this rank's tokens into their blocks."""

    splits: _Splits
    inside: int
    home: BlockMaps


def _inside_rows(back: Tensor, inside: RoutingPlan, pairs: BlockMaps | None) -> Tensor:
    """Rows returned to the intermediate rank, one per pair of :attr:`_Outward.inside` (its ``num_rows``)."""
    if pairs is not None:
        return pairs.unpad(back)
    return F.pad(back, (0, 0, 0, inside.num_rows - back.shape[0]))


class _Sent(NamedTuple):
    """A forward's tokens ready to leave: their rows, weights and expert ids in the hop across's order (by
    destination node), the plan of that hop, the handshake's counts and the kernels' backend."""

    rows: Tensor
    weights: Tensor
    codes: Tensor
    across: RoutingPlan
    counts: _Counts
    backend: str
    fixed: _Fixed | None


class _Chunk(NamedTuple):
    """The tokens of some destination nodes (:meth:`_Counts.select`): what the dispatch route sends, the route, its
    splits, its received rows per rank of the node and local expert, and the destination nodes in order."""

    inputs: tuple[Tensor, Tensor]
    route: _Outward
    splits: _Splits
    by_source: Tensor
    nodes: list[int]


class _Combine(NamedTuple):
    """What the combine needs: the tokens sent (the plan of the hop across), the plan of the pairs inside the node
    and their blocks (capacity), the expert-major row maps and the split sizes."""

    sent: _Sent
    inside: RoutingPlan
    pairs: BlockMaps | None
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
        sent = self._leave(x, plan, x_compute)
        chunk = self._chunk(sent, range(self.node_layout.num_nodes))
        received, weights = start_route(chunk.route, *chunk.inputs).finish_all()
        rows, maps = self._grouped(received, chunk.by_source, chunk.route.block)
        assert chunk.route.inside is not None
        inside = chunk.route.inside._replace(weights=weights)
        return rows, _Combine(sent, inside, chunk.route.pairs, maps, chunk.splits)

    def combine(self, rows: Tensor, ctx: _Combine) -> Tensor:
        """Weight and sum each token's outputs inside each node, send the sums home and add them up: ``(T, H)``."""
        splits, wire = ctx.splits, self.payload.combine
        summed = self._sum_inside(rows, ctx.maps, ctx.inside, ctx.pairs, splits)
        home = exchange(
            summed, splits.across_send, splits.across_recv, self.node_layout.inter, wire=wire, grad_wire=wire,
            timer=self.timer,
        )  # fmt: skip
        return self._at_home(home, ctx.sent)

    def run(
        self,
        x: Tensor,
        plan: RoutingPlan,
        experts: Callable[[ExpertRows], Tensor],
        independent: Callable[[], _Side],
        *,
        x_compute: Tensor | None = None,
    ) -> tuple[Tensor, _Side]:
        """With :attr:`overlap_chunks`: the tokens travel in chunks of destination nodes (chunk ``c``: the nodes
        ``o`` on from this rank's, for a range of offsets ``o``; the first holds this rank's own node), each chunk's
        experts and its sums inside the node run while the next chunks cross the boundary, and the work that needs
        no routed result while the sums travel home (:mod:`~lightning_llmfast.expert_parallel.overlap`)."""
        if self.overlap_chunks is None:
            return super().run(x, plan, experts, independent, x_compute=x_compute)
        sent = self._leave(x, plan, x_compute)
        num_nodes, wire, inter = self.node_layout.num_nodes, self.payload.combine, self.node_layout.inter
        # Fixed shapes (capacity) keep one chunk: a chunk's blocks would be sized for every node's tokens.
        limit = 1 if sent.fixed is not None else num_nodes
        count = chunk_count(self.overlap_chunks, sent.counts.pairs // self.world, limit=limit)
        ends = list(itertools.accumulate(split_evenly(num_nodes, count), initial=0))
        chunks = [self._chunk(sent, range(lo, hi)) for lo, hi in itertools.pairwise(ends)]

        def run_experts(c: int, arrived: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            (received, weights), chunk = arrived, chunks[c]
            route = chunk.route
            rows, maps = self._grouped(received, chunk.by_source, route.block)
            assert route.inside is not None
            inside = route.inside._replace(weights=weights)
            return (self._sum_inside(experts(rows), maps, inside, route.pairs, chunk.splits),)

        routes = [
            ChunkRoutes(
                chunk.inputs,
                chunk.route,
                exchange_route(chunk.splits.across_send, chunk.splits.across_recv, inter, (wire, wire), self.timer),
            )
            for chunk in chunks
        ]
        backs, side = exchange_routes(routes, run_experts, independent)
        # Chunk c returns its destination nodes' rows in node order: back to one block per node, nodes in order
        # (empty blocks included: every rank's graph holds every chunk, so every rank runs the same backward).
        pieces: dict[int, Tensor] = {}
        for chunk, (back,) in zip(chunks, backs, strict=True):
            sizes = [chunk.splits.across_send[m] for m in chunk.nodes]
            pieces.update(zip(chunk.nodes, back.split(sizes), strict=True))
        home = torch.cat([pieces[m] for m in range(num_nodes)])
        return self._at_home(home, sent), side

    def _leave(self, x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> _Sent:
        """The handshake (the one host read), the byte counts, and the rows, weights and expert ids to send."""
        source = self._start(x, plan, x_compute)
        backend = resolve_backend(self.backend, source.device)
        across, codes = self._across_plan(plan, backend)
        capacity, num_nodes, per_node = plan.capacity, self.node_layout.num_nodes, self.node_layout.ranks_per_node
        sizes = [plan.num_tokens, capacity] if capacity is not None else []  # fixed shapes: equal on every rank
        counts = self._handshake(plan, across, self._signature(source) + sizes)
        splits, _, _ = counts.select(range(num_nodes), self.node)
        if capacity is None:
            sent = sum(splits.across_send)
            rows = permute(source, across, backend=backend)[:sent]
            weights = permute(plan.weights.float(), across, backend=backend)[:sent]
            codes = codes.index_select(0, plan_indices(across).tokens[:sent])
            self._count_hops(splits, source, plan.top_k)
            return _Sent(rows, weights, codes, across, counts, backend, None)
        # A token reaches a node only through a kept pair there (at most C per expert), and a rank of the node gets
        # at most C pairs per expert from each node: blocks of those sizes, whatever the routing.
        tokens = min(plan.num_tokens, self.num_experts // num_nodes * capacity)
        inside = num_nodes * self.num_local * capacity
        splits = _Splits([tokens] * num_nodes, [tokens] * num_nodes, [inside] * per_node, [inside] * per_node)
        fixed = _Fixed(splits, inside, block_maps(across.offsets, tokens, across.num_rows))
        rows = fixed.home.pad(permute(source, across, backend=backend))
        weights = fixed.home.pad(permute(plan.weights.float(), across, backend=backend))
        codes = fixed.home.pad(codes.index_select(0, plan_indices(across).tokens))
        codes = torch.where(fixed.home.slot_valid[:, None], codes, -1)  # free slots: no expert
        self._count_hops(splits, source, plan.top_k)
        self.send_rows, self.recv_rows = num_nodes * tokens, per_node * inside
        return _Sent(rows, weights, codes, across, counts, backend, fixed)

    def _chunk(self, sent: _Sent, offsets: Sequence[int]) -> _Chunk:
        """The chunk of the nodes ``offsets`` on from this rank's (:meth:`_Counts.select`): its rows, weights and
        expert ids (the rows are grouped by destination node) and its route."""
        splits, by_source, nodes = sent.counts.select(offsets, self.node)
        block = None
        if sent.fixed is not None:  # one chunk of every node (see run)
            splits, block = sent.fixed.splits, sent.fixed.inside
        rows, weights, codes = sent.rows, sent.weights, sent.codes
        if len(nodes) < self.node_layout.num_nodes:
            starts = list(itertools.accumulate(sent.counts.across_send, initial=0))
            rows, weights, codes = (
                torch.cat([t[starts[m] : starts[m + 1]] for m in nodes]) for t in (sent.rows, sent.weights, sent.codes)
            )
        return _Chunk((rows, weights), _Outward(self, splits, codes, sent.backend, block), splits, by_source, nodes)

    def _grouped(
        self, received: Tensor, by_source: Tensor, block: int | None
    ) -> tuple[ExpertRows, tuple[Tensor, Tensor]]:
        """Received rows, grouped by (rank of the node, local expert) (capacity: in one block of ``block`` rows per
        rank, free rows after), as the grouped GEMM wants them: by (local expert, rank), free rows last; and the row
        maps both ways."""
        if block is None:
            order, inverse = AllToAllDroplessDispatcher._expert_major(by_source, received.shape[0])
        else:
            order, inverse = _blocked_expert_major(by_source, block)
        grouped = masked_gather(received, order, None, inverse, None)
        offsets = F.pad(by_source.sum(dim=0).cumsum(0), (1, 0)).to(torch.int32)
        return ExpertRows(grouped, offsets, block is not None, self._backend(grouped)), (inverse, order)

    def _sum_inside(
        self, outputs: Tensor, maps: tuple[Tensor, Tensor], inside: RoutingPlan, pairs: BlockMaps | None,
        splits: _Splits,
    ) -> Tensor:  # fmt: skip
        """The experts' outputs back to the intermediate rank (inside the node), weighted and summed per arrived
        token: one row per token that arrived across."""
        inverse, order = maps
        wire, intra = self.payload.combine, self.node_layout.intra
        back = masked_gather(outputs, inverse, None, order, None)
        back = exchange(
            back, splits.within_send, splits.within_recv, intra, wire=wire, grad_wire=wire, timer=self.timer
        )
        return unpermute(_inside_rows(back, inside, pairs), inside, backend=self._backend(back))

    def _at_home(self, home: Tensor, sent: _Sent) -> Tensor:
        """The sums that came home, added up per token over its nodes: ``(T, H)``."""
        across = sent.across
        if sent.fixed is not None:
            home = sent.fixed.home.unpad(home)
        else:
            home = F.pad(home, (0, 0, 0, across.num_rows - home.shape[0]))
        return unpermute(home, across, backend=self._backend(home))

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

    def _handshake(self, plan: RoutingPlan, across: RoutingPlan, signature: list[int]) -> _Counts:
        """Every rank's pairs per expert (with a capacity limit, also before it: the balance loss counts those),
        tokens per node, valid tokens and signature to every rank of the group: one all-to-all and the one host read
        of the dispatch. Sets :attr:`global_stats` (the balance loss's counts).

        Returns:
            The split sizes of both hops per source node of the tokens (:class:`_Counts`).
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
        by_source = pairs[:, :, node, mine]  # (N, L, E_l): from the tokens of node n, through rank l of this node
        onward = pairs[:, mine, node].sum(dim=2)  # (N, L): from the tokens of node n, to rank l of this node
        tail = start + num_nodes
        # NOTE: host sync, the one of the hierarchical dispatch (once per layer and forward; the combine, the
        # backward and every chunk reuse these splits).
        host = [to_nodes, from_nodes[:, mine, node], onward.flatten(), by_source.sum(dim=2).flatten()]
        host = torch.cat([*host, recv[:, tail:].flatten()]).tolist()
        self.host_syncs += 1
        cut = list(itertools.accumulate([num_nodes, num_nodes, num_nodes * per_node, num_nodes * per_node]))
        width = 1 + len(signature)  # each rank's valid tokens, then its signature
        theirs = [host[cut[3] + width * i : cut[3] + width * (i + 1)] for i in range(world)]
        if any(t[1:] != signature for t in theirs):
            kind = "dtype, hidden size, dispatch payload, tokens or capacity"
            self._raise_disagreement(kind, [t[1:] for t in theirs])
        self.global_stats = torch.cat([recv[:, start - num_experts : start], recv[:, tail : tail + 1]], 1).sum(0)
        onward_rows, inward_rows = host[cut[1] : cut[2]], host[cut[2] : cut[3]]
        result = _Counts(
            host[: cut[0]],
            host[cut[0] : cut[1]],
            [onward_rows[n * per_node : (n + 1) * per_node] for n in range(num_nodes)],
            [inward_rows[n * per_node : (n + 1) * per_node] for n in range(num_nodes)],
            by_source,
            sum(t[0] for t in theirs) * plan.top_k,
        )
        self.send_rows, self.recv_rows = sum(result.across_send), sum(inward_rows)
        return result

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


def _blocked_expert_major(by_source: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``order`` (expert-major row -> received row) and its inverse for rows received in one block of ``block`` rows
    per source (its rows by local expert first, ``by_source[l]`` of them, free rows after): the free rows go last, in
    order. On the device, without a sync."""
    sources, local = by_source.shape
    per_source = by_source.sum(dim=1)
    ends = by_source.cumsum(dim=1)  # (L, E_l) end of each expert's rows within its source's block
    row = torch.arange(sources * block, device=by_source.device)
    source, within = row // max(block, 1), row % max(block, 1)
    expert = (within.unsqueeze(1) >= ends[source]).sum(dim=1).clamp(max=local - 1)
    kept = within < per_source[source]
    expert_major = by_source.t().flatten()
    dst_start = (expert_major.cumsum(0) - expert_major).view(local, sources).t()  # (L, E_l)
    moved = dst_start[source, expert] + within - (ends - by_source)[source, expert]
    before = (per_source.cumsum(0) - per_source)[source] + torch.minimum(within, per_source[source])
    inverse = torch.where(kept, moved, per_source.sum() + row - before)
    order = torch.empty_like(inverse).scatter_(0, inverse, row)
    return order, inverse


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
