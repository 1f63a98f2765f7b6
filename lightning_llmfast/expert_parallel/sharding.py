"""Expert parallelism: each rank of a process group holds ``E / W`` experts; tokens travel by ``all_to_all_single``.

:func:`shard_experts` converts an MoE block in place (keeping ``Parameter`` objects for the local experts only) and
gives it an all-to-all :class:`~lightning_llmfast.moe.dispatcher.TokenDispatcher`
(:meth:`~lightning_llmfast.moe.MoEBlock.set_dispatcher`). The dispatch is driven by the router's one counting pass
(:class:`~lightning_llmfast.moe.RoutingPlan`): its per-expert counts are the send splits. Experts are laid out
contiguously (rank ``j`` holds experts ``j * E_l .. (j + 1) * E_l - 1``), so the plan's expert-grouped rows are
already grouped by destination rank. The combine weights never travel: received expert outputs come back in the
order they were sent and ``unpermute`` applies the weights at home.

Two dispatchers, chosen by the block's routing config:

- :class:`AllToAllDroplessDispatcher` (no ``capacity_factor``): one ``all_to_all_single`` of the ``E`` counts,
  the token count and a signature per rank gives the receive splits (and the batch-wide counts of the
  load-balancing loss, so that it needs no all-reduce). It is issued before the local permutation is queued and
  read on the host after: one host read per layer and forward (:attr:`AllToAllDispatcher.host_syncs` counts it);
  the combine and both backward exchanges reuse the same splits, swapped. The signature (dtype, hidden size,
  payload) is checked on every rank with that read, so ranks that disagree raise
  :class:`~lightning_llmfast.errors.RoutingError` instead of hanging.
- :class:`AllToAllCapacityDispatcher` (``capacity_factor`` set): every rank sends exactly ``capacity`` rows per
  expert (zeros pad the free slots), so both exchanges have fixed, equal splits.
  The capacity rule is the plan's, per source rank: ``C = ceil(cf * T_r * k / E)`` from that rank's own ``T_r``
  tokens, and that rank's plan drops exactly the pairs the one-process block drops on those tokens (the plan is
  computed before any exchange). The holder runs its experts over all ``W * C`` slots; zero rows give zero outputs
  and gradients. Every forward all-gathers every rank's sizes with the balance loss's counts (replacing the loss's
  all-reduce) and reads them on the host once, on every rank: a rank whose sizes differ makes every rank raise
  :class:`~lightning_llmfast.errors.RoutingError` before the exchange (checking only where a rank's own sizes
  changed would send the ranks into different collectives, and hang them).

Every exchange is differentiable: the backward of an all-to-all is the reverse all-to-all.

Across nodes (``ep_dispatch``): ``"flat"`` sends every (token, expert) pair straight to the expert's rank, so a token
whose ``k`` experts sit on another node crosses the node boundary ``k`` times; ``"hierarchical"``
(:class:`~lightning_llmfast.expert_parallel.hierarchical.HierarchicalDispatcher`, given the group's
:class:`~lightning_llmfast.expert_parallel.hierarchical.NodeGroups`) sends it once per destination node and fans it
out inside the node. With a ``node_layout`` both count the bytes they send inside the node and across it
(:attr:`AllToAllDispatcher.traffic`).

Payloads (``dispatch_dtype``, a :class:`~lightning_llmfast.expert_parallel.DispatchPayload`): ``None`` sends every row
in the activations' dtype; ``"bf16"`` sends the tokens in bf16 (``2 H`` bytes a row) and ``"fp8"`` as e4m3 with one
fp32 scale per row (``H + 4`` bytes: half of bf16 plus the scales), both quantized after the local permutation and
decoded to the activations' dtype before the experts. The expert outputs and every gradient come back in bf16 (the
default ``combine``, as DeepEP does; ``DispatchPayload(dispatch, combine="fp32")`` keeps the activations' dtype):
the outputs are weighted and summed over each token's ``k`` experts at home in the activations' dtype, so each
returned row is rounded once, by at most ``2**-8`` of each value, and that rounding does not add up over the
exchanges; gradients are straight-through (the quantization counts as the identity). Error of a dispatched element
``x`` of a row with ``m = max|row|`` (e4m3 keeps 3 mantissa bits, so rounding to nearest is within ``2**-4`` of the
value for normals; the per-row scale ``s = m / 448`` maps the row into e4m3's range, whose subnormals are spaced
``2**-9``)::

    |fp8(x) - x|  <= max(2**-4 * |x|, 2**-10 * m / 448)
    |bf16(x) - x| <= 2**-8 * |x|
    |fp8(x) - bf16(x)| <= max(2**-4 * |x|, 2**-10 * m / 448) + 2**-8 * |x|

(fp32 activations; with bf16 activations the decoded fp8 value is rounded to bf16 once more, ``+ 2**-8 * |x|``).

Example::

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    block = MoEBlock(MoEConfig.build(64, 128, 8, 2))  # same seed on every rank
    shard_experts(block, dist.group.WORLD)  # keeps experts 4 * rank .. 4 * rank + 3 on 2 ranks
    y = block(x_local)  # tokens of this rank; gradients flow back to every rank's tokens and router
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_llmfast.comm.timing import ExchangeTimer
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.dispatchers import (
    AllToAllCapacityDispatcher,
    AllToAllDispatcher,
    AllToAllDroplessDispatcher,
    SharedBatchDispatcher,
)
from lightning_llmfast.expert_parallel.exchange import comm_device
from lightning_llmfast.expert_parallel.hierarchical import (
    HierarchicalDispatcher,
    NodeGroups,
    check_node_limited,
    group_nodes,
    node_groups,
)
from lightning_llmfast.expert_parallel.overlap import check_chunks
from lightning_llmfast.expert_parallel.payload import DispatchPayload
from lightning_llmfast.expert_parallel.state import (
    expert_dtensor,
    expert_parameters,
    grouped_moe_blocks,
    sharded_moe_blocks,
)
from lightning_llmfast.moe.block import GroupedMoE

__all__ = ["EP_DISPATCHES", "set_ep_dispatch", "set_ep_overlap", "shard_experts", "shard_model_experts"]

EP_DISPATCHES = ("flat", "hierarchical")
"""How tokens cross nodes: every pair to its expert's rank, or once per destination node (module docstring)."""

# Expert-parameter dimensions compared across ranks by shard_experts (four 3-D parameters at most).
_SHAPE_SLOTS = 12


def _num_experts(block: nn.Module) -> int:
    experts = getattr(block, "experts", None) if isinstance(block, GroupedMoE) else None
    params = list(experts.named_parameters(recurse=False)) if isinstance(experts, nn.Module) else []
    if not params:
        raise ConfigError(
            f"shard_experts needs a grouped MoE block (MoEBlock, or a transformers block swapped by "
            f"GroupedRouterMixin) with 3-D expert parameters, got {type(block).__qualname__}"
        )
    sizes = {p.shape[0] for _, p in params if p.dim() == 3}
    if len(sizes) != 1 or any(p.dim() != 3 for _, p in params):
        shapes = {n: tuple(p.shape) for n, p in params}
        raise ConfigError(f"expert parameters must be 3-D with the experts first, got {shapes}")
    return sizes.pop()


def _check_sharding_arguments(ep_dispatch: str, node_layout: NodeGroups | None) -> None:
    """``shard_experts``' checks before any collective."""
    _check_ep_dispatch(ep_dispatch)
    if ep_dispatch == "hierarchical" and node_layout is None:
        raise ConfigError("ep_dispatch='hierarchical' needs the group's node_layout (expert_parallel.node_groups)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("shard_experts needs an initialised torch.distributed process group")


def shard_experts(
    block: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    loss_group: dist.ProcessGroup | None = None,
    dispatch_dtype: str | DispatchPayload | None = None,
    ep_dispatch: str = "flat",
    node_layout: NodeGroups | None = None,
) -> nn.Module:
    """Shard an MoE block's experts over ``group`` in place: each rank keeps ``Parameter`` s of its ``E / W`` only.

    Call it on every rank of ``group`` with identically initialised blocks (same seed): rank ``j`` keeps experts
    ``j * E / W`` to ``(j + 1) * E / W - 1``. The block then dispatches its tokens with an
    :class:`AllToAllDroplessDispatcher` (or, with a ``capacity_factor``, an :class:`AllToAllCapacityDispatcher`),
    set with :meth:`~lightning_llmfast.moe.MoEBlock.set_dispatcher`, and in training its ``stats.aux_loss`` (with
    ``aux_loss="micro_batch"``) is this rank's share of the batch-wide loss
    (:func:`~lightning_llmfast.expert_parallel.dispatchers.global_aux_loss` over ``loss_group``). Expert gradients
    then hold the sum over every rank's tokens of that rank's loss; average them as the dense ones are
    (:func:`~lightning_llmfast.expert_parallel.reduce_expert_gradients` does, under DDP).

    Args:
        block: :class:`~lightning_llmfast.moe.MoEBlock` or a transformers block swapped by
            :class:`~lightning_llmfast.GroupedRouterMixin`.
        group: the expert-parallel process group (default: the whole world).
        loss_group: the ranks whose tokens form one batch for the load-balancing loss (default: the whole world).
        dispatch_dtype: the tokens' payload on the wire: ``None`` (their dtype), ``"bf16"`` or ``"fp8"`` (outputs and
            gradients then come back in bf16), or a :class:`~lightning_llmfast.expert_parallel.DispatchPayload`.
        ep_dispatch: ``"flat"`` or ``"hierarchical"`` (a token crosses the node boundary once per destination node;
            needs ``node_layout``).
        node_layout: the group's nodes and sub-groups
            (:func:`~lightning_llmfast.expert_parallel.hierarchical.node_groups`), or ``None`` (one node).

    Returns:
        ``block``, for chaining.

    Raises:
        ConfigError: an unknown ``dispatch_dtype`` or ``ep_dispatch``, not a grouped MoE block, already sharded,
            ``W`` does not divide ``E``, (checked with one all-gather over ``group``, on every rank) the ranks'
            blocks differ in their expert shapes, or from :func:`set_ep_dispatch`.

    Example::

        shard_experts(block, dist.new_group([0, 1]))
        shard_experts(block, group, dispatch_dtype="fp8")  # e4m3 tokens out, bf16 outputs back
    """
    payload = DispatchPayload.of(dispatch_dtype)
    _check_sharding_arguments(ep_dispatch, node_layout)
    group = dist.group.WORLD if group is None else group
    num_experts = _num_experts(block)
    if isinstance(block.dispatcher, AllToAllDispatcher):
        raise ConfigError(f"{type(block).__qualname__} is already sharded over {block.dispatcher.world} ranks")
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ConfigError(
            f"an expert-parallel group of {world} ranks must divide the number of experts, got {num_experts} "
            f"experts ({type(block).__qualname__})"
        )
    params = dict(block.experts.named_parameters(recurse=False))
    _check_same_blocks(params, group)
    hierarchical = node_layout if ep_dispatch == "hierarchical" else None
    nodes = node_layout.nodes if node_layout is not None else None
    dispatcher = _dispatcher(block, group, num_experts, loss_group, payload, hierarchical, nodes)
    experts = dispatcher.local_experts
    for name, param in params.items():
        local = nn.Parameter(param.detach()[experts.start : experts.stop].clone(), requires_grad=param.requires_grad)
        setattr(block.experts, name, local)
    block.set_dispatcher(dispatcher)
    return block


def _check_spans_nodes(nodes: Sequence[int]) -> None:
    """Hierarchical dispatch needs a group on several nodes (on one, its node hop would run over one-rank groups)."""
    if len(set(nodes)) < 2:
        raise ConfigError(
            f"ep_dispatch='hierarchical' needs an expert-parallel group that spans several nodes, got one of "
            f"{len(nodes)} ranks on one node: no token crosses a node boundary, use ep_dispatch='flat'"
        )


def _check_ep_dispatch(ep_dispatch: str) -> None:
    if ep_dispatch not in EP_DISPATCHES:
        raise ConfigError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {ep_dispatch!r}")


def _dispatcher(
    block: nn.Module,
    group: dist.ProcessGroup,
    num_experts: int,
    loss_group: dist.ProcessGroup | None,
    payload: DispatchPayload,
    hierarchical: NodeGroups | None,
    nodes: Sequence[int] | None,
) -> AllToAllDispatcher:
    """The dispatcher of ``block``'s experts over ``group``: hierarchical over the nodes of ``hierarchical``, else
    flat (counting its bytes by ``nodes``), dropless or with the block's capacity limit."""
    routing = block.config.routing
    if hierarchical is not None:
        _check_spans_nodes(hierarchical.nodes)
        check_node_limited(routing, num_experts, hierarchical.num_nodes, type(block).__qualname__)
        return HierarchicalDispatcher(group, num_experts, hierarchical, loss_group, routing.backend, payload)
    kind = AllToAllDroplessDispatcher if routing.capacity_factor is None else AllToAllCapacityDispatcher
    return kind(group, num_experts, loss_group, routing.backend, payload, nodes)


def set_ep_dispatch(
    module: nn.Module,
    ep_dispatch: str,
    ranks_per_node: int,
    *,
    timeout: timedelta | None = None,
    node_layout: NodeGroups | None = None,
) -> NodeGroups | None:
    """Give every sharded MoE block of ``module`` the ``ep_dispatch`` dispatcher over its nodes, in place (every rank
    of the world calls it).

    The blocks keep their experts, groups, loss group and payloads; only how tokens cross nodes changes, and the
    dispatchers count their bytes inside the node and across it (:attr:`AllToAllDispatcher.traffic`).

    Args:
        module: a model whose blocks :func:`shard_model_experts` sharded (over one expert-parallel group).
        ep_dispatch: ``"flat"`` or ``"hierarchical"``.
        ranks_per_node: processes per node (global rank ``g`` runs on node ``g // ranks_per_node``).
        timeout: the hierarchical sub-groups' collective timeout (``None``: torch's default).
        node_layout: hierarchical: the sub-groups an earlier call returned for the same group and nodes, reused (no
            new process group); ``None``: built here (a collective over the world).

    Returns:
        The group's :class:`~lightning_llmfast.expert_parallel.hierarchical.NodeGroups` (hierarchical), else ``None``.

    Raises:
        ConfigError: an unknown ``ep_dispatch``, blocks sharded over different groups; hierarchical: the group does
            not fill whole nodes equally, lies on one node (nothing crosses a node boundary: use ``"flat"``), a
            ``node_layout`` of other nodes, or group-limited routing whose groups straddle nodes
            (:func:`~lightning_llmfast.expert_parallel.hierarchical.check_node_limited`).

    Example::

        layout = set_ep_dispatch(model, "hierarchical", ranks_per_node=8, timeout=timedelta(minutes=5))
        set_ep_dispatch(model, "hierarchical", ranks_per_node=8, node_layout=layout)  # the next fit: same groups
    """
    _check_ep_dispatch(ep_dispatch)
    blocks = list(sharded_moe_blocks(module))
    groups = {id(old.group): old.group for _, _, old in blocks}
    if len(groups) > 1:
        raise ConfigError(f"set_ep_dispatch needs every MoE block sharded over one group, got {len(groups)} groups")
    if not groups:
        return None
    group = next(iter(groups.values()))
    ranks = dist.get_process_group_ranks(group)
    nodes = tuple(rank // ranks_per_node for rank in ranks)
    layout = None
    if ep_dispatch == "hierarchical":  # checked on every rank before the sub-groups' collective
        placed = group_nodes(ranks, ranks_per_node)
        _check_spans_nodes(placed)
        if node_layout is not None and node_layout.nodes != placed:
            raise ConfigError(
                f"node_layout places the group on nodes {node_layout.nodes}, {ranks_per_node} "
                f"processes per node on {placed}"
            )
        layout = node_groups(group, ranks_per_node, timeout=timeout) if node_layout is None else node_layout
    for _, block, old in blocks:
        new = _dispatcher(block, group, old.num_experts, old.loss_group, old.payload, layout, nodes)
        block.set_dispatcher(new)
    return layout


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


def shard_model_experts(
    module: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    loss_group: dist.ProcessGroup | None = None,
    fsdp: bool = False,
    dispatch: DispatchPayload | None = None,
) -> None:
    """Shard every grouped MoE block of ``module`` over ``ep_mesh`` (:func:`shard_experts` on each).

    Call it on every rank, with the ranks' experts equal (same seed, or after a broadcast of the module's states),
    before the model is wrapped in DDP or sharded with FSDP2 and before its optimizer is built. Without ``fsdp``
    expert parameters stay plain tensors of the local experts, marked for DDP to ignore (average their gradients with
    :func:`~lightning_llmfast.expert_parallel.reduce_expert_gradients`); with ``fsdp`` they become DTensors
    ``Shard(0)`` over ``ep_mesh`` (their global shape is the full expert tensor), ready for FSDP2.

    Args:
        module: the model (or LightningModule); its MoE blocks must be grouped (:class:`~lightning_llmfast.moe.
            MoEBlock`, or transformers blocks after :class:`~lightning_llmfast.GroupedRouterMixin` swapped them).
        ep_mesh: the 1-D mesh of this rank's expert-parallel group; its size must divide every block's experts.
        loss_group: the ranks whose tokens form one batch for the load-balancing loss (default: the world).
        fsdp: expert parameters as DTensors for FSDP2 (else plain tensors DDP ignores).
        dispatch: the all-to-all payloads (``shard_experts``' ``dispatch_dtype``; ``None``: the activations' dtype).

    Raises:
        ConfigError: no grouped MoE block, or (from ``shard_experts``) the group size not dividing a block's experts.

    Example::

        shard_model_experts(model, dims.ep_mesh, loss_group=dims.dp_group)
    """
    blocks = grouped_moe_blocks(module)
    if not blocks:
        raise ConfigError(
            f"expert_parallel_size={ep_mesh.size()}: {type(module).__qualname__} has no grouped MoE block "
            "(MoEBlock, or a transformers block swapped by GroupedRouterMixin)"
        )
    for _, block in blocks:
        shard_experts(block, ep_mesh.get_group(), loss_group=loss_group, dispatch_dtype=dispatch)
    if fsdp:
        for _, block in blocks:
            for name, param in list(block.experts.named_parameters(recurse=False)):
                local = expert_dtensor(param.detach(), ep_mesh)
                setattr(block.experts, name, nn.Parameter(local, requires_grad=param.requires_grad))
    else:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, [name for name, _, _ in expert_parameters(module)]
        )


def set_ep_overlap(module: nn.Module, chunks: int | str | None, timer: ExchangeTimer | None = None) -> None:
    """Overlap the exchanges of every sharded MoE block of ``module`` with their experts' compute, in place (every
    rank calls it alike; :mod:`~lightning_llmfast.expert_parallel.overlap`).

    The flat dispatchers (dropless, capacity) send their rows in ``chunks`` chunks, the hierarchical one its tokens
    in chunks of destination nodes (at most one chunk per node; one with a capacity limit); all run the shared
    experts and the balance loss while the exchanges are in flight. ``timer`` stamps every token exchange
    (``comm/a2a_ms``, ``comm/a2a_exposed_ms``), with or without overlap.

    Args:
        module: a model whose blocks :func:`shard_experts` sharded.
        chunks: ``None`` (exchange, then compute: no overlap), an int ``>= 1`` or ``"auto"``.
        timer: the :class:`~lightning_llmfast.comm.timing.ExchangeTimer` of the exchanges, or ``None``.

    Raises:
        ConfigError: ``chunks`` is not ``None``, ``"auto"`` or an int ``>= 1``.

    Example::

        set_ep_overlap(model, 4, ExchangeTimer(HostClock()))
    """
    check_chunks(chunks)
    for _, _, dispatcher in sharded_moe_blocks(module):
        dispatcher.overlap_chunks = chunks
        dispatcher.timer = timer


def share_batch(module: nn.Module, group: dist.ProcessGroup, stats_group: dist.ProcessGroup | None = None) -> None:
    """Make every grouped MoE block of ``module`` whose experts are local compute its balance loss over ``group``,
    the ranks that share one batch (a context-parallel group), and its step sums over ``stats_group``.

    Each rank of ``group`` routes only its share of the batch's positions; :class:`SharedBatchDispatcher` sums the
    pairs per expert over the group, so the loss, like every other statistic, equals the one-process value. Blocks
    whose experts are sharded (expert parallelism) already compute it over their dispatch's loss group.

    A block with ``aux_loss="sequence"`` balances each document over the group's pieces of it, from the
    boundaries its caller passes (:func:`~lightning_llmfast.models.ffn.sequence_boundaries` of the shard's metadata);
    without them its forward raises.

    Args:
        module: the model.
        group: the ranks sharing one batch.
        stats_group: the group of the blocks' step sums (``aux_loss="global"``, the expert-bias update): every rank
            of the stage; ``None`` leaves them.

    Example::

        share_batch(model, dims.cp_group, dims.dp_group)
    """
    blocks = grouped_moe_blocks(module)
    for _, block in blocks:
        assert isinstance(block, GroupedMoE)
        block.batch_group = group
        if stats_group is not None:
            block.dp_group = stats_group
        if not isinstance(block.dispatcher, AllToAllDispatcher):
            block.set_dispatcher(SharedBatchDispatcher(group, block.config.routing.backend))
