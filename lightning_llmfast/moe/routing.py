"""Grouped MoE routing: top-k selection, one counting pass, a stable sync-free permutation, and the router losses.

:func:`route` turns router logits into a :class:`RoutingPlan` that every later consumer reuses: the permute and
unpermute ops, the grouped expert GEMMs (through ``offsets``), the auxiliary losses, the aux-loss-free bias update
(:func:`update_expert_bias`) and the load metrics. Tokens are counted once per layer, nothing reads a device value
on the host (unless ``validate=True`` asks for the eager finiteness check), and the memory is O(tokens * top_k):
there is no ``(tokens, experts)`` one-hot mask.

Example::

    logits = router(x)  # (num_tokens, num_experts)
    plan = route(logits, RoutingConfig(top_k=2), validate=False)
    y = unpermute(experts(permute(x, plan), plan.offsets), plan)
    loss = loss + 0.01 * plan.aux_loss + 0.001 * plan.z_loss
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.balance import update_expert_bias
from lightning_llmfast.moe.config import RoutingConfig
from lightning_llmfast.moe.fused_routing import fused_route, fused_route_supported
from lightning_llmfast.moe.kernels import resolve_backend, stable_counting_sort
from lightning_llmfast.moe.kernels.plan import PlanTensors, plan_from_permutation, routing_plan
from lightning_llmfast.moe.losses import SequenceBoundaries, balance_loss, sequence_balance_loss, z_loss
from lightning_llmfast.moe.selection import apply_capacity, expert_capacity, select_experts

__all__ = ["RoutingPlan", "nonfinite_flag", "route", "update_expert_bias"]

# Added to sums of sigmoid scores before dividing by them (as DeepSeek-V3 does): they can all underflow to zero.
# Softmax sums need none: the top-k softmax scores sum to at least 1 / E.
_NORM_EPS = 1e-20


class RoutingPlan(NamedTuple):
    """Where every ``(token, slot)`` pair goes; produced by :func:`route`, consumed by permute/unpermute and experts.

    A pair is token ``t``'s ``s``-th choice; its flattened index is ``t * top_k + s``. ``T`` is the number of
    tokens, ``k`` is ``top_k`` and ``E`` is ``num_experts``. All tensors live on the device of the logits. Tokens
    that ``token_mask`` masks out are routed nowhere: their pairs are never kept, and they count in no count or loss.

    Attributes:
        expert_ids: ``(T, k)`` int32, the top-k experts of each token by descending (biased) score, ties to the lower
            expert index.
        weights: ``(T, k)`` float32 combine weights from the unbiased scores, differentiable with respect to the
            logits; renormalised over the k choices when ``normalize`` was set, then times ``route_scale``. Dropped
            and masked pairs keep their weight here (``unpermute`` ignores them).
        tokens_per_expert: ``(E,)`` int32, kept pairs per expert.
        offsets: ``(E + 1,)`` int32, exclusive prefix sums of ``tokens_per_expert``: expert ``e`` owns rows
            ``offsets[e]:offsets[e + 1]`` of the permuted activations.
        permutation: ``(T * k,)`` int32 flattened pair indices ordered by expert, ascending inside each expert;
            the first ``offsets[-1]`` entries are the kept pairs, the dropped pairs follow (grouped by expert,
            ascending inside each expert), then the masked tokens' pairs.
        kept: ``(T, k)`` bool, whether the pair survived the capacity limit and the mask.
        num_dropped: 0-d int64 tensor, the number of valid pairs dropped by the capacity limit (a tensor so that
            reading it is the caller's choice of sync).
        aux_loss: 0-d float32 Switch/GShard load-balancing loss ``E * sum_e f_e * P_e``; ``f_e`` is the fraction
            of all routed pairs (before the capacity limit, as in Switch) choosing ``e``, ``P_e`` the mean routing
            probability of ``e`` (sigmoid scores are first normalised over the experts of each token, as in
            DeepSeek-V3), both over the valid tokens. Equals 1 for perfectly uniform routing; differentiable
            through ``P``.
        z_loss: 0-d float32 router z-loss, the mean over valid tokens of ``logsumexp(logits) ** 2``.
        nonfinite: 0-d bool tensor, whether any logit was NaN or infinite (``validate=False``); ``None`` when
            ``validate=True`` already raised for it, or ``validate=None`` skipped the check. Check it with
            :meth:`check_finite` where the host reads device values anyway.
        capacity: per-expert capacity, or ``None`` when dropless.
        num_experts: ``E``.
        top_k: ``k``.
        routed_per_expert: ``(E,)`` int32, valid pairs per expert before the capacity limit (what the balance
            losses and the expert-bias update count).
        router_probs: ``(T, E)`` float32 normalised routing probabilities ``P`` is the mean of, differentiable.
        token_mask: ``(T,)`` bool, or ``None`` (every token valid).
        positions: ``(T, k)`` int64 row of each pair in the permuted layout (the inverse of ``permutation``),
            clamped into ``num_rows`` (a dropped pair's row is padding or another pair's); ``None`` on the PyTorch
            path (the dispatcher derives it from ``permutation``), set by the fused Triton routing's counting pass.
        row_tokens: ``(num_rows,)`` int64 token of each row (``permutation[:num_rows] // k``), or ``None`` (as
            ``positions``).
        row_weights: ``(num_rows,)`` float32 combine weight of each row (0 for a dropped pair's), differentiable
            like ``weights``, or ``None`` (the fused Triton routing makes it in its counting pass).

    Example::

        plan = route(torch.randn(5, 4), top_k=2)
        plan.permutation.shape  # torch.Size([10])
    """

    expert_ids: Tensor
    weights: Tensor
    tokens_per_expert: Tensor
    offsets: Tensor
    permutation: Tensor
    kept: Tensor
    num_dropped: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    nonfinite: Tensor | None
    capacity: int | None
    num_experts: int
    top_k: int
    routed_per_expert: Tensor | None = None
    router_probs: Tensor | None = None
    token_mask: Tensor | None = None
    positions: Tensor | None = None
    row_tokens: Tensor | None = None
    row_weights: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """``T``, the number of routed tokens."""
        return self.expert_ids.shape[0]

    @property
    def num_rows(self) -> int:
        """Rows of the permuted activations: ``T * k``, or at most ``E * capacity`` with a capacity limit.

        A host-side bound, so that shapes never depend on device values; rows from ``offsets[-1]`` on are padding.
        """
        num_pairs = self.num_tokens * self.top_k
        return num_pairs if self.capacity is None else min(num_pairs, self.num_experts * self.capacity)

    @property
    def padded(self) -> bool:
        """Whether some pairs may be left out (a capacity limit or a token mask): rows from ``offsets[-1]`` on are
        padding and ``kept`` must be honoured."""
        return self.capacity is not None or self.token_mask is not None

    def sequence_aux_loss(self, boundaries: SequenceBoundaries) -> Tensor:
        """DeepSeek-V3's sequence-wise balance loss over the packed documents of ``metadata``, sync-free.

        Per document ``d`` of ``L_d`` valid tokens, ``sum_e f_e * P_e`` with ``f_e = E / (k * L_d) * (tokens of d
        selecting e)`` and ``P_e`` the mean of ``router_probs[:, e]`` over them; the mean over the documents with a
        valid token (1 for uniform routing). Selections are counted before the capacity limit.

        Args:
            boundaries: the packed documents of the ``T`` routed tokens.

        Returns:
            0-d float32, differentiable through ``router_probs``.

        Raises:
            RoutingError: ``boundaries`` are not :class:`SequenceBoundaries` of ``T`` tokens.

        Example::

            loss = plan.sequence_aux_loss(SequenceBoundaries(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), 2))
        """
        return sequence_balance_loss(self.router_probs, self.expert_ids, self.token_mask, boundaries)

    def global_aux_loss(self, counts: Tensor) -> Tensor:
        """The balance loss with ``f_e`` from ``counts`` (e.g. summed over a step's micro-batches and the ranks).

        ``E * sum_e (counts_e / sum(counts)) * P_e``, ``P_e`` the mean probability over this plan's valid tokens.

        Args:
            counts: ``(E,)`` integer pairs per expert.

        Returns:
            0-d float32, differentiable through ``router_probs``.

        Example::

            loss = plan.global_aux_loss(step_counts + plan.routed_per_expert)
        """
        if not isinstance(counts, Tensor) or tuple(counts.shape) != (self.num_experts,):
            got = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise RoutingError(f"counts must have shape ({self.num_experts},) (num_experts), got {got}")
        return balance_loss(counts, self.router_probs, self.token_mask)

    def check_finite(self) -> None:
        """Raises :class:`RoutingError` if the logits had a NaN or infinite value (recorded by ``validate=False``).

        Call it where the host reads device values anyway (logging), never in the hot path.

        Example::

            plan.check_finite()
        """
        # NOTE: host sync (reads a device flag); a no-op when route() already validated eagerly.
        if self.nonfinite is not None and bool(self.nonfinite):
            raise RoutingError("router logits contain NaN or infinite values (recorded by route(validate=False))")


def _check_tensors(logits: Tensor, routing: RoutingConfig, expert_bias: Tensor | None, mask: Tensor | None) -> None:
    """Host-side checks of route()'s tensors (shapes, dtypes, devices): no device value is read."""
    if not isinstance(logits, Tensor):
        raise RoutingError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise RoutingError(f"logits must be 2-D (num_tokens, num_experts), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise RoutingError(f"logits must be floating point, got {logits.dtype}")
    num_tokens, num_experts = logits.shape
    routing.check_experts(num_experts, error=RoutingError)
    if expert_bias is not None:
        if not isinstance(expert_bias, Tensor) or tuple(expert_bias.shape) != (num_experts,):
            shape = tuple(expert_bias.shape) if isinstance(expert_bias, Tensor) else type(expert_bias).__name__
            raise RoutingError(f"expert_bias must have shape ({num_experts},) (num_experts), got {shape}")
        if not expert_bias.is_floating_point():
            raise RoutingError(f"expert_bias must be a floating-point tensor, got {expert_bias.dtype}")
        if expert_bias.device != logits.device:
            raise RoutingError(f"expert_bias is on {expert_bias.device} but logits are on {logits.device}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise RoutingError(f"token_mask must be a bool tensor, got {got}")
        if tuple(mask.shape) != (num_tokens,):
            raise RoutingError(f"token_mask must have shape (num_tokens={num_tokens},), got {tuple(mask.shape)}")
        if mask.device != logits.device:
            raise RoutingError(f"token_mask is on {mask.device} but logits are on {logits.device}")


def nonfinite_flag(logits: Tensor) -> Tensor:
    """0-d bool: any NaN/inf in ``logits``, via the min and max (NaN propagates) rather than a ``(T, E)`` mask.

    Example::

        nonfinite_flag(torch.tensor([[0.0, float("nan")]]))  # tensor(True), read on the host only when needed
    """
    if logits.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=logits.device)
    lo, hi = torch.aminmax(logits)
    # x - x is 0 for finite x and NaN for NaN or +-inf: four 0-d ops, fewer launches than two isfinite calls.
    return ((lo - lo) + (hi - hi)).ne(0)


def _raise_nonfinite(logits: Tensor) -> None:
    # Error path only: locating the first bad value costs more syncs, which no longer matter.
    bad = (~torch.isfinite(logits)).nonzero()[0].tolist()
    value = logits[bad[0], bad[1]].item()
    raise RoutingError(f"router logits must be finite; found {value} at (token {bad[0]}, expert {bad[1]})")


def _routing_config(routing: RoutingConfig | int | None, options: dict[str, Any]) -> RoutingConfig:
    """``routing`` itself, or the config of the keyword form ``route(logits, top_k, score=..., ...)``."""
    if routing is None and "top_k" in options:
        routing = options.pop("top_k")
    if isinstance(routing, RoutingConfig):
        if options:
            raise RoutingError(
                f"pass the routing options in the RoutingConfig or as keywords, not both: {sorted(options)}"
            )
        return routing
    try:
        return RoutingConfig.from_options(routing, **options)
    except ConfigError as err:  # the keyword form reports bad routing arguments as routing errors
        raise RoutingError(str(err)) from None


def _select(logits32: Tensor, routing: RoutingConfig, expert_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Scores, the top-k experts of each token (by the biased scores) and their combine weights."""
    probs = logits32.softmax(dim=-1) if routing.score == "softmax" else logits32.sigmoid()
    selection = probs.detach() if expert_bias is None else probs.detach() + expert_bias.detach().float()
    expert_ids = select_experts(
        selection,
        routing.top_k,
        num_groups=routing.num_groups,
        topk_groups=routing.topk_groups,
        group_topk=routing.group_topk,
    )  # (T, k) int64
    weights = probs.gather(1, expert_ids)
    if routing.normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total if routing.score == "softmax" else total + _NORM_EPS)
    _, route_scale = routing.floats
    if route_scale != 1.0:
        weights = weights * route_scale
    return probs, expert_ids, weights


def _count(
    expert_ids: Tensor,
    weights: Tensor,
    num_experts: int,
    routing: RoutingConfig,
    capacity: int | None,
    token_mask: Tensor | None,
    backend: str,
) -> PlanTensors:
    """The one counting pass: counts before and after the capacity limit, offsets, kept pairs, rows and tokens.

    ``routed`` counts the valid pairs per expert before the capacity limit (what the losses and the bias update
    count); the rest is after it. Masked tokens' pairs get the extra key ``E``: they sort after every expert's pairs
    and are never kept.
    """
    keys = expert_ids.reshape(-1)
    num_bins = num_experts
    top_k = routing.top_k
    if token_mask is not None:
        keys = torch.where(token_mask.repeat_interleave(top_k), keys, num_experts)
        num_bins += 1
    if capacity is None or routing.drop_policy == "position":
        return routing_plan(keys, num_bins, num_experts, capacity, top_k, backend=backend, rows=False)
    counts, dest, _ = stable_counting_sort(keys, num_bins, backend=backend, validate=False)
    kept_counts, kept, permutation = apply_capacity(
        keys, weights.detach().reshape(-1), counts, dest, capacity, num_experts, routing.drop_policy, backend
    )
    num_rows = min(keys.numel(), num_experts * capacity)
    masked = token_mask is not None
    return plan_from_permutation(counts[:num_experts], kept_counts, kept, permutation, num_rows, top_k, masked)


def route(
    logits: Tensor,
    routing: RoutingConfig | int | None = None,
    *,
    expert_bias: Tensor | None = None,
    token_mask: Tensor | None = None,
    validate: bool | None = True,
    **options: Any,
) -> RoutingPlan:
    """Routes every token to its top-k experts and builds the stable, grouped, sync-free dispatch plan.

    Args:
        logits: ``(num_tokens, num_experts)`` router logits (any float dtype; routing runs in float32).
        routing: the :class:`~lightning_llmfast.moe.RoutingConfig`, or ``top_k`` with the config's fields as
            keywords (``route(logits, 2, capacity_factor=1.0)``; ``top_k=2`` as a keyword too). ``num_tokens`` in
            the capacity counts masked tokens too (a host-side size).
        expert_bias: optional ``(num_experts,)`` floating-point aux-loss-free balancing bias (DeepSeek-V3): added
            to the scores for the selection only; the weights come from the unbiased scores. Not differentiated.
        token_mask: ``(num_tokens,)`` bool; False tokens (padding) are routed nowhere and count in no loss,
            count or metric.
        validate: check the logits (and ``expert_bias``) for NaN/inf eagerly and raise. This costs one host sync
            on an accelerator. With ``False`` only host-side checks run, the logits' finding is stored in
            ``plan.nonfinite`` and the bias values are not checked; ``None`` skips the check altogether (the MoE
            block's path: its ``stats.nonfinite_flag()`` computes the flag when a monitor asks).
        options: the keyword form's routing options (only with an int ``routing``).

    Returns:
        The :class:`RoutingPlan`.

    Raises:
        RoutingError: logits not a 2-D float tensor, ``top_k`` out of range, bad routing options (keyword form),
            group options that do not fit the experts, ``expert_bias`` not a float tensor of shape
            ``(num_experts,)``, ``token_mask`` not a ``(num_tokens,)`` bool tensor on the logits' device, or
            (``validate=True``) non-finite logits or ``expert_bias``.

    Example::

        plan = route(torch.randn(6, 4), RoutingConfig(top_k=2, capacity_factor=1.0))
        plan.tokens_per_expert.sum() + plan.num_dropped  # == 12
    """
    routing = _routing_config(routing, options)
    _check_tensors(logits, routing, expert_bias, token_mask)
    num_tokens, num_experts = logits.shape
    capacity_factor, _ = routing.floats  # (capacity_factor, route_scale), specialised under torch.compile
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(capacity_factor, num_tokens * routing.top_k, num_experts, routing.min_capacity)
    backend = resolve_backend(routing.backend, logits.device)
    fused = backend == "triton" and fused_route_supported(routing, num_experts, token_mask)
    logits32 = logits if fused and validate is None else logits.float()  # the fused kernels read any float dtype
    if token_mask is not None and not (fused and validate is None):
        # Masked tokens (padding) may hold anything: zeroed first, they reach no NaN check, loss or gradient (the
        # fused kernels read them as 0 themselves).
        logits32 = logits32.masked_fill(~token_mask.unsqueeze(1), 0.0)
    nonfinite = None
    if validate is not None:
        nonfinite = _check_finite(logits32, expert_bias) if validate else nonfinite_flag(logits32)
    if fused:
        outputs = fused_route(logits, routing, expert_bias, capacity, token_mask)
        return _fused_plan(outputs, capacity, nonfinite, token_mask)
    probs, expert_ids, weights = _select(logits32, routing, expert_bias)
    counted = _count(expert_ids, weights, num_experts, routing, capacity, token_mask, backend)
    return _plan(logits32, probs, expert_ids, weights, counted, routing.score, capacity, nonfinite, token_mask)


def _fused_plan(
    outputs: tuple[Tensor, ...], capacity: int | None, nonfinite: Tensor | None, token_mask: Tensor | None
) -> RoutingPlan:
    """The :class:`RoutingPlan` of :func:`~lightning_llmfast.moe.fused_routing.fused_route`'s tensors."""
    ids, weights, probs, aux, z, routed, per_expert, offsets, permutation, positions, tokens, kept, dropped, rows = (
        outputs
    )
    return RoutingPlan(
        ids, weights, per_expert, offsets, permutation, kept, dropped, aux, z, nonfinite, capacity, probs.shape[1],
        ids.shape[1], routed, probs, token_mask, positions, tokens, rows,
    )  # fmt: skip


def _plan(
    logits32: Tensor,
    probs: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    counted: PlanTensors,
    score: str,
    capacity: int | None,
    nonfinite: Tensor | None,
    token_mask: Tensor | None,
) -> RoutingPlan:
    """The :class:`RoutingPlan` of the counted selection, with the losses from the same counts."""
    num_tokens, top_k = expert_ids.shape
    router_probs = probs if score == "softmax" else probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return RoutingPlan(
        expert_ids=expert_ids.to(torch.int32),
        weights=weights,
        tokens_per_expert=counted.tokens_per_expert,
        offsets=counted.offsets,
        permutation=counted.permutation,
        kept=counted.kept.view(num_tokens, top_k),
        num_dropped=counted.num_dropped,
        aux_loss=balance_loss(counted.routed, router_probs, token_mask),
        z_loss=z_loss(logits32, token_mask),
        nonfinite=nonfinite,
        capacity=capacity,
        num_experts=probs.shape[1],
        top_k=top_k,
        routed_per_expert=counted.routed,
        router_probs=router_probs,
        token_mask=token_mask,
        # Not kept in the plan on this path: MoEStats holds the plan until the next forward, and with activation
        # recomputation these (T * k) indices would outlive the layer's forward; the dispatcher derives them.
        positions=None,
        row_tokens=None,
    )


def _check_finite(logits: Tensor, expert_bias: Tensor | None) -> None:
    """``validate=True``: raise for NaN/inf logits or bias values."""
    # NOTE: host sync (one read of the device flags), documented: validate=True trades it for an eager error.
    flag = nonfinite_flag(logits)
    if expert_bias is not None:
        flag = flag | nonfinite_flag(expert_bias)
    if bool(flag):
        # Error path only: which of the two, and where, costs more syncs, which no longer matter.
        if bool(nonfinite_flag(logits)):
            _raise_nonfinite(logits)
        values = expert_bias.tolist()
        expert = next(e for e, v in enumerate(values) if not math.isfinite(v))
        raise RoutingError(f"expert_bias must be finite; found {values[expert]} at expert {expert}")
