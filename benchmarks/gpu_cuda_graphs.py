"""The ``cuda_graphs`` stage of ``gpu_check.sh``: an MoE block captured as CUDA graphs against the same block eager.

For dropless and capacity routing (bf16, T=4096 packed as (2, 2048), H=1024, F=512, E=8, k=2): capture (the first
calls), replay on new inputs, compare outputs and gradients with the eager twin, then time forward+backward of both
(CUDA events, median of the repeats, interleaved). Writes ``--json``.

Usage::

    python benchmarks/gpu_cuda_graphs.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from lightning_llmfast.moe import MoEBlock, MoEConfig

SHAPE = {"B": 2, "S": 2048, "H": 1024, "F": 512, "E": 8, "k": 2}


def _step(block: MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaf = x.clone().requires_grad_()
    y = block(leaf)
    (y.float().square().mean() + 0.01 * block.stats.aux_loss).backward()
    out = (y.detach().clone(), leaf.grad.clone(), block.experts.down_proj.grad.clone())
    block.zero_grad(set_to_none=False)
    return out


def _ms(block: MoEBlock, x: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _step(block, x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def check(capacity_factor: float | None, repeats: int) -> dict[str, Any]:
    """Capture, replay, compare and time one routing mode."""
    torch.manual_seed(0)
    s = SHAPE
    options = {"capacity_factor": capacity_factor}
    graphed = MoEBlock(MoEConfig.build(s["H"], s["F"], s["E"], s["k"], cuda_graphs=True, **options))
    eager = MoEBlock(MoEConfig.build(s["H"], s["F"], s["E"], s["k"], **options))
    graphed.to("cuda", torch.bfloat16)
    eager.to("cuda", torch.bfloat16).load_state_dict(graphed.state_dict())
    max_error = 0.0
    for _ in range(4):  # the first calls capture, the later ones replay
        x = torch.randn(s["B"], s["S"], s["H"], device="cuda", dtype=torch.bfloat16)
        for got, expected in zip(_step(graphed, x), _step(eager, x)):
            scale = float(expected.float().abs().max()) or 1.0
            max_error = max(max_error, float((got.float() - expected.float()).abs().max()) / scale)
    times: dict[str, list[float]] = {"graphed": [], "eager": []}
    x = torch.randn(s["B"], s["S"], s["H"], device="cuda", dtype=torch.bfloat16)
    for r in range(repeats):
        for name in ("graphed", "eager") if r % 2 else ("eager", "graphed"):
            times[name].append(_ms(graphed if name == "graphed" else eager, x))
    median = {name: statistics.median(v) for name, v in times.items()}
    return {
        "capacity_factor": capacity_factor,
        "max_relative_error": max_error,
        "agrees": max_error < 3e-2,
        "median_ms": median,
        "min_max_ms": {name: [min(v), max(v)] for name, v in times.items()},
        "eager_over_graphed": median["eager"] / median["graphed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_cuda_graphs.py needs a CUDA device")
    report = {"shape": SHAPE, "results": [check(c, args.repeats) for c in (None, 1.25)]}
    for r in report["results"]:
        print(
            f"capacity {r['capacity_factor']}: agrees {r['agrees']} (max rel err {r['max_relative_error']:.2e}), "
            f"eager {r['median_ms']['eager']:.2f} ms, graphed {r['median_ms']['graphed']:.2f} ms, "
            f"eager/graphed {r['eager_over_graphed']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not all(r["agrees"] for r in report["results"]):
        raise SystemExit("captured and eager blocks disagree")


if __name__ == "__main__":
    main()
