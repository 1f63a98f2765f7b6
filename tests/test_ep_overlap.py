"""Overlapped expert-parallel exchanges (``ep_overlap``) on 2 gloo processes: the chunked path gives the outputs and
gradients of the sequential one (dropless and capacity, both payloads, shared experts, a rank that receives nothing,
more chunks than rows) with the same host reads and the same bytes; on a slowed link (:class:`SlowLink`) the
reference model's step hides most of the exchange time; the strategy logs ``comm/a2a_ms`` and
``comm/a2a_exposed_ms``; and the timer's arithmetic against hand-computed stamps."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _distributed import run_distributed
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llmfast import ConfigError, LLMFastStrategy, MoEGPTLightningModule
from lightning_llmfast.bench.slow_link import SlowLink
from lightning_llmfast.comm.timing import ExchangeTimer, HostClock
from lightning_llmfast.data import pack_documents
from lightning_llmfast.expert_parallel import grouped_moe_blocks, set_ep_overlap, shard_experts
from lightning_llmfast.expert_parallel.overlap import chunk_count, split_evenly
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.moe import MoEBlock, MoEConfig

HIDDEN = 24
RTOL = 1e-6


def _sent_bytes(sent: list[int]) -> Any:
    original = dist.all_to_all_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(inp.numel() * inp.element_size())
        return original(out, inp, *args, **kwargs)

    return original, spy


def _run(block: MoEBlock, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Forward and backward; outputs, input and parameter gradients, and the bytes of every all_to_all_single."""
    sent: list[int] = []
    original, spy = _sent_bytes(sent)
    xs = x.clone().requires_grad_()
    dist.all_to_all_single = spy  # type: ignore[assignment]
    try:
        y = block(xs)
        (y.square().sum() + block.stats.aux_loss).backward()
    finally:
        dist.all_to_all_single = original  # type: ignore[assignment]
    return [y.detach(), xs.grad, *(p.grad for p in block.parameters())], sum(sent)


def _pair(capacity_factor: float | None, payload: str | None, shared: int, chunks: int | str) -> list[MoEBlock]:
    blocks = []
    for overlap in (None, chunks):
        torch.manual_seed(0)
        extra = {"capacity_factor": capacity_factor} if capacity_factor else {}
        config = MoEConfig.build(HIDDEN, 40, 8, 2, num_shared_experts=shared, backend="torch", **extra)
        block = shard_experts(MoEBlock(config), dispatch_dtype=payload)
        set_ep_overlap(block, overlap, ExchangeTimer(HostClock()))
        blocks.append(block)
    return blocks


def _equivalence_cases(rank: int, world: int) -> None:
    cases = [
        (None, None, 1, 3, 37 + 5 * rank, False),  # unequal tokens per rank
        (None, "fp8", 0, 7, 3, True),  # every token to expert 0: rank 1 receives nothing; chunks of no row
        (None, "bf16", 1, "auto", 1, False),  # one token
        (1.5, "fp8", 1, 2, 29, False),
        (1.5, None, 0, 5, 11, False),  # more chunks than slots: as many chunks as slots
    ]
    for capacity_factor, payload, shared, chunks, tokens, one_expert in cases:
        sequential, overlapped = _pair(capacity_factor, payload, shared, chunks)
        if one_expert:
            for block in (sequential, overlapped):
                with torch.no_grad():
                    block.router.weight.zero_()
                    block.router.weight[0] = 1.0
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank + 3)).abs()
        want, want_bytes = _run(sequential, x)
        got, got_bytes = _run(overlapped, x)
        what = f"rank {rank}: capacity {capacity_factor}, payload {payload}, shared {shared}, chunks {chunks}"
        for g, w in zip(got, want, strict=True):
            atol = RTOL * float(w.abs().max()) if w.numel() else 0.0
            torch.testing.assert_close(g, w, rtol=RTOL, atol=atol, msg=lambda m, what=what: f"{what}: {m}")
        assert got_bytes == want_bytes, (what, got_bytes, want_bytes)
        assert overlapped.dispatcher.host_syncs == sequential.dispatcher.host_syncs, what
        assert overlapped.dispatcher.traffic == sequential.dispatcher.traffic, what
        # Every exchange is timed (what the overlap hides is measured under a slowed link, below).
        for block in (sequential, overlapped):
            block.dispatcher.timer.close()
            assert block.dispatcher.timer.read_ms()[0] > 0, what


def test_overlapped_exchange_equals_the_sequential_one() -> None:
    run_distributed(_equivalence_cases, 2, timeout=180)


# ---------------------------------------------------------------------------------------------- slow link
# Experts heavy against everything else (the exchanges can only hide under the experts of their own layer), and a
# link whose time per step is a fixed share of the step's compute on this machine (measured first, so that a faster or
# busier machine keeps the same balance): what the overlap can hide, measured in step time.
SLOW_MODEL = {
    "vocab_size": 256, "hidden_size": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_size": 4096,
    "num_experts": 4, "top_k": 2, "router_backend": "torch",
}  # fmt: skip
LINK_SHARE = 0.5  # the slow link's time per step against the unslowed sequential step
ROUND_REPEATS, MAX_ROUNDS = 3, 4
MAX_RATIO = 0.6  # the added step time must shrink by at least 40%


def _reference_model(chunks: int | None) -> tuple[MoEGPT, ExchangeTimer]:
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(**SLOW_MODEL))
    for _, block in grouped_moe_blocks(model):
        shard_experts(block)
    timer = ExchangeTimer(HostClock())
    set_ep_overlap(model, chunks, timer)
    return model, timer


def _step_ms(model: MoEGPT, ids: torch.Tensor, link: SlowLink | None) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    dist.barrier()  # both ranks start together: a step's time is its own, not the other rank's lag
    start = time.perf_counter()
    if link is not None:
        link.__enter__()
    try:
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
    finally:
        if link is not None:
            link.__exit__(None, None, None)
    return (time.perf_counter() - start) * 1e3, loss.item()


def _added_ms(times: dict[str, list[float]], mode: str) -> float:
    """The step time the slow link adds: the fastest slowed step less the fastest unslowed one (the noise of a
    shared machine only ever slows a step down)."""
    return min(times[mode + "/slow"]) - min(times[mode + "/fast"])


def _slow_link_cases(rank: int, world: int) -> None:
    timed = {"sequential": _reference_model(None), "overlapped": _reference_model(4)}
    models = {mode: model for mode, (model, _) in timed.items()}
    exchange: dict[str, list[tuple[float, float]]] = {mode: [] for mode in models}  # (a2a ms, exposed ms)
    ids = torch.randint(0, SLOW_MODEL["vocab_size"], (2, 128), generator=torch.Generator().manual_seed(rank))
    for model in models.values():  # warm-up
        _step_ms(model, ids, None)
    counter = SlowLink(1e12)  # counts the bytes of a step, adds nothing
    fast = min(_step_ms(models["sequential"], ids, counter if r == 0 else None)[0] for r in range(3))
    agreed = torch.tensor([fast, float(counter.sent_bytes)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    bandwidth = float(agreed[1]) / (LINK_SHARE * float(agreed[0]) / 1e3)  # bytes/s
    times: dict[str, list[float]] = {f"{m}/{s}": [] for m in models for s in ("fast", "slow")}
    losses: dict[str, list[float]] = {m: [] for m in models}
    for _ in range(MAX_ROUNDS):
        for _ in range(ROUND_REPEATS):  # interleaved: the machine's load drifts alike for all four
            for mode, model in models.items():
                for speed in ("fast", "slow"):
                    ms, loss = _step_ms(model, ids, SlowLink(bandwidth) if speed == "slow" else None)
                    times[f"{mode}/{speed}"].append(ms)
                    losses[mode].append(loss)
                    timer = timed[mode][1]
                    timer.close()
                    read = timer.read_ms()  # a host clock: every step's stamps are complete once it returned
                    if speed == "slow" and read is not None:
                        exchange[mode].append(read)
        ratio = _added_ms(times, "overlapped") / _added_ms(times, "sequential")
        # The time the overlapped step waited for its exchanges, against the sequential step's exchange time
        # (unoverlapped: the link's whole time, which chunking does not shrink).
        exposed_ratio = min(e for _, e in exchange["overlapped"]) / min(b for b, _ in exchange["sequential"])
        decided = torch.tensor([float(ratio <= MAX_RATIO and exposed_ratio <= MAX_RATIO)])
        dist.all_reduce(decided, op=dist.ReduceOp.MIN)  # every rank stops after the same round
        if decided.item():
            break
    spread = {k: (round(min(v)), round(statistics.median(v))) for k, v in times.items()}
    if rank == 0:
        print(f"slow link {bandwidth / 1e6:.2f} MB/s: ", end="")
        print(f"added {_added_ms(times, 'sequential'):.0f} ms sequential, ", end="")
        print(f"{_added_ms(times, 'overlapped'):.0f} ms overlapped, ratio {ratio:.2f}; (min, median) {spread}", end="")
        print(f"; exposed / sequential exchange time {exposed_ratio:.2f}")
    for got, want in zip(losses["overlapped"], losses["sequential"], strict=True):
        assert abs(got - want) <= RTOL * abs(want), (got, want)
    assert _added_ms(times, "sequential") > LINK_SHARE * fast / 4, times  # the link did slow the sequential step
    assert ratio <= MAX_RATIO, (ratio, spread)
    # The timer sees the same: the sequential step waits for most of its exchange time, the overlapped one's
    # exposed time stays below the sequential exchange time by the margin the step time shows.
    assert all(exposed >= 0.5 * busy for busy, exposed in exchange["sequential"]), exchange
    assert exposed_ratio <= MAX_RATIO, (exposed_ratio, exchange)


@pytest.mark.slow
def test_slow_link_overlap_hides_the_exchange() -> None:
    run_distributed(_slow_link_cases, 2, timeout=400)


# ---------------------------------------------------------------------------------------------- strategy
class _Logged(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        names = ("comm/a2a_ms", "comm/a2a_exposed_ms")
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in names})


FIT_LINK = 1e6  # bytes/s: about 2 ms an exchange of the fits below


def _fit(rank: int, overlap: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16, num_experts=4, top_k=2,
        router_backend="torch",
    )  # fmt: skip
    module = MoEGPTLightningModule(config, lr=1e-2, warmup_steps=1)
    g = torch.Generator().manual_seed(7 + rank)
    batches = [next(pack_documents([torch.randint(0, 64, (16,), generator=g)], 16, 1)) for _ in range(3)]
    logged = _Logged()
    strategy = LLMFastStrategy(
        expert_parallel_size=2, ep_overlap=overlap, ep_overlap_chunks=3, process_group_backend="gloo"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[logged],
    )  # fmt: skip
    with SlowLink(FIT_LINK):  # every exchange in flight for a while: the sequential steps wait for them
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, logged.metrics


def _fit_cases(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    sequential, seq_logged = _fit(rank, False)
    overlapped, ovl_logged = _fit(rank, True)
    for name, value in sequential.items():  # three AdamW steps amplify summation-order differences
        torch.testing.assert_close(overlapped[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for logged in (seq_logged, ovl_logged):
        assert not logged[0] and all(step["comm/a2a_ms"] > 0 for step in logged[1:]), logged  # step 0: read at 1
    # Under the slowed link the sequential step waits for its exchanges (how much the overlap hides: above).
    assert all(step["comm/a2a_exposed_ms"] > 0 for step in seq_logged[1:]), seq_logged


@pytest.mark.slow
def test_strategy_overlaps_and_logs_exchange_times() -> None:
    run_distributed(_fit_cases, 2, timeout=300.0)


# ---------------------------------------------------------------------------------------------- single process
class _Clock:
    """Stamps are numbers given by the test; ``None`` is a stamp not reached yet."""

    def stamp(self) -> float:
        return 0.0

    def ready(self, stamp: float | None) -> bool:
        return stamp is not None

    def elapsed_ms(self, start: float, end: float) -> float:
        return end - start


def test_exchange_timer_union_of_spans_and_sum_of_waits() -> None:
    timer = ExchangeTimer(_Clock())
    assert timer.read_ms() is None
    for start, end in ((0.0, 10.0), (5.0, 12.0), (20.0, 25.0)):  # overlapping spans count once: 12 + 5
        span = timer.begin()
        span[0] = start
        timer.end(span, end)
    timer.waited(8.0, 13.0)  # a host woken after the exchange completed: counted up to the completion, 12
    timer.waited(14.0, 16.0)  # no exchange in flight: not exposed
    timer.waited(24.0, 25.0)
    timer.close()
    pending = timer.begin()  # the next step: its completion not stamped yet
    timer.close()
    assert timer.read_ms() == (17.0, 5.0)
    assert timer.read_ms() is None  # read steps are forgotten; the pending one waits
    timer.end(pending, 1.0)
    assert timer.read_ms() == (1.0, 0.0)


class _Evaluated(L.LightningModule):
    """Each evaluation step runs one exchange of 100 ms on ``timer`` (stamps given by hand, as with :class:`_Clock`)."""

    def __init__(self, timer: ExchangeTimer) -> None:
        super().__init__()
        self.timer = timer

    def _exchange(self) -> None:
        span = self.timer.begin()
        span[0] = 100.0
        self.timer.waited(150.0, 160.0)
        self.timer.end(span, 200.0)

    def validation_step(self, *args: Any) -> None:
        self._exchange()

    def test_step(self, *args: Any) -> None:
        self._exchange()

    def predict_step(self, *args: Any) -> None:
        self._exchange()


def test_evaluation_exchanges_are_dropped_and_never_charged_to_a_training_step() -> None:
    timer = ExchangeTimer(_Clock())
    strategy = LLMFastStrategy(expert_parallel_size=2)
    module = _Evaluated(timer)
    strategy._lightning_module, strategy.model, strategy._a2a_timer = module, module, timer
    span = timer.begin()  # a training step's exchange, still open when validation starts (val_check_interval)
    span[0] = 0.0
    timer.end(span, 10.0)
    timer.waited(2.0, 5.0)
    for _ in range(50):  # a validate/test/predict run of many steps: the timer holds nothing between them
        for step in (strategy.validation_step, strategy.test_step, strategy.predict_step):
            step(None, 0)
            assert not timer._spans and not timer._waits and len(timer._closed) == 1
    timer.close()  # what the next training step does first
    assert timer.read_ms() == (10.0, 3.0)  # the training step alone: no evaluation exchange charged to it
    assert timer.read_ms() is None and not timer._closed


def test_chunk_rules() -> None:
    assert split_evenly(7, 3) == [2, 2, 3] and split_evenly(0, 2) == [0, 0] and split_evenly(2, 4) == [0, 1, 0, 1]
    assert chunk_count("auto", 100) == 1 and chunk_count("auto", 600) == 2 and chunk_count("auto", 10**6) == 4
    assert chunk_count(8, 10, limit=3) == 3 and chunk_count(5, 10) == 5


def test_bad_overlap_arguments() -> None:
    for chunks in (0, -1, "many", 2.0, True):
        with pytest.raises(ConfigError, match="ep_overlap_chunks must be an int >= 1 or 'auto'"):
            LLMFastStrategy(expert_parallel_size=2, ep_overlap_chunks=chunks)
    with pytest.raises(ConfigError, match="ep_overlap must be a bool"):
        LLMFastStrategy(expert_parallel_size=2, ep_overlap="yes")
    assert LLMFastStrategy(expert_parallel_size=2, ep_overlap=False).ep_overlap_chunks is None
    assert LLMFastStrategy(expert_parallel_size=2).ep_overlap_chunks == "auto"
    with pytest.raises(ConfigError, match="ep_overlap_chunks"):
        set_ep_overlap(torch.nn.Linear(2, 2), 0)
    with pytest.raises(ConfigError, match="bandwidth > 0"):
        SlowLink(0)
