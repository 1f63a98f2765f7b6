"""The local dispatch path (LocalDispatcher + expert_swiglu): the fused ops against float64 loops and the materialised
rows, what it keeps for backward, awkward routings (one token, empty experts, one expert taking everything,
capacity)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe import MoEBlock, MoEConfig, permute, route, unpermute
from lightning_llmfast.moe.dispatcher import ExpertRows, LocalDispatcher, compute_copy
from lightning_llmfast.moe.expert_ops import gather_grouped_mm, gather_rows_into, grouped_mm, swiglu_down
from lightning_llmfast.moe.experts import expert_swiglu, routed_swiglu
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import pair_values_to_rows, plan_indices

H, FFN = 16, 24  # 16-byte aligned rows in float32 and bfloat16: the grouped_mm path

GROUP_SIZES = [[1], [0, 0, 7, 0], [3, 0, 5, 1], [2, 11, 0, 13, 1]]


def local_swiglu(
    x: torch.Tensor,
    plan: RoutingPlan,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    x_compute: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The block's local path: dispatch, the experts, combine."""
    dispatcher = LocalDispatcher(backend)
    rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
    return dispatcher.combine(expert_swiglu(rows, gate_up, down), ctx)


def _offs(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _swiglu_down_loop(gate_up: torch.Tensor, down: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(sizes):
        gate, up = gate_up[start : start + n].chunk(2, -1)
        out.append(scale[start : start + n, None] * ((F.silu(gate) * up) @ down[e]))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", GROUP_SIZES)
def test_scaled_swiglu_down_matches_float64_loop(sizes: list[int], dtype: torch.dtype, kernel_backend: str) -> None:
    """Output and all three gradients (``gate_up``, ``down``, the row scale) against float64 autograd of a loop."""
    g = torch.Generator().manual_seed(sum(sizes) * 5 + len(sizes))
    m, e = sum(sizes), len(sizes)
    inputs = [
        torch.randn(m, 2 * FFN, generator=g),
        torch.randn(e, FFN, H, generator=g) / FFN**0.5,
        torch.rand(m, generator=g),
    ]
    grad = torch.randn(m, H, generator=g)
    ours = [t.clone().to(dtype if i < 2 else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
    out = swiglu_down(ours[0], ours[1], _offs(sizes), ours[2], kernel_backend)
    out.backward(grad.to(dtype))
    ref = [t.double().requires_grad_() for t in inputs]
    ref_out = _swiglu_down_loop(*ref, sizes)
    ref_out.backward(grad.double())
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 6e-2}
    assert out.dtype == dtype and ours[2].grad.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **tol)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol)
    assert ref[2].grad.abs().sum() > 0  # the scale gradient is really compared


@pytest.mark.parametrize("sizes", GROUP_SIZES)
def test_permute_grouped_mm_is_bitwise_the_unfused_ops_under_autocast(sizes: list[int]) -> None:
    """Gather inside the GEMM from the shared bf16 copy: same output, token and weight gradients, to the bit."""
    g = torch.Generator().manual_seed(len(sizes) + 11)
    num_tokens, top_k = sum(sizes), 1
    # A plan that sends tokens to the experts in `sizes`, shuffled.
    expert_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[
        torch.randperm(num_tokens, generator=g)
    ]
    logits = torch.full((num_tokens, len(sizes)), -10.0).scatter(1, expert_of[:, None], 10.0)
    plan = route(logits, top_k, validate=False)
    idx = plan_indices(plan)
    x0 = torch.randn(num_tokens, H, generator=g)
    w0 = torch.randn(len(sizes), H, 2 * FFN, generator=g)
    grad = torch.randn(num_tokens * top_k, 2 * FFN, generator=g).bfloat16()
    results = []
    for fused in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            wb = w.to(torch.bfloat16)
            ends = plan.offsets[1:].to(torch.int32)
            if fused:
                out = gather_grouped_mm(
                    x, compute_copy(x).detach(), idx.tokens, None, idx.positions, None, wb, ends, "torch"
                )
            else:
                out = grouped_mm(permute(x, plan).to(torch.bfloat16), wb, ends)
        out.backward(grad)
        results.append((out.detach(), x.grad, w.grad))
    for unfused, fused in zip(*results):
        assert torch.equal(unfused, fused)
    assert results[1][1].dtype == torch.float32 and results[1][1].abs().sum() > 0


def _unfused(x: torch.Tensor, plan, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    rows = ExpertRows(permute(x, plan), plan.offsets, plan.capacity is not None, "torch")
    return unpermute(expert_swiglu(rows, gate_up, down), plan)


def _loop(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, plan) -> torch.Tensor:
    """Float64 oracle, token by token over the plan's kept pairs, differentiable in every input."""
    weights = logits.softmax(-1).gather(1, plan.expert_ids.long())
    weights = weights / weights.sum(-1, keepdim=True)
    out = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(x.shape[1])
        for s in range(plan.top_k):
            if plan.kept[t, s]:
                e = int(plan.expert_ids[t, s])
                gate, up = (x[t] @ gate_up[e]).chunk(2)
                acc = acc + weights[t, s] * ((F.silu(gate) * up) @ down[e])
        out.append(acc)
    return torch.stack(out)


ROUTINGS = [
    # (num_tokens, num_experts, top_k, capacity_factor, one expert takes everything)
    (1, 1, 1, None, False),
    (7, 3, 3, None, False),
    (13, 8, 2, None, False),
    (31, 5, 1, None, True),
    (13, 4, 2, 0.5, False),
    (29, 4, 2, 0.3, True),
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "capacity_factor", "skewed"), ROUTINGS)
def test_local_path_matches_materialised_rows_and_float64(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    skewed: bool,
    kernel_backend: str,
) -> None:
    """Output and the gradients of tokens, router logits and both expert weights, in float32."""
    g = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    base = [
        torch.randn(num_tokens, H, generator=g),
        torch.randn(num_tokens, num_experts, generator=g) + (torch.arange(num_experts) == 0) * 20.0 * skewed,
        torch.randn(num_experts, H, 2 * FFN, generator=g) / H**0.5,
        torch.randn(num_experts, FFN, H, generator=g) / FFN**0.5,
    ]
    grad = torch.randn(num_tokens, H, generator=g)
    runs = []
    for variant in ("fused", "unfused", "loop"):
        x, logits, gate_up, down = (t.clone().double() if variant == "loop" else t.clone() for t in base)
        for t in (x, logits, gate_up, down):
            t.requires_grad_()
        plan = route(logits, top_k, capacity_factor=capacity_factor, validate=False)
        if variant == "fused":
            out = local_swiglu(x, plan, gate_up, down, backend=kernel_backend)
        elif variant == "unfused":
            out = _unfused(x, plan, gate_up, down)
        else:
            out = _loop(x, logits, gate_up, down, plan)
        out.backward(grad.to(out.dtype))
        runs.append([out.detach(), x.grad, logits.grad, gate_up.grad, down.grad])
    if skewed and capacity_factor is not None:
        assert not bool(plan.kept.all())  # the capacity limit really dropped pairs
    for fused, unfused, loop in zip(*runs):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.double(), loop, rtol=1e-5, atol=1e-5)
    assert runs[2][2].abs().sum() > 0 or num_experts == 1  # router gradients exist and are compared


def test_moe_block_keeps_no_row_tensors_for_backward() -> None:
    """Under bf16 autocast a block saves one (T, H) bf16 copy (router and experts share it) and no (T*k, H) rows."""
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(H, FFN, num_experts=4, top_k=2, backend="torch"))
    x = torch.randn(13, H, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            y = block(x)
    token_copies = {t.untyped_storage().data_ptr() for t in saved if t.shape == (13, H) and t.dtype == torch.bfloat16}
    assert len(token_copies) == 1
    assert not [t for t in saved if t.dim() == 2 and t.shape == (26, H)]
    assert [t for t in saved if t.shape == (26, 2 * FFN)]  # the gate/up output, which the SwiGLU backward needs
    y.float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_row_weight_gradient_ignores_garbage_in_padding_rows() -> None:
    """A dropped pair's clamped position may point at a padding row whose gradient grouped_mm never wrote."""
    plan = route(torch.randn(9, 3), 2, capacity_factor=0.3, validate=False)
    assert not bool(plan.kept.all())
    idx = plan_indices(plan)
    weights = plan.weights.detach().requires_grad_()
    rows = pair_values_to_rows(weights, idx.pairs, idx.positions, plan.kept)
    grad = torch.arange(1.0, plan.num_rows + 1)
    grad[int(plan.offsets[-1]) :] = float("nan")
    rows.backward(grad)
    expected = torch.zeros_like(weights).reshape(-1)
    expected[idx.pairs[: int(plan.offsets[-1])]] = grad[: int(plan.offsets[-1])]
    assert torch.equal(weights.grad, expected.view_as(weights))


@pytest.mark.parametrize("num_tokens", [4, 6])
def test_local_path_rejects_x_of_another_token_count(num_tokens: int, kernel_backend: str) -> None:
    """Both paths (fused, and the float64 fallback) name the mismatch; unchecked, the fused gather would read past
    the end of ``x`` (Triton) or return the plan's token count."""
    plan = route(torch.randn(5, 4), 2, validate=False)
    gate_up, down = torch.randn(4, H, 2 * FFN), torch.randn(4, FFN, H)
    x = torch.randn(num_tokens, H)
    with pytest.raises(RoutingError, match="num_tokens=5"):
        local_swiglu(x.double(), plan, gate_up.double(), down.double(), backend=kernel_backend)
    with pytest.raises(RoutingError, match="num_tokens=5"):
        local_swiglu(x, plan, gate_up, down, backend=kernel_backend)
    with pytest.raises(RoutingError, match="x_compute"):
        local_swiglu(torch.randn(5, H), plan, gate_up, down, x_compute=torch.randn(5, 2 * H), backend=kernel_backend)


@pytest.mark.parametrize(
    ("gate_up_shape", "down_shape", "match"),
    [
        ((3, H, 2 * FFN), (3, FFN, H), r"offsets must have shape \(E\+1,\) = \(4,\) for E=3 experts"),
        ((4, H + 1, 2 * FFN), (4, FFN, H), rf"gate_up must have shape \(E, H={H}, 2F\), got \(4, {H + 1}, {2 * FFN}\)"),
        ((4, H, 2 * FFN + 1), (4, FFN, H), rf"gate_up's last dim must be even .*got {2 * FFN + 1}"),
        ((4, H, 2 * FFN), (4, FFN + 1, H), rf"down must have shape \(E=4, F={FFN}, H={H}\)"),
        ((4, H, 2 * FFN), (3, FFN, H), rf"down must have shape \(E=4, F={FFN}, H={H}\)"),
        ((4, H, 2 * FFN), (FFN, H), rf"down must have shape \(E=4, F={FFN}, H={H}\)"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused, and the float64 fallback
def test_local_path_rejects_weights_of_the_wrong_shape(gate_up_shape, down_shape, match, dtype) -> None:
    plan = route(torch.randn(5, 4), 2, validate=False)
    x = torch.randn(5, H, dtype=dtype)
    with pytest.raises(RoutingError, match=match):
        local_swiglu(x, plan, torch.randn(gate_up_shape, dtype=dtype), torch.randn(down_shape, dtype=dtype))


def test_local_path_rejects_x_compute_of_another_dtype() -> None:
    plan = route(torch.randn(5, 4), 2, validate=False)
    gate_up, down = torch.randn(4, H, 2 * FFN), torch.randn(4, FFN, H)
    x = torch.randn(5, H)
    with pytest.raises(RoutingError, match=r"x_compute must have dtype torch.float32 .*got torch.float64"):
        local_swiglu(x, plan, gate_up, down, x_compute=x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RoutingError, match=r"x_compute must have dtype torch.bfloat16 .*got torch.float32"):
            local_swiglu(x, plan, gate_up, down, x_compute=x)
        # compute_copy's result is what it takes, and gives what it computes by itself
        torch.testing.assert_close(
            local_swiglu(x, plan, gate_up, down, x_compute=compute_copy(x)), local_swiglu(x, plan, gate_up, down)
        )


def test_routed_swiglu_is_a_deprecated_alias_of_the_local_path() -> None:
    g = torch.Generator().manual_seed(5)
    plan = route(torch.randn(7, 4, generator=g), 2, validate=False)
    x, gate_up, down = torch.randn(7, H, generator=g), torch.randn(4, H, 2 * FFN, generator=g), torch.randn(4, FFN, H)
    with pytest.warns(DeprecationWarning, match="routed_swiglu is deprecated"):
        old = routed_swiglu(x, plan, gate_up, down, backend="torch")
    assert torch.equal(old, local_swiglu(x, plan, gate_up, down, backend="torch"))


def test_create_graph_backward_through_moe_block() -> None:
    """A first-order ``create_graph`` backward (as gradient penalties use) gives the plain backward's gradient: the
    row scaling leaves its in-place ``out=`` path when its inputs require grad."""
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(H, FFN, num_experts=4, top_k=2, backend="torch"))
    x = torch.randn(9, H, requires_grad=True)
    g = torch.randn(9, H)
    (expected,) = torch.autograd.grad((block(x) * g).sum(), x)
    (got,) = torch.autograd.grad((block(x) * g).sum(), x, create_graph=True)
    torch.testing.assert_close(got, expected)
    assert got.requires_grad


def test_permute_grouped_mm_passes_opcheck() -> None:
    """Schema, fake implementation and autograd of the fused gather + GEMM (dropless: every output row written)."""
    plan = route(torch.randn(11, 3), 2, validate=False)
    idx = plan_indices(plan)
    x = torch.randn(11, H, requires_grad=True)
    weight = torch.randn(3, H, 2 * FFN, requires_grad=True)
    ends = plan.offsets[1:].to(torch.int32)
    args = (x, x.detach(), idx.tokens, None, idx.positions, None, weight, ends, "torch")
    torch.library.opcheck(torch.ops.lightning_llmfast.permute_grouped_mm.default, args)


@pytest.mark.parametrize(("num_rows", "num_valid"), [(1, None), (13, None), (13, 8), (13, 0)])
def test_gather_rows_into_fills_the_buffer(kernel_backend: str, num_rows: int, num_valid: int | None) -> None:
    """The backward's regather into the data gradient's buffer: ``x[tokens]``, padding rows zero, schema checked."""
    g = torch.Generator().manual_seed(num_rows + (num_valid or 0))
    x, tokens = torch.randn(5, H, generator=g), torch.randint(0, 5, (num_rows,), generator=g)
    valid = None if num_valid is None else torch.tensor(num_valid)
    out = torch.full((num_rows, H), float("nan"))  # stale contents must all be overwritten
    gather_rows_into(out, x, tokens, valid, kernel_backend)
    expected = x[tokens]
    if num_valid is not None:
        expected[num_valid:] = 0
    assert torch.equal(out, expected)
    torch.library.opcheck(torch.ops.lightning_llmfast.gather_rows_into.default, (out, x, tokens, valid, kernel_backend))
