"""Pipeline parallelism on CPU processes (gloo): tokens/s, bubble share and memory per stage against pp and schedule.

    python benchmarks/bench_pipeline.py                       # -> benchmarks/results/pipeline.json
    python benchmarks/bench_pipeline.py --quick --json out.json

For each layout (``pp = 1``: the model whole in one process, the microbatches accumulated; ``pp = 2``: every
schedule; ``pp = 4``: GPipe, 1F1B and the interleaved ones) the same model (8 layers, so that 4 ranks x 2 stages
still hold one layer each), the same batch of ``B`` rows in ``M`` microbatches, ``--repeats`` timed steps after one
warm-up step. Reported per layout:

- ``step_ms``: the slowest rank's step (forward, backward, :meth:`~lightning_llmfast.parallel.pipeline.PipelineRunner
  .finish_step`), median / min / max over the repeats; ``tokens_per_s`` = ``B * T`` / median step;
- ``bubble``: the schedule's idle share from its action table
  (:func:`~lightning_llmfast.parallel.pipeline.bubble_share`: forward, input and weight gradient 1, full backward 2;
  hardware-independent);
- ``param_mib`` and ``param_share``: the largest parameter bytes one rank holds, and that over the whole model's;
- ``peak_rss_mib``: the largest growth of one rank's resident memory over the timed steps (activations held for
  backward, the schedule's buffers, gradients).

CPU step times on a shared machine only compare layouts measured together; the bubble and the bytes do not depend
on the machine. The processes share the machine's cores, so more stages do not mean more compute here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_moe_ep import init_worker

from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.bench.rss import PeakRSS
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel.pipeline import PipelineConfig, PipelineRunner
from lightning_llmfast.seqmeta import SequenceMetadata

__all__ = ["run"]

RESULTS = Path(__file__).parent / "results"
MODEL = {
    "vocab_size": 512, "hidden_size": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 128,
    "num_experts": 4, "top_k": 2, "router_backend": "torch",
}  # fmt: skip
ROWS, SEQ, MICROBATCHES = 16, 64, 8
LAYOUTS: list[tuple[int, str]] = [
    (1, "none"),
    *((2, s) for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")),
    *((4, s) for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")),
]


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=gen)  # type: ignore[call-overload]
    positions = torch.arange(SEQ).remainder(SEQ // 2).expand(ROWS, SEQ).contiguous()  # two documents per row
    labels = torch.roll(ids, -1, dims=1)
    labels[:, SEQ // 2 - 1 :: SEQ // 2] = -100
    return ids, labels, positions


def _one_process_step(model: MoEGPT, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    ids, labels, positions = batch
    total = (labels != -100).sum()
    size = ROWS // MICROBATCHES
    for mb in range(MICROBATCHES):
        rows = slice(mb * size, (mb + 1) * size)
        logits = model(ids[rows], positions[rows])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), ignore_index=-100, reduction="sum")
        (loss / total).backward()


def _worker(rank: int, world: int, port: int, schedule: str, repeats: int, out: str) -> None:
    init_worker(rank, world, port)
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(**MODEL))  # type: ignore[arg-type]
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = _batch()
    meta = SequenceMetadata.from_position_ids(batch[2])
    runner = None
    if world > 1:
        config = PipelineConfig(world, MICROBATCHES, schedule)
        runner = PipelineRunner(model, config, dist.group.WORLD, device=torch.device("cpu"), aux_loss_coef=0.01)

    def step() -> None:
        if runner is None:
            _one_process_step(model, batch)
        else:
            runner.step(*batch, meta)
            runner.finish_step()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: the schedule is built, buffers allocated
    times = []
    with PeakRSS() as rss:
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            if world > 1:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    mine = {"param_bytes": held, "full_param_bytes": full, "peak_rss_growth": rss.growth}
    ranks: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    if rank == 0:
        median = statistics.median(times)
        report = {
            "pp": world,
            "schedule": schedule,
            "stages_per_rank": 1 if runner is None else runner.config.stages_per_rank,
            "bubble": 0.0 if runner is None else runner.bubble,
            "step_ms": [1e3 * median, 1e3 * min(times), 1e3 * max(times)],
            "tokens_per_s": ROWS * SEQ / median,
            "param_mib": max(r["param_bytes"] for r in ranks) / 2**20,
            "param_share": max(r["param_bytes"] for r in ranks) / full,
            "peak_rss_mib": max(r["peak_rss_growth"] for r in ranks) / 2**20,
        }
        Path(out).write_text(json.dumps(report))
    if world > 1:
        leave_world()


def run(repeats: int, layouts: list[tuple[int, str]]) -> dict[str, Any]:
    """Every layout in its own set of processes, one after the other; the report :func:`main` prints and saves."""
    rows = []
    for pp, schedule in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "report.json")
            spawn_world(_worker, pp, (pp, free_port(), schedule, repeats, out), 600, "pipeline benchmark")
            rows.append(json.loads(Path(out).read_text()))
            print(_line(rows[-1]), flush=True)
    return {
        "model": MODEL,
        "batch": {"rows": ROWS, "seq_len": SEQ, "microbatches": MICROBATCHES},
        "repeats": repeats,
        "host": platform.node(),
        "torch": torch.__version__,
        "layouts": rows,
    }


def _line(row: dict[str, Any]) -> str:
    ms = row["step_ms"]
    return (
        f"| {row['pp']} | {row['schedule']} | {row['stages_per_rank']} | {row['bubble']:.3f} | "
        f"{ms[0]:.0f} ({ms[1]:.0f}-{ms[2]:.0f}) | {row['tokens_per_s']:.0f} | {row['param_mib']:.2f} | "
        f"{row['param_share']:.2f} | {row['peak_rss_mib']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repeats, pp <= 2")
    parser.add_argument("--json", type=Path, default=RESULTS / "pipeline.json")
    args = parser.parse_args()
    layouts = [layout for layout in LAYOUTS if layout[0] <= 2] if args.quick else LAYOUTS
    print("| pp | schedule | v | bubble | step ms (min-max) | tokens/s | param MiB/rank | share | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    report = run(2 if args.quick else args.repeats, layouts)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
