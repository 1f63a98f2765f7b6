"""The expert tensors of a model whose MoE blocks are sharded over expert-parallel groups: which they are, their
gradient reduction, their state as DTensors for distributed checkpoints, and full states cut to a rank's experts.

The ``N`` ranks of an expert-parallel group split every MoE block's experts between them
(:func:`~lightning_llmfast.expert_parallel.shard_experts`); ranks of different groups that hold the same experts
average those experts' gradients with :func:`reduce_expert_gradients`. For checkpoints each rank's local experts
(and their optimizer state) are viewed as DTensors ``Shard(0)`` over the expert-parallel mesh
(:func:`expert_dtensor_state_dict`, :func:`expert_dtensor_optimizer_state`): their global shape is the full expert
tensor, so a distributed checkpoint (DCP) has the keys and shapes of a one-process checkpoint, every rank writes
only its own experts (nothing is gathered, the replicas over other groups are written once) and it loads with any
world size and expert-parallel size. A full state (a one-process ``.ckpt`` file) is cut to a rank's experts by
:func:`slice_expert_state_dict` and :func:`slice_expert_optimizer_state`.

Example::

    names = [name for name, _, _ in expert_parameters(model)]
    reduce_expert_gradients(model, holders_group)  # before the optimizer step
    state = expert_dtensor_state_dict(model, get_model_state_dict(model), dims.ep_mesh)  # views, no copy
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_llmfast.expert_parallel.dispatchers import AllToAllDispatcher
from lightning_llmfast.moe.block import GroupedMoE

__all__ = [
    "expert_dtensor",
    "expert_dtensor_optimizer_state",
    "expert_dtensor_state_dict",
    "expert_parameters",
    "grouped_moe_blocks",
    "reduce_expert_gradients",
    "sharded_moe_blocks",
    "slice_expert_optimizer_state",
    "slice_expert_state_dict",
]


def grouped_moe_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every grouped MoE block of ``module`` (the blocks expert parallelism shards).

    Example::

        [name for name, _ in grouped_moe_blocks(model)]  # ["model.layers.0.ffn", ...]
    """
    return [(name, m) for name, m in module.named_modules() if isinstance(m, GroupedMoE)]


def sharded_moe_blocks(module: nn.Module) -> Iterator[tuple[str, GroupedMoE, AllToAllDispatcher]]:
    """``(name, block, dispatcher)`` of every MoE block of ``module`` whose experts are sharded.

    Example::

        [name for name, _, _ in sharded_moe_blocks(model)]
    """
    for prefix, block in module.named_modules():
        dispatch = block.dispatcher if isinstance(block, GroupedMoE) else None
        if isinstance(dispatch, AllToAllDispatcher):
            yield prefix, block, dispatch


def expert_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, AllToAllDispatcher]]:
    """``(name, parameter, dispatch)`` of every sharded expert parameter of ``module``, in ``named_modules`` order.

    Example::

        names = [name for name, _, _ in expert_parameters(model)]
    """
    for prefix, block, dispatch in sharded_moe_blocks(module):
        for name, param in block.experts.named_parameters(recurse=False):
            yield f"{prefix}.experts.{name}" if prefix else f"experts.{name}", param, dispatch


def reduce_expert_gradients(
    module: nn.Module, group: dist.ProcessGroup | None, reduce_dtype: torch.dtype | None = None
) -> None:
    """Average the expert gradients as DDP averages the dense ones: sum over ``group`` (one all-reduce), ``/ world``.

    Each holder's gradient already sums, over its expert-parallel group, every rank's loss; the sum over ``group``
    (the ranks that hold the same experts; ``None`` when this rank is the only one) adds the other groups' ranks, and
    dividing by the world size makes it the gradient of the mean of all ranks' losses. Call it once per optimizer
    step, after the last backward (missing gradients count as zeros). With ``reduce_dtype`` the all-reduce runs in
    that dtype, as DDP's bf16 hook does (cast, divide, sum, cast back).

    Example::

        reduce_expert_gradients(module, dims.edp_mesh.get_group())
    """
    params = [param for _, param, _ in expert_parameters(module) if param.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and reduce_dtype is not None:
        flat = flat.to(reduce_dtype).div_(dist.get_world_size())
        dist.all_reduce(flat, group=group)
    else:
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size())
    for param, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.grad = chunk.view_as(param).to(param.dtype)


def _local(full: Tensor, dispatch: AllToAllDispatcher) -> Tensor:
    experts = dispatch.local_experts
    return full[experts.start : experts.stop].clone()


def expert_dtensor(local: Tensor, ep_mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's experts, first dimension) as a DTensor ``Shard(0)`` over ``ep_mesh``: a view, no copy
    and no communication; its global shape has all the experts.

    Example::

        full_shape = expert_dtensor(block.experts.gate_up_proj.detach(), dims.ep_mesh).shape
    """
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)


def expert_dtensor_state_dict(module: nn.Module, state_dict: Mapping[str, Any], ep_mesh: DeviceMesh) -> dict[str, Any]:
    """A copy of ``state_dict`` (keyed by parameter names) whose local expert tensors are :func:`expert_dtensor` views
    over ``ep_mesh`` (nothing is copied or gathered): what DCP saves each rank's experts from and loads them into.

    Example::

        dcp.save({"state_dict": expert_dtensor_state_dict(model, model.state_dict(), dims.ep_mesh)}, checkpoint_id=d)
    """
    out = dict(state_dict)
    for name, _, _ in expert_parameters(module):
        if name in out:
            out[name] = expert_dtensor(out[name], ep_mesh)
    return out


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


def expert_dtensor_optimizer_state(module: nn.Module, state: dict[str, Any], ep_mesh: DeviceMesh) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (``get_optimizer_state_dict``'s) whose per-expert tensors (Adam
    moments...) are :func:`expert_dtensor` views over ``ep_mesh``, in place (nothing is copied or gathered).

    Example::

        state = expert_dtensor_optimizer_state(model, get_optimizer_state_dict(model, optimizer), dims.ep_mesh)
    """
    for name, param, _ in expert_parameters(module):
        param_state = state["state"].get(name, {})
        for key, value in param_state.items():
            if isinstance(value, Tensor) and value.shape == param.shape:
                param_state[key] = expert_dtensor(value, ep_mesh)
    return state


def slice_expert_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state (``optimizer.state_dict()`` of one process) cut to this rank's experts, in place.

    Example::

        optimizer.load_state_dict(slice_expert_optimizer_state(module, optimizer, full_state))
    """
    for param_state, key, param, dispatch in list(_expert_state_tensors(module, optimizer, state)):
        if param_state[key].shape[0] == dispatch.num_experts and param.shape[0] != dispatch.num_experts:
            param_state[key] = _local(param_state[key], dispatch)
    return state
