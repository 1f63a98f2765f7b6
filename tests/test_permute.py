"""permute/unpermute: loop oracles in float64, gradcheck, zero syncs, bitwise determinism, bad shapes."""

from __future__ import annotations

import pytest
import torch

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.routing import RoutingPlan, route
from lightning_llmfast.moe.token_rows import permute, plan_indices, unpermute

SHAPES = [(0, 4, 2), (1, 1, 1), (7, 3, 3), (13, 8, 2), (31, 5, 1), (97, 16, 4)]
CAPACITY = [(None, "position"), (1.0, "position"), (0.5, "score"), (0.05, "position")]


def make_plan(num_tokens: int, num_experts: int, top_k: int, capacity_factor, drop_policy, seed: int) -> RoutingPlan:
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    return route(logits, top_k, capacity_factor=capacity_factor, drop_policy=drop_policy)


def loop_permute(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    num_kept = int(plan.offsets[-1])
    rows = [x[int(plan.permutation[r]) // plan.top_k] for r in range(num_kept)]
    rows += [x.new_zeros(x.shape[1])] * (plan.num_rows - num_kept)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1]) + 0 * x.sum()


def loop_unpermute(rows: torch.Tensor, weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Differentiable in ``rows`` and ``weights`` (plain indexing and sums, token by token)."""
    row_of = {int(p): r for r, p in enumerate(plan.permutation.tolist())}
    out = []
    for t in range(plan.num_tokens):
        acc = torch.zeros(rows.shape[1], dtype=rows.dtype)
        for s in range(plan.top_k):
            if plan.kept[t, s]:
                acc = acc + weights[t, s] * rows[row_of[t * plan.top_k + s]]
        out.append(acc)
    if not out:  # no tokens: an empty result that still belongs to the graph
        return rows.new_zeros(0, rows.shape[1]) + 0 * (rows.sum() + weights.sum())
    return torch.stack(out)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), SHAPES)
@pytest.mark.parametrize(("capacity_factor", "drop_policy"), CAPACITY)
def test_permute_unpermute_match_loops_with_gradients(num_tokens, num_experts, top_k, capacity_factor, drop_policy):
    plan = make_plan(num_tokens, num_experts, top_k, capacity_factor, drop_policy, seed=num_tokens + num_experts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    scale = torch.randn(plan.num_rows, 6, generator=gen, dtype=torch.float64)  # a per-row "expert"
    weights = plan.weights.detach().double().requires_grad_()
    weights_ref = weights.detach().clone().requires_grad_()
    plan64 = plan._replace(weights=weights)

    rows = permute(x, plan64)
    assert rows.shape == (plan.num_rows, 6)
    assert torch.equal(rows.detach(), loop_permute(x.detach(), plan))
    out = unpermute(rows * scale, plan64)
    ref = loop_unpermute(loop_permute(x_ref, plan) * scale, weights_ref, plan)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    probe = torch.randn(num_tokens, 6, generator=gen, dtype=torch.float64)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights.grad, weights_ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("capacity_factor", "drop_policy"), CAPACITY)
def test_gradcheck(capacity_factor, drop_policy):
    plan = make_plan(9, 4, 2, capacity_factor, drop_policy, seed=3)
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(plan.num_rows, 3, dtype=torch.float64, requires_grad=True)
    weights = plan.weights.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: permute(t, plan), (x,))
    assert torch.autograd.gradcheck(lambda r, w: unpermute(r, plan._replace(weights=w)), (rows, weights))


def test_gradients_flow_to_logits():
    logits = torch.randn(12, 4, requires_grad=True)
    x = torch.randn(12, 5)
    plan = route(logits, 2)
    unpermute(permute(x, plan).exp(), plan).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_dropless_round_trip_recovers_input():
    # With normalised weights and identity experts, unpermute(permute(x)) == x.
    x = torch.randn(50, 7)
    plan = route(torch.randn(50, 6), 3)
    torch.testing.assert_close(unpermute(permute(x, plan), plan), x)


def test_all_pairs_dropped_gives_zeros():
    bias = torch.tensor([0.0, 50.0, 0.0])  # every token's first choice is expert 1
    plan = route(torch.randn(40, 3), 1, capacity_factor=0.1, expert_bias=bias)  # capacity 2 of 40
    out = unpermute(permute(torch.randn(40, 4), plan), plan)
    assert int(plan.offsets[-1]) == 2
    assert out[plan.kept[:, 0]].abs().sum() > 0
    assert torch.equal(out[~plan.kept[:, 0]], torch.zeros(38, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_combines_in_float32(dtype):
    plan = make_plan(20, 8, 2, None, "position", seed=4)
    x = torch.randn(20, 16).to(dtype).requires_grad_()
    rows = permute(x, plan)
    assert rows.dtype == dtype
    out = unpermute(rows * 3, plan)
    assert out.dtype == dtype
    expected = loop_unpermute((loop_permute(x.detach(), plan) * 3).float(), plan.weights.detach(), plan)
    torch.testing.assert_close(out.float(), expected.to(dtype).float())
    out.float().sum().backward()
    assert x.grad.dtype == dtype


@pytest.mark.parametrize(("capacity_factor", "drop_policy"), CAPACITY)
def test_sync_free_forward_backward(capacity_factor, drop_policy):
    logits = torch.randn(64, 8, requires_grad=True)
    x = torch.randn(64, 16, requires_grad=True)
    with SyncCounter() as counter:
        plan = route(logits, 2, capacity_factor=capacity_factor, drop_policy=drop_policy, validate=False)
        out = unpermute(permute(x, plan).tanh(), plan)
        (out.square().sum() + plan.aux_loss).backward()
    assert counter.num_syncs == 0, counter.syncs
    assert x.grad is not None and logits.grad is not None


def _loop_experts(rows: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` multiplies its rows by ``w[e]``; padding rows stay zero.

    A loop over the offsets read on the host, so the test's own part of the backward is a per-expert matmul
    (deterministic at any thread count), unlike ``w[expert_of_row]``, whose backward is an accumulating
    ``index_put_`` that varies with threading.
    """
    bounds = offsets.tolist()
    parts = [rows[bounds[e] : bounds[e + 1]] @ w[e] for e in range(w.shape[0])]
    parts.append(rows.new_zeros(rows.shape[0] - bounds[-1], w.shape[2]))
    return torch.cat(parts)


@pytest.mark.parametrize("num_threads", [1, 4])
def test_bitwise_deterministic(num_threads):
    gen = torch.Generator().manual_seed(5)
    logits0, x0 = torch.randn(300, 16, generator=gen), torch.randn(300, 32, generator=gen)
    w_expert = torch.randn(16, 32, 32, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        results = []
        for _ in range(2):
            logits, x = logits0.clone().requires_grad_(), x0.clone().requires_grad_()
            w = w_expert.clone().requires_grad_()
            plan = route(logits, 4, capacity_factor=1.1, validate=False)
            assert int(plan.num_dropped) > 0  # the capacity path, padding rows included
            y = _loop_experts(permute(x, plan), plan.offsets, w)
            unpermute(y, plan).square().sum().backward()
            results.append((x.grad, logits.grad, w.grad))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)


def test_bad_shapes_raise():
    plan = make_plan(10, 4, 2, None, "position", seed=6)
    with pytest.raises(RoutingError, match="num_tokens=10"):
        permute(torch.randn(9, 3), plan)
    with pytest.raises(RoutingError, match="num_tokens=10"):
        permute(torch.randn(10), plan)
    with pytest.raises(RoutingError, match="num_rows=20"):
        unpermute(torch.randn(19, 3), plan)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_hidden_size_zero_round_trip(kernel_backend, capacity_factor):
    plan = make_plan(5, 4, 2, capacity_factor, "position", seed=8)
    x = torch.ones(5, 0, requires_grad=True)
    rows = permute(x, plan, backend=kernel_backend)
    assert rows.shape == (plan.num_rows, 0)
    out = unpermute(rows, plan, backend=kernel_backend)
    assert out.shape == (5, 0)
    out.sum().backward()
    assert x.grad.shape == (5, 0)
    assert unpermute(torch.ones(plan.num_rows, 0), plan, backend=kernel_backend).shape == (5, 0)


@pytest.mark.parametrize(("num_tokens", "capacity_factor"), [(13, None), (13, 0.5), (1, None), (0, None)])
def test_custom_ops_pass_opcheck(kernel_backend, num_tokens, capacity_factor):
    """Schema (no undeclared mutation or aliasing), fake implementations (shapes, dtypes, strides), autograd."""
    plan = make_plan(num_tokens, 5, 2, capacity_factor, "position", seed=7)
    idx = plan_indices(plan)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, 8, generator=gen, requires_grad=True)
    rows = torch.randn(plan.num_rows, 8, generator=gen, requires_grad=True)
    weights = plan.weights.detach().clone().requires_grad_()
    kept = plan.kept if capacity_factor is not None else None
    pair_mask = kept.float() if kept is not None else None
    grad = torch.randn(num_tokens, 8, generator=gen)
    row_weights = weights.detach().reshape(-1)[idx.pairs]
    cases = [
        ("permute_rows", (x, idx.tokens, idx.num_valid, idx.positions, pair_mask, kernel_backend)),
        ("unpermute_rows", (rows, weights, idx.pairs, idx.tokens, idx.positions, kernel_backend)),
        ("combine_rows", (rows.detach(), idx.positions, pair_mask, torch.float32, kernel_backend)),
        ("combine_rows", (rows.detach().bfloat16(), idx.positions, pair_mask, torch.float32, kernel_backend)),
        ("sum_rows", (rows, idx.positions, pair_mask, idx.tokens, idx.num_valid, kernel_backend)),
        ("pair_values_to_rows", (weights, idx.pairs, idx.positions, kept)),
        ("combine_rows_backward", (grad, rows.detach(), idx.tokens, row_weights, idx.positions, kernel_backend)),
    ]
    for name, args in cases:  # the registered ops (what torch.compile traces), not the eager fast path
        torch.library.opcheck(getattr(torch.ops.lightning_llmfast, name).default, args)
