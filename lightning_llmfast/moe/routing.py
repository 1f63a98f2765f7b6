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
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from lightning_llmfast._checks import check_number
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.balance import update_expert_bias
from lightning_llmfast.moe.kernels import resolve_backend, stable_counting_sort
from lightning_llmfast.moe.losses import balance_loss, sequence_balance_loss, z_loss
from lightning_llmfast.moe.selection import apply_capacity, check_groups, expert_capacity, select_experts

if TYPE_CHECKING:
    from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["DROP_POLICIES", "SCORES", "RoutingPlan", "route", "update_expert_bias"]

SCORES: frozenset[str] = frozenset({"softmax", "sigmoid"})
DROP_POLICIES: frozenset[str] = frozenset({"position", "score"})

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
            ``validate=True`` already raised for it. Check it with :meth:`check_finite` where the host reads
            device values anyway.
        capacity: per-expert capacity, or ``None`` when dropless.
        num_experts: ``E``.
        top_k: ``k``.
        routed_per_expert: ``(E,)`` int32, valid pairs per expert before the capacity limit (what the balance
            losses and the expert-bias update count).
        router_probs: ``(T, E)`` float32 normalised routing probabilities ``P`` is the mean of, differentiable.
        token_mask: ``(T,)`` bool, or ``None`` (every token valid).

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

    def sequence_aux_loss(self, metadata: SequenceMetadata) -> Tensor:
        """DeepSeek-V3's sequence-wise balance loss over the packed documents of ``metadata``, sync-free.

        Per document ``d`` of ``L_d`` valid tokens, ``sum_e f_e * P_e`` with ``f_e = E / (k * L_d) * (tokens of d
        selecting e)`` and ``P_e`` the mean of ``router_probs[:, e]`` over them; the mean over the documents with a
        valid token (1 for uniform routing). Selections are counted before the capacity limit.

        Args:
            metadata: :class:`~lightning_llmfast.seqmeta.SequenceMetadata` of the ``T`` routed tokens.

        Returns:
            0-d float32, differentiable through ``router_probs``.

        Raises:
            RoutingError: ``metadata`` is not a ``SequenceMetadata`` of ``T`` tokens.

        Example::

            loss = plan.sequence_aux_loss(SequenceMetadata.from_lengths([3, 5]))
        """
        return sequence_balance_loss(self.router_probs, self.expert_ids, self.token_mask, metadata)

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


def _check_extras(
    logits: Tensor,
    route_scale: float,
    capacity_factor: float | None,
    min_capacity: int | None,
    token_mask: Tensor | None,
) -> None:
    check_number("route_scale", route_scale, low=0, low_open=True, error=RoutingError)
    if min_capacity is not None and capacity_factor is None:
        raise RoutingError("min_capacity needs a capacity_factor (dropless routing has no capacity)")
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or token_mask.dtype != torch.bool:
            got = token_mask.dtype if isinstance(token_mask, Tensor) else type(token_mask).__name__
            raise RoutingError(f"token_mask must be a bool tensor, got {got}")
        if tuple(token_mask.shape) != (logits.shape[0],):
            raise RoutingError(
                f"token_mask must have shape (num_tokens={logits.shape[0]},), got {tuple(token_mask.shape)}"
            )
        if token_mask.device != logits.device:
            raise RoutingError(f"token_mask is on {token_mask.device} but logits are on {logits.device}")


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
    num_groups: int | None = None,
    topk_groups: int | None = None,
    group_topk: int | None = None,
    route_scale: float = 1.0,
    min_capacity: int | None = None,
    token_mask: Tensor | None = None,
) -> RoutingPlan:
    """Routes every token to its top-k experts and builds the stable, grouped, sync-free dispatch plan.

    Args:
        logits: ``(num_tokens, num_experts)`` router logits (any float dtype; routing runs in float32).
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        score: ``"softmax"`` (over experts) or ``"sigmoid"`` (independent per expert, DeepSeek-V3 style).
        normalize: renormalise the k selected weights of each token to sum to one.
        capacity_factor: ``None`` for dropless routing; otherwise each expert keeps at most ``capacity =
            min(max(ceil(capacity_factor * num_tokens * top_k / num_experts), min_capacity), num_tokens * top_k)``
            pairs, in exact arithmetic (:func:`~lightning_llmfast.moe.selection.expert_capacity`; a float factor
            counts as the decimal it prints as). ``num_tokens`` counts masked tokens too (a host-side size).
        drop_policy: which overflow pairs are dropped: ``"position"`` drops later tokens first, ``"score"`` drops
            the lowest weights first (ties: later pairs first).
        expert_bias: optional ``(num_experts,)`` floating-point aux-loss-free balancing bias (DeepSeek-V3): added
            to the scores for the selection only; the weights come from the unbiased scores. Not differentiated.
        validate: check the logits (and ``expert_bias``) for NaN/inf eagerly and raise. This costs one host sync
            on an accelerator. With ``False`` only host-side checks run, the logits' finding is stored in
            ``plan.nonfinite`` and the bias values are not checked.
        backend: ``"auto"`` (the Triton kernels for CUDA logits, the PyTorch reference elsewhere), ``"torch"`` or
            ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
        num_groups: group-limited routing (DeepSeek-V3): the experts form ``num_groups`` equal groups of
            consecutive experts; ``None`` (with ``topk_groups``) for plain top-k.
        topk_groups: groups each token may route to, chosen by the sum of their ``group_topk`` best (biased)
            selection scores.
        group_topk: scores summed per group; default ``max(1, top_k // topk_groups)`` (the DeepSeek-V3 paper).
        route_scale: factor applied to the weights after the normalisation (DeepSeek-V3's routed scaling factor).
        min_capacity: floor of the capacity (needs ``capacity_factor``).
        token_mask: ``(num_tokens,)`` bool; False tokens (padding) are routed nowhere and count in no loss,
            count or metric.

    Returns:
        The :class:`RoutingPlan`.

    Raises:
        RoutingError: logits not a 2-D float tensor, ``top_k`` out of range, unknown ``score``/``drop_policy``/
            ``backend``, ``capacity_factor`` not a finite number > 0, ``expert_bias`` not a float tensor of shape
            ``(num_experts,)``, bad group options, ``route_scale`` not a finite number > 0, ``min_capacity``
            without ``capacity_factor`` or not an int >= 0, ``token_mask`` not a ``(num_tokens,)`` bool tensor on
            the logits' device, or (``validate=True``) non-finite logits or ``expert_bias``.

    Example::

        plan = route(torch.randn(6, 4), top_k=2, capacity_factor=1.0)
        plan.tokens_per_expert.sum() + plan.num_dropped  # == 12
    """
    _check_arguments(logits, top_k, score, capacity_factor, drop_policy, expert_bias)
    _check_extras(logits, route_scale, capacity_factor, min_capacity, token_mask)
    check_groups(logits.shape[1], top_k, num_groups, topk_groups, group_topk)
    backend = resolve_backend(backend, logits.device)
    num_tokens, num_experts = logits.shape
    num_pairs = num_tokens * top_k
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(capacity_factor, num_pairs, num_experts, min_capacity)
    logits32 = logits.float()
    if token_mask is not None:
        # Masked tokens (padding) may hold anything: zeroed first, they reach no NaN check, loss or gradient.
        logits32 = logits32.masked_fill(~token_mask.unsqueeze(1), 0.0)
    nonfinite = _check_finite(logits32, expert_bias) if validate else _nonfinite_flag(logits32)

    probs = logits32.softmax(dim=-1) if score == "softmax" else logits32.sigmoid()
    selection = probs.detach() if expert_bias is None else probs.detach() + expert_bias.detach().float()
    expert_ids = select_experts(
        selection, top_k, num_groups=num_groups, topk_groups=topk_groups, group_topk=group_topk
    )  # (T, k) int64
    weights = probs.gather(1, expert_ids)
    if normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total if score == "softmax" else total + _NORM_EPS)
    if route_scale != 1.0:
        weights = weights * route_scale

    # The one counting pass: pairs per key and each pair's position in the key-grouped stable order. Masked
    # tokens' pairs get the extra key E: they sort after every expert's pairs and are never kept.
    keys = expert_ids.reshape(-1)
    num_bins = num_experts
    if token_mask is not None:
        keys = torch.where(token_mask.repeat_interleave(top_k), keys, num_experts)
        num_bins += 1
    counts, dest, order = stable_counting_sort(keys, num_bins, backend=backend, validate=False)
    routed = counts[:num_experts]
    if capacity is None:
        tokens_per_expert, kept, permutation = routed, keys < num_experts, order
    else:
        tokens_per_expert, kept, permutation = apply_capacity(
            keys, weights.detach().reshape(-1), counts, dest, capacity, num_experts, drop_policy, backend
        )
    offsets = torch.nn.functional.pad(tokens_per_expert.cumsum(0), (1, 0))

    # Losses share the counts above.
    router_probs = probs if score == "softmax" else probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    valid_pairs = num_pairs if token_mask is None else routed.sum()
    return RoutingPlan(
        expert_ids=expert_ids.to(torch.int32),
        weights=weights,
        tokens_per_expert=tokens_per_expert.to(torch.int32),
        offsets=offsets.to(torch.int32),
        permutation=permutation.to(torch.int32),
        kept=kept.view(num_tokens, top_k),
        num_dropped=valid_pairs - offsets[-1],
        aux_loss=balance_loss(routed, router_probs, token_mask),
        z_loss=z_loss(logits32, token_mask),
        nonfinite=nonfinite,
        capacity=capacity,
        num_experts=num_experts,
        top_k=top_k,
        routed_per_expert=routed.to(torch.int32),
        router_probs=router_probs,
        token_mask=token_mask,
    )


def _check_finite(logits: Tensor, expert_bias: Tensor | None) -> None:
    """``validate=True``: raise for NaN/inf logits or bias values."""
    # NOTE: host sync (one read of the device flags), documented: validate=True trades it for an eager error.
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
