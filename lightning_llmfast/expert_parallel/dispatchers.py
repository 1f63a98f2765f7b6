"""The all-to-all token dispatchers of expert parallelism (built by
:func:`~lightning_llmfast.expert_parallel.shard_experts`, which describes the two modes), and the batch-wide
load-balancing loss they feed.

Example::

    dispatcher = AllToAllDroplessDispatcher(group, num_experts=8)
    block.set_dispatcher(dispatcher)  # what shard_experts does, after keeping this rank's experts only
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed._functional_collectives import all_reduce, wait_tensor

from lightning_llmfast.comm.timing import ExchangeTimer
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.expert_parallel.exchange import block_maps, comm_device, masked_gather, stage_to_device
from lightning_llmfast.expert_parallel.overlap import Chunk, chunk_count, exchange_chunks, split_evenly
from lightning_llmfast.expert_parallel.payload import DispatchPayload, exchange, wire_row_bytes
from lightning_llmfast.moe.dispatcher import ExpertRows, LocalDispatcher, TokenDispatcher
from lightning_llmfast.moe.kernels import BACKENDS, resolve_backend
from lightning_llmfast.moe.losses import masked_probs
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import permute, unpermute

__all__ = [
    "AllToAllCapacityDispatcher",
    "AllToAllDispatcher",
    "AllToAllDroplessDispatcher",
    "NodeTraffic",
    "SharedBatchDispatcher",
    "global_aux_loss",
]

_Side = TypeVar("_Side")

# Wire codes of the activation dtypes in the size signature (ranks must agree on the bytes per row).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Handshake(NamedTuple):
    """What the dropless counts exchange tells a rank: ``(W, E_l)`` rows it receives per source and local expert
    (device), the rows it sends to and receives from each rank, and the valid pairs of the whole group (host)."""

    mine: Tensor
    in_splits: list[int]
    out_splits: list[int]
    pairs: int


class _Return(NamedTuple):
    """What an all-to-all combine needs: the plan, and the row maps and splits of the return exchange."""

    plan: RoutingPlan
    maps: tuple[Tensor, ...]
    in_splits: list[int] | None
    out_splits: list[int] | None


@dataclass
class NodeTraffic:
    """Bytes a rank has sent to other ranks so far, split by whether they crossed the node boundary.

    Counted on the host from the split sizes an exchange already has (no device read of its own).

    Attributes:
        inter: bytes sent to ranks on other nodes.
        intra: bytes sent to other ranks of this rank's node.

    Example::

        traffic = NodeTraffic()
        traffic.add((0, 0, 1, 1), 0, [3, 2, 1, 0], 64)  # 128 bytes inside the node, 64 across
    """

    inter: int = 0
    intra: int = 0

    def add(self, nodes: Sequence[int], me: int, rows: Sequence[int], row_bytes: int) -> None:
        """Count ``rows[r]`` rows of ``row_bytes`` sent by group rank ``me`` to each group rank ``r`` (on node
        ``nodes[r]``); the rows a rank keeps cross nothing."""
        for rank, count in enumerate(rows):
            if rank == me:
                continue
            if nodes[rank] == nodes[me]:
                self.intra += count * row_bytes
            else:
                self.inter += count * row_bytes


class AllToAllDispatcher(TokenDispatcher):
    """Experts spread over a process group; tokens travel to their holders by ``all_to_all_single`` and back.

    The base of :class:`AllToAllDroplessDispatcher` and :class:`AllToAllCapacityDispatcher` (built by
    :func:`shard_experts`). Holds no parameters; buffers whose contents depend only on sizes are built once per size.
    The combine weights never travel: outputs come back in the order they were sent and are weighted at home.
    Rows travel as ``payload`` says (:class:`~lightning_llmfast.expert_parallel.DispatchPayload`: tokens in bf16 or fp8,
    outputs and every gradient in bf16 or the activations' dtype) and arrive in the activations' dtype.

    Args:
        group: the expert-parallel process group.
        num_experts: ``E`` (global).
        loss_group: the ranks whose tokens form one batch for :func:`global_aux_loss` (default: the world).
        backend: the permutation's and the experts' kernels (``"auto"``: Triton on CUDA; ``"torch"``, ``"triton"``),
            carried to the experts in the :class:`~lightning_llmfast.moe.dispatcher.ExpertRows`.
        payload: what the exchanges put on the wire (default: the activations' dtype both ways).
        nodes: the node of each rank of ``group`` (any integers: equal ones share a node), for :attr:`traffic`;
            ``None``: the whole group on one node.

    Attributes:
        host_syncs: host reads of device values so far (one per forward: the exchanged split sizes, or with a
            capacity limit the gathered sizes every rank checks).
        send_rows: rows this rank sent in the last forward's dispatch exchange (its combine sends back what it
            received; each backward exchange mirrors a forward one).
        recv_rows: rows this rank received in the last forward's dispatch exchange.
        global_stats: ``(E + 1,)`` int64 valid pairs per expert (before any capacity limit) and valid tokens of the
            last forward, summed over the group (device tensor).
        traffic: the bytes this rank's forward exchanges (dispatch and combine) have sent so far, inside its node
            and across (:class:`NodeTraffic`; the backward's exchanges mirror them, in the gradients' payload).
        overlap_chunks: ``None``: :meth:`run` exchanges, then computes; an int or ``"auto"``: the rows travel in
            that many chunks under the experts' compute (:mod:`~lightning_llmfast.expert_parallel.overlap`; set by
            :func:`~lightning_llmfast.expert_parallel.set_ep_overlap`).
        timer: stamps every exchange and wait (:class:`~lightning_llmfast.comm.timing.ExchangeTimer`), or ``None``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        loss_group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        payload: DispatchPayload | None = None,
        nodes: Sequence[int] | None = None,
    ) -> None:
        self.group = group
        self.payload = DispatchPayload() if payload is None else payload
        self.loss_group = dist.group.WORLD if loss_group is None else loss_group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.nodes = tuple(nodes) if nodes is not None else (0,) * self.world
        if len(self.nodes) != self.world:
            raise ConfigError(f"nodes must give the node of each of the {self.world} ranks, got {self.nodes}")
        self.traffic = NodeTraffic()
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.host_syncs = 0
        self.send_rows = 0
        self.recv_rows = 0
        self.global_stats: Tensor | None = None
        self._sizes: tuple[int, ...] | None = None
        self._static: dict[tuple[Any, ...], Tensor] = {}
        self.overlap_chunks: int | str | None = None
        self.timer: ExchangeTimer | None = None

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.rank * self.num_local, (self.rank + 1) * self.num_local)

    def batch_aux_loss(self, plan: RoutingPlan) -> Tensor:
        """This rank's share of the balance loss of the whole batch over ``loss_group`` (:func:`global_aux_loss`)."""
        # The dispatch's exchanged counts cover the loss's batch when its group is the whole loss group.
        covered = dist.get_world_size(self.loss_group) == self.world
        return global_aux_loss(plan, self.loss_group, self.global_stats if covered else None)

    def _start(self, x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> Tensor:
        if x.dim() != 2 or x.shape[0] != plan.num_tokens:
            raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
        if plan.num_experts != self.num_experts:
            raise RoutingError(f"expected a plan over {self.num_experts} experts, got {plan.num_experts}")
        self.global_stats = None
        return x if x_compute is None else x_compute

    def _backend(self, rows: Tensor) -> str:
        """The kernels of the permutation and the experts on ``rows``' device: Triton on CUDA for ``"auto"``."""
        return resolve_backend(self.backend, rows.device)

    def _signature(self, rows: Tensor) -> list[int]:
        if rows.dtype not in _DTYPES:
            raise RoutingError(f"expert parallelism exchanges {_DTYPES} activations, got {rows.dtype}")
        return [_DTYPES.index(rows.dtype), rows.shape[1], self.payload.code]

    def _count_traffic(self, sent: Sequence[int], returned: Sequence[int], rows: Tensor) -> None:
        """Add a forward's bytes to :attr:`traffic`: ``sent[r]`` token rows to rank ``r`` in the dispatch payload,
        ``returned[r]`` output rows back to it in the combine one."""
        hidden, dtype, payload = rows.shape[1], rows.dtype, self.payload
        self.traffic.add(self.nodes, self.rank, sent, wire_row_bytes(payload.dispatch, hidden, dtype))
        self.traffic.add(self.nodes, self.rank, returned, wire_row_bytes(payload.combine, hidden, dtype))

    def _send(self, rows: Tensor, out_splits: list[int] | None, in_splits: list[int] | None) -> Tensor:
        """Tokens to their experts in the dispatch payload (their gradients come back in the combine one)."""
        payload = self.payload
        wires = {"wire": payload.dispatch, "grad_wire": payload.combine}
        return exchange(rows, out_splits, in_splits, self.group, **wires, timer=self.timer)

    def _return(self, rows: Tensor, out_splits: list[int] | None, in_splits: list[int] | None) -> Tensor:
        """Expert outputs back to their tokens' ranks, and their gradients to the experts, in the combine payload."""
        payload = self.payload
        wires = {"wire": payload.combine, "grad_wire": payload.combine}
        return exchange(rows, out_splits, in_splits, self.group, **wires, timer=self.timer)

    def _chunked(
        self, chunks: Sequence[Chunk], experts: Callable[[int, Tensor], Tensor], independent: Callable[[], _Side]
    ) -> tuple[list[Tensor], _Side]:
        """:func:`~lightning_llmfast.expert_parallel.overlap.exchange_chunks` over this dispatcher's group."""
        return exchange_chunks(chunks, experts, independent, self.group, self.payload, self.timer)

    def _raise_disagreement(self, kind: str, theirs: list[list[int]]) -> None:
        raise RoutingError(
            f"expert-parallel ranks disagree on the {kind} of their all-to-all exchange (per rank of the group, "
            f"rank {self.rank} of {self.world} sees {theirs}): every rank must run the same block with the same "
            "dtype, hidden size and dispatch payload (and, with capacity_factor, the same number of tokens)"
        )

    def _cached(self, key: tuple[Any, ...], build: Callable[[], Tensor]) -> Tensor:
        if key not in self._static:
            self._static[key] = build()
        return self._static[key]

    def __repr__(self) -> str:
        experts = self.local_experts
        span = f"[{experts.start}, {experts.stop})"
        return f"{type(self).__name__}(world={self.world}, rank={self.rank}, local_experts={span})"


class AllToAllDroplessDispatcher(AllToAllDispatcher):
    """Dropless expert parallelism: the receive splits come from one exchange of the counts (one host read).

    Example::

        shard_experts(MoEBlock(MoEConfig.build(64, 128, 8, 2)), group)  # installs this dispatcher
    """

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        rows, shake = self._handshake(x, plan, x_compute)
        recv_rows = self._send(rows, shake.out_splits, shake.in_splits)
        # Received rows are grouped by (source rank, local expert); the grouped GEMM wants (local expert, source).
        order, inverse = self._expert_major(shake.mine, self.recv_rows)
        grouped = masked_gather(recv_rows, order, None, inverse, None)
        offsets = F.pad(shake.mine.sum(dim=0).cumsum(0), (1, 0)).to(torch.int32)
        rows = ExpertRows(grouped, offsets, False, self._backend(grouped))
        return rows, _Return(plan, (inverse, order), shake.in_splits, shake.out_splits)

    def run(
        self,
        x: Tensor,
        plan: RoutingPlan,
        experts: Callable[[ExpertRows], Tensor],
        independent: Callable[[], _Side],
        *,
        x_compute: Tensor | None = None,
    ) -> tuple[Tensor, _Side]:
        """With :attr:`overlap_chunks`: the rows each rank sends to each other rank in consecutive chunks, each
        chunk's experts under the next chunks' exchanges (:mod:`~lightning_llmfast.expert_parallel.overlap`)."""
        if self.overlap_chunks is None:
            return super().run(x, plan, experts, independent, x_compute=x_compute)
        rows, shake = self._handshake(x, plan, x_compute)
        count = chunk_count(self.overlap_chunks, shake.pairs // self.world)
        sent = [split_evenly(n, count) for n in shake.in_splits]  # [rank][chunk]
        received = [split_evenly(n, count) for n in shake.out_splits]
        pieces = torch.split(rows, [n for per_rank in sent for n in per_rank])
        chunks = [
            (
                torch.cat(pieces[c::count]),
                [per_rank[c] for per_rank in received],
                [per_rank[c] for per_rank in sent],
            )
            for c in range(count)
        ]
        # Row ranges of each chunk within each source's rows (sorted by local expert), for the chunk's groups.
        bounds = [sum(per_rank[:c]) for per_rank in received for c in range(count + 1)]
        bounds = stage_to_device(bounds, shake.mine.device).view(self.world, count + 1)
        ends = F.pad(shake.mine.cumsum(dim=1), (1, 0))  # (W, E_l + 1) ends of each expert's rows per source

        def run_experts(c: int, recv: Tensor) -> Tensor:
            low, high = bounds[:, c : c + 1], bounds[:, c + 1 : c + 2]
            per_expert = ends.clamp(low, high).diff(dim=1)  # (W, E_l) rows of the chunk per source and expert
            order, inverse = self._expert_major(per_expert, recv.shape[0])
            grouped = masked_gather(recv, order, None, inverse, None)
            offsets = F.pad(per_expert.sum(dim=0).cumsum(0), (1, 0)).to(torch.int32)
            outputs = experts(ExpertRows(grouped, offsets, False, self._backend(grouped)))
            return masked_gather(outputs, inverse, None, order, None)

        backs, side = self._chunked(chunks, run_experts, independent)
        # Chunk c holds piece c of every destination: back to one block per destination, pieces in order.
        back_pieces = [torch.split(back, [per_rank[c] for per_rank in sent]) for c, back in enumerate(backs)]
        back = torch.cat([back_pieces[c][r] for r in range(self.world) for c in range(count)])
        padding = plan.num_rows - back.shape[0]  # the masked pairs' rows (zero weight): zeros
        return unpermute(F.pad(back, (0, 0, 0, padding)), plan, backend=self.backend), side

    def _handshake(self, x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> tuple[Tensor, _Handshake]:
        """The counts exchange and its one host read: the rows to send (permuted, padding left out) and the
        :class:`_Handshake`; checks that every rank agrees on the signature."""
        source = self._start(x, plan, x_compute)
        if plan.capacity is not None:
            raise RoutingError("AllToAllDroplessDispatcher needs a dropless plan; use AllToAllCapacityDispatcher")
        world, local, num_experts = self.world, self.num_local, self.num_experts
        signature = self._signature(source)
        counts = plan.tokens_per_expert.to(torch.int64)
        # Every rank gets every source's full counts and valid-token count (W * (E + 4) integers, not W * E_l): its
        # own experts' receive splits, and the batch-wide counts of the load-balancing loss without an all-reduce.
        header = stage_to_device([plan.num_tokens, *signature], counts.device)  # pinned, non-blocking
        if plan.token_mask is not None:  # padding counts in no loss: the valid tokens, counted on the device
            header = torch.cat([plan.token_mask.sum(dtype=torch.int64).view(1), header[1:]])
        send = torch.cat([counts, header]).expand(world, -1).contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        # Queued before the host waits: the permutation and the send splits need no received value.
        rows = permute(source, plan, backend=self.backend)
        send_rows = counts.view(world, local).sum(dim=1)
        work.wait()
        mine = recv[:, self.rank * local : (self.rank + 1) * local]
        # NOTE: host sync, the one of dropless expert parallelism (once per layer and forward; every later
        # exchange of this layer, in forward and backward, reuses these splits).
        host = torch.cat([send_rows, mine.sum(dim=1), recv[:, num_experts:].flatten()]).tolist()
        self.host_syncs += 1
        in_splits, out_splits, theirs = host[:world], host[world : 2 * world], host[2 * world :]
        width = 1 + len(signature)  # each source's valid tokens, then its signature
        tokens = sum(theirs[::width])
        received = [theirs[width * i + 1 : width * (i + 1)] for i in range(world)]
        if any(r != signature for r in received):
            self._raise_disagreement("dtype, hidden size or dispatch payload", received)
        self.global_stats = recv[:, : num_experts + 1].sum(dim=0)
        self.send_rows, self.recv_rows = sum(in_splits), sum(out_splits)
        self._count_traffic(in_splits, out_splits, source)
        # A token mask's pairs sort after every expert's: the rows past the kept ones are padding and stay home.
        shake = _Handshake(mine, in_splits, out_splits, tokens * plan.top_k)
        return rows[: self.send_rows], shake

    def combine(self, rows: Tensor, ctx: _Return) -> Tensor:
        """Send the experts' outputs back to their tokens' ranks and weight them at home: ``(T, H)``."""
        inverse, order = ctx.maps
        back = self._return(masked_gather(rows, inverse, None, order, None), ctx.in_splits, ctx.out_splits)
        padding = ctx.plan.num_rows - back.shape[0]  # the masked pairs' rows (zero weight): zeros
        return unpermute(F.pad(back, (0, 0, 0, padding)), ctx.plan, backend=self.backend)

    @staticmethod
    def _expert_major(by_source: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
        """``order`` (expert-major row -> source-major row) and its inverse, on the device, without a sync."""
        flat, expert_major = by_source.flatten(), by_source.t().flatten()
        src_end = flat.cumsum(0)
        src_start = src_end - flat
        dst_start = (expert_major.cumsum(0) - expert_major).view(by_source.shape[1], -1).t().flatten()
        row = torch.arange(num_rows, device=by_source.device)
        block = torch.searchsorted(src_end, row, right=True)
        inverse = dst_start[block] + row - src_start[block]  # source-major row -> expert-major row
        order = torch.empty_like(inverse).scatter_(0, inverse, row)
        return order, inverse


class AllToAllCapacityDispatcher(AllToAllDispatcher):
    """Capacity-limited expert parallelism: fixed, equal splits of ``capacity`` rows per expert.

    One all-gather per forward of every rank's sizes (tokens, capacity, dtype, hidden size, payload) with the balance
    loss's counts, read on the host once: ranks that disagree all raise :class:`~lightning_llmfast.errors.RoutingError`
    before the token exchange, and the loss needs no all-reduce of its own.

    Example::

        shard_experts(MoEBlock(MoEConfig.build(64, 128, 8, 2, capacity_factor=1.25)), group)  # installs this one
    """

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        send, ctx = self._slots(x, plan, x_compute)
        world, local, capacity = self.world, self.num_local, plan.capacity
        assert capacity is not None
        recv = self._send(send, None, None)  # (W * E_l * C, H): source, local expert, slot
        hidden_size = recv.shape[1]
        grouped = recv.view(world, local, capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
        # Every local expert owns W * C rows; the free slots are zero rows, whose outputs and gradients are zero.
        group_rows = world * capacity
        offsets = self._cached(
            ("offsets", group_rows, recv.device),
            lambda: torch.arange(local + 1, device=recv.device, dtype=torch.int32) * group_rows,
        )
        return ExpertRows(grouped, offsets, False, self._backend(grouped)), ctx

    def _slots(self, x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> tuple[Tensor, _Return]:
        """The ``(E * C, H)`` slots to send (expert-major; zeros where free) and the combine's context."""
        source = self._start(x, plan, x_compute)
        capacity = plan.capacity
        if capacity is None:
            raise RoutingError("AllToAllCapacityDispatcher needs a plan with a capacity; use the dropless one")
        world, local = self.world, self.num_local
        sizes = [plan.num_tokens, capacity, *self._signature(source)]
        gathered, work = self._gather_sizes(plan, sizes, source.device)
        # Queued before the host waits: the permutation and the slot maps need no received value.
        rows = permute(source, plan, backend=self.backend)
        slot_src, slot_valid, row_slot, row_valid = self._slot_maps(plan)
        work.wait()
        self._check_sizes(gathered, sizes, plan.routed_per_expert is not None)
        send = masked_gather(rows, slot_src, slot_valid, row_slot, row_valid)  # (E * C, H)
        self.send_rows = self.recv_rows = send.shape[0]
        self._count_traffic([local * capacity] * world, [local * capacity] * world, send)
        return send, _Return(plan, (row_slot, row_valid, slot_src, slot_valid), None, None)

    def run(
        self,
        x: Tensor,
        plan: RoutingPlan,
        experts: Callable[[ExpertRows], Tensor],
        independent: Callable[[], _Side],
        *,
        x_compute: Tensor | None = None,
    ) -> tuple[Tensor, _Side]:
        """With :attr:`overlap_chunks`: every expert's ``C`` slots in consecutive chunks of slots (fixed shapes), each
        chunk's experts under the next chunks' exchanges (:mod:`~lightning_llmfast.expert_parallel.overlap`)."""
        if self.overlap_chunks is None:
            return super().run(x, plan, experts, independent, x_compute=x_compute)
        send, ctx = self._slots(x, plan, x_compute)
        capacity, hidden_size = plan.capacity, send.shape[1]
        world, local = self.world, self.num_local
        assert capacity is not None
        count = chunk_count(self.overlap_chunks, world * local * capacity, limit=max(capacity, 1))
        widths = split_evenly(capacity, count)
        slots = torch.split(send.view(world, local, capacity, hidden_size), widths, dim=2)
        chunks = [(chunk.reshape(-1, hidden_size), None, None) for chunk in slots]

        def run_experts(c: int, recv: Tensor) -> Tensor:
            rows = widths[c] * world  # every local expert's slots of this chunk, from every source
            grouped = recv.view(world, local, widths[c], hidden_size).transpose(0, 1).reshape(-1, hidden_size)
            offsets = self._cached(
                ("offsets", rows, recv.device),
                lambda: torch.arange(local + 1, device=recv.device, dtype=torch.int32) * rows,
            )
            out = experts(ExpertRows(grouped, offsets, False, self._backend(grouped)))
            return out.view(local, world, widths[c], hidden_size).transpose(0, 1).reshape(-1, hidden_size)

        backs, side = self._chunked(chunks, run_experts, independent)
        back = torch.cat([b.view(world, local, w, hidden_size) for b, w in zip(backs, widths, strict=True)], dim=2)
        return self._unslot(back.view(-1, hidden_size), ctx), side

    def combine(self, rows: Tensor, ctx: _Return) -> Tensor:
        """Send the experts' outputs back to their slots' ranks and weight them at home: ``(T, H)``."""
        capacity, hidden_size = ctx.plan.capacity, rows.shape[1]
        back = rows.view(self.num_local, self.world, capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
        return self._unslot(self._return(back, None, None), ctx)

    def _unslot(self, slots: Tensor, ctx: _Return) -> Tensor:
        """The returned ``(E * C, H)`` slots back to their tokens, weighted: ``(T, H)``."""
        row_slot, row_valid, slot_src, slot_valid = ctx.maps
        return unpermute(
            masked_gather(slots, row_slot, row_valid, slot_src, slot_valid), ctx.plan, backend=self.backend
        )

    def _slot_maps(self, plan: RoutingPlan) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Kept permuted rows <-> fixed slots ``expert * C + rank_in_expert``, both ways, from the plan's offsets."""
        assert plan.capacity is not None
        slot_src, slot_valid, row_slot, row_valid = block_maps(plan.offsets, plan.capacity, plan.num_rows)
        return slot_src, slot_valid, row_slot, row_valid

    def _gather_sizes(self, plan: RoutingPlan, sizes: list[int], device: torch.device) -> tuple[Tensor, Any]:
        """Start the all-gather of every rank's ``sizes`` and of its valid pairs per expert and valid tokens (the
        balance loss's batch-wide counts): ``((W, E + 1 + len(sizes)) int64, work)``.

        Every rank enters it on every forward, whatever its own sizes: a rank that skipped it while another entered
        it would pair that rank's gather with its own token exchange and hang both.
        """
        if tuple(sizes) != self._sizes:
            self._sizes = tuple(sizes)
            self._static.clear()  # the size-derived buffers of the old sizes are not needed again
        comm = comm_device(self.group, device)
        routed = plan.routed_per_expert
        if routed is None:  # a plan built without route(): the loss all-reduces its own counts (and refuses)
            counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=device)
        else:
            if plan.token_mask is None:
                valid = torch.full((1,), plan.num_tokens, dtype=torch.int64, device=device)
            else:  # padding counts in no loss
                valid = plan.token_mask.sum(dtype=torch.int64).view(1)
            counts = torch.cat([routed.to(torch.int64), valid])
        mine = torch.cat([counts.to(comm), stage_to_device(sizes, comm)])
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=comm)
        work = dist.all_gather_single(gathered, mine, group=self.group, async_op=True)
        return gathered.view(self.world, -1), work

    def _check_sizes(self, gathered: Tensor, sizes: list[int], routed: bool) -> None:
        """Every rank reads every rank's sizes from :meth:`_gather_sizes` (one host read) and raises if any differ;
        the summed counts become :attr:`global_stats` (the balance loss then needs no all-reduce of its own)."""
        stats = self.num_experts + 1
        # NOTE: host sync, the one of capacity-limited expert parallelism (once per layer and forward): every rank
        # must learn of another rank's change before the token exchange, whose buffers the sizes shape.
        theirs = gathered[:, stats:].tolist()
        self.host_syncs += 1
        if any(t != sizes for t in theirs):
            self._raise_disagreement("tokens, capacity, dtype, hidden size or dispatch payload", theirs)
        self.global_stats = gathered[:, :stats].sum(dim=0) if routed else None


class SharedBatchDispatcher(LocalDispatcher):
    """Every expert local, the balance loss over a group of ranks that share one batch (context parallelism).

    The ranks of a context-parallel group each hold a share of one batch's positions; the Switch loss of the batch
    counts the pairs of every share. This dispatcher moves tokens as :class:`~lightning_llmfast.moe.LocalDispatcher`
    does and returns :func:`global_aux_loss` over ``group`` as the block's loss: its mean over the group's ranks is the
    loss of the whole batch (one all-reduce of ``E + 1`` integers per block, no host read).

    Args:
        group: the ranks sharing the batch (the context-parallel group).
        backend: the permutation's and the experts' kernels.

    Example::

        block.set_dispatcher(SharedBatchDispatcher(dims.cp_group))
    """

    def __init__(self, group: dist.ProcessGroup, backend: str = "auto") -> None:
        super().__init__(backend)
        self.group = group

    def batch_aux_loss(self, plan: RoutingPlan) -> Tensor:
        return global_aux_loss(plan, self.group)

    def __repr__(self) -> str:
        return f"SharedBatchDispatcher(group_size={dist.get_world_size(self.group)}, backend={self.backend!r})"


def global_aux_loss(plan: RoutingPlan, group: dist.ProcessGroup | None = None, stats: Tensor | None = None) -> Tensor:
    """This rank's share of the load-balancing loss of the whole batch (all ranks of ``group``), from one forward.

    The Switch loss ``E * sum_e f_e * P_e`` of :func:`~lightning_llmfast.moe.route` is not a mean of per-rank losses:
    ``f`` must count the pairs of every rank. The valid pairs per expert (before the capacity limit) and the valid
    token count (a ``token_mask``'s padding counts in neither, nor in ``P``, as in the one-process loss) are summed
    over ``group`` with one all-reduce of ``E + 1`` integers (queued, no host read); the result is scaled
    so that the mean over the ranks of the returned values, and of their gradients (what DDP averages), is the
    one-process loss of the concatenated batch.

    Args:
        plan: this rank's routing plan (its ``router_probs``: softmax, or sigmoid normalised per token).
        group: the ranks whose tokens form the batch (default: the whole world).
        stats: ``(E + 1,)`` int64 valid pairs per expert and valid tokens, already summed over ``group`` (the
            dropless dispatch exchanges them with its counts); ``None``: all-reduced here.

    Returns:
        0-d float32, differentiable with respect to the router logits.

    Example::

        loss = global_aux_loss(block.stats.plan)
    """
    group = dist.group.WORLD if group is None else group
    num_experts = plan.num_experts
    if stats is None:
        if plan.routed_per_expert is None:
            raise RoutingError("global_aux_loss needs a plan from route() (its routed_per_expert counts)")
        # Valid pairs per expert before the capacity limit and valid tokens: masked (padding) tokens count nowhere.
        routed = plan.routed_per_expert.to(torch.int64)
        if plan.token_mask is None:
            valid = torch.full((1,), plan.num_tokens, dtype=torch.int64, device=routed.device)
        else:
            valid = plan.token_mask.sum(dtype=torch.int64).view(1)
        # Functional: traceable by torch.compile (a context-parallel group's compiled layers) as well.
        stats = wait_tensor(all_reduce(torch.cat([routed, valid]), "sum", group))
    counts = stats[:num_experts].to(torch.float32)
    tokens = stats[num_experts].clamp(min=1).to(torch.float32)
    scale = dist.get_world_size(group) * num_experts / (counts.sum().clamp(min=1) * tokens)
    return torch.dot(counts, masked_probs(plan.router_probs, plan.token_mask).sum(dim=0)) * scale
