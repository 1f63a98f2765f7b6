"""MoE blocks: naive baseline vs grouped block vs a float64 loop reference, sync counts, compile, metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.callbacks import ExpertLoadMetric
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe import GroupedExperts, MoEBlock, MoEConfig, NaiveMoEBlock, SwiGLUExperts
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.expert_ops import grouped_mm, silu_glu, swiglu_down
from lightning_llmfast.moe.experts import expert_swiglu, grouped_mm_supported

H, FFN = 8, 12  # multiples of 4: the float32 grouped_mm path (16-byte aligned rows)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The experts over materialised rows, their offsets checked (as ``GroupedExperts`` calls them)."""
    return expert_swiglu(ExpertRows(x, offsets, False, "torch"), gate_up, down, validate=True)


def _pair(num_experts: int, top_k: int, *, seed: int = 0, **kwargs: object) -> tuple[NaiveMoEBlock, MoEBlock]:
    torch.manual_seed(seed)
    naive = NaiveMoEBlock(H, FFN, num_experts, top_k)
    # Larger weights than the 0.02 init, so that outputs and gradients are far from zero and comparisons bite.
    for p in naive.parameters():
        torch.nn.init.normal_(p, std=0.5)
    grouped = MoEBlock(MoEConfig.build(H, FFN, num_experts, top_k, **kwargs))
    grouped.load_state_dict(naive.state_dict(), strict=False)  # expert_bias, if any, stays zero
    return naive, grouped


def _build(block_cls: type, *args: int) -> torch.nn.Module:
    """``block_cls`` (the naive or the grouped block) from its sizes."""
    return block_cls(*args) if block_cls is NaiveMoEBlock else MoEBlock(MoEConfig.build(*args))


def _reference(block: torch.nn.Module, x: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 per-token, per-slot loop over the block's parameters: the independent oracle."""
    w_router = block.router.weight.double()
    top_k = block.top_k if isinstance(block, NaiveMoEBlock) else block.config.routing.top_k
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    x = x.double().reshape(-1, w_router.shape[1])
    probs = (x @ w_router.T).softmax(-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(top_k):
            if kept is not None and not kept[t, s]:
                continue
            e = int(top_i[t, s])
            gate, up = (x[t] @ gate_up[e]).chunk(2)
            out[t] += top_w[t, s] * ((F.silu(gate) * up) @ down[e])
    return out


def _grads(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    block.zero_grad()
    x = x.detach().requires_grad_()
    y = block(x)
    (y * g).sum().backward()
    return (y.detach(), x.grad, *(p.grad.clone() for p in block.parameters()))


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_tokens"),
    [(1, 1, 5), (2, 1, 1), (4, 2, 7), (8, 2, 13), (8, 8, 6), (5, 3, 17)],
)
def test_grouped_matches_naive_and_reference(
    kernel_backend: str, num_experts: int, top_k: int, num_tokens: int
) -> None:
    naive, grouped = _pair(num_experts, top_k, seed=num_tokens, backend=kernel_backend)
    x = torch.randn(num_tokens, H)
    g = torch.randn(num_tokens, H)
    ref = _reference(naive, x)
    a, b = _grads(naive, x, g), _grads(grouped, x, g)
    torch.testing.assert_close(a[0].double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[0].double(), ref, rtol=1e-5, atol=1e-5)
    for ga, gb in zip(a[1:], b[1:]):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive.stats.router_logits, grouped.stats.router_logits)
    assert torch.equal(naive.stats.tokens_per_expert, grouped.stats.tokens_per_expert)
    torch.testing.assert_close(naive.stats.aux_loss, grouped.stats.aux_loss)
    torch.testing.assert_close(naive.stats.z_loss, grouped.stats.z_loss)
    assert grouped.stats.tokens_per_expert.sum() == num_tokens * top_k
    assert grouped.stats.nonfinite is None and not grouped.stats.nonfinite_flag()  # not checked in the hot path


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_scores_match_naive(normalize: bool) -> None:
    torch.manual_seed(5)
    naive = NaiveMoEBlock(H, FFN, 6, 3, score="sigmoid", normalize=normalize)
    grouped = MoEBlock(MoEConfig.build(H, FFN, 6, 3, score="sigmoid", normalize=normalize, backend="torch"))
    grouped.load_state_dict(naive.state_dict())
    x, g = torch.randn(11, H), torch.randn(11, H)
    for a, b in zip(_grads(naive, x, g), _grads(grouped, x, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(naive.stats.aux_loss, grouped.stats.aux_loss)


def test_one_expert_gets_everything_and_leading_dims() -> None:
    naive, grouped = _pair(6, 2, backend="torch")
    with torch.no_grad():  # experts 2 and 4 dominate every token's router logits
        for block in (naive, grouped):
            block.router.weight.zero_()
            block.router.weight[2, 0] = 50.0
            block.router.weight[4, 0] = 25.0
    x = torch.randn(3, 5, H)
    x[..., 0] = x[..., 0].abs() + 1
    y_naive, y_grouped = naive(x), grouped(x)
    assert y_grouped.shape == x.shape
    torch.testing.assert_close(y_grouped, y_naive, rtol=1e-5, atol=1e-5)
    assert grouped.stats.tokens_per_expert.tolist() == [0, 0, 15, 0, 15, 0]
    torch.testing.assert_close(y_grouped.reshape(-1, H).double(), _reference(naive, x), rtol=1e-5, atol=1e-5)


def test_empty_input_forward_backward() -> None:
    _, grouped = _pair(4, 2, backend="torch")
    x = torch.randn(0, H, requires_grad=True)
    y = grouped(x)
    assert y.shape == (0, H)
    assert grouped.stats.tokens_per_expert.tolist() == [0, 0, 0, 0]
    assert grouped.stats.aux_loss == 0
    (y.sum() + grouped.stats.aux_loss + grouped.stats.z_loss).backward()
    assert x.grad.shape == (0, H)
    assert torch.equal(grouped.experts.gate_up_proj.grad, torch.zeros_like(grouped.experts.gate_up_proj))


@settings(max_examples=15, deadline=None)
@given(
    num_experts=st.integers(1, 9),
    data=st.data(),
    num_tokens=st.integers(1, 23),
    seed=st.integers(0, 2**16),
)
def test_grouped_matches_naive_random(num_experts: int, data: st.DataObject, num_tokens: int, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    naive, grouped = _pair(num_experts, top_k, seed=seed, backend="torch")
    x, g = torch.randn(num_tokens, H), torch.randn(num_tokens, H)
    for ga, gb in zip(_grads(naive, x, g), _grads(grouped, x, g)):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drop_policy", ["position", "score"])
def test_capacity_matches_reference_over_kept_pairs(drop_policy: str) -> None:
    _, grouped = _pair(4, 2, backend="torch", capacity_factor=0.5, drop_policy=drop_policy)
    x = torch.randn(19, H, requires_grad=True)
    y = grouped(x)
    plan = grouped.stats.plan
    assert int(plan.num_dropped) > 0
    torch.testing.assert_close(y.double(), _reference(grouped, x, plan.kept), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(grouped.experts.gate_up_proj.grad).all()


@pytest.mark.parametrize("kwargs", [{}, {"capacity_factor": 1.0}, {"expert_bias": True}, {"score": "sigmoid"}], ids=str)
def test_forward_backward_has_no_host_sync(kwargs: dict[str, object]) -> None:
    _, grouped = _pair(8, 2, backend="torch", **kwargs)
    x = torch.randn(2, 11, H, requires_grad=True)
    with SyncCounter() as counter:
        y = grouped(x)
        (y.square().mean() + grouped.stats.aux_loss + grouped.stats.z_loss).backward()
    assert counter.num_syncs == 0, counter.syncs
    # The counter is live: the naive baseline is caught syncing.
    naive, _ = _pair(8, 2)
    with SyncCounter() as counter:
        naive(x)
    assert counter.syncs["nonzero"] >= 8 and counter.syncs["bincount"] == 1


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_torch_compile_fullgraph_forward_backward(capacity_factor: float | None) -> None:
    """The output and every gradient (x, router, both expert weights) agree compiled and eager.

    torch 2.11 once returned all-zero gradients here, silently, while the output was right: the permute/unpermute
    autograd.Functions' forwards returned buffers filled in place. The eager run is itself checked against the
    float64 loop oracle, and every gradient must be nonzero, so two equally wrong runs cannot pass.
    """
    naive, grouped = _pair(4, 2, backend="torch", capacity_factor=capacity_factor)
    x = torch.randn(9, H)
    compiled = torch.compile(grouped, fullgraph=True, backend="aot_eager")
    g = torch.randn(9, H)
    eager = _grads(grouped, x, g)
    kept = grouped.stats.plan.kept
    assert capacity_factor is None or not kept.all()
    torch.testing.assert_close(eager[0].double(), _reference(grouped, x, kept), rtol=1e-5, atol=1e-5)
    if capacity_factor is None:
        for a, b in zip(eager, _grads(naive, x, g)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    traced = _grads(compiled, x, g)
    assert len(traced) == 5
    for a, b in zip(eager, traced):
        assert b.abs().sum() > 0
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_custom_ops_pass_opcheck() -> None:
    """Schema (no undeclared mutation or aliasing), fake implementations (shapes, dtypes, strides), autograd."""
    torch.manual_seed(3)
    offs = torch.tensor([2, 2, 5, 9], dtype=torch.int32)  # group ends: an empty group, and uneven ones
    x = torch.randn(9, H, requires_grad=True)
    gate_up = torch.randn(4, H, 2 * FFN, requires_grad=True)
    hf_layout = torch.randn(4, 2 * FFN, H).transpose(1, 2).requires_grad_()  # HF's (E, 2F, H) as a view
    down = torch.randn(4, FFN, H, requires_grad=True)
    cases = [
        ("grouped_mm", (x, gate_up, offs)),
        ("grouped_mm", (x, hf_layout, offs)),
        ("grouped_mm", (x.detach().T, torch.randn(9, 2 * FFN), offs)),  # the weight-gradient form
        ("swiglu", (torch.randn(9, 2 * FFN, requires_grad=True),)),
        ("swiglu", (torch.randn(1, 2 * FFN, requires_grad=True),)),
        ("swiglu_backward", (torch.randn(9, FFN), torch.randn(9, 2 * FFN))),
        ("swiglu_down", (torch.randn(9, 2 * FFN, requires_grad=True), down, offs, None, "torch")),
        (
            "swiglu_down",
            (torch.randn(9, 2 * FFN), torch.randn(4, H, FFN).transpose(1, 2).requires_grad_(), offs, None, "torch"),
        ),
        (
            "swiglu_down",
            (torch.randn(9, 2 * FFN, requires_grad=True), down, offs, torch.rand(9, requires_grad=True), "torch"),
        ),
    ]
    for name, args in cases:  # the registered ops (what torch.compile traces), not the eager fast path
        torch.library.opcheck(getattr(torch.ops.lightning_llmfast, name).default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[1], [0, 0, 7, 0], [3, 0, 5, 1], [2, 11, 0, 13, 1]])
def test_fused_swiglu_down_equals_the_unfused_ops_bitwise(sizes: list[int], dtype: torch.dtype) -> None:
    """Rebuilding the SwiGLU product in backward gives the same bits as saving it: output and both gradients."""
    g = torch.Generator().manual_seed(sum(sizes) * 7 + len(sizes))
    h, ffn = 16, 24  # bf16 grouped_mm needs 16-byte aligned rows
    m, e = sum(sizes), len(sizes)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    gate_up = torch.randn(m, 2 * ffn, generator=g).to(dtype)
    down = torch.randn(e, ffn, h, generator=g).to(dtype)
    grad = torch.randn(m, h, generator=g).to(dtype)
    results = []
    for fused in (False, True):
        a, b = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
        out = swiglu_down(a, b, offs, None, "torch") if fused else grouped_mm(silu_glu(a), b, offs)
        out.backward(grad)
        results.append((out.detach(), a.grad, b.grad))
    for unfused, fused in zip(*results):
        assert torch.equal(unfused, fused)
    # and both agree with a float64 per-group loop
    ref_out, start = torch.zeros(m, h, dtype=torch.float64), 0
    for i, n in enumerate(sizes):
        gate, up = gate_up[start : start + n].double().chunk(2, -1)
        ref_out[start : start + n] = (F.silu(gate) * up) @ down[i].double()
        start += n
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(results[1][0].double(), ref_out, **tol)


def test_grouped_swiglu_keeps_no_product_for_backward() -> None:
    """The experts save rows, weights and ``gate_up`` for backward, never the ``(M, F)`` SwiGLU product."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, H, FFN)
    offsets = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)
    x = torch.randn(13, H, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = experts(x, offsets)
    assert (13, 2 * FFN) in saved and (13, FFN) not in saved
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_deterministic_bitwise() -> None:
    _, grouped = _pair(8, 2, backend="torch", capacity_factor=1.25)
    x, g = torch.randn(31, H), torch.randn(31, H)
    first, second = _grads(grouped, x, g), _grads(grouped, x, g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_expert_bias_buffer_updates_only_in_training() -> None:
    _, grouped = _pair(4, 1, backend="torch", expert_bias=True, bias_update_rate=0.1)
    assert "expert_bias" in grouped.state_dict()
    x = torch.randn(16, H)
    grouped.eval()
    grouped(x)
    assert torch.equal(grouped.expert_bias, torch.zeros(4))
    grouped.train()
    grouped(x)
    assert torch.equal(grouped.expert_bias, torch.zeros(4))  # bias_update="step": applied by finish_step()
    grouped.finish_step()
    counts = grouped.stats.tokens_per_expert.float()
    torch.testing.assert_close(grouped.expert_bias, 0.1 * torch.sign(counts.mean() - counts))


def test_nonfinite_logits_are_flagged_on_demand_not_raised() -> None:
    _, grouped = _pair(4, 2, backend="torch")
    x = torch.randn(5, H)
    x[2, 0] = float("nan")
    with SyncCounter() as counter:
        grouped(x)
    assert counter.num_syncs == 0
    assert bool(grouped.stats.nonfinite_flag())
    mask = torch.ones(5, dtype=torch.bool)
    mask[2] = False  # the token holding the NaN is padding: it reaches no logit check
    grouped(x, token_mask=mask)
    assert not bool(grouped.stats.nonfinite_flag())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 5}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"score": "relu"}, "score"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"backend": "cuda"}, "backend"),
        ({"drop_policy": "random"}, "drop_policy"),
        ({"top_k": True}, r"top_k must be an int (>= 1|in \[1, num_experts=4\]), got True"),
        ({"hidden_size": True}, "hidden_size must be an int >= 1, got True"),
        ({"num_experts": 2.0}, "num_experts must be an int >= 1, got 2.0"),
        ({"capacity_factor": float("inf")}, "capacity_factor must be a finite number > 0, got inf"),
        ({"capacity_factor": float("nan")}, "capacity_factor must be a finite number > 0, got nan"),
        ({"bias_update_rate": float("inf")}, "bias_update_rate must be a finite number >= 0, got inf"),
        ({"bias_update_rate": None}, "bias_update_rate must be a finite number >= 0, got None"),
        ({"bias_update_rate": "0.1"}, "bias_update_rate must be a finite number >= 0, got '0.1'"),
        ({"bias_update_rate": -1.0}, "bias_update_rate must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_config_raises(kwargs: dict[str, object], match: str) -> None:
    args = {"hidden_size": H, "ffn_size": FFN, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        MoEBlock(MoEConfig.build(**args))
    if set(kwargs) <= {"top_k", "hidden_size", "score"}:
        with pytest.raises(ConfigError, match=match):
            NaiveMoEBlock(**args)


@pytest.mark.parametrize("cls", [SwiGLUExperts, GroupedExperts])
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, H, FFN), "num_experts must be an int >= 1, got -1"),
        ((0, H, FFN), "num_experts must be an int >= 1, got 0"),
        ((2, True, FFN), "hidden_size must be an int >= 1, got True"),
        ((2, H, 1.5), "ffn_size must be an int >= 1, got 1.5"),
    ],
)
def test_experts_reject_bad_sizes(cls: type, args: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cls(*args)


@pytest.mark.parametrize("block_cls", [MoEBlock, NaiveMoEBlock])
@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.randn(4, 2 * H), rf"x must have shape \(\.\.\., hidden_size={H}\), got \(4, {2 * H}\)"),
        (torch.randn(3, 4), rf"x must have shape \(\.\.\., hidden_size={H}\), got \(3, 4\)"),
        (torch.tensor(1.0), rf"x must have shape \(\.\.\., hidden_size={H}\), got \(\)"),
        (torch.ones(2, H, dtype=torch.int64), "x must be floating point, got torch.int64"),
        (
            torch.randn(2, H, dtype=torch.bfloat16),
            "x has dtype torch.bfloat16 but the block's weights are torch.float32",
        ),
        (torch.randn(2, H, dtype=torch.float64), "x has dtype torch.float64 but the block's weights are torch.float32"),
    ],
)
def test_block_rejects_bad_x(block_cls: type, x: torch.Tensor, match: str) -> None:
    """The last dim used to be reshaped into more or fewer tokens silently; another dtype failed inside nn.Linear."""
    block = _build(block_cls, H, FFN, 4, 2)
    with pytest.raises(RoutingError, match=match):
        block(x)


@pytest.mark.parametrize("block_cls", [MoEBlock, NaiveMoEBlock])
def test_block_takes_16_bit_x_under_autocast(block_cls: type) -> None:
    """Under autocast the compute dtype is autocast's whatever x's is, and the output keeps x's dtype."""
    block = _build(block_cls, H, FFN, 4, 2)
    x = torch.randn(2, 5, H).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
        y_from_float = block(x.float())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.testing.assert_close(y, y_from_float.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RoutingError, match=r"x has dtype torch\.float64"):
        block(x.double())  # autocast does not cast float64 matmul inputs


OFFSETS_ERRORS = [
    ([0, 0, 0, 0], False, r"offsets must end at M=6 \(the number of rows\), got offsets\[-1\]=0"),
    ([0, 2, 3, 4], False, r"offsets must end at M=6 \(the number of rows\), got offsets\[-1\]=4"),
    ([1, 2, 3, 6], False, r"offsets must start at 0, got offsets\[0\]=1"),
    ([1, 2, 3, 6], True, r"offsets must start at 0, got offsets\[0\]=1"),
    ([0, 4, 2, 6], False, r"offsets must be non-decreasing, got offsets\[1\]=4 > offsets\[2\]=2"),
    ([0, 2, 3, 7], True, r"offsets\[-1\] must be <= M=6 \(the number of rows\), got offsets\[-1\]=7"),
    ([0, 2, 6], False, r"offsets must have shape \(E\+1,\) = \(4,\) for E=3 experts, got \(3,\)"),
    ([[0, 2, 3, 6]], False, r"offsets must have shape \(E\+1,\) = \(4,\) for E=3 experts, got \(1, 4\)"),
    ([0.0, 2.0, 3.0, 6.0], False, "offsets must be an integer tensor, got torch.float32"),
]


@pytest.mark.parametrize(("offsets", "padded", "match"), OFFSETS_ERRORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # grouped_mm, and the per-expert loop
def test_grouped_experts_reject_bad_offsets(offsets: list, padded: bool, match: str, dtype: torch.dtype) -> None:
    """offsets[-1] < M would return the rows grouped_mm never wrote (uninitialised memory): rejected."""
    experts = GroupedExperts(3, H, FFN).to(dtype)
    x = torch.randn(6, H, dtype=dtype)
    offsets = torch.tensor(offsets, dtype=torch.int32 if isinstance(offsets[0], int) else None)
    with pytest.raises(RoutingError, match=match):
        experts(x, offsets, padded=padded)


def test_grouped_experts_offsets_of_any_integer_dtype() -> None:
    experts = GroupedExperts(3, H, FFN)
    x = torch.randn(6, H)
    expected = _loop_experts(x, [2, 1, 3], experts)
    for dtype in (torch.int32, torch.int64, torch.int16):
        got = experts(x, torch.tensor([0, 2, 3, 6], dtype=dtype))
        torch.testing.assert_close(got.double(), expected)


@pytest.mark.parametrize(
    ("gate_up_shape", "down_shape", "match"),
    [
        ((3, H + 1, 2 * FFN), (3, FFN, H), rf"gate_up must have shape \(E, H={H}, 2F\)"),
        ((3, H, 2 * FFN - 1), (3, FFN, H), "gate_up's last dim must be even"),
        ((3, H, 2 * FFN), (3, FFN, H + 1), rf"down must have shape \(E=3, F={FFN}, H={H}\)"),
        ((3, H, 2 * FFN), (2, FFN, H), rf"down must have shape \(E=3, F={FFN}, H={H}\)"),
        ((4, H, 2 * FFN), (4, FFN, H), r"offsets must have shape \(E\+1,\) = \(5,\) for E=4 experts"),
    ],
)
def test_grouped_swiglu_rejects_weights_of_the_wrong_shape(gate_up_shape: tuple, down_shape: tuple, match: str) -> None:
    offsets = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    with pytest.raises(RoutingError, match=match):
        grouped_swiglu(torch.randn(6, H), offsets, torch.randn(gate_up_shape), torch.randn(down_shape))
    with pytest.raises(RoutingError, match="x must be 2-D"):
        grouped_swiglu(torch.randn(6, H, 1), offsets, torch.randn(3, H, 2 * FFN), torch.randn(3, FFN, H))
    with pytest.raises(RoutingError, match=r"x \(torch.float64\) and the weights .* must share a dtype"):
        grouped_swiglu(torch.randn(6, H).double(), offsets, torch.randn(3, H, 2 * FFN), torch.randn(3, FFN, H))


def _loop_experts(x: torch.Tensor, sizes: list[int], experts: SwiGLUExperts) -> torch.Tensor:
    out, start = torch.zeros(sum(sizes), experts.hidden_size, dtype=torch.float64), 0
    for e, n in enumerate(sizes):
        gate, up = (x[start : start + n].double() @ experts.gate_up_proj[e].double()).chunk(2, -1)
        out[start : start + n] = (F.silu(gate) * up) @ experts.down_proj[e].double()
        start += n
    return out


@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 0, 7], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_grouped_experts_vs_loop_with_padding(sizes: list[int]) -> None:
    torch.manual_seed(len(sizes) + sum(sizes))
    experts = GroupedExperts(4, H, FFN)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    pad = 3
    x = torch.randn(sum(sizes) + pad, H, requires_grad=True)
    with SyncCounter() as counter:
        y = experts(x, offsets, padded=True, validate=False)  # the hot path's call: no offsets read on the host
        (y * torch.randn_like(y)).sum().backward()
    assert counter.num_syncs == 0
    torch.testing.assert_close(y[: sum(sizes)].double(), _loop_experts(x.detach(), sizes, experts))
    assert torch.equal(y[sum(sizes) :], torch.zeros(pad, H))
    assert torch.equal(x.grad[sum(sizes) :], torch.zeros(pad, H))


def test_grouped_experts_fallback_float64_and_odd_sizes() -> None:
    experts = GroupedExperts(3, 6, 10).double()  # float64 and 6/10 (unaligned): the per-expert loop
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert not grouped_mm_supported(x, experts.gate_up_proj, experts.down_proj)
    y = experts(x, offsets)
    torch.testing.assert_close(y, _loop_experts(x.detach(), [2, 0, 3], experts))
    assert torch.autograd.gradcheck(lambda a: grouped_swiglu(a, offsets, experts.gate_up_proj, experts.down_proj), x)


# (rows, K, N, group sizes): empty groups, one group with every row, prime row counts, a single row, padding rows
# past the last end (left unwritten by grouped_mm). K and N are multiples of 4: grouped_mm takes 16-byte strides.
GROUPS = [(13, 8, 12, [0, 5, 0, 8]), (17, 4, 4, [17]), (1, 4, 8, [0, 1, 0]), (20, 4, 12, [6, 0, 9])]


@pytest.mark.parametrize(("rows", "k", "n", "sizes"), GROUPS)
def test_grouped_mm_op_matches_a_float64_loop_in_both_layouts(rows: int, k: int, n: int, sizes: list[int]) -> None:
    """The experts' grouped GEMM (``F.grouped_mm`` as a custom op): rows times their expert's weight, and the weight
    gradient layout ``(K, M) x (M, N) -> (E, K, N)`` whose groups run along ``M``."""
    g = torch.Generator().manual_seed(rows * 7 + k)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a, b, grad = torch.randn(rows, k, generator=g), torch.randn(len(sizes), k, n, generator=g), torch.randn(rows, n)
    out, weight_grad = grouped_mm(a, b, ends), grouped_mm(a.t(), grad, ends)
    start = 0
    for group, end in enumerate(ends.tolist()):
        expected = a[start:end].double() @ b[group].double()
        torch.testing.assert_close(out[start:end].double(), expected, rtol=1e-5, atol=1e-5)
        expected = a[start:end].double().t() @ grad[start:end].double()
        torch.testing.assert_close(weight_grad[group].double(), expected, rtol=1e-5, atol=1e-5)
        start = end


def test_grouped_mm_backward_matches_autograd_reference() -> None:
    torch.manual_seed(1)
    experts = GroupedExperts(3, H, FFN)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    x = torch.randn(9, H, requires_grad=True)
    y = experts(x, offsets)
    y.sum().backward()  # an expanded (stride-0) gradient: grouped_mm needs it made contiguous
    grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    experts.zero_grad()
    x2 = x.detach().double().requires_grad_()
    params = [experts.gate_up_proj, experts.down_proj]
    ref = torch.cat(
        [
            (F.silu(a) * b) @ params[1][e].double()
            for e, (s, t) in enumerate([(0, 4), (4, 4), (4, 9)])
            for a, b in [(x2[s:t] @ params[0][e].double()).chunk(2, -1)]
        ]
    )
    ref_grads = torch.autograd.grad(ref.sum(), [x2, *params])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def test_expert_load_metric_against_hand_computation() -> None:
    metric = ExpertLoadMetric(4)
    metric.update(torch.tensor([3, 1, 0, 0], dtype=torch.int32))
    metric.update(torch.tensor([1, 1, 2, 0]), num_dropped=torch.tensor(2), num_pairs=10)
    out = metric.compute()
    counts = [4.0, 2.0, 2.0, 0.0]
    torch.testing.assert_close(out["load_imbalance"], torch.tensor(4.0 / 2.0))
    torch.testing.assert_close(out["dropped_fraction"], torch.tensor(2 / (4 + 10)))
    entropy = -sum(c / 8 * torch.log(torch.tensor(c / 8)) for c in counts if c)
    torch.testing.assert_close(out["load_entropy"], entropy)
    metric.reset()
    metric.update(torch.full((4,), 5))
    out = metric.compute()
    torch.testing.assert_close(out["load_imbalance"], torch.tensor(1.0))
    torch.testing.assert_close(out["load_entropy"], torch.log(torch.tensor(4.0)))
    assert out["dropped_fraction"] == 0


def test_expert_load_metric_update_is_sync_free_and_validates() -> None:
    metric = ExpertLoadMetric(3)
    with SyncCounter() as counter:
        metric.update(torch.tensor([1, 2, 3]), torch.tensor(1), validate=False)  # the per-step call
    assert counter.num_syncs == 0
    with pytest.raises(RoutingError, match="tokens_per_expert"):
        metric.update(torch.tensor([1, 2]))
    with pytest.raises(ConfigError, match="num_experts"):
        ExpertLoadMetric(0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2, 3],), "tokens_per_expert must be a torch.Tensor, got list"),
        ((torch.tensor([1.0, 2.5, 3.0]),), "tokens_per_expert must be an integer tensor, got torch.float32"),
        ((torch.tensor([1, 2, 3]), torch.tensor([1, 0])), r"num_dropped must be an int or a 0-d integer tensor"),
        ((torch.tensor([1, 2, 3]), torch.tensor(1.0)), r"num_dropped must be an int or a 0-d integer tensor"),
        ((torch.tensor([1, 2, 3]), None, 7.5), "num_pairs must be an int >= 0, got 7.5"),
        ((torch.tensor([1, 2, 3]), None, torch.tensor(7.0)), "num_pairs must be an int or a 0-d integer tensor"),
        ((torch.tensor([1, 2, 3]), -1), "num_dropped must be an int >= 0, got -1"),
        ((torch.tensor([1, 2, 3]), True), "num_dropped must be an int >= 0, got True"),
        ((torch.tensor([-1, 0, 0]),), r"tokens_per_expert must be counts >= 0, got \[-1, 0, 0\]"),
        ((torch.tensor([1, 2, 3]), torch.tensor(-2)), "num_dropped must be >= 0, got -2"),
        ((torch.tensor([1, 2, 3]), 1, 5), r"num_pairs must be >= kept \+ dropped = 6 \+ 1 .*got 5"),
        ((torch.tensor([1, 2, 3]), torch.tensor(1), torch.tensor(6)), r"num_pairs must be >= kept \+ dropped = 6 \+ 1"),
    ],
)
def test_expert_load_metric_rejects_bad_counts(args: tuple, match: str) -> None:
    """Negative counts (a NaN entropy), float counts (they would be truncated) and lists raise RoutingError."""
    metric = ExpertLoadMetric(3)
    metric.update(torch.tensor([1, 1, 1]))
    with pytest.raises(RoutingError, match=match):
        metric.update(*args)
    # Nothing of the rejected update was added.
    assert metric.tokens_per_expert.tolist() == [1, 1, 1]
    assert int(metric.num_dropped) == 0 and int(metric.num_pairs) == 3


def test_autocast_bf16_is_sync_free_and_matches_naive() -> None:
    naive, grouped = _pair(4, 2, backend="torch")
    x = torch.randn(2, 7, H)
    with torch.autocast("cpu", dtype=torch.bfloat16), SyncCounter() as counter:
        y = grouped(x)
        y.float().square().sum().backward()
    assert counter.num_syncs == 0, counter.syncs
    assert grouped.experts.gate_up_proj.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_naive = naive(x)
    torch.testing.assert_close(y.float(), y_naive.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_matches_naive_and_is_sync_free() -> None:
    torch.manual_seed(0)
    naive = NaiveMoEBlock(64, 128, 8, 2).cuda().bfloat16()
    grouped = MoEBlock(MoEConfig.build(64, 128, 8, 2, backend="auto")).cuda().bfloat16()
    grouped.load_state_dict(naive.state_dict())
    x = torch.randn(4, 33, 64, device="cuda", dtype=torch.bfloat16)
    y_naive = naive(x)
    grouped(x)  # warm-up: lazy CUDA/Triton initialisation may read device properties
    with SyncCounter(device="cuda") as counter:
        y = grouped(x)
        y.float().square().sum().backward()
    assert counter.num_syncs == 0, counter.syncs  # grouped_mm on sm80+, else the Triton grouped GEMM
    torch.testing.assert_close(y.float(), y_naive.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(grouped.stats.tokens_per_expert.cpu(), naive.stats.tokens_per_expert.cpu())
