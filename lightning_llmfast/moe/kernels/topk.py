"""The router's scores, top-k and combine weights in one Triton launch, and their whole backward in another.

Forward, per block of tokens with all experts in registers: the scores (softmax, or sigmoid), the top-k experts of
the scores plus an optional selection bias (ties to the lower expert index; optionally inside each token's best
groups of experts only, DeepSeek-V3's group-limited routing), the combine weights (the unbiased scores
of the chosen experts, renormalised when asked, times ``route_scale``), the normalised routing probabilities, and the
block's sums of those probabilities and of ``logsumexp(logits) ** 2``: the balance and z-losses are finished from them
in the counting pass's scan (:func:`~lightning_llmfast.moe.kernels.plan.plan_with_losses_triton`). Backward: the
logits' gradient from the gradients of the weights (given per pair and per permuted row), of the probabilities and
of both losses.

Its reference is the PyTorch composition in :mod:`~lightning_llmfast.moe.routing` (softmax or sigmoid, ``topk``,
``gather``, renormalisation, the losses of :mod:`~lightning_llmfast.moe.losses`) differentiated by autograd; the tests
compare both, forward and every gradient.

Example::

    ids, weights, probs, sums = topk_scores_triton(logits, None, top_k=2, sigmoid=False, normalize=True, scale=1.0)
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import tl, triton, triton_jit

__all__ = ["MAX_FUSED_EXPERTS", "topk_scores_backward_triton", "topk_scores_triton"]

MAX_FUSED_EXPERTS = 1024
"""Experts the fused router kernels hold per token in registers; more take the PyTorch composition."""

_NORM_EPS = 1e-20  # added to sums of sigmoid scores before dividing (routing._NORM_EPS)


@triton_jit
def _scores(logits_ptr, t, e, t_ok, e_ok, num_experts, SIGMOID: tl.constexpr):
    """Float32 logits of a tile, their logsumexp, softmax, and the scores (softmax or sigmoid)."""
    mask = t_ok[:, None] & e_ok[None, :]
    logits = tl.load(logits_ptr + t[:, None].to(tl.int64) * num_experts + e[None, :], mask=mask, other=0)
    logits = tl.where(e_ok[None, :], logits.to(tl.float32), float("-inf"))
    top = tl.max(logits, axis=1)
    exp = tl.exp(logits - top[:, None])
    total = tl.sum(exp, axis=1)
    lse = top + tl.log(total)
    softmax = exp / total[:, None]
    scores = tl.where(e_ok[None, :], tl.sigmoid(logits), 0.0) if SIGMOID else softmax
    return lse, softmax, scores


@triton_jit
def _group_limit(
    select, e, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
    G_PAD: tl.constexpr, TOPK_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
):  # fmt: skip
    """``select`` with ``-inf`` outside each token's ``TOPK_GROUPS`` best groups of ``GROUP_SIZE`` consecutive
    experts, a group scored by the sum of its ``PER_GROUP`` best values (ties: the lower group)."""
    group = e // GROUP_SIZE  # padded experts (select -inf) fall in no group below NUM_GROUPS
    g = tl.arange(0, G_PAD)
    group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
    for gi in tl.static_range(NUM_GROUPS):
        mine = tl.where(group[None, :] == gi, select, float("-inf"))
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(PER_GROUP):
            best = tl.max(mine, axis=1)
            total += best
            pick = tl.min(tl.where(mine == best[:, None], e[None, :], E_PAD), axis=1)
            mine = tl.where(e[None, :] == pick[:, None], float("-inf"), mine)
        group_scores = tl.where(g[None, :] == gi, total[:, None], group_scores)
    allowed = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(group_scores, axis=1)
        pick = tl.min(tl.where(group_scores == best[:, None], g[None, :], G_PAD), axis=1)
        allowed = allowed | (group[None, :] == pick[:, None])
        group_scores = tl.where(g[None, :] == pick[:, None], float("-inf"), group_scores)
    return tl.where(allowed, select, float("-inf"))


@triton_jit
def _topk_scores_kernel(
    logits_ptr, bias_ptr, mask_ptr, ids_ptr, keys_ptr, weights_ptr, probs_ptr, prob_sums_ptr, lse_sums_ptr,
    num_tokens, num_experts, scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
):  # fmt: skip
    """A block of tokens: experts, weights, probabilities, and the block's probability and ``lse ** 2`` sums;
    ``NUM_GROUPS > 0``: the experts picked inside each token's best groups only; ``HAS_MASK``: a masked token's
    logits read as 0, its pairs' keys are ``num_experts`` and it adds nothing to the sums."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    t_ok, e_ok = t < num_tokens, e < num_experts
    valid = _valid_tokens(mask_ptr, t, t_ok, HAS_MASK)
    lse, _softmax, scores = _scores(logits_ptr, t, e, valid, e_ok, num_experts, SIGMOID)
    select = scores
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + e, mask=e_ok, other=0).to(tl.float32)[None, :]
    select = tl.where(e_ok[None, :], select, float("-inf"))
    if NUM_GROUPS > 0:
        select = _group_limit(select, e, BLOCK_T, E_PAD, GROUP_SIZE, NUM_GROUPS, G_PAD, TOPK_GROUPS, PER_GROUP)
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(select, axis=1)
        pick = tl.min(tl.where(select == best[:, None], e[None, :], E_PAD), axis=1)  # ties: the lower expert
        hit = e[None, :] == pick[:, None]
        ids = tl.where(slot[None, :] == j, pick[:, None], ids)
        weights = tl.where(slot[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
        select = tl.where(hit, float("-inf"), select)
    if NORMALIZE:
        total = tl.sum(weights, axis=1)
        weights = weights / (total + _NORM_EPS if SIGMOID else total)[:, None]
    pair = t[:, None].to(tl.int64) * TOP_K + slot[None, :]
    pair_ok = t_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(ids_ptr + pair, ids, mask=pair_ok)
    if HAS_MASK:
        tl.store(keys_ptr + pair, tl.where(valid[:, None], ids, num_experts), mask=pair_ok)
    tl.store(weights_ptr + pair, weights * scale, mask=pair_ok)
    probs = scores / (tl.sum(scores, axis=1) + _NORM_EPS)[:, None] if SIGMOID else scores
    mask = t_ok[:, None] & e_ok[None, :]
    tl.store(probs_ptr + t[:, None].to(tl.int64) * num_experts + e[None, :], probs, mask=mask)
    tl.store(prob_sums_ptr + pid * num_experts + e, tl.sum(tl.where(valid[:, None], probs, 0.0), axis=0), mask=e_ok)
    tl.store(lse_sums_ptr + pid, tl.sum(tl.where(valid, lse * lse, 0.0), axis=0))


@triton_jit
def _valid_tokens(mask_ptr, t, t_ok, HAS_MASK: tl.constexpr):
    """The tokens of the block that route: inside the tensor and, with a mask, unmasked."""
    if HAS_MASK:
        return t_ok & (tl.load(mask_ptr + t, mask=t_ok, other=0) != 0)
    return t_ok


@triton_jit
def _pair_grad(
    ids_ptr, grad_weights_ptr, grad_rows_ptr, positions_ptr, kept_ptr, t, e, t_ok, j, TOP_K: tl.constexpr,
    HAS_GRAD_WEIGHTS: tl.constexpr, HAS_GRAD_ROWS: tl.constexpr,
):  # fmt: skip
    """Slot ``j``'s one-hot expert mask and its weight's gradient (per pair plus, if kept, its row's)."""
    pair = t.to(tl.int64) * TOP_K + j
    hit = e[None, :] == tl.load(ids_ptr + pair, mask=t_ok, other=-1)[:, None]
    grad = tl.zeros(t.shape, dtype=tl.float32)
    if HAS_GRAD_WEIGHTS:
        grad += tl.load(grad_weights_ptr + pair, mask=t_ok, other=0)
    if HAS_GRAD_ROWS:
        keep = tl.load(kept_ptr + pair, mask=t_ok, other=0) != 0
        row = tl.load(positions_ptr + pair, mask=t_ok, other=0)
        grad += tl.load(grad_rows_ptr + row, mask=t_ok & keep, other=0)
    return hit, grad


@triton_jit
def _topk_scores_backward_kernel(
    logits_ptr, mask_ptr, ids_ptr, grad_weights_ptr, grad_rows_ptr, positions_ptr, kept_ptr, grad_probs_ptr,
    routed_ptr, grad_aux_ptr, grad_z_ptr, grad_logits_ptr, num_tokens, num_experts, scale, TOP_K: tl.constexpr,
    E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_GRAD_WEIGHTS: tl.constexpr, HAS_GRAD_ROWS: tl.constexpr, HAS_GRAD_PROBS: tl.constexpr,
    HAS_AUX: tl.constexpr, HAS_Z: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """A block of tokens: the logits' gradient from every gradient the forward's outputs received (0 for masked
    tokens, whose logits the forward read as 0)."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    t_ok, e_ok = t < num_tokens, e < num_experts
    mask = t_ok[:, None] & e_ok[None, :]
    valid = _valid_tokens(mask_ptr, t, t_ok, HAS_MASK)
    lse, softmax, scores = _scores(logits_ptr, t, e, valid, e_ok, num_experts, SIGMOID)
    tokens = tl.maximum(num_tokens, 1).to(tl.float32)
    if HAS_MASK:  # the losses average over the tokens that route, top_k valid pairs each
        tokens = tl.maximum(tl.sum(tl.load(routed_ptr + e, mask=e_ok, other=0), axis=0) // TOP_K, 1).to(tl.float32)
    # Combine weights w_j = scale * r_j / S with r_j the chosen scores and S their sum (when normalising).
    picked = tl.zeros([BLOCK_T], dtype=tl.float32)
    grad_dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        hit, grad_w = _pair_grad(
            ids_ptr, grad_weights_ptr, grad_rows_ptr, positions_ptr, kept_ptr, t, e, t_ok, j, TOP_K,
            HAS_GRAD_WEIGHTS, HAS_GRAD_ROWS,
        )  # fmt: skip
        chosen = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        picked += chosen
        grad_dot += grad_w * chosen
    total = picked + _NORM_EPS if SIGMOID else picked
    total = tl.where(t_ok, total, 1.0)  # tokens past the end pick nothing: no 0 / 0
    grad_scores = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        hit, grad_w = _pair_grad(
            ids_ptr, grad_weights_ptr, grad_rows_ptr, positions_ptr, kept_ptr, t, e, t_ok, j, TOP_K,
            HAS_GRAD_WEIGHTS, HAS_GRAD_ROWS,
        )  # fmt: skip
        grad_chosen = (grad_w - grad_dot / total) / total if NORMALIZE else grad_w
        grad_scores += tl.where(hit, (grad_chosen * scale)[:, None], 0.0)
    grad_probs = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    if HAS_GRAD_PROBS:
        ptrs = grad_probs_ptr + t[:, None].to(tl.int64) * num_experts + e[None, :]
        grad_probs += tl.load(ptrs, mask=mask, other=0)
    if HAS_AUX:
        routed = tl.load(routed_ptr + e, mask=e_ok, other=0)
        pairs = tl.maximum(tl.sum(routed, axis=0), 1).to(tl.float32)
        coef = tl.load(grad_aux_ptr) * num_experts / pairs / tokens
        grad_probs += (routed.to(tl.float32) * coef)[None, :]
    if SIGMOID:
        norm = tl.sum(scores, axis=1) + _NORM_EPS
        grad_scores += grad_probs / norm[:, None] - (tl.sum(grad_probs * scores, axis=1) / (norm * norm))[:, None]
        grad = grad_scores * scores * (1.0 - scores)
    else:
        grad_scores += grad_probs
        grad = scores * (grad_scores - tl.sum(scores * grad_scores, axis=1)[:, None])
    if HAS_Z:
        grad += (tl.load(grad_z_ptr) * 2.0 / tokens * lse)[:, None] * softmax
    grad = tl.where(valid[:, None], grad, 0.0)
    out = grad_logits_ptr + t[:, None].to(tl.int64) * num_experts + e[None, :]
    tl.store(out, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _block_tokens(num_experts: int) -> tuple[int, int]:
    e_pad = triton.next_power_of_2(max(num_experts, 1))
    return e_pad, max(1, min(64, 4096 // e_pad))


def topk_scores_triton(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    *,
    sigmoid: bool,
    normalize: bool,
    scale: float,
    groups: tuple[int, int, int] | None = None,
    token_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor], Tensor]:
    """Top-k routing of ``(T, E)`` logits in one launch.

    Args:
        logits: ``(T, E)`` router logits (any float dtype; computed in float32).
        bias: ``(E,)`` selection bias (aux-loss-free balancing), or ``None``.
        top_k: experts per token.
        sigmoid: sigmoid scores (else softmax).
        normalize: renormalise the chosen scores to sum 1.
        scale: ``route_scale``.
        groups: group-limited routing ``(num_groups, topk_groups, group_topk)`` (checked by the caller:
            :func:`~lightning_llmfast.moe.selection.check_groups`), or ``None``: the top-k experts of the selection
            scores inside each token's ``topk_groups`` best groups, a group scored by its ``group_topk`` best.
        token_mask: ``(T,)`` bool, or ``None``: a False token's logits count as 0 (as the composition's
            ``masked_fill``), its pairs get the key ``E`` and it adds nothing to the losses' sums.

    Returns:
        ``expert_ids`` ``(T, k)`` int32, ``weights`` ``(T, k)`` float32, ``router_probs`` ``(T, E)`` float32, the
        per-block sums ``((blocks, E) probabilities, (blocks,) logsumexp ** 2)`` for the losses and the ``(T * k,)``
        int32 counting keys (``expert_ids`` itself without a mask).
    """
    logits = logits.contiguous()
    (num_tokens, num_experts), device = logits.shape, logits.device
    e_pad, block_t = _block_tokens(num_experts)
    blocks = max(triton.cdiv(num_tokens, block_t), 1)
    num_groups, topk_groups, per_group = groups or (0, 0, 0)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    probs = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.empty(blocks, num_experts, dtype=torch.float32, device=device)
    lse_sums = torch.empty(blocks, dtype=torch.float32, device=device)
    keys = ids if token_mask is None else torch.empty_like(ids)
    _topk_scores_kernel[(blocks,)](
        logits, bias if bias is not None else logits, token_mask if token_mask is not None else logits, ids, keys,
        weights, probs, prob_sums, lse_sums, num_tokens, num_experts, float(scale), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, BLOCK_T=block_t, SIGMOID=sigmoid, HAS_BIAS=bias is not None,
        NORMALIZE=normalize, HAS_MASK=token_mask is not None, NUM_GROUPS=num_groups,
        GROUP_SIZE=num_experts // max(num_groups, 1), G_PAD=triton.next_power_of_2(max(num_groups, 1)),
        TOPK_GROUPS=topk_groups, PER_GROUP=per_group,
    )  # fmt: skip
    return ids, weights, probs, (prob_sums, lse_sums), keys.view(-1)


def topk_scores_backward_triton(
    logits: Tensor,
    expert_ids: Tensor,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    positions: Tensor,
    kept: Tensor,
    routed: Tensor,
    *,
    sigmoid: bool,
    normalize: bool,
    scale: float,
    token_mask: Tensor | None = None,
) -> Tensor:
    """The logits' gradient of :func:`topk_scores_triton` and the losses, in one launch.

    Args:
        logits: the forward's ``(T, E)`` logits.
        expert_ids: ``(T, k)`` int32 chosen experts.
        grads: gradients of ``(weights (T, k), row weights (R,), router_probs (T, E), balance loss, z-loss)``, each
            ``None`` when it got none. A row weight is its pair's weight when kept, else 0.
        positions: ``(T, k)`` int64 row of each pair.
        kept: ``(T, k)`` bool.
        routed: ``(E,)`` integer valid pairs per expert (the balance loss's counts).
        sigmoid, normalize, scale, token_mask: as the forward.

    Returns:
        ``(T, E)`` in ``logits``' dtype.
    """
    logits = logits.contiguous()
    (num_tokens, num_experts), top_k = logits.shape, expert_ids.shape[1]
    grad_logits = torch.empty_like(logits)
    if logits.numel() == 0:
        return grad_logits
    e_pad, block_t = _block_tokens(num_experts)
    given = [g.contiguous() if g is not None else logits for g in grads]
    _topk_scores_backward_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, token_mask if token_mask is not None else logits, expert_ids, given[0], given[1], positions, kept,
        given[2], routed, given[3], given[4], grad_logits, num_tokens, num_experts, float(scale), TOP_K=top_k,
        E_PAD=e_pad, BLOCK_T=block_t, SIGMOID=sigmoid, NORMALIZE=normalize, HAS_GRAD_WEIGHTS=grads[0] is not None,
        HAS_GRAD_ROWS=grads[1] is not None, HAS_GRAD_PROBS=grads[2] is not None, HAS_AUX=grads[3] is not None,
        HAS_Z=grads[4] is not None, HAS_MASK=token_mask is not None,
    )  # fmt: skip
    return grad_logits
