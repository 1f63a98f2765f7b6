"""Grouped MoE routing: top-k selection, one counting pass, a stable sync-free permutation, and the router losses.

:func:`route` turns router logits into a :class:`RoutingPlan` that every later consumer reuses: the permute and
unpermute ops, the grouped expert GEMMs (through ``offsets``), the auxiliary losses, the aux-loss-free bias update
(:func:`update_expert_bias`) and the load metrics. Tokens are counted once per layer, nothing reads a device value
on the host (unless ``validate=True`` asks for the eager finiteness check), and the memory is O(tokens * top_k):
there is no ``(tokens, experts)`` one-hot mask.

Example::

    logits = router(x)  # (num_tokens, num_experts)
    plan = route(logits, top_k=2, validate=False)
    y = unpermute(experts(permute(x, plan), plan.offsets), plan)
    loss = loss + 0.01 * plan.aux_loss + 0.001 * plan.z_loss
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast._checks import check_number
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.kernels import resolve_backend, stable_counting_sort

__all__ = ["DROP_POLICIES", "SCORES", "RoutingPlan", "route", "update_expert_bias"]

SCORES: frozenset[str] = frozenset({"softmax", "sigmoid"})
DROP_POLICIES: frozenset[str] = frozenset({"position", "score"})

# Added to sums of sigmoid scores before dividing by them (as DeepSeek-V3 does): they can all underflow to zero.
# Softmax sums need none: the top-k softmax scores sum to at least 1 / E.
_NORM_EPS = 1e-20


class RoutingPlan(NamedTuple):
    """Where every ``(token, slot)`` pair goes; produced by :func:`route`, consumed by permute/unpermute and experts.

    A pair is token ``t``'s ``s``-th choice; its flattened index is ``t * top_k + s``. ``T`` is the number of
    tokens, ``k`` is ``top_k`` and ``E`` is ``num_experts``. All tensors live on the device of the logits.

    Attributes:
        expert_ids: ``(T, k)`` int32, the top-k experts of each token by descending (biased) score.
        weights: ``(T, k)`` float32 combine weights from the unbiased scores, differentiable with respect to the
            logits; renormalised over the k choices when ``normalize`` was set. Dropped pairs keep their weight
            here (``unpermute`` ignores them).
        tokens_per_expert: ``(E,)`` int32, kept pairs per expert.
        offsets: ``(E + 1,)`` int32, exclusive prefix sums of ``tokens_per_expert``: expert ``e`` owns rows
            ``offsets[e]:offsets[e + 1]`` of the permuted activations.
        permutation: ``(T * k,)`` int32 flattened pair indices ordered by expert, ascending inside each expert;
            the first ``offsets[-1]`` entries are the kept pairs, the dropped pairs follow (grouped by expert,
            ascending inside each expert).
        kept: ``(T, k)`` bool, whether the pair survived the capacity limit (all true when dropless).
        num_dropped: 0-d int64 tensor, the number of dropped pairs (a tensor so that reading it is the caller's
            choice of sync).
        aux_loss: 0-d float32 Switch/GShard load-balancing loss ``E * sum_e f_e * P_e``; ``f_e`` is the fraction
            of all routed pairs (before the capacity limit, as in Switch) choosing ``e``, ``P_e`` the mean routing
            probability of ``e`` (sigmoid scores are first normalised over the experts of each token, as in
            DeepSeek-V3). Equals 1 for perfectly uniform routing; differentiable through ``P``.
        z_loss: 0-d float32 router z-loss, the mean over tokens of ``logsumexp(logits) ** 2``.
        nonfinite: 0-d bool tensor, whether any logit was NaN or infinite (``validate=False``); ``None`` when
            ``validate=True`` already raised for it. Check it with :meth:`check_finite` where the host reads
            device values anyway.
        capacity: per-expert capacity, or ``None`` when dropless.
        num_experts: ``E``.
        top_k: ``k``.

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

    def check_finite(self) -> None:
        """Raises :class:`RoutingError` if the logits had a NaN or infinite value (recorded by ``validate=False``).

        Call it where the host reads device values anyway (logging), never in the hot path.

        Example::

            plan.check_finite()
        """
        # NOTE: host sync (reads a device flag); a no-op when route() already validated eagerly.
        if self.nonfinite is not None and bool(self.nonfinite):
            raise RoutingError("router logits contain NaN or infinite values (recorded by route(validate=False))")


def _check_arguments(
    logits: Tensor,
    top_k: int,
    score: str,
    capacity_factor: float | None,
    drop_policy: str,
    expert_bias: Tensor | None,
) -> None:
    if not isinstance(logits, Tensor):
        raise RoutingError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise RoutingError(f"logits must be 2-D (num_tokens, num_experts), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise RoutingError(f"logits must be floating point, got {logits.dtype}")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or not 1 <= top_k <= num_experts:  # NumPy ints too
        raise RoutingError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if score not in SCORES:
        raise RoutingError(f"score must be one of {sorted(SCORES)}, got {score!r}")
    if drop_policy not in DROP_POLICIES:
        raise RoutingError(f"drop_policy must be one of {sorted(DROP_POLICIES)}, got {drop_policy!r}")
    if capacity_factor is not None:
        check_number("capacity_factor", capacity_factor, low=0, low_open=True, error=RoutingError)
    if expert_bias is not None:
        if not isinstance(expert_bias, Tensor) or tuple(expert_bias.shape) != (num_experts,):
            shape = tuple(expert_bias.shape) if isinstance(expert_bias, Tensor) else type(expert_bias).__name__
            raise RoutingError(f"expert_bias must have shape ({num_experts},) (num_experts), got {shape}")
        if not expert_bias.is_floating_point():
            raise RoutingError(f"expert_bias must be a floating-point tensor, got {expert_bias.dtype}")
        if expert_bias.device != logits.device:
            raise RoutingError(f"expert_bias is on {expert_bias.device} but logits are on {logits.device}")


def _nonfinite_flag(logits: Tensor) -> Tensor:
    """0-d bool: any NaN/inf in ``logits``, via the min and max (NaN propagates) rather than a ``(T, E)`` mask."""
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


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return x.cumsum(0) - x


def route(
    logits: Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = True,
    capacity_factor: float | None = None,
    drop_policy: str = "position",
    expert_bias: Tensor | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> RoutingPlan:
    """Routes every token to its top-k experts and builds the stable, grouped, sync-free dispatch plan.

    Args:
        logits: ``(num_tokens, num_experts)`` router logits (any float dtype; routing runs in float32).
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        score: ``"softmax"`` (over experts) or ``"sigmoid"`` (independent per expert, DeepSeek-V3 style).
        normalize: renormalise the k selected weights of each token to sum to one.
        capacity_factor: ``None`` for dropless routing; otherwise each expert keeps at most
            ``capacity = min(ceil(capacity_factor * num_tokens * top_k / num_experts), num_tokens * top_k)`` pairs.
        drop_policy: which overflow pairs are dropped: ``"position"`` drops later tokens first, ``"score"`` drops
            the lowest weights first (ties: later pairs first).
        expert_bias: optional ``(num_experts,)`` floating-point aux-loss-free balancing bias (DeepSeek-V3): added
            to the scores for the selection only; the weights come from the unbiased scores. Not differentiated.
        validate: check the logits (and ``expert_bias``) for NaN/inf eagerly and raise. This costs one host sync
            on an accelerator. With ``False`` only host-side checks run, the logits' finding is stored in
            ``plan.nonfinite`` and the bias values are not checked.
        backend: ``"auto"`` (the Triton kernels for CUDA logits, the PyTorch reference elsewhere), ``"torch"`` or
            ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).

    Returns:
        The :class:`RoutingPlan`.

    Raises:
        RoutingError: logits not a 2-D float tensor, ``top_k`` out of range, unknown ``score``/``drop_policy``/
            ``backend``, ``capacity_factor`` not a finite number > 0, ``expert_bias`` not a float tensor of shape
            ``(num_experts,)``, or (``validate=True``) non-finite logits or ``expert_bias``.

    Example::

        plan = route(torch.randn(6, 4), top_k=2, capacity_factor=1.0)
        plan.tokens_per_expert.sum() + plan.num_dropped  # == 12
    """
    _check_arguments(logits, top_k, score, capacity_factor, drop_policy, expert_bias)
    backend = resolve_backend(backend, logits.device)
    num_tokens, num_experts = logits.shape
    num_pairs = num_tokens * top_k
    device = logits.device

    if validate:
        # NOTE: host sync (one read of the device flags), documented: validate=True trades it for an eager error.
        nonfinite = None
        flag = _nonfinite_flag(logits)
        if expert_bias is not None:
            flag = flag | _nonfinite_flag(expert_bias)
        if bool(flag):
            # Error path only: which of the two, and where, costs more syncs, which no longer matter.
            if bool(_nonfinite_flag(logits)):
                _raise_nonfinite(logits)
            values = expert_bias.tolist()
            expert = next(e for e, v in enumerate(values) if not math.isfinite(v))
            raise RoutingError(f"expert_bias must be finite; found {values[expert]} at expert {expert}")
    else:
        nonfinite = _nonfinite_flag(logits)

    logits32 = logits.float()
    probs = logits32.softmax(dim=-1) if score == "softmax" else logits32.sigmoid()
    selection = probs.detach() if expert_bias is None else probs.detach() + expert_bias.detach().float()
    expert_ids = torch.topk(selection, top_k, dim=-1, sorted=True).indices  # (T, k) int64
    weights = probs.gather(1, expert_ids)
    if normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total if score == "softmax" else total + _NORM_EPS)

    # The one counting pass: pairs per expert and each pair's position in the expert-grouped stable order.
    flat_ids = expert_ids.reshape(-1)
    counts, dest, order = stable_counting_sort(flat_ids, num_experts, backend=backend, validate=False)
    if capacity_factor is None:
        capacity = None
        tokens_per_expert = counts
        kept = torch.ones(num_pairs, dtype=torch.bool, device=device)
        permutation = order
    else:
        # Capped at T * k (no expert can get more pairs): a huge factor must not overflow ceil() or the int64 clamp.
        capacity = capacity_factor * num_pairs / num_experts
        capacity = math.ceil(capacity) if capacity < num_pairs else num_pairs
        tokens_per_expert, kept, permutation = _apply_capacity(
            flat_ids, weights.detach().reshape(-1), counts, dest, capacity, drop_policy, backend
        )
    offsets = torch.nn.functional.pad(tokens_per_expert.cumsum(0), (1, 0))

    # Losses share the counts above. Means divide by host-side sizes (at least 1): empty batches give zero loss.
    router_probs = probs if score == "softmax" else probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    # E * sum_e (counts_e / (T * k)) * (sum_t p_te / T), with the scalar factors folded into one multiply.
    aux_scale = num_experts / (max(num_pairs, 1) * max(num_tokens, 1))
    aux_loss = torch.dot(counts.to(torch.float32), router_probs.sum(dim=0)) * aux_scale
    lse = torch.logsumexp(logits32, dim=-1)
    z_loss = torch.dot(lse, lse) / max(num_tokens, 1)

    return RoutingPlan(
        expert_ids=expert_ids.to(torch.int32),
        weights=weights,
        tokens_per_expert=tokens_per_expert.to(torch.int32),
        offsets=offsets.to(torch.int32),
        permutation=permutation.to(torch.int32),
        kept=kept.view(num_tokens, top_k),
        num_dropped=num_pairs - offsets[-1],
        aux_loss=aux_loss,
        z_loss=z_loss,
        nonfinite=nonfinite,
        capacity=capacity,
        num_experts=num_experts,
        top_k=top_k,
    )


def _apply_capacity(
    flat_ids: Tensor,
    flat_weights: Tensor,
    counts: Tensor,
    dest: Tensor,
    capacity: int,
    drop_policy: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Keeps at most ``capacity`` pairs per expert.

    Args:
        flat_ids: ``(T * k,)`` int64 expert of each pair.
        flat_weights: ``(T * k,)`` float32 weight of each pair (detached), for ``drop_policy="score"``.
        counts: ``(E,)`` int64 pairs per expert; ``dest``: ``(T * k,)`` int64 position in the grouped stable order.
        capacity: kept pairs per expert at most.
        drop_policy: ``"position"`` or ``"score"``.
        backend: resolved kernel backend.

    Returns:
        ``tokens_per_expert`` ``(E,)`` int64, ``kept`` ``(T * k,)`` bool and the permutation ``(T * k,)`` int64
        (kept pairs grouped by expert first, then the dropped ones, both stable).
    """
    num_experts = counts.numel()
    starts = _exclusive_cumsum(counts)
    # Whatever the policy, exactly min(count, capacity) pairs of each expert survive.
    tokens_per_expert = counts.clamp(max=capacity)
    if drop_policy == "position":
        # Rank inside the expert by flattened index: it falls out of the stable order.
        rank = dest - starts[flat_ids]
        kept = rank < capacity
        # Kept pairs keep their rank; dropped ones line up after all kept pairs, by expert, in the same order.
        dropped = counts - tokens_per_expert
        kept_start = _exclusive_cumsum(tokens_per_expert)[flat_ids]
        dropped_start = tokens_per_expert.sum() + _exclusive_cumsum(dropped)[flat_ids]
        position = torch.where(kept, kept_start + rank, dropped_start + rank - capacity)
        pairs = torch.arange(position.numel(), device=position.device)
        return tokens_per_expert, kept, torch.empty_like(position).scatter_(0, position, pairs)
    # Rank inside the expert by descending weight (ties by index): the same counting sort over the pairs visited
    # in descending-weight order.
    order = torch.sort(flat_weights, descending=True, stable=True).indices
    _, dest_by_weight, _ = stable_counting_sort(flat_ids[order], num_experts, backend=backend, validate=False)
    rank = torch.empty_like(dest).scatter_(0, order, dest_by_weight - starts[flat_ids[order]])
    kept = rank < capacity
    # Keys 0..E-1 for kept pairs and E..2E-1 for dropped ones: one more stable pass yields the final layout.
    _, _, permutation = stable_counting_sort(
        flat_ids + num_experts * (~kept).long(), 2 * num_experts, backend=backend, validate=False
    )
    return tokens_per_expert, kept, permutation


def update_expert_bias(expert_bias: Tensor, tokens_per_expert: Tensor, rate: float) -> Tensor:
    """Aux-loss-free load balancing (DeepSeek-V3): nudges each expert's bias toward the mean load, in place.

    ``bias += rate * sign(mean_load - load)``: overloaded experts get a lower selection bias, underloaded ones a
    higher one. When a process group is initialised, the counts are first summed across ranks with a
    non-blocking ``all_reduce`` (the update is queued behind it on the device; the host does not wait).

    Args:
        expert_bias: ``(E,)`` float bias passed to :func:`route`, updated in place (no autograd).
        tokens_per_expert: ``(E,)`` integer counts from ``RoutingPlan.tokens_per_expert`` (not modified).
        rate: update speed, ``>= 0`` (DeepSeek-V3 uses 1e-3).

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
    # copy=True: the all_reduce below works in place and the caller's counts must stay per-rank.
    load = tokens_per_expert.to(device=expert_bias.device, dtype=torch.float32, copy=True)
    if dist.is_available() and dist.is_initialized():
        # async_op: the host returns at once; wait() on a device work handle only orders the device streams.
        dist.all_reduce(load, op=dist.ReduceOp.SUM, async_op=True).wait()
    with torch.no_grad():
        expert_bias.add_(torch.sign(load.mean() - load).to(expert_bias.dtype), alpha=rate)
    return expert_bias
