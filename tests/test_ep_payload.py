"""Quantized expert-parallel dispatch (``dispatch_dtype="bf16"|"fp8"``) on 2 gloo processes, in both dispatch modes:
received rows within the e4m3 bound of docs/distributed.md (and on e4m3's grid of their row scale), MoE block outputs
and gradients against a float64 loop on the quantized tokens, bytes of every ``all_to_all_single`` against the
formula, one host read per forward in capacity mode, and ranks that disagree on the payload raise instead of hanging."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _distributed import run_distributed

from lightning_llmfast import ConfigError, LLMFastStrategy
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.expert_parallel import (
    AllToAllCapacityDispatcher,
    AllToAllDroplessDispatcher,
    shard_experts,
)
from lightning_llmfast.expert_parallel.payload import DispatchPayload
from lightning_llmfast.moe import MoEBlock, MoEConfig, RoutingConfig, route
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.layout import parallelize

HIDDEN = 24
SLACK = 1 + 2.0**-20  # fp32 rounding of the scaling (x / s, q * s)


def _ref_fp8(x: torch.Tensor) -> torch.Tensor:
    """The published layout: ``s = max|row| / 448`` in fp32, ``q = e4m3(x / s)``, received as ``q * s``."""
    scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, 1.0)
    return (x.float() / scale).to(torch.float8_e4m3fn).float() * scale


def _e4m3_bound(x: torch.Tensor) -> torch.Tensor:
    """``max(2**-4 |x|, 2**-10 max|row| / 448)``: half an ulp of 3 mantissa bits, or of e4m3's subnormals."""
    row_max = x.abs().amax(dim=1, keepdim=True) if x.shape[0] else x.new_zeros(0, 1)
    return torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * row_max / 448) * SLACK


def _case(world: int, rank: int, experts: int, top_k: int, tokens: int, routing: str, seed: int) -> Any:
    """This rank's tokens and logits, and every rank's logits (the global batch, the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * tokens, HIDDEN, generator=g) * torch.logspace(-2, 2, world * tokens)[:, None]
    logits = torch.randn(world * tokens, experts, generator=g)
    if routing == "one":  # every token to expert 0: the other rank receives nothing
        logits[:, 0] += 100.0
    mine = slice(rank * tokens, (rank + 1) * tokens)
    return x[mine].contiguous(), logits[mine].contiguous(), logits.view(world, tokens, experts)


def _spy(sent: list[int]) -> Any:
    original = dist.all_to_all_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(inp.numel() * inp.element_size())
        return original(out, inp, *args, **kwargs)

    return original, spy


def _step(dispatcher: Any, x: torch.Tensor, routing: RoutingConfig, logits: torch.Tensor, sent: list[int]) -> Any:
    """dispatch -> a stand-in expert (rows * 3) -> combine -> backward, counting the bytes of every exchange."""
    plan = route(logits, routing)
    xs = x.clone().requires_grad_()
    original, spy = _spy(sent)
    dist.all_to_all_single = spy  # type: ignore[assignment]
    try:
        rows, ctx = dispatcher.dispatch(xs, plan)
        out = dispatcher.combine(rows.rows * 3, ctx)
        out.sum().backward()
    finally:
        dist.all_to_all_single = original  # type: ignore[assignment]
    return rows, xs.grad


def _dispatch_case(rank: int, world: int, experts: int, top_k: int, tokens: int, routing: str, cf: Any) -> None:
    seed = experts * 100 + top_k * 10 + tokens
    x, logits, everyone = _case(world, rank, experts, top_k, tokens, routing, seed)
    config = RoutingConfig(top_k=top_k, capacity_factor=cf, backend="torch")
    kind = AllToAllDroplessDispatcher if cf is None else AllToAllCapacityDispatcher
    results, sent = {}, {}
    for wire in (None, "bf16", "fp8"):
        sent[wire] = []
        dispatcher = kind(dist.group.WORLD, experts, backend="torch", payload=DispatchPayload(wire))
        results[wire] = _step(dispatcher, x, config, logits, sent[wire])
    exact, bf16, fp8 = (results[w][0].rows for w in (None, "bf16", "fp8"))
    # Rows are whole tokens: their row max is the token's, so the bound reads off the exactly sent rows.
    assert torch.equal(bf16, exact.bfloat16().float())
    assert ((fp8 - exact).abs() <= _e4m3_bound(exact)).all()
    assert ((fp8 - bf16).abs() <= _e4m3_bound(exact) + 2.0**-8 * exact.abs()).all()
    assert torch.equal(fp8, _ref_fp8(exact))  # on e4m3's grid of the row scale: the rows did travel as fp8
    # Gradients straight through the quantization: per kept pair its combine weight, times the stand-in expert's
    # 3; in bf16 the weight is rounded on the way to the expert and the product on the way back.
    plan = route(logits, config)
    bf16 = (3 * plan.weights.bfloat16().float()).bfloat16().float()
    for wire, per_pair in ((None, 3 * plan.weights), ("fp8", bf16), ("bf16", bf16)):
        expected = torch.where(plan.kept, per_pair, 0).sum(dim=1)[:, None].expand_as(x)
        torch.testing.assert_close(results[wire][1], expected, rtol=2.0**-22, atol=0)
    _check_bytes(rank, world, experts, top_k, tokens, cf, everyone, sent)


def _check_bytes(
    rank: int, world: int, experts: int, top_k: int, tokens: int, cf: Any, everyone: Any, sent: dict
) -> None:
    """Every exchange's bytes against the formula: rows times bytes a row (fp8: ``H`` + a 4-byte scale)."""
    local = experts // world
    if cf is None:  # rows this rank sends (all its pairs) and receives (every rank's pairs for its experts)
        ids = [torch.topk(everyone[r], top_k, dim=-1).indices for r in range(world)]
        send = tokens * top_k
        recv = sum(int(((i >= rank * local) & (i < (rank + 1) * local)).sum()) for i in ids)
        handshake = [world * (experts + 4) * 8]
    else:  # E * C rows both ways, whatever the routing
        capacity = max(-(-int(cf * tokens * top_k * 2) // (2 * experts)), 0)  # ceil(cf * T * k / E), exact here
        send = recv = experts * min(capacity, tokens * top_k)
        handshake = []
    row = {None: 4 * HIDDEN, "bf16": 2 * HIDDEN, "fp8": HIDDEN + 4}
    for wire, calls in sent.items():
        back = row[DispatchPayload(wire).combine]
        # forward: dispatch, combine; backward: combine's gradient, then dispatch's
        assert calls == [*handshake, send * row[wire], recv * back, send * back, recv * back], (wire, calls)
    assert sent["fp8"][len(handshake)] == sent["bf16"][len(handshake)] // 2 + 4 * send


def _reference(block: MoEBlock, x: torch.Tensor, kept: torch.Tensor, combine: str | None) -> torch.Tensor:
    """float64 loop: softmax top-k routing on ``x``, each kept pair's SwiGLU expert on the fp8-rounded token
    (straight-through), outputs rounded to bf16 when they come back in bf16, weighted sum at home."""
    x64 = x.double()
    xq = x64 + (_ref_fp8(x).double() - x64).detach()
    probs = (x64 @ block.router.weight.double().t()).softmax(dim=-1)
    weights, ids = torch.topk(probs, kept.shape[1], dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    out = []
    for t in range(x.shape[0]):
        y = x64.new_zeros(x.shape[1])
        for s in range(kept.shape[1]):
            if kept[t, s]:
                gate, up = (xq[t] @ gate_up[ids[t, s]]).chunk(2)
                o = (F.silu(gate) * up) @ down[ids[t, s]]
                o = o + (o.bfloat16().double() - o).detach() if combine == "bf16" else o
                y = y + weights[t, s] * o
        out.append(y)
    return torch.stack(out)


def _block_case(rank: int, world: int, cf: Any, combine: str) -> None:
    """The sharded block with fp8 dispatch against the float64 loop: outputs, input, router and expert gradients."""
    torch.manual_seed(21)
    block = MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2, backend="torch", capacity_factor=cf))
    full = copy.deepcopy(block)
    shard_experts(block, dist.group.WORLD, dispatch_dtype=DispatchPayload("fp8", combine=combine))
    x, _, _ = _case(world, rank, 2 * world, 2, 5, "spread", 7 + (cf is not None))
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (block(xs) * grad_out).sum().backward()
    expected = _reference(full, xr, block.stats.plan.kept, combine)
    (expected * grad_out.double()).sum().backward()
    # fp32 combine: fp32 sums of up to 100-fold values against float64; bf16 outputs: the loop rounds them too, at
    # most 1 bf16 ulp apart (2**-7), and their gradients travel in bf16 (2**-8 a value, twice)
    rtol = 1e-4 if combine == "fp32" else 2.0**-7
    _close(block(xs), expected, rtol)
    _close(xs.grad, xr.grad, rtol)
    _close(block.router.weight.grad, full.router.weight.grad, rtol)  # this rank's tokens: its own router gradient
    local = block.dispatcher.local_experts
    for name in ("gate_up_proj", "down_proj"):
        # every rank's tokens reach the local experts: their gradients sum over the ranks' losses
        total = getattr(full.experts, name).grad.clone()
        dist.all_reduce(total)
        mine = getattr(block.experts, name).grad
        assert mine.abs().max() > 0
        _close(mine, total[local.start : local.stop], rtol)


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    expected = expected.double()
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def _steady_capacity_with_one_sync(rank: int, world: int) -> None:
    torch.manual_seed(3)
    block = MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2, backend="torch", capacity_factor=1.0))
    shard_experts(block, dist.group.WORLD, dispatch_dtype="fp8")
    for step in range(2):
        x, _, _ = _case(world, rank, 2 * world, 2, 6, "spread", 40 + step)
        xs = x.requires_grad_()
        with SyncCounter() as counter:
            block(xs).sum().add(block.stats.aux_loss).backward()
        # The one read of every step: the gathered sizes every rank checks (fp8's scales read nothing).
        assert counter.syncs == {"tolist": 1}, counter.syncs
    assert block.dispatcher.host_syncs == 2
    assert xs.grad is not None and xs.grad.abs().sum() > 0


def _disagreement(rank: int, world: int) -> None:
    for cf in (None, 1.0):
        torch.manual_seed(4)
        block = MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2, backend="torch", capacity_factor=cf))
        shard_experts(block, dist.group.WORLD, dispatch_dtype="fp8" if rank else "bf16")
        with pytest.raises(RoutingError, match="dispatch payload"):
            block(torch.randn(4, HIDDEN))


def _fsdp_case(rank: int, world: int) -> None:
    """FSDP2 x EP through ``parallelize`` (the strategy's path): the payload reaches every block, and the fp8 model's
    loss and gradients stay within e4m3's rounding of the same model's with the activations' dtype on the wire."""
    results = []
    for dispatch in (None, DispatchPayload("fp8")):
        torch.manual_seed(6)
        layer = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN), MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2))
        )
        model = torch.nn.Sequential(layer)
        dims = ParallelDims(world, "fsdp", world)
        dims.build_mesh("cpu")
        parallelize(model, dims, [layer], device=torch.device("cpu"), dispatch=dispatch)
        assert layer[1].dispatcher.payload == DispatchPayload.of(dispatch)
        x, _, _ = _case(world, rank, 2 * world, 2, 5, "spread", 60)
        loss = model(x).square().mean()
        loss.backward()
        grad = layer[0].weight.grad.full_tensor()
        results.append((loss.detach(), grad))
    (loss, grad), (loss8, grad8) = results
    assert 0 < abs(loss8 - loss) <= 2.0**-3 * loss
    assert (grad8 - grad).norm() <= 2.0**-3 * grad.norm()


def _worker(rank: int, world: int) -> None:
    # (experts, top_k, tokens per rank, routing, capacity factor): spread, one expert takes everything, one token
    for case in [(4, 2, 7, "spread", None), (4, 1, 6, "one", None), (2, 1, 1, "spread", None),
                 (4, 2, 7, "spread", 1.0), (4, 1, 6, "one", 1.0), (2, 2, 1, "spread", 1.5)]:  # fmt: skip
        _dispatch_case(rank, world, *case)
    for cf, combine in ((None, "fp32"), (1.0, "fp32"), (None, "bf16")):
        _block_case(rank, world, cf, combine)
    _steady_capacity_with_one_sync(rank, world)
    _disagreement(rank, world)
    _fsdp_case(rank, world)


@pytest.mark.slow
def test_quantized_dispatch_on_two_ranks() -> None:
    run_distributed(_worker, 2, timeout=180)


def test_dispatch_dtype_is_validated_at_construction() -> None:
    with pytest.raises(ConfigError, match="'fp16'"):
        LLMFastStrategy(expert_parallel_size=2, dispatch_dtype="fp16")
    with pytest.raises(ConfigError, match="needs expert_parallel_size > 1"):
        LLMFastStrategy(dispatch_dtype="fp8")
    with pytest.raises(ConfigError, match="combine"):
        LLMFastStrategy(expert_parallel_size=2, dispatch_dtype=DispatchPayload("fp8", combine="fp8"))
    with pytest.raises(ConfigError, match=r"torch\.bfloat16"):
        shard_experts(MoEBlock(MoEConfig.build(8, 16, 4, 2)), dispatch_dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert LLMFastStrategy(expert_parallel_size=2, dispatch_dtype="fp8").dispatch_payload.combine == "bf16"
