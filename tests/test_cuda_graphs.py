"""``MoEConfig(cuda_graphs=True)``: what it refuses (host syncs, collectives, dynamic exchange) with a ConfigError, how
it captures (one ``torch.compile(mode="reduce-overhead", fullgraph=True)`` of the block's path, reused), and on a GPU
that the replayed graphs give the eager results."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_llmfast.moe.block as block_module
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.dispatcher import LocalDispatcher, TokenDispatcher

H, FFN, E = 16, 32, 4


class _ExchangingDispatcher(TokenDispatcher):
    """Stands for an all-to-all dispatcher: anything but the local one."""

    def dispatch(self, x: Any, plan: Any, *, x_compute: Any = None) -> Any:
        raise AssertionError("never reached: refused before")

    def combine(self, rows: Any, ctx: Any) -> Any:
        raise AssertionError("never reached: refused before")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"aux_loss": "global"}, "aux_loss='global'"),
        ({"expert_bias": True, "bias_update": "forward"}, "bias_update='forward'"),
        ({"cuda_graphs": 1}, "cuda_graphs"),
    ],
)
def test_collectives_in_the_forward_and_bad_values_are_refused(options: dict[str, Any], match: str) -> None:
    options = {"cuda_graphs": True, **options}
    with pytest.raises(ConfigError, match=match):
        MoEConfig.build(H, FFN, E, 2, **options)


def test_only_the_local_dispatcher_is_captured() -> None:
    config = MoEConfig.build(H, FFN, E, 2, capacity_factor=1.0, cuda_graphs=True)
    with pytest.raises(ConfigError, match="local dispatcher only, got _ExchangingDispatcher"):
        MoEBlock(config, _ExchangingDispatcher())
    block = MoEBlock(config)
    with pytest.raises(ConfigError, match="expert"):
        block.set_dispatcher(_ExchangingDispatcher())
    assert isinstance(block.dispatcher, LocalDispatcher)
    MoEBlock(MoEConfig.build(H, FFN, E, 2), _ExchangingDispatcher())  # without the option: any dispatcher


@pytest.fixture
def compile_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Capture on CPU too, with ``torch.compile`` recorded and the path run eagerly (CUDA graphs need a GPU)."""
    calls: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(block_module, "CAPTURE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_the_block_path_is_compiled_once_for_reduce_overhead(compile_calls, capacity_factor) -> None:
    torch.manual_seed(0)
    graphed = MoEBlock(MoEConfig.build(H, FFN, E, 2, capacity_factor=capacity_factor, cuda_graphs=True))
    eager = MoEBlock(MoEConfig.build(H, FFN, E, 2, capacity_factor=capacity_factor))
    eager.load_state_dict(graphed.state_dict())
    x = torch.randn(3, 7, H)
    for _ in range(2):
        results = []
        for block in (graphed, eager):
            leaf = x.clone().requires_grad_()
            y = block(leaf)
            (y.square().sum() + block.stats.aux_loss).backward()
            results.append((y, leaf.grad, block.router.weight.grad.clone()))
            block.zero_grad()
        for got, expected in zip(*results):
            assert torch.equal(got, expected)
    assert compile_calls == [{"mode": "reduce-overhead", "fullgraph": True}]  # once: the graph is reused


def _static_outputs(value: Any, static: Any) -> Any:
    """``value`` with each tensor that needs no gradient written into ``static``'s (allocated on the capture when
    ``static`` is None), as a CUDA graph's replay writes its outputs into the same memory every time."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            return value
        if static is None:
            return value.detach().clone()
        return static.copy_(value)
    if isinstance(value, tuple):
        statics = static if static is not None else (None,) * len(value)
        items = [_static_outputs(v, s) for v, s in zip(value, statics)]
        return type(value)._make(items) if hasattr(value, "_fields") else tuple(items)
    return value


@pytest.fixture
def graph_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph's semantics on CPU: Python inside the captured callable runs at the capture only (attributes it
    sets on a replay are undone), and every replay writes its outputs into the capture's static memory."""

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        block, state = fn.__self__, {"static": None}

        def replay(*args: Any) -> Any:
            before = dict(vars(block))
            outputs = fn(*args)
            if state["static"] is None:
                state["static"] = _static_outputs(outputs, None)
                return state["static"]
            for name in ("stats",):  # what the replayed region would have set in Python: not set on a replay
                if name in before:
                    setattr(block, name, before[name])
            return _static_outputs(outputs, state["static"])

        return replay

    monkeypatch.setattr(block_module, "CAPTURE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", fake_compile)


def test_stats_after_a_replay_describe_the_replayed_step(graph_replays) -> None:
    """The record read after a replay is that step's (logits, counts, plan), and a record kept from an earlier step
    is not overwritten by the replays after it."""
    torch.manual_seed(0)
    graphed = MoEBlock(MoEConfig.build(H, FFN, E, 2, capacity_factor=1.0, cuda_graphs=True))
    eager = MoEBlock(MoEConfig.build(H, FFN, E, 2, capacity_factor=1.0))
    eager.load_state_dict(graphed.state_dict())
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(2, 5, H, generator=g) for _ in range(3)]
    steps[2][:, :, 0] += 10.0  # another routing, so that stale counts would show
    kept = []
    for x in steps:
        graphed(x)
        eager(x)
        got, expected = graphed.stats, eager.stats
        torch.testing.assert_close(got.router_logits, expected.router_logits, rtol=0, atol=0)
        assert torch.equal(got.tokens_per_expert, expected.tokens_per_expert)
        assert torch.equal(got.plan.expert_ids, expected.plan.expert_ids)
        assert torch.equal(got.num_dropped, expected.num_dropped)
        kept.append((got, expected.router_logits.detach().clone()))
    for record, logits in kept:
        torch.testing.assert_close(record.router_logits, logits, rtol=0, atol=0)


def test_experts_on_the_per_expert_loop_are_refused_at_the_first_forward(compile_calls) -> None:
    block = MoEBlock(MoEConfig.build(H, FFN, E, 2, cuda_graphs=True)).double()
    with pytest.raises(ConfigError, match="per-expert loop"):
        block(torch.randn(5, H, dtype=torch.float64))
    assert not compile_calls


@pytest.mark.cuda
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_captured_block_replays_the_eager_results_on_cuda(cuda_device, capacity_factor) -> None:
    torch.manual_seed(0)
    config = dict(capacity_factor=capacity_factor)
    graphed = MoEBlock(MoEConfig.build(64, 128, 8, 2, cuda_graphs=True, **config)).to(cuda_device, torch.bfloat16)
    eager = MoEBlock(MoEConfig.build(64, 128, 8, 2, **config)).to(cuda_device, torch.bfloat16)
    eager.load_state_dict(graphed.state_dict())
    for step in range(4):  # capture, then replays on new data
        x = torch.randn(2, 64, 64, device=cuda_device, dtype=torch.bfloat16)
        outs = []
        for block in (graphed, eager):
            leaf = x.clone().requires_grad_()
            y = block(leaf)
            (y.float().square().sum() + block.stats.aux_loss).backward()
            outs.append((y.detach().clone(), leaf.grad.clone(), block.experts.down_proj.grad.clone()))
            block.zero_grad()
        for got, expected in zip(*outs):
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2, msg=f"step {step}")
