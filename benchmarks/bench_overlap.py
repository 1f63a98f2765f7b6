"""Overlapped against sequential expert-parallel exchanges (``ep_overlap``) over a link of bandwidth B: the reference
model's training step (forward+backward) on 2 CPU processes (gloo), its exchanges slowed to B by
:class:`~lightning_llmfast.bench.slow_link.SlowLink` (each completes bytes/B after the link took it, so chunking
does not shrink the link time).

Per B and mode (same weights, same tokens, interleaved repeats, :func:`~lightning_llmfast.bench.harness.interleave`):
the step time (the slowest rank's; median, min, max), the time the slow link adds to it (against the same mode at
B = infinity, from the fastest steps: a shared machine's noise only ever slows a step), the exchange time and the
exposed time of :class:`~lightning_llmfast.comm.timing.ExchangeTimer` (``comm/a2a_ms``, ``comm/a2a_exposed_ms``;
rank 0, median), and the ratio overlapped / sequential of the added time with its spread (extremes of the repeats).

``--device cuda`` (the ``overlap`` stage of ``benchmarks/gpu_check.sh``): one process on one GPU over NCCL, a larger
model, the link time a ``torch.cuda._sleep`` on the communication stream (every byte of the world-of-one exchange
counts as crossing the link), the exchange times from CUDA events.

Usage::

    python benchmarks/bench_overlap.py                  # -> benchmarks/results/overlap.json and overlap.png
    python benchmarks/bench_overlap.py --quick          # fewer bandwidths and repeats
    python benchmarks/bench_overlap.py --json out.json --plot out.png
    python benchmarks/bench_overlap.py --device cuda --json gpu_out/overlap.json --plot gpu_out/overlap.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_moe_ep import init_worker, spawn

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.bench.slow_link import SlowLink
from lightning_llmfast.comm.timing import ExchangeTimer, clock_for
from lightning_llmfast.expert_parallel import grouped_moe_blocks, set_ep_overlap, shard_experts
from lightning_llmfast.models import MoEGPT, MoEGPTConfig

__all__ = ["run"]

RESULTS = Path(__file__).parent / "results"
# Experts heavy against the rest of the step (an exchange hides only under the experts of its own layer).
MODEL = {
    "vocab_size": 256, "hidden_size": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_size": 4096,
    "num_experts": 4, "top_k": 2, "router_backend": "torch",
}  # fmt: skip
TOKENS = (2, 128)  # per rank
CUDA_MODEL = {
    **MODEL, "hidden_size": 1024, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "ffn_size": 4096, "num_experts": 8,
}  # fmt: skip
CUDA_TOKENS = (4, 2048)
CHUNKS = 4
MODES = {"sequential": None, "overlapped": CHUNKS}


def _model(config: dict[str, Any], chunks: int | None, timer: ExchangeTimer, device: torch.device) -> MoEGPT:
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(**config)).to(device)
    for _, block in grouped_moe_blocks(model):
        shard_experts(block)
    set_ep_overlap(model, chunks, timer)
    return model


def _init(rank: int, world: int, port: int, device: torch.device) -> None:
    if device.type != "cuda":
        init_worker(rank, world, port)
        return
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120),
        device_id=device,
    )  # fmt: skip


def _timed_step(model: MoEGPT, ids: torch.Tensor, bandwidth: float, timer: ExchangeTimer, exchange: list) -> Any:
    """An :func:`interleave` implementation: one training step over the link, timed as its slowest rank's."""

    def step(r: int) -> float:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        link = SlowLink(bandwidth) if math.isfinite(bandwidth) else None
        if link is not None:
            link.__enter__()
        try:
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        finally:
            if link is not None:
                link.__exit__(None, None, None)
        if ids.is_cuda:
            torch.cuda.synchronize()  # step boundaries only: the step's own time, its events readable
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=ids.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        timer.close()
        times = timer.read_ms()
        if r >= 0 and times is not None:
            exchange.append(times)
        return float(elapsed)

    return step


def _worker(
    rank: int, world: int, port: int, device_type: str, bandwidths: list[float], repeats: int, out: str
) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    _init(rank, world, port, device)
    config, tokens = (CUDA_MODEL, CUDA_TOKENS) if device.type == "cuda" else (MODEL, TOKENS)
    timers = {mode: ExchangeTimer(clock_for(device)) for mode in MODES}
    models = {mode: _model(config, chunks, timers[mode], device) for mode, chunks in MODES.items()}
    ids = torch.randint(0, config["vocab_size"], tokens, generator=torch.Generator().manual_seed(rank)).to(device)
    exchange: dict[str, list[tuple[float, float]]] = {}
    impls: dict[str, Callable[[int], float | None]] = {}
    for bandwidth in bandwidths:
        for mode, model in models.items():
            name = f"{mode}@{bandwidth:g}"
            exchange[name] = []
            impls[name] = _timed_step(model, ids, bandwidth, timers[mode], exchange[name])
    measured = interleave(impls, repeats)
    if rank == 0:
        rows = [_row(bandwidth, measured, exchange) for bandwidth in bandwidths]
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)",
            "model": config,
            "tokens_per_rank": tokens[0] * tokens[1],
            "chunks": CHUNKS,
            "ep": world,
            "repeats": repeats,
            "load_average": os.getloadavg(),
            "results": rows,
        }
        Path(out).write_text(json.dumps(report))
    leave_world()


def _row(bandwidth: float, measured: dict[str, Any], exchange: dict[str, list[tuple[float, float]]]) -> dict:
    row: dict[str, Any] = {"link_MBps": bandwidth / 1e6 if math.isfinite(bandwidth) else None}
    for mode in MODES:
        m, base = measured[f"{mode}@{bandwidth:g}"], measured[f"{mode}@inf"]
        times = exchange[f"{mode}@{bandwidth:g}"]
        row[mode] = {
            "step_ms": 1e3 * m.median,
            "step_ms_min": 1e3 * m.low,
            "step_ms_max": 1e3 * m.high,
            "added_ms": 1e3 * (m.low - base.low),
            "added_ms_median": 1e3 * (m.median - base.median),
            "a2a_ms": statistics.median(t[0] for t in times) if times else None,
            "a2a_exposed_ms": statistics.median(t[1] for t in times) if times else None,
        }
    seq, ovl = row["sequential"], row["overlapped"]
    if math.isfinite(bandwidth) and seq["added_ms"] > 0:
        row["added_ratio"] = ovl["added_ms"] / seq["added_ms"]
        row["added_ratio_median"] = ovl["added_ms_median"] / seq["added_ms_median"]
    return row


def run(quick: bool = False, repeats: int | None = None, device: str = "cpu", timeout: float = 1800) -> dict[str, Any]:
    """Spawn 2 gloo processes (``"cuda"``: one NCCL process), measure both modes at every bandwidth interleaved,
    return rank 0's report.

    Example::

        report = run(quick=True)
        report["results"][1]["added_ratio"]
    """
    if device == "cuda":
        bandwidths = [math.inf, 50e9, 12.5e9] if quick else [math.inf, 100e9, 50e9, 25e9, 12.5e9]
    else:
        bandwidths = [math.inf, 2.6e6, 1.3e6] if quick else [math.inf, 5.2e6, 2.6e6, 1.3e6, 0.65e6]
    world = 1 if device == "cuda" else 2
    return spawn(_worker, world, (device, bandwidths, repeats or (3 if quick else 7)), timeout)


def print_report(report: dict[str, Any]) -> None:
    """Print :func:`run`'s report as a markdown table."""
    print(f"\nReference model step, ep={report['ep']} on {report['device']}, ", end="")
    print(f"{report['tokens_per_rank']} tokens per rank, {report['chunks']} chunks, ", end="")
    print(f"min/median of {report['repeats']}, load {report['load_average'][0]:.1f}")
    print("| link MB/s | seq step ms | seq added ms | seq exposed ms | overlap step ms | overlap added ms "
          "| overlap exposed ms | added ratio (min / median) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["results"]:
        seq, ovl = r["sequential"], r["overlapped"]
        link = "inf" if r["link_MBps"] is None else f"{r['link_MBps']:.2f}"
        ratio = f"{r['added_ratio']:.2f} / {r['added_ratio_median']:.2f}" if "added_ratio" in r else "-"
        print(
            f"| {link} | {seq['step_ms']:.0f} ({seq['step_ms_min']:.0f}-{seq['step_ms_max']:.0f}) "
            f"| {seq['added_ms']:.0f} | {seq['a2a_exposed_ms']:.0f} "
            f"| {ovl['step_ms']:.0f} ({ovl['step_ms_min']:.0f}-{ovl['step_ms_max']:.0f}) "
            f"| {ovl['added_ms']:.0f} | {ovl['a2a_exposed_ms']:.0f} | {ratio} |"
        )


def plot(report: dict[str, Any], path: Path) -> None:
    """Step time and exposed exchange time against the link bandwidth, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["link_MBps"] is not None]
    links = [r["link_MBps"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, color in (("sequential", "tab:red"), ("overlapped", "tab:blue")):
        ax.plot(links, [r[mode]["step_ms_min"] for r in rows], "o-", color=color, label=f"{mode}: step")
        ax.plot(links, [r[mode]["a2a_exposed_ms"] for r in rows], "s--", color=color, label=f"{mode}: exposed a2a")
        base = next(r for r in report["results"] if r["link_MBps"] is None)[mode]["step_ms_min"]
        ax.axhline(base, color=color, lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel(f"link bandwidth (MB/s per rank), {report['device']}")
    ax.set_ylabel("ms per training step")
    ax.set_title(f"ep={report['ep']}, {report['chunks']} chunks (dotted: no slow link)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", type=Path, default=RESULTS / "overlap.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "overlap.png")
    args = parser.parse_args()
    report = run(args.quick, args.repeats, args.device)
    print_report(report)
    args.json.write_text(json.dumps(report, indent=1))
    plot(report, args.plot)


if __name__ == "__main__":
    main()
