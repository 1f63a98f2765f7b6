"""MoEBlock's DeepSeek-era options against float64 loops: shared experts, group-limited routing, route_scale, token
masks, the three aux losses, the per-step expert-bias update, and one fullgraph compile with every option."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe import MoEBlock, MoEConfig, SequenceBoundaries

H, FFN, E = 12, 8, 8  # multiples of 4: float32 grouped_mm (the sync-free CPU path) takes them


def _block(**kwargs: object) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(H, FFN, E, kwargs.pop("top_k", 2), **kwargs))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if block.expert_bias is not None:
        block.expert_bias.normal_(std=0.05)
    return block


def _loop(block: MoEBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token float64 loop: DeepSeek-V3 group-limited sigmoid routing, scaled weights, plus the shared SwiGLU."""
    scores = (x.double() @ block.router.weight.double().T).sigmoid()
    sel = scores + (block.expert_bias.double() if block.expert_bias is not None else 0.0)
    size = E // block.config.routing.num_groups
    per_group = max(1, block.config.routing.top_k // block.config.routing.topk_groups)
    out = []
    for t in range(x.shape[0]):
        y = torch.zeros(H, dtype=torch.float64)
        if mask[t]:
            group_score = [
                sel[t, g * size : (g + 1) * size].sort(descending=True).values[:per_group].sum()
                for g in range(block.config.routing.num_groups)
            ]
            best = sorted(range(block.config.routing.num_groups), key=lambda g: -float(group_score[g].detach()))[
                : block.config.routing.topk_groups
            ]
            allowed = [e for e in range(E) if e // size in best]
            chosen = sorted(allowed, key=lambda e: -float(sel[t, e].detach()))[: block.config.routing.top_k]
            total = sum(scores[t, e] for e in chosen) + 1e-20
            for e in chosen:
                gate, up = (x[t].double() @ block.experts.gate_up_proj[e].double()).chunk(2)
                y = y + block.config.routing.route_scale * scores[t, e] / total * (
                    (F.silu(gate) * up) @ block.experts.down_proj[e].double()
                )
        shared = block.shared_experts
        gate, up = (x[t].double() @ shared.gate_up_proj.double()).chunk(2)
        out.append(y + (F.silu(gate) * up) @ shared.down_proj.double())
    return torch.stack(out)


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_shared_experts_groups_scale_and_mask_match_a_float64_loop(kernel_backend: str, num_tokens: int) -> None:
    block = _block(
        num_shared_experts=2,
        num_groups=4,
        topk_groups=2,
        route_scale=2.5,
        score="sigmoid",
        expert_bias=True,
        backend=kernel_backend,
    )
    assert block.shared_experts.down_proj.shape == (2 * FFN, H)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens), requires_grad=True)
    mask = torch.arange(num_tokens) % 3 != 1
    mask[0] = True
    with SyncCounter() as counter:
        y = block(x, token_mask=mask)
        g = torch.randn_like(y)
        (y * g).sum().backward()
    assert counter.num_syncs == 0, counter.syncs
    params = list(block.parameters())
    grads = [p.grad.clone() for p in params]
    xd = x.detach().double().requires_grad_()
    want = _loop(block, xd, mask)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    expected = torch.autograd.grad((want * g.double()).sum(), [xd, *params], allow_unused=True)
    torch.testing.assert_close(x.grad.double(), expected[0], rtol=1e-4, atol=1e-5)
    for got, exp in zip(grads, expected[1:]):
        torch.testing.assert_close(
            got.double(), exp.double() if exp is not None else torch.zeros_like(got.double()), rtol=1e-4, atol=1e-5
        )
    assert int(block.stats.tokens_per_expert.sum()) == int(mask.sum()) * 2


def test_global_aux_loss_accumulates_over_the_step() -> None:
    block = _block(aux_loss="global").train()
    counts = torch.zeros(E, dtype=torch.int64)
    for size in (5, 7, 3):
        x = torch.randn(size, H)
        block(x)
        plan = block.stats.plan
        counts += plan.routed_per_expert.long()
        probs = (x.double() @ block.router.weight.double().T).softmax(-1).mean(0)
        want = E * sum(float(counts[e]) / float(counts.sum()) * probs[e] for e in range(E))
        torch.testing.assert_close(block.stats.aux_loss.double(), want, rtol=1e-5, atol=1e-6)
    block.finish_step()
    block(torch.randn(4, H))
    torch.testing.assert_close(block.stats.aux_loss, block.stats.plan.aux_loss)  # a fresh step: this batch only
    block.eval()(torch.randn(4, H))
    assert block.stats.aux_loss is block.stats.plan.aux_loss


def _documents(lengths: list[int]) -> SequenceBoundaries:
    return SequenceBoundaries(torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths)), len(lengths))


def test_sequence_aux_loss_uses_the_given_boundaries_or_rows() -> None:
    block = _block(aux_loss="sequence", score="sigmoid")
    x = torch.randn(2, 6, H)
    block(x)
    by_rows = block.stats.plan.sequence_aux_loss(_documents([6, 6]))
    torch.testing.assert_close(block.stats.aux_loss, by_rows)
    documents = _documents([2, 7, 3])
    block(x, boundaries=documents)
    torch.testing.assert_close(block.stats.aux_loss, block.stats.plan.sequence_aux_loss(documents))
    assert not torch.allclose(block.stats.aux_loss, by_rows)  # the boundaries did change the loss


def test_bias_updates_once_per_step_from_pre_capacity_counts() -> None:
    block = _block(expert_bias=True, bias_update_rate=0.1, capacity_factor=0.5).train()
    start = block.expert_bias.clone()
    total = torch.zeros(E, dtype=torch.float64)
    for size in (6, 9):
        x = torch.randn(size, H)
        block(x)
        sel = (x.double() @ block.router.weight.double().T).softmax(-1) + start.double()
        for t in range(size):
            total[sel[t].argsort(descending=True)[:2]] += 1
        assert torch.equal(block.expert_bias, start)  # not per forward
    block.finish_step()
    torch.testing.assert_close(block.expert_bias.double(), start.double() + 0.1 * torch.sign(total.mean() - total))
    assert int(block._step_counts.sum()) == 0
    per_forward = _block(expert_bias=True, bias_update_rate=0.1, bias_update="forward").train()
    before = per_forward.expert_bias.clone()
    per_forward(torch.randn(5, H))
    load = per_forward.stats.plan.routed_per_expert.double()
    torch.testing.assert_close(per_forward.expert_bias.double(), before.double() + 0.1 * torch.sign(load.mean() - load))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aux_loss": "batch"}, "aux_loss must be one of"),
        ({"bias_update": "epoch"}, "bias_update must be one of"),
        ({"num_groups": 3, "topk_groups": 1}, "num_groups=3 must divide num_experts=8"),
        ({"num_groups": 4}, "num_groups and topk_groups go together"),
        ({"shared_ffn_size": 16}, "shared_ffn_size needs num_shared_experts >= 1"),
        ({"num_shared_experts": -1}, "num_shared_experts must be an int >= 0"),
        ({"route_scale": float("nan")}, "route_scale must be a finite number > 0"),
    ],
)
def test_bad_options_fail_at_construction(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoEBlock(MoEConfig.build(H, FFN, E, 2, **kwargs))


def test_bad_token_mask_is_a_routing_error() -> None:
    with pytest.raises(RoutingError, match=r"token_mask must have shape \(2, 3\)"):
        _block()(torch.randn(2, 3, H), token_mask=torch.ones(6, dtype=torch.bool))


def test_compile_fullgraph_with_every_option() -> None:
    """Compiled and eager agree (output, every gradient, the bias after the step) with every option on; two blocks
    with different float options compile one after the other (their floats must not turn symbolic)."""
    kwargs = dict(
        num_shared_experts=1, shared_ffn_size=6, num_groups=4, topk_groups=2, score="sigmoid", expert_bias=True,
        backend="torch",
    )  # fmt: skip
    x = torch.randn(2, 5, H)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    meta = _documents([4, 6])
    for aux_loss, capacity_factor, route_scale in (("sequence", 1.25, 1.5), ("global", 1.5, 2.0)):
        options = dict(kwargs, aux_loss=aux_loss, capacity_factor=capacity_factor, route_scale=route_scale)
        eager, compiled_block = _block(**options), _block(**options)
        compiled = torch.compile(compiled_block, fullgraph=True, backend="aot_eager")
        results = []
        for block, call in ((eager, eager), (compiled_block, compiled)):
            xi = x.clone().requires_grad_()
            y = call(xi, token_mask=mask, boundaries=meta)
            (y.square().sum() + block.stats.aux_loss).backward()
            results.append((y.detach(), xi.grad, block.stats.aux_loss.detach(), *(p.grad for p in block.parameters())))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for block in (eager, compiled_block):
            block.finish_step()
        assert not torch.equal(eager.expert_bias, _block(**options).expert_bias)  # the step did move it
        torch.testing.assert_close(compiled_block.expert_bias, eager.expert_bias)


def test_a_step_bias_that_never_sees_finish_step_warns_once() -> None:
    from lightning_llmfast.moe.block import _UNFINISHED_FORWARDS

    block = MoEBlock(MoEConfig.build(8, 16, 4, 2, expert_bias=True, backend="torch"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(_UNFINISHED_FORWARDS + 5):
            block(torch.randn(5, 8))
    assert sum("finish_step" in str(w.message) for w in seen) == 1
    assert torch.equal(block.expert_bias, torch.zeros(4))  # nothing moved it: what the warning is about
    finished = MoEBlock(MoEConfig.build(8, 16, 4, 2, expert_bias=True, backend="torch"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(_UNFINISHED_FORWARDS + 5):
            finished(torch.randn(5, 8))
            finished.finish_step()
    assert not any("finish_step" in str(w.message) for w in seen)
    assert not torch.equal(finished.expert_bias, torch.zeros(4))
