"""``--profile fsdp``: per-rank memory and tokens/sec of ``"llmfast_fsdp"`` against DDP and Lightning's FSDP2 peer.

One run of ``world_size`` CPU processes (gloo) trains the same model on the same data under three strategies
(five with ``expert_parallel_size=N > 1``), interleaved ``repeats`` times:

- ``llmfast_fsdp``: ``strategy="llmfast_fsdp"``, the model unchanged;
- ``llmfast``: ``strategy="llmfast"`` (DDP, every rank holds everything);
- ``peer``: Lightning's ``ModelParallelStrategy`` with the ``fully_shard`` calls its documentation shows in
  ``configure_model`` (each transformer block, then the model);
- ``llmfast_ep``: ``LLMFastStrategy(expert_parallel_size=N)`` (DDP for dense parameters, experts split over ``N``);
- ``llmfast_fsdp_ep``: ``LLMFastStrategy(sharding="fsdp", expert_parallel_size=N)`` (FSDP2 x EP on one mesh).

Per rank it counts the bytes of parameters, gradients and optimizer state the rank holds after a step (local
shards of DTensors, whole tensors otherwise) and times the measured steps. The result dictionary::

    {"profile": "fsdp", "device", "world_size", "commit", "machine", "date", "seconds",
     "fsdp": {variant: {"tokens_per_sec", "segments_tokens_per_sec", "final_loss",
                        "bytes_per_rank": {"params", "grads", "optimizer", "total"}}},
     "ratios": {"bytes_vs_ideal",           # bytes / (DDP bytes / world_size)
                "tokens_per_sec_vs_peer",   # median over repeats of the ratio within each repeat
                # with N > 1: {"median", "low", "high"} of the per-repeat ratios
                "fsdp_ep_vs_fsdp", "fsdp_ep_vs_ep"},
     "targets": {"bytes_within_5pct_of_ideal", "tokens_per_sec_at_least_peer"}, "notes": [...]}

Example::

    python -m lightning_llmfast.bench --profile fsdp --json fsdp.json
    python -m lightning_llmfast.bench --profile fsdp --world-size 4 --expert-parallel-size 2  # FSDP2 x EP
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_llmfast.bench.e2e import E2ESettings, make_batches
from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.processes import free_port, leave_world
from lightning_llmfast.bench.steps import Batches, quiet
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.parallel.dims import ParallelDims

__all__ = ["EP_VARIANTS", "FSDP_SETTINGS", "FSDP_VARIANTS", "fsdp_markdown", "run_fsdp_benchmark"]

FSDP_VARIANTS: tuple[str, ...] = ("llmfast_fsdp", "llmfast", "peer")
EP_VARIANTS: tuple[str, ...] = ("llmfast_ep", "llmfast_fsdp_ep")
"""Added with ``expert_parallel_size > 1``: expert parallelism alone (DDP) and FSDP2 x EP."""

FSDP_SETTINGS = E2ESettings(
    model={"hidden_size": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 128, "num_experts": 8},
    seq_len=256,
    batch_size=2,
    mean_doc_len=48,
    warmup_steps=1,
    measured_steps=4,
    repeats=5,
)
"""Model and data of the profile: every parameter's first dimension divides by 2 and 4 (even shards)."""


class _PeerModule(MoEGPTLightningModule):
    """The model as Lightning's ``ModelParallelStrategy`` documentation shards it: by hand, in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


class StepTimeMeter(Callback):
    """Times the steps after the warm-up and counts what the rank holds after the last one."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.tokens = warmup, 0.0, 0
        self.seconds, self.bytes, self.loss = 0.0, {}, float("nan")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            trainer.strategy.barrier()
            self.start = time.perf_counter()
        if batch_idx >= self.warmup:
            self.tokens += batch.num_tokens

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step < trainer.max_steps:
            return
        trainer.strategy.barrier()
        self.seconds = time.perf_counter() - self.start
        self.loss = float(outputs["loss"])
        params = list(pl_module.parameters())  # tied weights count once
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        counts = {
            "params": _nbytes(params),
            "grads": _nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": _nbytes(state),
        }
        self.bytes = {**counts, "total": sum(counts.values())}


def _variants(ep: int) -> tuple[str, ...]:
    return FSDP_VARIANTS + (EP_VARIANTS if ep > 1 else ())


def _strategy(variant: str, world_size: int, ep: int) -> Any:
    timeout = timedelta(seconds=120)
    if variant == "peer":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # "auto" would make every process of one node a tensor-parallel rank: shard over all of them instead.
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1, timeout=timeout)
    from lightning_llmfast.strategy import LLMFastStrategy

    sharding = "fsdp" if variant.startswith("llmfast_fsdp") else "ddp"
    return LLMFastStrategy(sharding=sharding, expert_parallel_size=ep if variant in EP_VARIANTS else 1, timeout=timeout)


def _segment(variant: str, settings: E2ESettings, batches: list[Any], world_size: int, ep: int) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    config = MoEGPTConfig(**settings.model, router_backend="torch")
    module_cls = _PeerModule if variant == "peer" else MoEGPTLightningModule
    module = module_cls(config, lr=settings.lr, warmup_steps=1)
    meter = StepTimeMeter(settings.warmup_steps)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(variant, world_size, ep), max_steps=len(batches),
        callbacks=[meter], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    with quiet():
        trainer.fit(module, train_dataloaders=Batches(batches))
    tokens = trainer.strategy.reduce(torch.tensor(float(meter.tokens)), reduce_op="sum").item()
    return {"tokens": tokens, "seconds": meter.seconds, "bytes": meter.bytes, "loss": meter.loss}


def _worker(out: Path, settings: E2ESettings, repeats: int, ep: int) -> None:
    """One rank: every variant ``repeats`` times, interleaved; writes ``out/rank<r>.json``."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # the ranks share the machine's cores
    steps = settings.segment_steps
    every = make_batches(settings, steps * world_size, vocab_size=MoEGPTConfig().vocab_size)
    batches = every[rank * steps : (rank + 1) * steps]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in _variants(ep)}

    def runner(variant: str) -> Callable[[int], float]:
        def run(_: int) -> float:
            runs[variant].append(_segment(variant, settings, batches, world_size, ep))
            return runs[variant][-1]["seconds"]

        return run

    # Every rank runs the same rounds in the same rotated order: the segments' collectives pair up.
    interleave({v: runner(v) for v in runs}, repeats, warmup=0)
    (out / f"rank{rank}.json").write_text(json.dumps(runs))


def _launch(out: Path, world_size: int, settings: E2ESettings, repeats: int, ep: int, timeout: float) -> None:
    port = free_port()
    spec = json.dumps({"settings": settings.__dict__, "repeats": repeats, "ep": ep})
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "lightning_llmfast.bench.fsdp", str(out), spec]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"fsdp benchmark rank {rank} failed:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _summary(ranks: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """One variant over all ranks: tokens/sec of each segment (its slowest rank), the largest rank's bytes."""
    segments = ranks[0][variant]
    rates = [s["tokens"] / max(max(r[variant][i]["seconds"] for r in ranks), 1e-9) for i, s in enumerate(segments)]
    worst = max((r[variant][-1]["bytes"] for r in ranks), key=lambda b: b["total"])
    return {
        "tokens_per_sec": statistics.median(rates),
        "segments_tokens_per_sec": rates,
        "bytes_per_rank": worst,
        "final_loss": segments[-1]["loss"],
    }


def _paired(summary: dict[str, dict[str, Any]], num: str, den: str) -> dict[str, float]:
    """Median and range over the repeats of ``num``'s tokens/sec over ``den``'s within each repeat."""
    pairs = zip(summary[num]["segments_tokens_per_sec"], summary[den]["segments_tokens_per_sec"], strict=True)
    ratios = [a / b for a, b in pairs]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def _note(world_size: int, settings: E2ESettings, ep: int) -> str:
    return (
        f"{world_size} gloo CPU processes, 1 thread each, expert_parallel_size {ep} for the _ep variants; "
        f"model {settings.model}, rows {settings.batch_size} x "
        f"{settings.seq_len} per rank; median of {settings.repeats} interleaved segments of {settings.measured_steps} "
        "measured steps; bytes: the largest rank's parameters + gradients + optimizer state after the last step"
    )


def run_fsdp_benchmark(
    world_size: int = 2,
    *,
    expert_parallel_size: int = 1,
    settings: E2ESettings = FSDP_SETTINGS,
    repeats: int | None = None,
    measured_steps: int | None = None,
    timeout: float = 900.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the three strategies (five with expert parallelism) on ``world_size`` CPU processes; return the result.

    Args:
        world_size: processes (one gloo rank each).
        expert_parallel_size: ``N > 1`` adds :data:`EP_VARIANTS` (``N`` must divide ``world_size`` and the experts).
        settings: model, rows per rank, steps and repeats (:data:`FSDP_SETTINGS`).
        repeats, measured_steps: overrides of ``settings.repeats`` and ``settings.measured_steps``.
        timeout: seconds the whole run may take before its processes are killed.
        log: progress messages.

    Raises:
        ConfigError: ``world_size`` below 2 (nothing to shard), or an ``expert_parallel_size`` that does not divide it.
        RuntimeError: a rank failed or the run took longer than ``timeout`` seconds.

    Example::

        result = run_fsdp_benchmark(2)
        result["ratios"]["bytes_vs_ideal"]  # ~1.0
    """
    from lightning_llmfast.bench.suite import git_commit, machine

    if world_size < 2:
        raise ConfigError(f"the fsdp profile needs world_size >= 2, got {world_size}")
    ParallelDims(world_size, "fsdp", expert_parallel_size)  # checks the layout before any process starts
    variants = _variants(expert_parallel_size)
    settings = settings.with_overrides(measured_steps=measured_steps, repeats=repeats)
    repeats = settings.repeats
    start = time.perf_counter()
    log(f"fsdp: {world_size} CPU processes, {repeats} x {variants}")
    with tempfile.TemporaryDirectory() as tmp:
        _launch(Path(tmp), world_size, settings, repeats, expert_parallel_size, timeout)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    summary = {variant: _summary(ranks, variant) for variant in variants}
    ideal = summary["llmfast"]["bytes_per_rank"]["total"] / world_size
    bytes_ratio = summary["llmfast_fsdp"]["bytes_per_rank"]["total"] / ideal
    # Paired: the load of a shared machine swings between repeats far more than between neighbouring segments.
    ours, peer = summary["llmfast_fsdp"]["segments_tokens_per_sec"], summary["peer"]["segments_tokens_per_sec"]
    speed_ratio = statistics.median(a / b for a, b in zip(ours, peer))
    ratios: dict[str, Any] = {"bytes_vs_ideal": bytes_ratio, "tokens_per_sec_vs_peer": speed_ratio}
    if expert_parallel_size > 1:
        ratios["fsdp_ep_vs_fsdp"] = _paired(summary, "llmfast_fsdp_ep", "llmfast_fsdp")
        ratios["fsdp_ep_vs_ep"] = _paired(summary, "llmfast_fsdp_ep", "llmfast_ep")
    return {
        "profile": "fsdp",
        "device": "cpu",
        "world_size": world_size,
        "expert_parallel_size": expert_parallel_size,
        "commit": git_commit(),
        "machine": machine(torch.device("cpu")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "fsdp": summary,
        "ratios": ratios,
        "targets": {
            "bytes_within_5pct_of_ideal": abs(bytes_ratio - 1) <= 0.05,
            "tokens_per_sec_at_least_peer": speed_ratio >= 1.0,
        },
        "notes": [_note(world_size, settings, expert_parallel_size)],
        "seconds": round(time.perf_counter() - start, 1),
    }


def fsdp_markdown(result: dict[str, Any]) -> str:
    """The result of :func:`run_fsdp_benchmark` as a Markdown table.

    Example::

        print(fsdp_markdown(run_fsdp_benchmark(2)))
    """
    lines = [
        f"fsdp profile, {result['world_size']} processes ({result['machine']}, {result['commit']})",
        "",
        "| variant | tokens/sec | params MB | grads MB | optimizer MB | total MB / rank | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, entry in result["fsdp"].items():
        b = {k: v / 2**20 for k, v in entry["bytes_per_rank"].items()}
        lines.append(
            f"| {variant} | {entry['tokens_per_sec']:.0f} | {b['params']:.2f} | {b['grads']:.2f} | "
            f"{b['optimizer']:.2f} | {b['total']:.2f} | {entry['final_loss']:.4f} |"
        )
    ratios, targets = result["ratios"], result["targets"]
    lines += [
        "",
        f"bytes per rank / (DDP's / N): {ratios['bytes_vs_ideal']:.3f} (target within 5%: "
        f"{'met' if targets['bytes_within_5pct_of_ideal'] else 'missed'}); tokens/sec vs peer: "
        f"{ratios['tokens_per_sec_vs_peer']:.2f}x (target >= 1: "
        f"{'met' if targets['tokens_per_sec_at_least_peer'] else 'missed'})",
    ]
    for key, label in (("fsdp_ep_vs_fsdp", "FSDP2 alone"), ("fsdp_ep_vs_ep", "EP alone")):
        if key in ratios:
            r = ratios[key]
            lines.append(
                f"FSDP2 x EP tokens/sec vs {label}: {r['median']:.2f}x (per repeat {r['low']:.2f}-{r['high']:.2f}x)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    _spec = json.loads(sys.argv[2])
    _worker(Path(sys.argv[1]), E2ESettings(**_spec["settings"]), int(_spec["repeats"]), int(_spec["ep"]))
    leave_world()
