"""Expert parallelism for a whole model on the ``("edp", "ep")`` mesh of :class:`~lightning_llmfast.parallel.
ParallelDims`: sharded MoE blocks, expert-gradient reduction and checkpoints. Used by
:class:`~lightning_llmfast.LLMFastStrategy`.

The ``N`` ranks of an ``"ep"`` group split every MoE block's experts between them
(:func:`~lightning_llmfast.moe.expert_parallel.shard_experts`); the ranks of an ``"edp"`` group hold the same experts.

- Under DDP, dense parameters stay replicated and DDP averages their gradients over all ranks; expert parameters are
  excluded from DDP and :func:`reduce_expert_gradients` averages them with one all-reduce over ``"edp"``.
  Checkpoints hold the full expert tensors (gathered over ``"ep"``), so they have the keys and shapes of a
  one-process checkpoint and load with any expert-parallel size.
- Under FSDP2, expert parameters are DTensors ``Shard(0)`` over ``"ep"``, then ``fully_shard`` ed over ``"edp"``
  (:func:`fully_shard_experts`); FSDP2 reduces their gradients and DCP checkpoints them like every other DTensor.

Example::

    dims = ParallelDims(world, "ddp", 2)
    dims.build_mesh("cuda")
    shard_model_experts(module, dims)  # after init_process_group, before DDP
    ...  # forward, backward
    reduce_expert_gradients(module, dims)  # before the optimizer step
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_llmfast.comm.payload import DispatchPayload
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe.alltoall import AllToAllDispatcher
from lightning_llmfast.moe.block import GroupedMoE
from lightning_llmfast.moe.expert_parallel import shard_experts
from lightning_llmfast.parallel.dims import ParallelDims

__all__ = [
    "expert_parameters",
    "fully_shard_experts",
    "grouped_moe_blocks",
    "gather_expert_optimizer_state",
    "gather_expert_state_dict",
    "reduce_expert_gradients",
    "shard_model_experts",
    "slice_expert_optimizer_state",
    "slice_expert_state_dict",
]


def shard_model_experts(module: nn.Module, dims: ParallelDims, dispatch: DispatchPayload | None = None) -> None:
    """Shard every grouped MoE block of ``module`` over the ``"ep"`` groups of ``dims``' mesh.

    Call it on every rank after :meth:`ParallelDims.build_mesh`, with the ranks' experts equal (same seed, or after
    :func:`~lightning_llmfast.parallel.fsdp.broadcast_module_states`), before the model is wrapped in DDP or sharded
    with FSDP2 and before its optimizer is built. Under DDP expert parameters stay plain tensors of the local experts,
    marked for DDP to ignore; under FSDP2 they become DTensors ``Shard(0)`` over ``"ep"`` (their global shape is the
    full expert tensor) for :func:`fully_shard_experts`. The load-balancing loss covers the data-parallel group.

    Args:
        module: the model (or LightningModule); its MoE blocks must be grouped (:class:`~lightning_llmfast.moe.
            MoEBlock`, or transformers blocks after :class:`~lightning_llmfast.GroupedRouterMixin` swapped them).
        dims: the layout, its mesh built; ``dims.ep`` must divide every block's number of experts.
        dispatch: the all-to-all payloads (``shard_experts``' ``dispatch_dtype``; ``None``: the activations' dtype).

    Raises:
        ConfigError: no grouped MoE block, or (from ``shard_experts``) ``dims.ep`` not dividing a block's experts.

    Example::

        shard_model_experts(model, dims)
        dims.ep_mesh.get_group()  # the ranks that exchange tokens
    """
    blocks = grouped_moe_blocks(module)
    if not blocks:
        raise ConfigError(
            f"expert_parallel_size={dims.ep}: {type(module).__qualname__} has no grouped MoE block "
            "(MoEBlock, or a transformers block swapped by GroupedRouterMixin)"
        )
    for _, block in blocks:
        shard_experts(block, dims.ep_mesh.get_group(), loss_group=dims.dp_group, dispatch_dtype=dispatch)
    if dims.sharding == "fsdp":
        for _, block in blocks:
            for name, param in list(block.experts.named_parameters(recurse=False)):
                local = DTensor.from_local(param.detach(), dims.ep_mesh, [Shard(0)], run_check=False)
                setattr(block.experts, name, nn.Parameter(local, requires_grad=param.requires_grad))
    else:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, [name for name, _, _ in expert_parameters(module)]
        )


def fully_shard_experts(
    module: nn.Module,
    dims: ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` every MoE block sharded by :func:`shard_model_experts`: its experts over ``"edp"``.

    FSDP2 gathers a group's parameters when its module's ``forward`` runs; the block reads its experts' weights in its
    own ``forward``, so the block is the experts' group (over ``"edp"``), and its other children with parameters
    (router, shared experts, their gates) are groups of their own over ``"dp_shard"``, sharded like every dense
    parameter. Each rank then holds ``1 / world`` of every expert tensor. Expert gradients are summed over ``"edp"``
    and divided by the world size: each local expert's gradient already sums the losses of its ``"ep"`` group's
    ranks (the all-to-all's backward brings them home), so this makes it the gradient of the mean of all ranks'
    losses, as for the dense parameters.

    Raises:
        ConfigError: a block holds parameters of its own outside its children.

    Example::

        fully_shard_experts(model, dims)  # before the layers are sharded over "dp_shard"
    """
    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "reshard_after_forward": reshard_after_forward}
    for name, block, _ in list(_expert_blocks(module)):
        own = [n for n, _ in block.named_parameters(recurse=False)]
        if own:
            raise ConfigError(f"expert parallelism under FSDP: MoE block {name!r} holds parameters directly ({own})")
        for child_name, child in block.named_children():
            if child_name != "experts" and any(True for _ in child.parameters()):
                fully_shard(child, mesh=dims.dp_shard_mesh, **kwargs)
        fully_shard(block, mesh=dims.edp_mesh, **kwargs)
        block.set_gradient_divide_factor(float(dims.world_size))
        # gloo has no pre-multiplied sum: a plain sum, then the division (NCCL fuses it). Not with one "edp" rank:
        # there FSDP2 sends nothing and divides once itself (forcing the sum would divide a second time).
        gloo = dist.get_backend(dims.edp_mesh.get_group()) == "gloo"
        block.set_force_sum_reduction_for_comms(gloo and dims.edp > 1)


def grouped_moe_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every grouped MoE block of ``module`` (the blocks expert parallelism shards).

    Example::

        [name for name, _ in grouped_moe_blocks(model)]  # ["model.layers.0.ffn", ...]
    """
    return [(name, m) for name, m in module.named_modules() if _is_grouped_moe(m)]


def _is_grouped_moe(module: nn.Module) -> bool:
    return isinstance(module, GroupedMoE)


def _expert_blocks(module: nn.Module) -> Iterator[tuple[str, nn.Module, AllToAllDispatcher]]:
    """``(name, block, dispatch)`` of every MoE block of ``module`` whose experts are sharded."""
    for prefix, block in module.named_modules():
        dispatch = block.dispatcher if isinstance(block, GroupedMoE) else None
        if isinstance(dispatch, AllToAllDispatcher):
            yield prefix, block, dispatch


def expert_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, AllToAllDispatcher]]:
    """``(name, parameter, dispatch)`` of every sharded expert parameter of ``module``, in ``named_modules`` order.

    Example::

        names = [name for name, _, _ in expert_parameters(model)]
    """
    for prefix, block, dispatch in _expert_blocks(module):
        for name, param in block.experts.named_parameters(recurse=False):
            yield f"{prefix}.experts.{name}" if prefix else f"experts.{name}", param, dispatch


def reduce_expert_gradients(module: nn.Module, dims: ParallelDims, reduce_dtype: torch.dtype | None = None) -> None:
    """Average the expert gradients as DDP averages the dense ones: sum over ``"edp"`` (one all-reduce), ``/ world``.

    Each holder's gradient already sums, over its ``"ep"`` group, every rank's loss; the ``"edp"`` sum adds the
    other groups' ranks, and dividing by the world size makes it the gradient of the mean of all ranks' losses.
    Call it once per optimizer step, after the last backward (missing gradients count as zeros). With
    ``reduce_dtype`` the all-reduce runs in that dtype, as DDP's bf16 hook does (cast, divide, sum, cast back).

    Example::

        reduce_expert_gradients(module, dims)
    """
    params = [param for _, param, _ in expert_parameters(module) if param.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dims.edp > 1 and reduce_dtype is not None:
        flat = flat.to(reduce_dtype).div_(dist.get_world_size())
        dist.all_reduce(flat, group=dims.edp_mesh.get_group())
    else:
        if dims.edp > 1:
            dist.all_reduce(flat, group=dims.edp_mesh.get_group())
        flat.div_(dist.get_world_size())
    for param, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.grad = chunk.view_as(param).to(param.dtype)


def _gather(local: Tensor, dispatch: AllToAllDispatcher) -> Tensor:
    parts = [torch.empty_like(local) for _ in range(dispatch.world)]
    dist.all_gather(parts, local.contiguous(), group=dispatch.group)
    return torch.cat(parts)


def _local(full: Tensor, dispatch: AllToAllDispatcher) -> Tensor:
    experts = dispatch.local_experts
    return full[experts.start : experts.stop].clone()


def gather_expert_state_dict(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every sharded expert tensor replaced by the full one (all ranks must call it).

    Example::

        checkpoint["state_dict"] = gather_expert_state_dict(module, module.state_dict())
    """
    for name, _, dispatch in expert_parameters(module):
        state_dict[name] = _gather(state_dict[name], dispatch)
    return state_dict


def slice_expert_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a full ``state_dict`` whose expert tensors are cut to this rank's experts (no communication).

    Example::

        module.load_state_dict(slice_expert_state_dict(module, full_state_dict))
    """
    out = dict(state_dict)
    for name, _, dispatch in expert_parameters(module):
        if name in out and out[name].shape[0] == dispatch.num_experts:
            out[name] = _local(out[name], dispatch)
    return out


def _expert_state_tensors(
    module: nn.Module, optimizer: Optimizer, state: Mapping[str, Any]
) -> Iterator[tuple[dict[str, Any], str, nn.Parameter, AllToAllDispatcher]]:
    """``(param_state, key, param, dispatch)`` of every per-expert tensor in an optimizer ``state_dict()``."""
    experts = {id(param): (param, dispatch) for _, param, dispatch in expert_parameters(module)}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        if id(param) in experts and index in state["state"]:
            param_state = state["state"][index]
            for key, value in param_state.items():
                if isinstance(value, Tensor) and value.dim() == param.dim():
                    yield param_state, key, *experts[id(param)]


def gather_expert_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its per-expert tensors (Adam moments...) gathered to full size (collective).

    Example::

        state = gather_expert_optimizer_state(module, optimizer, optimizer.state_dict())
    """
    for param_state, key, _, dispatch in list(_expert_state_tensors(module, optimizer, state)):
        param_state[key] = _gather(param_state[key], dispatch)
    return state


def slice_expert_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state (from :func:`gather_expert_optimizer_state`) cut to this rank's experts, in place.

    Example::

        optimizer.load_state_dict(slice_expert_optimizer_state(module, optimizer, full_state))
    """
    for param_state, key, param, dispatch in list(_expert_state_tensors(module, optimizer, state)):
        if param_state[key].shape[0] == dispatch.num_experts and param.shape[0] != dispatch.num_experts:
            param_state[key] = _local(param_state[key], dispatch)
    return state
