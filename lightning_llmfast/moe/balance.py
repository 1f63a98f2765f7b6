"""Aux-loss-free load balancing (DeepSeek-V3's expert bias) and the exact summing of expert counts over ranks.

Example::

    bias = torch.zeros(num_experts)
    plan = route(logits, top_k=2, expert_bias=bias)
    update_expert_bias(bias, plan.routed_per_expert, rate=1e-3)  # once per optimizer step
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast._checks import check_number
from lightning_llmfast.errors import RoutingError

__all__ = ["all_reduce_counts", "update_expert_bias"]


def all_reduce_counts(counts: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """A copy of ``counts`` summed over the ranks of ``group`` (when a process group is initialised), sync-free.

    Integer counts are summed as int64 (exact on any number of ranks), floating ones as float64. One non-blocking
    ``all_reduce``: ``wait()`` on its work handle only orders the device streams, the host does not wait.

    Args:
        counts: ``(E,)`` real counts (not modified).
        group: the process group (``None``: the default group).

    Returns:
        ``(E,)`` int64 or float64 sums.

    Example::

        global_counts = all_reduce_counts(plan.routed_per_expert)
    """
    exact = torch.float64 if counts.is_floating_point() else torch.int64
    # copy=True: the all_reduce works in place and the caller's counts must stay per-rank.
    total = counts.to(dtype=exact, copy=True)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
    return total


def update_expert_bias(
    expert_bias: Tensor, tokens_per_expert: Tensor, rate: float, *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Aux-loss-free load balancing (DeepSeek-V3): nudges each expert's bias toward the mean load, in place.

    ``bias += rate * sign(mean_load - load)``: overloaded experts get a lower selection bias, underloaded ones a
    higher one. When a process group is initialised, the counts are first summed across the ranks of ``group``
    with one non-blocking ``all_reduce`` of ``E`` integers (the update is queued behind it on the device; the host
    does not wait).

    Args:
        expert_bias: ``(E,)`` float bias passed to :func:`route`, updated in place (no autograd).
        tokens_per_expert: ``(E,)`` integer counts from ``RoutingPlan.tokens_per_expert`` (not modified).
        rate: update speed, ``>= 0`` (DeepSeek-V3 uses 1e-3).
        group: the data-parallel process group to sum over (``None``: the default group).

    Returns:
        ``expert_bias``, for chaining.

    Raises:
        RoutingError: arguments not tensors, shapes differ, ``expert_bias`` not floating point, or ``rate`` not
            a finite number >= 0.

    Example::

        bias = torch.zeros(num_experts)
        plan = route(logits, top_k=2, expert_bias=bias)
        update_expert_bias(bias, plan.tokens_per_expert, rate=1e-3)
    """
    for name, value in (("expert_bias", expert_bias), ("tokens_per_expert", tokens_per_expert)):
        if not isinstance(value, Tensor):
            raise RoutingError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if expert_bias.dim() != 1 or tuple(tokens_per_expert.shape) != tuple(expert_bias.shape):
        raise RoutingError(
            f"expert_bias and tokens_per_expert must both have shape (num_experts,), got "
            f"{tuple(expert_bias.shape)} and {tuple(tokens_per_expert.shape)}"
        )
    if not expert_bias.is_floating_point():
        raise RoutingError(f"expert_bias must be a floating-point tensor (updated in place), got {expert_bias.dtype}")
    if tokens_per_expert.is_complex() or tokens_per_expert.dtype == torch.bool:
        raise RoutingError(f"tokens_per_expert must be a real count tensor, got {tokens_per_expert.dtype}")
    check_number("rate", rate, low=0, error=RoutingError)
    # The comparison with the mean runs in float64: exact for any integer load below 2**53.
    load = all_reduce_counts(tokens_per_expert.to(expert_bias.device), group).to(torch.float64)
    with torch.no_grad():
        expert_bias.add_(torch.sign(load.mean() - load).to(expert_bias.dtype), alpha=rate)
    return expert_bias
