"""``--profile scaling``: tokens/sec on 1, 2 and 4 processes at three batch sizes, and the scaling efficiency.

Weak scaling: every rank trains ``B`` rows per step of the same model under ``strategy="llmfast"`` (DDP; one process
has no process group at all), so ``N`` processes train ``N * B`` rows per step. For each world size the ranks are
started (gloo on CPU, NCCL on CUDA) and run every batch size; this repeats ``repeats`` times, world sizes interleaved; a
segment's rate is its global real tokens over the slowest rank's time for the measured steps. The efficiency is
``tokens/s(N) / (N * tokens/s(1))`` at the same ``B``, from the medians, with the range the repeats span
(``min(N) / (N * max(1))`` to ``max(N) / (N * min(1))``). On a machine with fewer cores than processes the
processes share cores, and the efficiency says so.

The result dictionary::

    {"profile": "scaling", "device", "commit", "machine", "date", "seconds", "world_sizes", "batch_sizes",
     "scaling": {B: {N: {"tokens_per_sec" (median), "tokens_per_sec_min", "tokens_per_sec_max",
                        "tokens_per_sec_repeats", "efficiency", "efficiency_range": [low, high]}}},
     "notes": [...]}

Example::

    python -m lightning_llmfast.bench --profile scaling --json scaling.json --plot scaling.png
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_llmfast.bench.e2e import E2ESettings, make_batches
from lightning_llmfast.bench.fsdp import StepTimeMeter
from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.bench.steps import Batches, quiet
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPTConfig, MoEGPTLightningModule

__all__ = ["MAX_SECONDS", "SCALING_SETTINGS", "plot_scaling", "run_scaling_benchmark", "scaling_markdown"]

SCALING_SETTINGS = E2ESettings(
    model={"hidden_size": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 64, "num_experts": 4},
    seq_len=128,
    batch_size=1,
    mean_doc_len=32,
    warmup_steps=1,
    measured_steps=4,
    repeats=3,
)
"""Model and rows of the profile (``batch_size`` is replaced by each of the batch sizes)."""

MAX_SECONDS = 540.0
"""Default soft time budget of the profile: it ends within 10 minutes on a loaded 2-core CPU machine."""


def _segment(settings: E2ESettings, batches: list[Any], world_size: int, device: str) -> dict[str, float]:
    from lightning_llmfast.strategy import LLMFastStrategy

    torch.manual_seed(settings.seed)
    module = MoEGPTLightningModule(MoEGPTConfig(**settings.model), lr=settings.lr, warmup_steps=1)
    meter = StepTimeMeter(settings.warmup_steps)
    with quiet():  # the Trainer's banners too: one Trainer per segment
        trainer = L.Trainer(
            accelerator=device, devices=world_size, strategy=LLMFastStrategy(timeout=timedelta(seconds=120)),
            max_steps=len(batches), callbacks=[meter], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            num_sanity_val_steps=0, limit_val_batches=0, precision=settings.precision,
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=Batches(batches))
    tokens = trainer.strategy.reduce(torch.tensor(float(meter.tokens), device=trainer.strategy.root_device),
                                     reduce_op="sum")  # fmt: skip
    return {"tokens": float(tokens), "seconds": meter.seconds}


def _worker(rank: int, world_size: int, port: int, spec: dict[str, Any], out: str) -> None:
    """One rank: every batch size ``repeats`` times, rotated; writes ``out/rank<r>.json``."""
    # Lightning sees processes started by someone else (LOCAL_RANK set) and joins them instead of launching; with
    # OMP_NUM_THREADS set it keeps one thread per process (else it gives each its share of the cores, which a
    # single process would take all of).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    settings, sizes, device = E2ESettings(**spec["settings"]), spec["batch_sizes"], spec["device"]
    steps = settings.segment_steps
    runs: dict[str, list[dict[str, float]]] = {str(b): [] for b in sizes}

    def runner(size: int) -> Callable[[int], float]:
        def run(_: int) -> float:
            sized = settings.with_overrides(batch_size=size)
            every = make_batches(sized, steps * world_size, vocab_size=MoEGPTConfig().vocab_size)
            runs[str(size)].append(_segment(sized, every[rank * steps : (rank + 1) * steps], world_size, device))
            return runs[str(size)][-1]["seconds"]

        return run

    # Every rank runs the same rounds in the same rotated order: the segments' collectives pair up.
    interleave({str(size): runner(size) for size in sizes}, settings.repeats, warmup=0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(runs))
    leave_world()


def _run_world(world_size: int, spec: dict[str, Any], timeout: float) -> list[dict[str, list[dict[str, float]]]]:
    with tempfile.TemporaryDirectory() as tmp:
        spawn_world(_worker, world_size, (world_size, free_port(), spec, tmp), timeout, "scaling benchmark")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


def _summary(rates: dict[int, list[float]], world_sizes: Sequence[int]) -> dict[str, dict[str, Any]]:
    one = rates[1]
    out = {}
    for n in world_sizes:
        median = statistics.median(rates[n])
        out[str(n)] = {
            "tokens_per_sec": median,
            "tokens_per_sec_min": min(rates[n]),
            "tokens_per_sec_max": max(rates[n]),
            "tokens_per_sec_repeats": rates[n],
            "efficiency": median / (n * statistics.median(one)),
            "efficiency_range": [min(rates[n]) / (n * max(one)), max(rates[n]) / (n * min(one))],
        }
    return out


def run_scaling_benchmark(
    world_sizes: Sequence[int] = (1, 2, 4),
    batch_sizes: Sequence[int] = (1, 2, 4),
    *,
    device: str = "cpu",
    settings: E2ESettings = SCALING_SETTINGS,
    repeats: int | None = None,
    measured_steps: int | None = None,
    timeout: float = 600.0,
    max_seconds: float | None = MAX_SECONDS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure tokens/sec and scaling efficiency; returns the result dictionary.

    Args:
        world_sizes: process counts; must include 1 (the efficiency's reference).
        batch_sizes: rows per rank per step.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (one GPU per process).
        settings: model, row length, steps and repeats (:data:`SCALING_SETTINGS`).
        repeats: override of ``settings.repeats``.
        measured_steps: override of ``settings.measured_steps``.
        timeout: seconds each world size may take before its processes are killed.
        max_seconds: soft budget: a repeat after the first starts only if, at the pace of those before it, it ends
            within this many seconds of the start (``None``: every repeat runs). The result notes a cut.
        log: progress messages.

    Raises:
        ConfigError: ``world_sizes`` without 1, a size or batch size below 1, or more CUDA processes than GPUs.
        TimeoutError: a world size took longer than ``timeout``.
        torch.multiprocessing.ProcessRaisedException: a rank failed.

    Example::

        result = run_scaling_benchmark((1, 2), (1,), repeats=2)
        result["scaling"]["1"]["2"]["efficiency"]
    """
    if 1 not in world_sizes or min(world_sizes) < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError(f"scaling needs world sizes including 1 and batch sizes >= 1, got {world_sizes}, "
                          f"{batch_sizes}")  # fmt: skip
    if device == "cuda" and max(world_sizes) > torch.cuda.device_count():
        raise ConfigError(f"scaling on cuda needs {max(world_sizes)} GPUs, found {torch.cuda.device_count()}")
    settings = settings.with_overrides(measured_steps=measured_steps, repeats=repeats)
    spec = {"settings": settings.__dict__, "batch_sizes": list(batch_sizes), "device": device}
    start = time.perf_counter()
    rates: dict[int, dict[int, list[float]]] = {b: {n: [] for n in world_sizes} for b in batch_sizes}
    once = {**spec, "settings": settings.with_overrides(repeats=1).__dict__}
    done = 0
    for repeat in range(settings.repeats):
        elapsed = time.perf_counter() - start
        if repeat and max_seconds is not None and elapsed * (repeat + 1) / repeat > max_seconds:
            log(f"scaling: stopping after {repeat} repeat(s), another would end past {max_seconds:.0f} s")
            break
        done += 1
        # World sizes interleaved (fresh processes each repeat): a shared machine's load drifts between them alike.
        for n in world_sizes:
            log(f"scaling: repeat {repeat + 1}/{settings.repeats}, {n} process(es), batch sizes {list(batch_sizes)}")
            ranks = _run_world(n, once, timeout)
            for b in batch_sizes:
                segment = [r[str(b)][0] for r in ranks]
                rates[b][n].append(segment[0]["tokens"] / max(max(s["seconds"] for s in segment), 1e-9))
    return _result(settings, device, world_sizes, batch_sizes, rates, done, time.perf_counter() - start)


def _result(
    settings: E2ESettings,
    device: str,
    world_sizes: Sequence[int],
    batch_sizes: Sequence[int],
    rates: dict[int, dict[int, list[float]]],
    done: int,
    seconds: float,
) -> dict[str, Any]:
    from lightning_llmfast.bench.suite import git_commit, machine

    cut = [] if done == settings.repeats else [f"time budget: {done} of {settings.repeats} repeats run"]
    return {
        "profile": "scaling",
        "device": device,
        "commit": git_commit(),
        "machine": machine(torch.device(device)),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "world_sizes": list(world_sizes),
        "batch_sizes": list(batch_sizes),
        "scaling": {str(b): _summary(rates[b], world_sizes) for b in batch_sizes},
        "notes": [
            f"weak scaling under strategy='llmfast' ({'gloo' if device == 'cpu' else 'nccl'}), 1 thread per process; "
            f"model {settings.model}, rows of {settings.seq_len} tokens, B rows per rank; median of "
            f"{done} interleaved segments of {settings.measured_steps} measured steps",
            *cut,
        ],
        "seconds": round(seconds, 1),
    }


def scaling_markdown(result: dict[str, Any]) -> str:
    """The result of :func:`run_scaling_benchmark` as a Markdown table (tokens/s with its range, efficiency).

    Example::

        print(scaling_markdown(run_scaling_benchmark()))
    """
    sizes = result["batch_sizes"]
    lines = [
        f"scaling profile ({result['device']}, {result['machine']}, {result['commit']})",
        "",
        "| processes | " + " | ".join(f"B={b}: tokens/s (min-max) | B={b}: efficiency (range)" for b in sizes) + " |",
        "|---|" + "---|---|" * len(sizes),
    ]
    for n in result["world_sizes"]:
        cells = []
        for b in sizes:
            e = result["scaling"][str(b)][str(n)]
            low, high = e["efficiency_range"]
            cells.append(f"{e['tokens_per_sec']:.0f} ({e['tokens_per_sec_min']:.0f}-{e['tokens_per_sec_max']:.0f})")
            cells.append(f"{e['efficiency']:.2f} ({low:.2f}-{high:.2f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_scaling(result: dict[str, Any], path: Path) -> bool:
    """Tokens/sec and efficiency against processes, one line per batch size; ``False`` without matplotlib.

    Example::

        plot_scaling(result, Path("scaling.png"))
    """
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, eff_ax) = plt.subplots(1, 2, figsize=(10, 4))
    ns = result["world_sizes"]
    for b in result["batch_sizes"]:
        entries = [result["scaling"][str(b)][str(n)] for n in ns]
        rates = [e["tokens_per_sec"] for e in entries]
        errors = [[r - e["tokens_per_sec_min"] for r, e in zip(rates, entries)],
                  [e["tokens_per_sec_max"] - r for r, e in zip(rates, entries)]]  # fmt: skip
        rate_ax.errorbar(ns, rates, yerr=errors, marker="o", capsize=3, label=f"B={b}")
        eff_ax.plot(ns, [e["efficiency"] for e in entries], marker="o", label=f"B={b}")
    eff_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    rate_ax.set(xlabel="processes", ylabel="tokens/s (all ranks)", xticks=ns)
    eff_ax.set(xlabel="processes", ylabel="tokens/s(N) / (N * tokens/s(1))", xticks=ns, ylim=(0, 1.1))
    rate_ax.legend(), eff_ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
