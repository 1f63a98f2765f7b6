"""Expert parallelism for a whole model: a device mesh with an expert-parallel dimension, sharded MoE blocks,
expert-gradient reduction and layout-independent checkpoints. Used by :class:`~lightning_llmfast.LLMFastStrategy`.

The mesh is ``("edp", "ep")`` of shape ``(world / N, N)``, torchtitan style: the ``N`` ranks of an ``"ep"`` group
split every MoE block's experts between them (:func:`~lightning_llmfast.moe.expert_parallel.shard_experts`), the
ranks of an ``"edp"`` group hold the same experts. Dense parameters stay replicated and DDP averages their gradients
over all ranks; expert parameters are excluded from DDP (and from its start-up broadcast, which would overwrite
every rank's experts with rank 0's) and :func:`reduce_expert_gradients` averages them with one all-reduce over
``"edp"``. Checkpoints hold the full expert tensors (gathered over ``"ep"``), so they have the keys and shapes of a
one-process checkpoint and load with any expert-parallel size.

Example::

    mesh = shard_model_experts(module, expert_parallel_size=2)  # after init_process_group, before DDP
    ...  # forward, backward
    reduce_expert_gradients(module, mesh)  # before the optimizer step
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe.alltoall import AllToAllDispatcher
from lightning_llmfast.moe.block import GroupedMoE
from lightning_llmfast.moe.expert_parallel import shard_experts

__all__ = [
    "expert_parameters",
    "gather_expert_optimizer_state",
    "gather_expert_state_dict",
    "reduce_expert_gradients",
    "shard_model_experts",
    "slice_expert_optimizer_state",
    "slice_expert_state_dict",
]


def shard_model_experts(module: nn.Module, expert_parallel_size: int, device_type: str = "cpu") -> DeviceMesh:
    """Build the ``("edp", "ep")`` mesh and shard every grouped MoE block of ``module`` over its ``"ep"`` groups.

    Call it on every rank, after the process group is initialised and before the model is wrapped in DDP or its
    optimizer is built. Expert parameters are marked for DDP to ignore.

    Args:
        module: the model (or LightningModule); its MoE blocks must be grouped (:class:`~lightning_llmfast.moe.
            MoEBlock`, or transformers blocks after :class:`~lightning_llmfast.GroupedRouterMixin` swapped them).
        expert_parallel_size: ``N``, the ranks that split the experts; it must divide the world size and every
            block's number of experts.
        device_type: the mesh's device type (``"cpu"`` for gloo, ``"cuda"`` for NCCL).

    Returns:
        The mesh.

    Raises:
        ConfigError: no process group, ``N`` not an int >= 1 dividing the world size, no grouped MoE block, or
            (from ``shard_experts``) ``N`` not dividing a block's experts.

    Example::

        mesh = shard_model_experts(model, 2)
        mesh["ep"].get_group()  # the ranks that exchange tokens
    """
    check_int("expert_parallel_size", expert_parallel_size, low=1)
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("expert parallelism needs an initialised torch.distributed process group")
    world = dist.get_world_size()
    if world % expert_parallel_size:
        raise ConfigError(f"expert_parallel_size={expert_parallel_size} must divide the world size {world}")
    blocks = [(name, m) for name, m in module.named_modules() if _is_grouped_moe(m)]
    if not blocks:
        raise ConfigError(
            f"expert_parallel_size={expert_parallel_size}: {type(module).__qualname__} has no grouped MoE block "
            "(MoEBlock, or a transformers block swapped by GroupedRouterMixin)"
        )
    mesh = init_device_mesh(
        device_type,
        (world // expert_parallel_size, expert_parallel_size),
        mesh_dim_names=(
            "edp",
            "ep",
        ),
    )
    for _, block in blocks:
        shard_experts(block, mesh["ep"].get_group())
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, [name for name, _, _ in expert_parameters(module)]
    )
    return mesh


def _is_grouped_moe(module: nn.Module) -> bool:
    return isinstance(module, GroupedMoE)


def expert_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, AllToAllDispatcher]]:
    """``(name, parameter, dispatch)`` of every sharded expert parameter of ``module``, in ``named_modules`` order.

    Example::

        names = [name for name, _, _ in expert_parameters(model)]
    """
    for prefix, block in module.named_modules():
        dispatch = block.dispatcher if isinstance(block, GroupedMoE) else None
        if isinstance(dispatch, AllToAllDispatcher):
            for name, param in block.experts.named_parameters(recurse=False):
                yield f"{prefix}.experts.{name}" if prefix else f"experts.{name}", param, dispatch


def reduce_expert_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Average the expert gradients as DDP averages the dense ones: sum over ``"edp"`` (one all-reduce), ``/ world``.

    Each holder's gradient already sums, over its ``"ep"`` group, every rank's loss; the ``"edp"`` sum adds the
    other groups' ranks, and dividing by the world size makes it the gradient of the mean of all ranks' losses.
    Call it once per optimizer step, after the last backward (missing gradients count as zeros).

    Example::

        reduce_expert_gradients(module, mesh)
    """
    params = [param for _, param, _ in expert_parameters(module) if param.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if mesh["edp"].size() > 1:
        dist.all_reduce(flat, group=mesh["edp"].get_group())
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
