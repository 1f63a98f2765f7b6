"""route()'s conventions for today's MoE models against float64 loops written here from the published formulas.

- exact capacity ``ceil(cf * T * k / E)`` (``fractions.Fraction``), ``min_capacity``;
- DeepSeek-V3 group-limited routing (groups by the sum of their best ``K_r / M`` scores), ``route_scale``;
- the token mask (masked tokens routed nowhere, in no loss or count);
- Switch aux loss, DeepSeek-V3 sequence-wise balance loss, z-loss, all over the valid tokens;
- Triton and reference paths equal.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.losses import SequenceBoundaries
from lightning_llmfast.moe.routing import route
from lightning_llmfast.moe.selection import expert_capacity


def _logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    return 2.0 * torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))


def _oracle_route(
    logits: torch.Tensor,
    top_k: int,
    score: str,
    bias: torch.Tensor | None,
    groups: tuple[int, int] | None,
    route_scale: float,
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Per-token loops in float64: expert ids (best first), weights, and the normalised probabilities ``p'``."""
    lg = logits.double()
    probs = lg.softmax(-1) if score == "softmax" else lg.sigmoid()
    num_tokens, num_experts = probs.shape
    ids, weights = [], []
    for t in range(num_tokens):
        sel = [float(probs[t, e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(num_experts)]
        allowed = list(range(num_experts))
        if groups is not None:
            num_groups, topk_groups = groups
            size = num_experts // num_groups
            per_group = min(max(1, top_k // topk_groups), size)  # "the highest K_r / M affinity scores"
            group_score = [
                sum(sorted(sel[g * size : (g + 1) * size], reverse=True)[:per_group]) for g in range(num_groups)
            ]
            best = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -sel[e])[:top_k]
        w = [float(probs[t, e]) for e in chosen]
        total = sum(w) + (1e-20 if score == "sigmoid" else 0.0)
        ids.append(chosen)
        weights.append([route_scale * v / total for v in w])
    normalised = probs if score == "softmax" else probs / probs.sum(-1, keepdim=True)
    return ids, weights, normalised


def _same_selection(
    plan_ids: torch.Tensor, plan_w: torch.Tensor, ids: list[list[int]], weights: list[list[float]]
) -> None:
    for t, (chosen, w) in enumerate(zip(ids, weights)):
        got = dict(zip(plan_ids[t].tolist(), plan_w[t].double().tolist()))
        assert sorted(got) == sorted(chosen), (t, got, chosen)
        for e, v in zip(chosen, w):
            assert math.isclose(got[e], v, rel_tol=1e-5, abs_tol=1e-7), (t, e)


# ---------------------------------------------------------------------------------------------------------------
# capacity


def test_capacity_is_exact_against_fractions() -> None:
    assert route(torch.zeros(25, 5), 2, capacity_factor=1.1).capacity == 11
    factors = [0.05 * i for i in range(1, 61)] + [1.1, 1.25, 1.3, 0.7, 2.2, 1e-3, 7]
    mismatched = 0
    for num_pairs in range(0, 61):
        for num_experts in range(1, 13):
            for cf in factors:
                expected = min(math.ceil(Fraction(str(cf)) * num_pairs / num_experts), num_pairs)
                got = expert_capacity(cf, num_pairs, num_experts)
                assert got == expected, (cf, num_pairs, num_experts)
                mismatched += got != min(math.ceil(cf * num_pairs / num_experts), num_pairs)
    assert mismatched > 0  # the float formula is off somewhere in this grid: the test can tell the two apart
    assert expert_capacity(Fraction(1, 3), 9, 1) == 3
    assert expert_capacity(0.1, 10, 5, min_capacity=4) == 4  # the floor
    assert expert_capacity(0.1, 3, 5, min_capacity=4) == 3  # still at most T * k
    assert expert_capacity(1e300, 7, 3) == 7


def test_min_capacity_floors_the_plan() -> None:
    plan = route(_logits(8, 4, 0), 1, capacity_factor=0.25, min_capacity=3)
    assert plan.capacity == 3
    assert bool((plan.tokens_per_expert <= 3).all())
    with pytest.raises(RoutingError, match="min_capacity needs a capacity_factor"):
        route(_logits(8, 4, 0), 1, min_capacity=3)
    with pytest.raises(RoutingError, match="min_capacity must be an int >= 0"):
        route(_logits(8, 4, 0), 1, capacity_factor=1.0, min_capacity=-1)


# ---------------------------------------------------------------------------------------------------------------
# group-limited routing, route_scale


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "groups", "score"),
    [
        (1, 8, 2, (4, 2), "sigmoid"),  # T=1
        (13, 8, 2, (4, 2), "sigmoid"),  # prime T, DeepSeek-V3's shape in small
        (11, 16, 4, (8, 3), "softmax"),
        (7, 6, 2, (6, 2), "sigmoid"),  # groups of one
        (5, 6, 6, (2, 2), "softmax"),  # k = E
        (9, 8, 3, (2, 1), "sigmoid"),  # k < group size, one group
        (3, 1, 1, (1, 1), "sigmoid"),  # E = 1
        (17, 12, 4, (3, 1), "softmax"),  # k = group size: the best group only
    ],
)
def test_group_limited_routing_matches_the_paper(
    kernel_backend: str, num_tokens: int, num_experts: int, top_k: int, groups: tuple[int, int], score: str
) -> None:
    logits = _logits(num_tokens, num_experts, seed=num_tokens * 31 + num_experts)
    bias = 0.1 * torch.randn(num_experts, generator=torch.Generator().manual_seed(1))
    plan = route(
        logits,
        top_k,
        score=score,
        expert_bias=bias,
        num_groups=groups[0],
        topk_groups=groups[1],
        route_scale=2.5,
        backend=kernel_backend,
    )
    ids, weights, _ = _oracle_route(logits, top_k, score, bias, groups, 2.5)
    _same_selection(plan.expert_ids, plan.weights, ids, weights)
    counts = torch.zeros(num_experts, dtype=torch.int32)
    for chosen in ids:
        counts[chosen] += 1
    assert torch.equal(plan.tokens_per_expert, counts)


def test_group_limits_really_bind() -> None:
    # Expert 0 is the best single expert, but its group's second expert is the worst: by the sum of the two best
    # scores the other group wins, and expert 0 must not be picked.
    logits = torch.tensor([[3.0, -9.0, 2.0, 2.0]])
    plan = route(logits, 2, score="sigmoid", num_groups=2, topk_groups=1, group_topk=2)
    assert sorted(plan.expert_ids[0].tolist()) == [2, 3]
    assert sorted(route(logits, 2, score="sigmoid").expert_ids[0].tolist()) == [0, 2]


def test_ties_pick_a_valid_top_k_on_both_backends(kernel_backend: str) -> None:
    logits = torch.zeros(6, 8)  # every score tied
    logits[:, 5] = 1.0
    plan = route(logits, 3, score="sigmoid", num_groups=4, topk_groups=2, backend=kernel_backend)
    sel = logits.sigmoid()
    for t in range(6):
        chosen = plan.expert_ids[t].tolist()
        assert 5 in chosen and len(set(chosen)) == 3
        assert len({e // 2 for e in chosen}) <= 2  # within two groups
    assert torch.equal(plan.tokens_per_expert.sum(), torch.tensor(18, dtype=torch.int32))
    torch.testing.assert_close(plan.weights.sum(1), torch.ones(6))
    assert bool((sel.gather(1, plan.expert_ids.long()) >= 0.5).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_groups": 4}, "num_groups and topk_groups go together"),
        ({"num_groups": 3, "topk_groups": 1}, "num_groups=3 must divide num_experts=8"),
        ({"num_groups": 4, "topk_groups": 5}, "topk_groups must be an int >= 1 and <= 4"),
        ({"num_groups": 8, "topk_groups": 1}, "hold fewer than top_k=2 experts"),
        ({"num_groups": 4, "topk_groups": 2, "group_topk": 3}, "group_topk must be an int >= 1 and <= 2"),
        ({"group_topk": 1}, "group_topk needs num_groups"),
        ({"route_scale": 0.0}, "route_scale must be a finite number > 0"),
        ({"token_mask": torch.ones(5, dtype=torch.bool)}, r"token_mask must have shape \(num_tokens=4,\)"),
        ({"token_mask": torch.ones(4)}, "token_mask must be a bool tensor"),
    ],
)
def test_bad_group_mask_and_scale_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        route(_logits(4, 8, 0), 2, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# token mask and losses


def _oracle_losses(
    logits: torch.Tensor, ids: list[list[int]], normalised: torch.Tensor, mask: list[bool], top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch aux loss ``E * sum_e f_e P_e`` and z-loss over the valid tokens (float64, differentiable)."""
    num_experts = logits.shape[1]
    valid = [t for t, m in enumerate(mask) if m]
    n = max(len(valid), 1)
    aux = logits.new_zeros((), dtype=torch.float64)
    for e in range(num_experts):
        f = sum(ids[t].count(e) for t in valid) / (n * top_k)
        aux = aux + f * sum((normalised[t, e] for t in valid), torch.zeros((), dtype=torch.float64)) / n
    z = sum((torch.logsumexp(logits[t].double(), 0) ** 2 for t in valid), torch.zeros((), dtype=torch.float64)) / n
    return num_experts * aux, z


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "valid"),
    [(11, 6, 2, "random"), (7, 4, 4, "one"), (5, 1, 1, "random"), (1, 3, 2, "one"), (6, 5, 2, "none")],
)
def test_token_mask_routes_nowhere_and_counts_nowhere(
    kernel_backend: str, num_tokens: int, num_experts: int, top_k: int, valid: str
) -> None:
    logits = _logits(num_tokens, num_experts, seed=num_tokens + 7).requires_grad_()
    gen = torch.Generator().manual_seed(num_tokens)
    mask = {
        "random": torch.rand(num_tokens, generator=gen) < 0.6,
        "one": torch.arange(num_tokens) == num_tokens // 2,  # all tokens masked but one
        "none": torch.zeros(num_tokens, dtype=torch.bool),
    }[valid]
    with torch.no_grad():
        logits[~mask] = float("nan")  # padding garbage must not leak into any loss
    for capacity_factor in (None, 1.0):
        plan = route(
            logits,
            top_k,
            score="sigmoid",
            capacity_factor=capacity_factor,
            token_mask=mask,
            validate=False,
            backend=kernel_backend,
        )
        ids, _, _ = _oracle_route(logits.detach(), top_k, "sigmoid", None, None, 1.0)
        scores = logits.double().sigmoid()
        normalised = scores / scores.sum(-1, keepdim=True)
        assert not bool(plan.kept[~mask].any())
        routed = torch.zeros(num_experts, dtype=torch.int32)
        for t in torch.nonzero(mask).flatten().tolist():
            routed[ids[t]] += 1
        assert torch.equal(plan.routed_per_expert, routed)
        assert int(plan.tokens_per_expert.sum() + plan.num_dropped) == int(mask.sum()) * top_k
        kept_pairs = set(plan.permutation[: int(plan.offsets[-1])].tolist())
        assert all(mask[p // top_k] for p in kept_pairs)
        aux, z = _oracle_losses(logits, ids, normalised, mask.tolist(), top_k)
        torch.testing.assert_close(plan.aux_loss.double(), aux, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plan.z_loss.double(), z, rtol=1e-5, atol=1e-6)
        (got,) = torch.autograd.grad(plan.aux_loss + plan.z_loss, logits)
        want = torch.zeros_like(logits)  # no valid token: the oracle's losses are constant zeros
        if (aux + z).requires_grad:
            (want,) = torch.autograd.grad(aux + z, logits)
            want = want.nan_to_num(0.0)  # the NaN padding rows get 0 from route (and no term in the oracle)
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
        assert bool(torch.isfinite(got).all())


def _oracle_sequence_loss(
    ids: list[list[int]], normalised: torch.Tensor, lengths: list[int], mask: list[bool], top_k: int
) -> torch.Tensor:
    """DeepSeek-V3 (eq. 17-20): per sequence ``sum_i f_i P_i``, ``f_i = N_r / (K_r T) * sum_t 1[i in topk_t]``,
    ``P_i = 1 / T * sum_t s'_it``, over its valid tokens; the mean over sequences with a valid token."""
    num_experts = normalised.shape[1]
    losses, start = [], 0
    for length in lengths:
        tokens = [t for t in range(start, start + length) if mask[t]]
        start += length
        if not tokens:
            continue
        n = len(tokens)
        loss = torch.zeros((), dtype=torch.float64)
        for e in range(num_experts):
            f = num_experts / (top_k * n) * sum(ids[t].count(e) for t in tokens)
            loss = loss + f * sum(normalised[t, e] for t in tokens) / n
        losses.append(loss)
    return torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float64)


@pytest.mark.parametrize(
    ("lengths", "num_experts", "top_k", "case"),
    [
        ([1, 4, 0, 6], 6, 2, "random_mask"),  # an empty document, T = 11 (prime)
        ([5, 3, 5], 4, 4, "doc_masked"),  # k = E; the middle document entirely masked
        ([7], 1, 1, "none"),  # E = 1: the loss is exactly 1
        ([1], 5, 2, "none"),  # T = 1
        ([3, 3, 3, 2], 5, 1, "one_expert"),  # one expert receives everything
    ],
)
def test_sequence_aux_loss_matches_deepseek_v3(lengths: list[int], num_experts: int, top_k: int, case: str) -> None:
    num_tokens = sum(lengths)
    logits = _logits(num_tokens, num_experts, seed=num_tokens).requires_grad_()
    mask = torch.ones(num_tokens, dtype=torch.bool)
    if case == "random_mask":
        mask = torch.rand(num_tokens, generator=torch.Generator().manual_seed(3)) < 0.7
        mask[0] = True
    elif case == "doc_masked":
        mask[5:8] = False
    bias = torch.zeros(num_experts)
    if case == "one_expert":
        bias[2] = 100.0
    plan = route(logits, top_k, score="sigmoid", expert_bias=bias, token_mask=mask, capacity_factor=1.0)
    documents = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))
    loss = plan.sequence_aux_loss(SequenceBoundaries(documents, len(lengths)))
    ids, _, _ = _oracle_route(logits.detach(), top_k, "sigmoid", bias, None, 1.0)
    normalised = logits.double().sigmoid() / logits.double().sigmoid().sum(-1, keepdim=True)
    want = _oracle_sequence_loss(ids, normalised, lengths, mask.tolist(), top_k)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    if num_experts == 1:
        assert float(loss.detach()) == pytest.approx(1.0)
    (got,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-4, atol=1e-7)


def test_sequence_aux_loss_rejects_foreign_boundaries() -> None:
    plan = route(_logits(6, 4, 0), 2)
    with pytest.raises(
        RoutingError, match=r"must be a \(6,\) integer tensor \(one per token\), got torch.int64 of shape \(5,\)"
    ):
        plan.sequence_aux_loss(SequenceBoundaries(torch.tensor([0, 0, 1, 1, 1]), 2))
    with pytest.raises(RoutingError, match="integer tensor"):
        plan.sequence_aux_loss(SequenceBoundaries(torch.zeros(6), 1))
    with pytest.raises(RoutingError, match="boundaries must be SequenceBoundaries"):
        plan.sequence_aux_loss([6])


def test_triton_and_reference_plans_are_equal() -> None:
    from lightning_llmfast.moe.kernels import triton_available

    if not triton_available(torch.device("cpu")):
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 on CPU")
    logits = _logits(131, 16, seed=5)  # more pairs than one counting block
    mask = torch.rand(131, generator=torch.Generator().manual_seed(2)) < 0.8
    for policy in ("position", "score"):
        kwargs = dict(
            score="sigmoid",
            num_groups=4,
            topk_groups=2,
            route_scale=1.5,
            capacity_factor=0.9,
            min_capacity=2,
            drop_policy=policy,
            token_mask=mask,
        )
        ref, tri = route(logits, 4, backend="torch", **kwargs), route(logits, 4, backend="triton", **kwargs)
        # A masked token's scores are all equal (its logits count as 0): its experts are ties, in any order.
        assert torch.equal(ref.expert_ids[mask], tri.expert_ids[mask])
        for name in (
            "tokens_per_expert",
            "offsets",
            "permutation",
            "kept",
            "num_dropped",
            "routed_per_expert",
        ):
            assert torch.equal(getattr(ref, name), getattr(tri, name)), name
        # The fused router kernel (position policy) renormalises in its own order: equal to rounding.
        torch.testing.assert_close(ref.weights, tri.weights, rtol=1e-6, atol=1e-7)
