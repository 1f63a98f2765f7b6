"""Expert parallelism: each rank of a process group holds ``E / W`` experts; tokens travel by ``all_to_all_single``.

:func:`shard_experts` converts an MoE block in place (keeping ``Parameter`` objects for the local experts only) and
installs an :class:`ExpertParallelDispatch` at the block's one expert call site. The dispatch is driven by the
router's one counting pass (:class:`~lightning_llmfast.moe.RoutingPlan`): its per-expert counts are the send splits.
Experts are laid out contiguously (rank ``j`` holds experts ``j * E_l .. (j + 1) * E_l - 1``), so the plan's
expert-grouped rows are already grouped by destination rank. The combine weights never travel: received expert
outputs come back in the order they were sent and ``unpermute`` applies the weights at home.

Two modes, chosen by the plan:

- dropless (``capacity is None``): one ``all_to_all_single`` of the ``E`` counts, the token count and a two-integer
  signature per rank gives the receive splits (and the batch-wide counts of the load-balancing loss, so that it
  needs no all-reduce). It is issued before the local permutation is queued and read on the host after:
  one host read per layer and forward (:attr:`ExpertParallelDispatch.host_syncs` counts it); the combine and both
  backward exchanges reuse the same splits, swapped. The signature (dtype, hidden size) is checked on every rank
  with that read, so ranks that disagree raise :class:`~lightning_llmfast.errors.RoutingError` instead of hanging.
- capacity (``capacity_factor`` set): every rank sends exactly ``capacity`` rows per expert (zeros pad the free
  slots), so both exchanges have fixed, equal splits and nothing is read on the host. The capacity rule is the
  plan's, per source rank: ``C = ceil(cf * T_r * k / E)`` from that rank's own ``T_r`` tokens, and that rank's
  plan drops exactly the pairs the one-process block drops on those tokens (the plan is computed before any
  exchange). The holder runs its experts over all ``W * C`` slots; zero rows give zero outputs and gradients. The
  sizes are checked collectively (one host read) on the first forward and whenever a rank's own sizes change.

Every exchange is differentiable: the backward of an all-to-all is the reverse all-to-all.

Example::

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    block = MoEBlock(hidden_size=64, ffn_size=128, num_experts=8, top_k=2)  # same seed on every rank
    shard_experts(block, dist.group.WORLD)  # keeps experts 4 * rank .. 4 * rank + 3 on 2 ranks
    y = block(x_local)  # tokens of this rank; gradients flow back to every rank's tokens and router
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llmfast._autograd import in_backward
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe._exchange import all_to_all, comm_device, masked_gather, stage_to_device
from lightning_llmfast.moe.experts import grouped_swiglu
from lightning_llmfast.moe.permute import permute, unpermute
from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["ExpertParallelDispatch", "global_aux_loss", "shard_experts"]

# Wire codes of the activation dtypes in the size signature (ranks must agree on the bytes per row).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Expert-parameter dimensions compared across ranks by shard_experts (four 3-D parameters at most).
_SHAPE_SLOTS = 12


class ExpertParallelDispatch(nn.Module):
    """Expert-parallel replacement of :func:`~lightning_llmfast.moe.routed_swiglu` (same call signature).

    Installed by :func:`shard_experts`; holds no parameters. Buffers whose contents depend only on sizes (the
    local experts' group ends, slot ranges) are built once per size and reused across steps; the token buffers
    come from the caching allocator with the same sizes every step.

    Args:
        group: the expert-parallel process group.
        num_experts: ``E`` (global).
        loss_group: the ranks whose tokens form one batch for :func:`global_aux_loss` (default: the world).

    Attributes:
        host_syncs: host reads of device values so far (dropless: one per forward; capacity: one per size change).
        last_send_rows: rows this rank sent in the last forward's dispatch all-to-all (its combine sends back
            what it received; each backward exchange mirrors a forward one).
        last_recv_rows: rows this rank received in the last forward's dispatch all-to-all.
        last_global_stats: dropless: ``(E + 1,)`` int64 pairs per expert and tokens of the last forward, summed
            over the group (device tensor); ``None`` with a capacity limit.

    Example::

        block.expert_dispatch = ExpertParallelDispatch(group, num_experts=8)  # what shard_experts installs
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, loss_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.loss_group = dist.group.WORLD if loss_group is None else loss_group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.host_syncs = 0
        self.last_send_rows = 0
        self.last_recv_rows = 0
        self.last_global_stats: Tensor | None = None
        self._checked_sizes: tuple[int, ...] | None = None
        self._static: dict[tuple[Any, ...], Tensor] = {}

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.rank * self.num_local, (self.rank + 1) * self.num_local)

    def forward(
        self,
        x: Tensor,
        plan: RoutingPlan,
        gate_up: Tensor,
        down: Tensor,
        act: Callable[[Tensor], Tensor] = F.silu,
        *,
        x_compute: Tensor | None = None,
        backend: str = "auto",
    ) -> Tensor:
        """``out[t] = sum_s weights[t, s] * expert_{e(t, s)}(x[t])`` with the experts spread over the group.

        Args:
            x: ``(T, H)`` this rank's tokens.
            plan: their routing plan over all ``E`` experts.
            gate_up: ``(E_l, H, 2F)`` the local experts' weights (any strides).
            down: ``(E_l, F, H)``.
            act: activation of the gate half.
            x_compute: ``x`` in the compute dtype (shared with the router), or ``None``.
            backend: permutation kernels (``"auto"``, ``"torch"``, ``"triton"``).

        Returns:
            ``(T, H)`` in the compute dtype.

        Raises:
            RoutingError: wrong shapes, or ranks that disagree on the exchange sizes (raised on every rank).
        """
        if x.dim() != 2 or x.shape[0] != plan.num_tokens:
            raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
        # Under FSDP2 the gathered expert weights are DTensors sharded over this group: the local experts are ours.
        gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (gate_up, down))
        if plan.num_experts != self.num_experts or gate_up.shape[0] != self.num_local:
            raise RoutingError(
                f"expected a plan over {self.num_experts} experts and {self.num_local} local experts, got "
                f"{plan.num_experts} and {gate_up.shape[0]}"
            )
        source = x if x_compute is None else x_compute
        self.last_global_stats = None
        if plan.capacity is None:
            hidden = self._dropless(source, plan, gate_up, down, act, backend)
        else:
            hidden = self._capacity(permute(source, plan, backend=backend), plan, gate_up, down, act)
        return unpermute(hidden, plan, backend=backend)

    def _signature(self, rows: Tensor) -> list[int]:
        if rows.dtype not in _DTYPES:
            raise RoutingError(f"expert parallelism exchanges {_DTYPES} activations, got {rows.dtype}")
        return [_DTYPES.index(rows.dtype), rows.shape[1]]

    def _raise_disagreement(self, kind: str, theirs: list[list[int]]) -> None:
        raise RoutingError(
            f"expert-parallel ranks disagree on the {kind} of their all-to-all exchange (per rank of the group, "
            f"rank {self.rank} of {self.world} sees {theirs}): every rank must run the same block with the same "
            "dtype and hidden size (and, with capacity_factor, the same number of tokens)"
        )

    # ------------------------------------------------------------------ dropless
    def _dropless(
        self,
        source: Tensor,
        plan: RoutingPlan,
        gate_up: Tensor,
        down: Tensor,
        act: Callable[[Tensor], Tensor],
        backend: str,
    ) -> Tensor:
        world, local, num_experts = self.world, self.num_local, self.num_experts
        signature = self._signature(source)
        counts = plan.tokens_per_expert.to(torch.int64)
        # Every rank gets every source's full counts and token count (W * (E + 3) integers, not W * E_l): its own
        # experts' receive splits, and the batch-wide counts of the load-balancing loss without an all-reduce.
        header = stage_to_device([plan.num_tokens, *signature], counts.device)  # pinned, non-blocking
        send = torch.cat([counts, header]).expand(world, -1).contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        # Queued before the host waits: the permutation and the send splits need no received value.
        rows = permute(source, plan, backend=backend)
        send_rows = counts.view(world, local).sum(dim=1)
        work.wait()
        mine = recv[:, self.rank * local : (self.rank + 1) * local]
        # NOTE: host sync, the one of dropless expert parallelism (once per layer and forward; every later
        # exchange of this layer, in forward and backward, reuses these splits).
        host = torch.cat([send_rows, mine.sum(dim=1), recv[:, num_experts + 1 :].flatten()]).tolist()
        self.host_syncs += 1
        in_splits, out_splits, theirs = host[:world], host[world : 2 * world], host[2 * world :]
        received = [theirs[2 * i : 2 * i + 2] for i in range(world)]
        if any(r != signature for r in received):
            self._raise_disagreement("dtype or hidden size", received)
        self.last_global_stats = recv[:, : num_experts + 1].sum(dim=0)
        self.last_send_rows, self.last_recv_rows = sum(in_splits), sum(out_splits)
        recv_rows = all_to_all(rows, out_splits, in_splits, self.group)
        # Received rows are grouped by (source rank, local expert); the grouped GEMM wants (local expert, source).
        by_source = mine
        order, inverse = self._expert_major(by_source, self.last_recv_rows)
        grouped = masked_gather(recv_rows, order, None, inverse, None)
        offsets = F.pad(by_source.sum(dim=0).cumsum(0), (1, 0)).to(torch.int32)
        hidden = grouped_swiglu(grouped, offsets, gate_up, down, act, validate=False)
        back = masked_gather(hidden, inverse, None, order, None)
        return all_to_all(back, in_splits, out_splits, self.group)

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

    # ------------------------------------------------------------------ capacity
    def _capacity(
        self, rows: Tensor, plan: RoutingPlan, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]
    ) -> Tensor:
        world, local, capacity = self.world, self.num_local, plan.capacity
        assert capacity is not None
        self._check_sizes([plan.num_tokens, capacity, *self._signature(rows)], rows.device)
        slot_src, slot_valid, row_slot, row_valid = self._slot_maps(plan, rows.device)
        send = masked_gather(rows, slot_src, slot_valid, row_slot, row_valid)  # (E * C, H)
        self.last_send_rows = self.last_recv_rows = send.shape[0]
        recv = all_to_all(send, None, None, self.group)  # (W * E_l * C, H): source, local expert, slot
        hidden_size = recv.shape[1]
        grouped = recv.view(world, local, capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
        # Every local expert owns W * C rows; the free slots are zero rows, whose outputs and gradients are zero.
        group_rows = world * capacity
        offsets = self._cached(
            ("offsets", group_rows, rows.device),
            lambda: torch.arange(local + 1, device=rows.device, dtype=torch.int32) * group_rows,
        )
        hidden = grouped_swiglu(grouped, offsets, gate_up, down, act, validate=False)
        back = hidden.view(local, world, capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
        slots = all_to_all(back, None, None, self.group)
        return masked_gather(slots, row_slot, row_valid, slot_src, slot_valid)

    def _slot_maps(self, plan: RoutingPlan, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Kept permuted rows <-> fixed slots ``expert * C + rank_in_expert``, both ways, from the plan's offsets."""
        capacity, num_rows, num_experts = plan.capacity, plan.num_rows, self.num_experts
        assert capacity is not None
        offsets = plan.offsets.to(torch.int64)
        slot = self._cached(("arange", capacity, device), lambda: torch.arange(capacity, device=device))
        slot_src = (offsets[:-1, None] + slot).flatten().clamp(max=max(num_rows - 1, 0))
        slot_valid = (slot < plan.tokens_per_expert.to(torch.int64)[:, None]).flatten()
        row = self._cached(("arange", num_rows, device), lambda: torch.arange(num_rows, device=device))
        row_valid = row < offsets[-1]
        expert = torch.searchsorted(offsets[1:], row, right=True).clamp(max=num_experts - 1)
        row_slot = (expert * capacity + row - offsets[expert]).clamp(0, max(num_experts * capacity - 1, 0))
        return slot_src, slot_valid, row_slot, row_valid

    def _cached(self, key: tuple[Any, ...], build: Callable[[], Tensor]) -> Tensor:
        if key not in self._static:
            self._static[key] = build()
        return self._static[key]

    def _check_sizes(self, sizes: list[int], device: torch.device) -> None:
        """All ranks agree on ``sizes``: checked collectively when this rank's own sizes change (one host read)."""
        if tuple(sizes) == self._checked_sizes:
            return
        mine = torch.tensor(sizes, dtype=torch.int64, device=comm_device(self.group, device))
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        # NOTE: host sync, only when this rank's sizes change (the steady state reads nothing).
        theirs = torch.stack(everyone).tolist()
        self.host_syncs += 1
        if any(t != sizes for t in theirs):
            self._raise_disagreement("tokens, capacity, dtype or hidden size", theirs)
        self._checked_sizes = tuple(sizes)
        self._static.clear()  # the size-derived buffers of the old sizes are not needed again

    def extra_repr(self) -> str:
        experts = self.local_experts
        return f"world={self.world}, rank={self.rank}, local_experts=[{experts.start}, {experts.stop})"


def global_aux_loss(block: nn.Module, group: dist.ProcessGroup | None = None, stats: Tensor | None = None) -> Tensor:
    """This rank's share of the load-balancing loss of the whole batch (all ranks of ``group``), from one forward.

    The Switch loss ``E * sum_e f_e * P_e`` of :func:`~lightning_llmfast.moe.route` is not a mean of per-rank losses:
    ``f`` must count the pairs of every rank. The pairs per expert (before the capacity limit) and the token count
    are summed over ``group`` with one all-reduce of ``E + 1`` integers (queued, no host read); the result is scaled
    so that the mean over the ranks of the returned values, and of their gradients (what DDP averages), is the
    one-process loss of the concatenated batch.

    Args:
        block: an MoE block after its forward (``last_plan``, ``last_router_logits``; ``score`` if not softmax).
        group: the ranks whose tokens form the batch (default: the whole world).
        stats: ``(E + 1,)`` int64 pairs per expert and tokens, already summed over ``group`` (the dropless dispatch
            exchanges them with its counts); ``None``: all-reduced here.

    Returns:
        0-d float32, differentiable with respect to the router logits.

    Example::

        block.last_aux_loss = global_aux_loss(block)  # what shard_experts' forward hook does
    """
    group = dist.group.WORLD if group is None else group
    plan, logits = block.last_plan, block.last_router_logits
    num_experts, top_k = plan.num_experts, plan.top_k
    if stats is None:
        ids = plan.expert_ids.reshape(-1).to(torch.int64)
        stats = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        stats.scatter_add_(0, ids, torch.ones_like(ids))  # integer adds: order-free, deterministic
        stats[num_experts] = plan.num_tokens
        dist.all_reduce(stats, group=group, async_op=True).wait()
    if getattr(block, "score", "softmax") == "sigmoid":
        # Normalised over the experts of each token, as route() does for its loss (DeepSeek-V3).
        probs = logits.float().sigmoid()
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        probs = logits.float().softmax(dim=-1)
    tokens = stats[num_experts].clamp(min=1).to(torch.float32)
    scale = dist.get_world_size(group) * num_experts / (tokens * tokens * top_k)
    return torch.dot(stats[:num_experts].to(torch.float32), probs.sum(dim=0)) * scale


def _aux_hook(block: nn.Module, args: Any, output: Any) -> None:
    # Not again when activation recomputation replays the forward inside backward (its collectives would not pair).
    if block.training and not in_backward():
        dispatch = block.expert_dispatch
        # The dispatch's exchanged counts cover the loss's batch when its group is the whole loss group.
        covered = dist.get_world_size(dispatch.loss_group) == dispatch.world
        stats = dispatch.last_global_stats if covered else None
        block.last_aux_loss = global_aux_loss(block, dispatch.loss_group, stats)


def _num_experts(block: nn.Module) -> int:
    experts = getattr(block, "experts", None)
    params = list(experts.named_parameters(recurse=False)) if isinstance(experts, nn.Module) else []
    if not params or not hasattr(block, "expert_dispatch"):
        raise ConfigError(
            f"shard_experts needs a grouped MoE block (MoEBlock, or a transformers block swapped by "
            f"GroupedRouterMixin) with 3-D expert parameters, got {type(block).__qualname__}"
        )
    sizes = {p.shape[0] for _, p in params if p.dim() == 3}
    if len(sizes) != 1 or any(p.dim() != 3 for _, p in params):
        shapes = {n: tuple(p.shape) for n, p in params}
        raise ConfigError(f"expert parameters must be 3-D with the experts first, got {shapes}")
    return sizes.pop()


def shard_experts(
    block: nn.Module, group: dist.ProcessGroup | None = None, *, loss_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Shard an MoE block's experts over ``group`` in place: each rank keeps ``Parameter`` s of its ``E / W`` only.

    Call it on every rank of ``group`` with identically initialised blocks (same seed): rank ``j`` keeps experts
    ``j * E / W`` to ``(j + 1) * E / W - 1``. The block then dispatches its tokens with
    :class:`ExpertParallelDispatch`, and its ``last_aux_loss`` becomes this rank's share of the batch-wide loss
    (:func:`global_aux_loss` over ``loss_group``). Expert gradients then hold the sum over every rank's tokens of
    that rank's loss; average them as the dense ones are (``lightning_llmfast.parallel.expert`` does, under DDP).

    Args:
        block: :class:`~lightning_llmfast.moe.MoEBlock` or a transformers block swapped by
            :class:`~lightning_llmfast.GroupedRouterMixin`.
        group: the expert-parallel process group (default: the whole world).
        loss_group: the ranks whose tokens form one batch for the load-balancing loss (default: the whole world).

    Returns:
        ``block``, for chaining.

    Raises:
        ConfigError: not a grouped MoE block, already sharded, ``W`` does not divide ``E``, or (checked with one
            all-gather over ``group``, on every rank) the ranks' blocks differ in their expert shapes.

    Example::

        shard_experts(block, dist.new_group([0, 1]))
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("shard_experts needs an initialised torch.distributed process group")
    group = dist.group.WORLD if group is None else group
    num_experts = _num_experts(block)
    if isinstance(block.expert_dispatch, ExpertParallelDispatch):
        raise ConfigError(f"{type(block).__qualname__} is already sharded over {block.expert_dispatch.world} ranks")
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ConfigError(
            f"an expert-parallel group of {world} ranks must divide the number of experts, got {num_experts} "
            f"experts ({type(block).__qualname__})"
        )
    params = dict(block.experts.named_parameters(recurse=False))
    _check_same_blocks(params, group)
    dispatch = ExpertParallelDispatch(group, num_experts, loss_group)
    experts = dispatch.local_experts
    for name, param in params.items():
        local = nn.Parameter(param.detach()[experts.start : experts.stop].clone(), requires_grad=param.requires_grad)
        setattr(block.experts, name, local)
    block.expert_dispatch = dispatch
    block.register_forward_hook(_aux_hook)
    return block


def _check_same_blocks(params: dict[str, Tensor], group: dist.ProcessGroup) -> None:
    # A fixed length whatever the block: ranks with other parameter lists must not make the all-gather mismatch.
    shapes = [d for p in params.values() for d in p.shape][:_SHAPE_SLOTS]
    shapes += [-1] * (_SHAPE_SLOTS - len(shapes))
    device = next(iter(params.values())).device
    if device.type == "meta":
        return  # nothing allocated (a sharding plan, or a model built on the meta device): one config's shapes
    mine = torch.tensor([len(params), *shapes], dtype=torch.int64, device=comm_device(group, device))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    theirs = torch.stack(everyone).tolist()  # construction time: the host read does not matter
    if any(t != theirs[0] for t in theirs):
        raise ConfigError(f"the expert-parallel ranks' MoE blocks differ: expert parameter shapes per rank {theirs}")
