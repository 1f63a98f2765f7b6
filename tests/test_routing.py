"""route(), RoutingPlan and update_expert_bias against an independent loop oracle (float64 for the floats)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.routing import RoutingPlan, route, update_expert_bias

EK = [(1, 1), (2, 1), (2, 2), (8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8), (160, 1), (160, 2), (160, 8)]
CAPACITY = [(None, "position"), (1.0, "position"), (0.7, "score")]


def distinct_logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """Random logits whose values in a row are distinct and well separated, so top-k has no ties to break."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1).float()
    return (ranks - num_experts / 2) * (6.0 / max(num_experts, 2)) + 0.01 * torch.rand(
        num_tokens, num_experts, generator=gen
    )


def oracle(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = True,
    capacity_factor: float | None = None,
    drop_policy: str = "position",
    expert_bias: torch.Tensor | None = None,
    drop_weights: torch.Tensor | None = None,
) -> dict:
    """Straightforward per-pair loops; floats in float64 (differentiable in ``logits`` if it requires grad).

    ``drop_weights`` (the float32 weights of the plan under test) rank pairs for ``drop_policy="score"``, so that
    rounding differences between float32 and float64 cannot reorder near-equal weights.
    """
    num_tokens, num_experts = logits.shape
    lg = logits.double()
    probs = lg.softmax(-1) if score == "softmax" else lg.sigmoid()
    # Selection from float32 scores like the router (the selection itself is not what is tested), by a sort.
    sel = logits.detach().float()
    sel = sel.softmax(-1) if score == "softmax" else sel.sigmoid()
    if expert_bias is not None:
        sel = sel + expert_bias.float()
    ids = torch.argsort(sel, dim=1, descending=True, stable=True)[:, :top_k]
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    pairs_of: list[list[int]] = [[] for _ in range(num_experts)]
    flat = ids.reshape(-1).tolist()
    for pair, e in enumerate(flat):
        pairs_of[e].append(pair)
    counts = [len(p) for p in pairs_of]
    kept_of, dropped_of = pairs_of, [[] for _ in range(num_experts)]
    capacity = None
    if capacity_factor is not None:
        # Exact: the factor is the decimal it prints as (0.2 * 30 / 6 is 1, whatever the float products round to).
        capacity = math.ceil(Fraction(str(capacity_factor)) * (num_tokens * top_k) / num_experts)
        capacity = min(capacity, num_tokens * top_k)  # documented cap: no expert can get more pairs
        kept_of, dropped_of = [], []
        w = (drop_weights if drop_weights is not None else weights).reshape(-1).tolist()
        for plist in pairs_of:
            if drop_policy == "position":
                keep = set(plist[:capacity])
            else:
                keep = set(sorted(plist, key=lambda p: (-w[p], p))[:capacity])
            kept_of.append([p for p in plist if p in keep])
            dropped_of.append([p for p in plist if p not in keep])
    tpe = [len(p) for p in kept_of]
    offsets = [0]
    for c in tpe:
        offsets.append(offsets[-1] + c)
    permutation = [p for plist in kept_of for p in plist] + [p for plist in dropped_of for p in plist]
    kept = [False] * len(flat)
    for plist in kept_of:
        for p in plist:
            kept[p] = True
    router_probs = probs if score == "softmax" else probs / (probs.sum(-1, keepdim=True) + 1e-20)
    frac = torch.tensor(counts, dtype=torch.float64) / max(len(flat), 1)
    aux = num_experts * (frac * router_probs.sum(0) / max(num_tokens, 1)).sum()
    z = torch.logsumexp(lg, -1).square().sum() / max(num_tokens, 1)
    return {
        "expert_ids": ids.int(),
        "weights": weights,
        "tokens_per_expert": torch.tensor(tpe, dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int32),
        "permutation": torch.tensor(permutation, dtype=torch.int32),
        "kept": torch.tensor(kept, dtype=torch.bool).view(num_tokens, top_k),
        "num_dropped": len(flat) - offsets[-1],
        "aux_loss": aux,
        "z_loss": z,
        "capacity": capacity,
    }


def assert_plan_matches(plan: RoutingPlan, ref: dict) -> None:
    for name in ("expert_ids", "tokens_per_expert", "offsets", "permutation", "kept"):
        got = getattr(plan, name)
        assert got.dtype == ref[name].dtype, name
        assert torch.equal(got, ref[name]), name
    assert int(plan.num_dropped) == ref["num_dropped"]
    assert plan.capacity == ref["capacity"]
    assert plan.weights.dtype == torch.float32
    torch.testing.assert_close(plan.weights.double(), ref["weights"].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.aux_loss.double(), ref["aux_loss"].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.z_loss.double(), ref["z_loss"].detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_experts", "top_k"), EK)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 1000, 4099])
@pytest.mark.parametrize(("capacity_factor", "drop_policy"), CAPACITY)
def test_route_matches_oracle(num_tokens, num_experts, top_k, capacity_factor, drop_policy):
    logits = distinct_logits(num_tokens, num_experts, seed=num_tokens * 1000 + num_experts * 10 + top_k)
    plan = route(logits, top_k, capacity_factor=capacity_factor, drop_policy=drop_policy, backend="torch")
    ref = oracle(logits, top_k, capacity_factor=capacity_factor, drop_policy=drop_policy, drop_weights=plan.weights)
    assert_plan_matches(plan, ref)
    assert plan.nonfinite is None
    assert plan.num_rows == (
        num_tokens * top_k if capacity_factor is None else min(num_tokens * top_k, num_experts * plan.capacity)
    )


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    num_experts=st.integers(1, 12),
    data=st.data(),
    score=st.sampled_from(["softmax", "sigmoid"]),
    normalize=st.booleans(),
    capacity_factor=st.one_of(st.none(), st.floats(0.05, 3.0)),
    drop_policy=st.sampled_from(["position", "score"]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_route_matches_oracle_random(
    num_tokens, num_experts, data, score, normalize, capacity_factor, drop_policy, with_bias, seed
):
    top_k = data.draw(st.integers(1, num_experts))
    logits = distinct_logits(num_tokens, num_experts, seed)
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(seed + 1)) if with_bias else None
    kwargs = dict(
        score=score, normalize=normalize, capacity_factor=capacity_factor, drop_policy=drop_policy, expert_bias=bias
    )
    plan = route(logits, top_k, validate=False, **kwargs)
    assert_plan_matches(plan, oracle(logits, top_k, drop_weights=plan.weights, **kwargs))
    assert not bool(plan.nonfinite)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_gradients_match_float64_oracle(score, capacity_factor):
    logits = distinct_logits(37, 8, seed=3).requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    coef = torch.randn(37, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    plan = route(logits, 3, score=score, capacity_factor=capacity_factor, drop_policy="score")
    ref = oracle(
        logits64, 3, score=score, capacity_factor=capacity_factor, drop_policy="score", drop_weights=plan.weights
    )
    (plan.weights.double() * coef).sum().add(plan.aux_loss).add(plan.z_loss).backward()
    (ref["weights"] * coef).sum().add(ref["aux_loss"]).add(ref["z_loss"]).backward()
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-4, atol=1e-6)


def test_expert_bias_steers_selection_but_not_weights():
    logits = distinct_logits(50, 6, seed=5)
    bias = torch.zeros(6)
    bias[4] = 100.0  # one expert gets everything
    plan = route(logits, 1, expert_bias=bias, capacity_factor=1.0)
    assert torch.equal(plan.expert_ids, torch.full((50, 1), 4, dtype=torch.int32))
    assert plan.weights.eq(1.0).all()  # renormalised over k = 1
    unnormalised = route(logits, 1, expert_bias=bias, normalize=False)
    torch.testing.assert_close(unnormalised.weights[:, 0], logits.softmax(-1)[:, 4])
    # capacity = ceil(1.0 * 50 / 6) = 9: the first 9 tokens are kept, the rest dropped (position policy)
    assert plan.capacity == 9
    assert plan.tokens_per_expert.tolist() == [0, 0, 0, 0, 9, 0]
    assert int(plan.num_dropped) == 41
    assert plan.kept[:9].all() and not plan.kept[9:].any()
    assert plan.permutation.tolist() == list(range(50))


def test_uniform_routing_has_unit_aux_loss():
    # Every expert chosen equally often with uniform probabilities: E * sum(1/E * 1/E) = 1.
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 1e-6  # break ties, keep the probabilities ~uniform
    plan = route(logits, 1)
    assert plan.tokens_per_expert.tolist() == [2, 2, 2, 2]
    torch.testing.assert_close(plan.aux_loss, torch.tensor(1.0))
    torch.testing.assert_close(plan.z_loss, torch.tensor(math.log(4) ** 2))


def test_deterministic_bitwise():
    logits = torch.randn(257, 16, generator=torch.Generator().manual_seed(6))
    outs = []
    for _ in range(2):
        lg = logits.clone().requires_grad_()
        plan = route(lg, 4, capacity_factor=0.9, drop_policy="score")
        (plan.weights.square().sum() + plan.aux_loss + plan.z_loss).backward()
        outs.append((plan, lg.grad))
    (p1, g1), (p2, g2) = outs
    for a, b in zip(p1, p2):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b
    assert torch.equal(g1, g2)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"capacity_factor": 1.0},
        {"capacity_factor": 0.5, "drop_policy": "score"},
        {"score": "sigmoid", "expert_bias": torch.zeros(16)},
    ],
)
def test_route_is_sync_free(options):
    logits = torch.randn(100, 16, requires_grad=True)
    with SyncCounter() as counter:
        plan = route(logits, 2, validate=False, **options)
        (plan.weights.sum() + plan.aux_loss + plan.z_loss).backward()
    assert counter.num_syncs == 0, counter.syncs
    # validate=True pays exactly the one documented sync
    with SyncCounter() as counter:
        route(logits, 2, validate=True, **options)
    assert counter.num_syncs == 1, counter.syncs


class _LargeIntTensors(TorchDispatchMode):
    """Records every integer/bool op output with at least ``limit`` elements."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            is_int = isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
            if is_int and t.numel() >= self.limit:
                self.seen.append((str(func), tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize(("capacity_factor", "drop_policy"), CAPACITY)
def test_no_tokens_by_experts_integer_tensors(capacity_factor, drop_policy):
    num_tokens, num_experts = 65536, 64
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))
    with _LargeIntTensors(num_tokens * num_experts) as mode:
        route(logits, 8, capacity_factor=capacity_factor, drop_policy=drop_policy, validate=False, backend="torch")
    assert mode.seen == []
    with mode:  # positive control: the mode does see a (T, E) mask where one is made
        torch.isfinite(logits)
    assert mode.seen


def test_nonfinite_recorded_without_sync_and_checked_later():
    logits = torch.randn(9, 4)
    logits[5, 2] = float("nan")
    plan = route(logits, 2, validate=False)
    assert bool(plan.nonfinite)
    with pytest.raises(RoutingError, match="NaN or infinite"):
        plan.check_finite()
    route(torch.randn(9, 4), 2, validate=False).check_finite()  # finite: no error
    route(torch.randn(9, 4), 2).check_finite()  # validated eagerly: nothing recorded


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_logits_raise_eagerly(bad):
    logits = torch.randn(9, 4)
    logits[5, 2] = bad
    with pytest.raises(RoutingError, match=r"finite.*token 5, expert 2"):
        route(logits, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 5}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"capacity_factor": float("inf")}, "capacity_factor"),
        ({"expert_bias": torch.zeros(5)}, "expert_bias"),
        ({"expert_bias": torch.zeros(4, 1)}, "expert_bias"),
        ({"expert_bias": torch.zeros(4, dtype=torch.bool)}, "expert_bias must be a floating-point tensor"),
        ({"expert_bias": torch.zeros(4, dtype=torch.int64)}, "expert_bias must be a floating-point tensor"),
        ({"expert_bias": [0.0] * 4}, "expert_bias must have shape"),
        ({"expert_bias": torch.tensor([float("nan"), 0, 0, 0])}, r"expert_bias must be finite; found nan at expert 0"),
        (
            {"expert_bias": torch.tensor([0, 0, float("-inf"), 0])},
            r"expert_bias must be finite; found -inf at expert 2",
        ),
        ({"capacity_factor": float("nan")}, "capacity_factor"),
        ({"capacity_factor": True}, "capacity_factor"),
        ({"capacity_factor": "1.0"}, "capacity_factor"),
        ({"top_k": True}, "top_k"),
        ({"score": "tanh"}, "score"),
        ({"drop_policy": "random"}, "drop_policy"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    kwargs = {"top_k": 2, **kwargs}
    with pytest.raises(RoutingError, match=match):
        route(torch.randn(6, 4), **kwargs)


@pytest.mark.parametrize("logits", [torch.randn(6), torch.randn(2, 3, 4), torch.randint(0, 3, (6, 4)), [[0.0, 1.0]]])
def test_bad_logits_raise(logits):
    with pytest.raises(RoutingError, match="logits"):
        route(logits, 1)
    assert issubclass(RoutingError, ValueError)


@pytest.mark.parametrize("capacity_factor", [4.0, 1e300, 1e308, 1.7e308])
@pytest.mark.parametrize("drop_policy", ["position", "score"])
def test_huge_capacity_factor_is_capped_at_the_pair_count(capacity_factor, drop_policy):
    logits = distinct_logits(5, 4, seed=3)
    plan = route(logits, 2, capacity_factor=capacity_factor, drop_policy=drop_policy)
    dropless = route(logits, 2)
    assert plan.capacity == 10  # T * k
    assert int(plan.num_dropped) == 0 and plan.kept.all()
    for name in ("expert_ids", "tokens_per_expert", "offsets", "permutation"):
        assert torch.equal(getattr(plan, name), getattr(dropless, name)), name


def test_nonfinite_expert_bias_is_not_checked_without_validate():
    bias = torch.tensor([float("nan"), 0.0, 0.0, 0.0])
    plan = route(torch.randn(3, 4), 1, expert_bias=bias, validate=False)  # the hot path reads no values
    assert not bool(plan.nonfinite)  # the flag is about the logits


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(4), torch.zeros(4), None), "rate must be a finite number >= 0, got None"),
        ((torch.zeros(4), torch.zeros(4), "1"), "rate must be a finite number >= 0, got '1'"),
        ((torch.zeros(4), torch.zeros(4), float("inf")), "rate must be a finite number >= 0, got inf"),
        ((torch.zeros(4), torch.zeros(4), True), "rate must be a finite number >= 0, got True"),
        ((torch.zeros(4), [1, 2, 3, 4], 0.1), "tokens_per_expert must be a torch.Tensor, got list"),
        (([0.0] * 4, torch.zeros(4), 0.1), "expert_bias must be a torch.Tensor, got list"),
        ((torch.zeros(4, dtype=torch.long), torch.tensor([1, 2, 3, 4]), 0.1), "expert_bias must be a floating"),
        ((torch.zeros(4), torch.ones(4, dtype=torch.bool), 0.1), "tokens_per_expert must be a real count"),
    ],
)
def test_update_expert_bias_rejects_bad_arguments(args, match):
    bias = args[0]
    before = bias.clone() if isinstance(bias, torch.Tensor) else None
    with pytest.raises(RoutingError, match=match):
        update_expert_bias(*args)
    if before is not None:
        assert torch.equal(bias, before)  # not touched


def test_update_expert_bias_sign_rule_in_place():
    bias = torch.zeros(4)
    counts = torch.tensor([10, 2, 4, 4], dtype=torch.int32)  # mean 5
    out = update_expert_bias(bias, counts, rate=0.1)
    assert out is bias
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert counts.tolist() == [10, 2, 4, 4]
    update_expert_bias(bias, torch.tensor([5, 5, 5, 5]), rate=0.1)  # balanced: unchanged
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    with pytest.raises(RoutingError, match="shape"):
        update_expert_bias(bias, torch.tensor([1, 2, 3]), rate=0.1)
    with pytest.raises(RoutingError, match="rate"):
        update_expert_bias(bias, counts, rate=-1.0)


def test_update_expert_bias_all_reduces_without_blocking(tmp_path, monkeypatch):
    calls = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(kwargs.get("async_op"))
        tensor.mul_(3)  # pretend three ranks reported the same counts
        return real(tensor, *args, **kwargs)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_reduce", spy)
        counts = torch.tensor([1, 5, 3])
        bias = torch.zeros(3)
        update_expert_bias(bias, counts, rate=0.5)
    finally:
        dist.destroy_process_group()
    assert calls == [True]
    assert counts.tolist() == [1, 5, 3]  # the caller's counts are not reduced in place
    torch.testing.assert_close(bias, torch.tensor([0.5, -0.5, 0.0]))


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(0, 4, 2), (1, 1, 1), (7, 8, 2), (1000, 64, 8)])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_agrees_with_naive_router(num_tokens, num_experts, top_k, score):
    from lightning_llmfast.moe.naive import router_losses, router_scores

    logits = distinct_logits(num_tokens, num_experts, seed=num_tokens + top_k).requires_grad_()
    plan = route(logits, top_k, score=score)
    scores = router_scores(logits, score)
    top_w, top_i = scores.topk(top_k, dim=-1)
    counts = torch.bincount(top_i.flatten(), minlength=num_experts)
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    aux, z = router_losses(logits, probs, counts, top_k)
    assert torch.equal(plan.expert_ids, top_i.int())
    assert torch.equal(plan.tokens_per_expert, counts.int())
    torch.testing.assert_close(plan.weights, top_w / top_w.sum(dim=-1, keepdim=True))
    torch.testing.assert_close(plan.aux_loss, aux)
    torch.testing.assert_close(plan.z_loss, z)
    grads = torch.autograd.grad(plan.aux_loss + plan.z_loss + plan.weights.square().sum(), logits)
    naive_weights = top_w / top_w.sum(dim=-1, keepdim=True)
    expected = torch.autograd.grad(aux + z + naive_weights.square().sum(), logits)
    torch.testing.assert_close(grads[0], expected[0])
