"""Routing on the Triton path in four launches forward and one backward: all of
:func:`~lightning_llmfast.moe.route` for the common configurations.

:func:`~lightning_llmfast.moe.route` with ``backend="triton"`` (``"auto"`` on CUDA) takes this path for plain and
group-limited top-k (DeepSeek-V3: the groups are chosen in the router kernel), with or without a token mask, dropless
or keeping pairs by position under a capacity limit: the router kernel (scores, group limit, top-k, combine weights,
probabilities; :mod:`~lightning_llmfast.moe.kernels.topk`) and the counting sort's three launches, which also write
every integer of the plan, each row's combine weight, the balance loss and the z-loss
(:func:`~lightning_llmfast.moe.kernels.plan.plan_with_losses_triton`). Its backward is one launch from the gradients
of the weights (per pair and per row), of the probabilities and of both losses to the logits. The PyTorch composition
of :mod:`~lightning_llmfast.moe.routing` (differentiated by autograd) is its reference: same integers, the same
floats to rounding.

A ``token_mask`` is applied in the same launches: a masked token's logits read as 0 (as the composition's
``masked_fill``), its pairs take the extra key ``E`` (sorted after every expert's, never kept), and both losses average
over the tokens that route, counted in the scan from the valid pairs.

Left to the composition (whose counting sort still runs in Triton), see :func:`fused_route_supported`:

- ``drop_policy="score"``: ranking each expert's pairs by weight takes a sort of all pairs by weight before a second
  counting pass (:func:`~lightning_llmfast.moe.selection.apply_capacity`), not one pass;
- more than :data:`~lightning_llmfast.moe.kernels.topk.MAX_FUSED_EXPERTS` experts: a token's scores no longer fit
  in registers.

Example::

    plan = route(logits, RoutingConfig(top_k=2, backend="triton"), validate=None)  # this path on CUDA
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmfast._autograd import eager_custom_op
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.moe.kernels.plan import plan_with_losses_triton
from lightning_llmfast.moe.kernels.topk import MAX_FUSED_EXPERTS, topk_scores_backward_triton, topk_scores_triton
from lightning_llmfast.moe.selection import group_score_count

__all__ = ["fused_route", "fused_route_supported"]

# (expert_ids, weights, router_probs, aux_loss, z_loss, routed, tokens_per_expert, offsets, permutation, positions,
#  row_tokens, kept, num_dropped, row_weights)
RouteOutputs = tuple[Tensor, ...]


@torch.library.custom_op("lightning_llmfast::fused_route", mutates_args=())
def _fused_route(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
    capacity: int | None,
    groups: list[int] | None,
    token_mask: Tensor | None,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor
]:
    """The routing plan's tensors of ``(T, E)`` logits (:data:`RouteOutputs` order); ``groups``: ``[num_groups,
    topk_groups, group_topk]`` of group-limited routing, or ``None``; ``token_mask``: ``(T,)`` bool or ``None``."""
    num_tokens, num_experts = logits.shape
    ids, weights, probs, sums, keys = topk_scores_triton(
        logits, bias, top_k, sigmoid=sigmoid, normalize=normalize, scale=scale, groups=groups and tuple(groups),
        token_mask=token_mask,
    )  # fmt: skip
    num_bins = num_experts + (token_mask is not None)  # masked pairs: the extra key E, never kept
    plan, row_weights, aux, z = plan_with_losses_triton(
        keys, num_bins, num_experts, capacity, top_k, weights.view(-1), sums
    )
    shape = (num_tokens, top_k)
    return (
        ids, weights, probs, aux, z, plan.routed, plan.tokens_per_expert, plan.offsets, plan.permutation,
        plan.positions.view(shape), plan.tokens, plan.kept.view(shape), plan.num_dropped, row_weights,
    )  # fmt: skip


@_fused_route.register_fake
def _fused_route_fake(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
    capacity: int | None,
    groups: list[int] | None,
    token_mask: Tensor | None,
) -> RouteOutputs:
    (num_tokens, num_experts), n = logits.shape, logits.shape[0] * top_k
    rows = n if capacity is None else min(n, num_experts * capacity)
    i32, i64, f32 = torch.int32, torch.int64, torch.float32

    def new(*shape: int, dtype: torch.dtype) -> Tensor:
        return logits.new_empty(shape, dtype=dtype)

    return (
        new(num_tokens, top_k, dtype=i32), new(num_tokens, top_k, dtype=f32), new(num_tokens, num_experts, dtype=f32),
        new(dtype=f32), new(dtype=f32), new(num_experts, dtype=i32), new(num_experts, dtype=i32),
        new(num_experts + 1, dtype=i32), new(n, dtype=i32), new(num_tokens, top_k, dtype=i64), new(rows, dtype=i64),
        new(num_tokens, top_k, dtype=torch.bool), new(dtype=i64), new(rows, dtype=f32),
    )  # fmt: skip


def _fused_route_setup(ctx: Any, inputs: tuple[Any, ...], output: RouteOutputs) -> None:
    logits, _, _, ctx.sigmoid, ctx.normalize, ctx.scale, _, _, token_mask = inputs
    ids, positions, kept, routed = output[0], output[9], output[11], output[5]
    ctx.save_for_backward(logits, ids, positions, kept, routed, token_mask)
    ctx.set_materialize_grads(False)  # the integer outputs get no gradient, the others maybe none: no zero fills


def _fused_route_backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    logits, ids, positions, kept, routed, token_mask = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 9
    grad_weights, grad_probs, grad_aux, grad_z, grad_rows = (grads[i] for i in (1, 2, 3, 4, 13))
    grad_logits = _fused_route_grad(
        logits, ids, grad_weights, grad_rows, grad_probs, grad_aux, grad_z, positions, kept, routed, ctx.sigmoid,
        ctx.normalize, ctx.scale, token_mask,
    )  # fmt: skip
    return grad_logits, None, None, None, None, None, None, None, None


@torch.library.custom_op("lightning_llmfast::fused_route_backward", mutates_args=())
def _fused_route_grad(
    logits: Tensor, ids: Tensor, grad_weights: Tensor | None, grad_rows: Tensor | None, grad_probs: Tensor | None,
    grad_aux: Tensor | None, grad_z: Tensor | None, positions: Tensor, kept: Tensor, routed: Tensor, sigmoid: bool,
    normalize: bool, scale: float, token_mask: Tensor | None,
) -> Tensor:  # fmt: skip
    """The logits' gradient as an opaque op: a compiled backward traces around the Triton kernel, never into it."""
    return topk_scores_backward_triton(
        logits, ids, (grad_weights, grad_rows, grad_probs, grad_aux, grad_z), positions, kept, routed,
        sigmoid=sigmoid, normalize=normalize, scale=scale, token_mask=token_mask,
    )  # fmt: skip


@_fused_route_grad.register_fake
def _fused_route_grad_fake(
    logits: Tensor, ids: Tensor, grad_weights: Tensor | None, grad_rows: Tensor | None, grad_probs: Tensor | None,
    grad_aux: Tensor | None, grad_z: Tensor | None, positions: Tensor, kept: Tensor, routed: Tensor, sigmoid: bool,
    normalize: bool, scale: float, token_mask: Tensor | None,
) -> Tensor:  # fmt: skip
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


_fused_route.register_autograd(_fused_route_backward, setup_context=_fused_route_setup)
# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
_fused_route, _fused_route_grad = eager_custom_op(_fused_route), eager_custom_op(_fused_route_grad)


def fused_route_supported(routing: RoutingConfig, num_experts: int, token_mask: Tensor | None) -> bool:
    """Whether :func:`fused_route` computes this routing (else the PyTorch composition does)."""
    by_score = routing.capacity_factor is not None and routing.drop_policy == "score"
    return not by_score and num_experts <= MAX_FUSED_EXPERTS


def fused_route(
    logits: Tensor,
    routing: RoutingConfig,
    expert_bias: Tensor | None,
    capacity: int | None,
    token_mask: Tensor | None = None,
) -> RouteOutputs:
    """The routing plan's tensors in :data:`RouteOutputs` order (see the module docstring), differentiable in the
    weights, row weights, probabilities and both losses; masked tokens (``token_mask`` False) route nowhere."""
    _, route_scale = routing.floats
    bias = None if expert_bias is None else expert_bias.detach()
    sigmoid = routing.score == "sigmoid"
    groups = None
    if routing.num_groups is not None and routing.topk_groups is not None:
        per_group = group_score_count(
            logits.shape[1], routing.top_k, routing.num_groups, routing.topk_groups, routing.group_topk
        )
        groups = [routing.num_groups, routing.topk_groups, per_group]
    return _fused_route(
        logits, bias, routing.top_k, sigmoid, routing.normalize, float(route_scale), capacity, groups, token_mask
    )
