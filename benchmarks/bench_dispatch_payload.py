"""fp8 against bf16 (and fp32) expert-parallel dispatch payloads: an MoE block's forward+backward on ``--ep N`` CPU
processes (gloo), dropless and capacity modes, in one run.

Per mode and ``dispatch_dtype`` (same weights, same tokens; fp8 and bf16 send the outputs and gradients back in bf16,
fp32 sends everything in fp32): bytes every rank puts on the wire per step (a spy on ``all_to_all_single``, handshake
included), the dispatch exchange's bytes alone, the block output's error against the fp32 payload (largest error over
the largest output, and root mean square over root mean square), and the step time (the slowest rank's, median and
range over the interleaved repeats, :func:`~lightning_llmfast.bench.harness.interleave`) with its ratio to bf16.

Usage::

    python benchmarks/bench_dispatch_payload.py            # T=2048 tokens per rank, H=256, F=512, E=8, k=2
    python benchmarks/bench_dispatch_payload.py --quick    # small shapes, seconds
    python benchmarks/bench_dispatch_payload.py --json benchmarks/results/cpu_dispatch_payload_DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_moe_ep import init_worker, spawn, timed
from torch import Tensor

from lightning_llmfast.bench.harness import interleave, ratio_range
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.moe import MoEBlock, MoEConfig

__all__ = ["run"]

PAYLOADS = ("fp32", "bf16", "fp8")


def _bytes_per_step(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> list[int]:
    """Bytes of every ``all_to_all_single`` this rank sends in one forward+backward."""
    sent: list[int] = []
    original = dist.all_to_all_single

    def spy(out: Tensor, inp: Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(inp.numel() * inp.element_size())
        return original(out, inp, *args, **kwargs)

    dist.all_to_all_single = spy  # type: ignore[assignment]
    try:
        x.grad = None
        fn(x).backward(grad)
    finally:
        dist.all_to_all_single = original  # type: ignore[assignment]
    return sent


def _errors(out: Tensor, reference: Tensor) -> dict[str, float]:
    diff = (out - reference).double()
    rms = reference.double().square().mean().sqrt()
    max_rel = diff.abs().max() / reference.abs().max()
    return {"max_rel": float(max_rel), "rms_rel": float(diff.square().mean().sqrt() / rms)}


def _worker(rank: int, world: int, port: int, shape: tuple[Any, ...], repeats: int, out: str) -> None:
    init_worker(rank, world, port)
    tokens, hidden, ffn, experts, top_k, factor = shape
    blocks = {}
    for mode, cf in (("dropless", None), ("capacity", factor)):
        for payload in PAYLOADS:
            torch.manual_seed(0)
            block = MoEBlock(MoEConfig.build(hidden, ffn, experts, top_k, capacity_factor=cf, backend="torch"))
            blocks[f"{mode}_{payload}"] = shard_experts(block, dispatch_dtype=None if payload == "fp32" else payload)
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens, hidden, requires_grad=True)
    grad = torch.randn(tokens, hidden)
    sent = {name: _bytes_per_step(block, x, grad) for name, block in blocks.items()}
    with torch.no_grad():
        outputs = {name: block(x) for name, block in blocks.items()}
    errors = {name: _errors(y, outputs[name.rsplit("_", 1)[0] + "_fp32"]) for name, y in outputs.items()}
    measured = interleave({name: timed(block, x, grad) for name, block in blocks.items()}, repeats, count=True)
    if rank == 0:
        rows = {}
        for name, m in measured.items():
            bf16 = measured[name.rsplit("_", 1)[0] + "_bf16"]
            handshake = 1 if name.startswith("dropless") else 0  # the dropless counts exchange comes first
            rows[name] = {
                **m.summary("step_ms"),
                "x_bf16_time": m.median / bf16.median,
                "x_bf16_time_range": ratio_range(m, bf16),
                "bytes_per_step": sum(sent[name]),
                "dispatch_bytes": sent[name][handshake],
                "exchanges": sent[name],
                **errors[name],
            }
            for key in ("step_ms", "step_ms_min", "step_ms_max"):
                rows[name][key] *= 1e3
            rows[name]["step_ms_repeats"] = [1e3 * v for v in m.values]
        report = {
            "shape": dict(zip(("T_per_rank", "H", "F", "E", "k", "capacity_factor"), shape, strict=True)),
            "ep": world,
            "repeats": repeats,
            "load_average": os.getloadavg(),
            "results": rows,
        }
        Path(out).write_text(json.dumps(report))
    leave_world()


def run(world: int = 2, quick: bool = False, repeats: int | None = None, timeout: float = 900) -> dict[str, Any]:
    """Spawn ``world`` gloo processes, measure the six (mode, payload) blocks interleaved, return rank 0's report.

    Example::

        report = run(world=2, quick=True)
        report["results"]["dropless_fp8"]["dispatch_bytes"]
    """
    shape = (256, 64, 128, 4 * world, 2, 1.25) if quick else (2048, 256, 512, 8, 2, 1.25)
    return spawn(_worker, world, (shape, repeats or (3 if quick else 9)), timeout)


def print_report(report: dict[str, Any]) -> None:
    """Print :func:`run`'s report as a markdown table."""
    shape = ", ".join(f"{k}={v}" for k, v in report["shape"].items())
    print(f"\nMoE block fwd+bwd, ep={report['ep']} CPU processes ({shape}), median of {report['repeats']}, ", end="")
    print(f"load average {report['load_average'][0]:.1f}")
    print("| mode, payload | bytes/step | dispatch bytes | max err | rms err | step ms (min-max) | x bf16 time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in report["results"].items():
        low, high = r["x_bf16_time_range"] or (float("nan"), float("nan"))
        print(
            f"| {name} | {r['bytes_per_step']:,} | {r['dispatch_bytes']:,} | {r['max_rel']:.2e} | {r['rms_rel']:.2e} "
            f"| {r['step_ms']:.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) "
            f"| {r['x_bf16_time']:.2f} ({low:.2f}-{high:.2f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args.ep, args.quick, args.repeats)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
