"""The expert tensors of a model whose MoE blocks are sharded over expert-parallel groups: which they are, their
gradient reduction, and full (gathered) or per-rank (sliced) state dicts and optimizer states.

The ``N`` ranks of an expert-parallel group split every MoE block's experts between them
(:func:`~lightning_llmfast.expert_parallel.shard_experts`); ranks of different groups that hold the same experts
average those experts' gradients with :func:`reduce_expert_gradients`. Checkpoints hold the full expert tensors
(gathered over each block's group), so they have the keys and shapes of a one-process checkpoint and load with any
expert-parallel size.

Example::

    names = [name for name, _, _ in expert_parameters(model)]
    reduce_expert_gradients(model, holders_group)  # before the optimizer step
    full = gather_expert_state_dict(model, model.state_dict())
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_llmfast.expert_parallel.dispatchers import AllToAllDispatcher
from lightning_llmfast.moe.block import GroupedMoE

__all__ = [
    "expert_parameters",
    "gather_expert_optimizer_state",
    "gather_expert_state_dict",
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
