"""Gradient clipping by the global 2-norm under DDP, FSDP2, expert parallelism and FSDP2 + expert parallelism.

Every element of the model counts once, whatever its layout: a gradient replicated on every rank (DDP's dense
parameters) is counted from the local copy; a sharded one (FSDP2's DTensors, experts split over the expert-parallel
ranks) contributes its local squares, divided by how many ranks hold the same shard, to one all-reduce over the
data-parallel group. The result is the norm one process computes on the whole model. It stays on the device (no
host read), and every gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils``'s rule).

Example::

    norm = clip_grad_norm(grads, max_norm=1.0, group=dims.dp_group)  # grads: ShardedGrad per parameter
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["ShardedGrad", "clip_grad_norm", "global_grad_norm", "sharded_grads"]


class ShardedGrad(NamedTuple):
    """A gradient and the number of ranks that hold the same elements of it.

    Attributes:
        grad: the local gradient (a plain tensor: a DTensor's local shard).
        replicas: ``0`` for a gradient replicated on every rank (counted from the local copy, no communication),
            else how many ranks of the group hold this same shard (its squares are divided by it before the sum).
    """

    grad: Tensor
    replicas: int


def sharded_grads(params: Sequence[Tensor], expert_params: set[int], edp: int) -> list[ShardedGrad]:
    """The :class:`ShardedGrad` of every parameter of ``params`` with a gradient.

    Args:
        params: the parameters (plain tensors or DTensors).
        expert_params: ``id()`` of the plain parameters split over the expert-parallel ranks (DDP + EP).
        edp: ranks holding the same experts (``world / expert_parallel_size``).

    Example::

        grads = sharded_grads(list(module.parameters()), set(), edp=1)
    """
    out = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            # Shard and FSDP's strided shard split the tensor; Replicate copies it.
            replicated = [mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate()]
            # The DTensor's mesh may be part of the world: the other parts hold further copies.
            copies = dist.get_world_size() // mesh.size() if dist.is_initialized() else 1
            out.append(ShardedGrad(grad.to_local(), math.prod(replicated) * copies))
        elif id(param) in expert_params:
            out.append(ShardedGrad(grad, edp))
        else:
            out.append(ShardedGrad(grad, 0))
    return out


def _squares(grads: list[Tensor]) -> Tensor | None:
    if not grads:
        return None
    return torch.nn.utils.get_total_norm(grads, 2.0, foreach=None).to(torch.float32).square()


def global_grad_norm(grads: Sequence[ShardedGrad], group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm over every element of the model: one all-reduce of one float if any gradient is sharded.

    Args:
        grads: from :func:`sharded_grads`.
        group: the data-parallel group (every rank); ``None``: the default group, if one is initialised.

    Returns:
        0-d float32 on the gradients' device (``0`` without gradients).

    Example::

        norm = global_grad_norm(sharded_grads(params, set(), 1))
    """
    replicated = _squares([g.grad for g in grads if g.replicas == 0])
    by_replicas: dict[int, list[Tensor]] = {}
    for g in grads:
        if g.replicas:
            by_replicas.setdefault(g.replicas, []).append(g.grad)
    sharded = [sq / replicas for replicas, ts in sorted(by_replicas.items()) if (sq := _squares(ts)) is not None]
    total = replicated
    if sharded:
        shard_sum = torch.stack(sharded).sum()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(shard_sum, group=group)
        total = shard_sum if total is None else total + shard_sum
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total.sqrt()


def clip_grad_norm(grads: Sequence[ShardedGrad], max_norm: float, group: dist.ProcessGroup | None = None) -> Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` of the global norm; returns the norm.

    No host read: the factor is a device tensor applied with one fused multiply per device and dtype.

    Example::

        norm = clip_grad_norm(sharded_grads(params, set(), 1), 1.0)
    """
    norm = global_grad_norm(grads, group)
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.grad.device, g.grad.dtype), []).append(g.grad)
    for (device, dtype), tensors in buckets.items():
        torch._foreach_mul_(tensors, factor.to(device=device, dtype=dtype))
    return norm
