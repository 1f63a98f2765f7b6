"""The pipelined training step on CUDA: the ``pipeline`` stage of benchmarks/gpu_check.sh.

    python benchmarks/gpu_pipeline.py --device cuda --json gpu_out/pipeline.json
    python benchmarks/gpu_pipeline.py --device cpu --seq 32 --json /tmp/p.json   # the same checks on the CPU (gloo)

A lent machine has one GPU, and NCCL refuses two ranks on one device, so the script proves what one GPU can:

1. *One rank, looped stages.* A world of one process (NCCL on CUDA, gloo on the CPU) holds both stages of every
   multi-stage schedule (``"interleaved_1f1b"``, ``"interleaved_zero_bubble"``, ``"zbv"``, ``pp = 1``, ``v = 2``):
   torch's schedule runs the stage-to-stage handoff on the device, the runner opens each microbatch's metadata
   around every stage forward and weights the token losses over the batch. The gradients after
   :meth:`~lightning_llmfast.parallel.pipeline.PipelineRunner.step` and ``finish_step`` must equal those of one
   process accumulating the microbatches (float32, TF32 off; relative difference per tensor below ``1e-4``, the
   loss within ``1e-5``). Then timed: the step's median over ``--repeats`` (CUDA events) and the peak memory.
2. *Two ranks over NCCL* (``pp = 2``, 1F1B, one GPU each, the same comparison on each rank's stage): run with two
   GPUs or more; with fewer it is skipped, the reason printed and written to the JSON.

The script exits non-zero when a comparison fails. ``--json`` gets every schedule's result.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel.pipeline import PipelineConfig, PipelineRunner
from lightning_llmfast.seqmeta import SequenceMetadata

__all__ = ["check_layout", "main"]

MODEL = {
    "vocab_size": 512, "hidden_size": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 256,
    "num_experts": 4, "top_k": 2, "router_backend": "torch",
}  # fmt: skip
ROWS, SEQ, MICROBATCHES = 8, 256, 4
LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv")
AUX = 0.01


def _batch(device: torch.device, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ROWS`` rows of three documents each (lengths ``seq * 3 // 8``, 1 and the rest), labels ignored at document
    ends."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, seq), generator=gen)  # type: ignore[call-overload]
    lengths = [seq * 3 // 8, 1, seq - 1 - seq * 3 // 8]
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(ROWS, seq).contiguous()
    labels = torch.roll(ids, -1, dims=1)
    ends = torch.tensor(lengths).cumsum(0) - 1
    labels[:, ends] = -100
    return ids.to(device), labels.to(device), positions.to(device)


def _reference_grads(model: MoEGPT, batch: tuple[torch.Tensor, ...]) -> tuple[dict[str, torch.Tensor], float]:
    """One process accumulating the microbatches: the gradients of the batch's token-mean loss (plus each
    microbatch's router loss weighted by its label tokens) and that loss."""
    ids, labels, positions = batch
    total = (labels != -100).sum()
    size, loss_value = ROWS // MICROBATCHES, 0.0
    for mb in range(MICROBATCHES):
        rows = slice(mb * size, (mb + 1) * size)
        meta = SequenceMetadata.from_position_ids(positions[rows])
        logits = model(ids[rows], positions[rows], metadata=meta)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels[rows].flatten(), ignore_index=-100, reduction="sum")
        weight = (labels[rows] != -100).sum() / total
        loss = ce / total + AUX * weight * model.aux_loss()
        loss.backward()
        loss_value += float(loss.detach())
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, loss_value


def check_layout(
    pp: int, schedule: str, device: torch.device, group: dist.ProcessGroup | None, repeats: int, seq: int = SEQ
) -> dict[str, Any]:
    """Compare one pipelined step of ``schedule`` on ``pp`` ranks with one process, then time it (module doc)."""
    torch.manual_seed(0)
    whole = MoEGPT(MoEGPTConfig(**MODEL)).to(device)  # type: ignore[arg-type]
    model = copy.deepcopy(whole)
    batch = _batch(device, seq)
    expected, expected_loss = _reference_grads(whole, batch)
    config = PipelineConfig(pp, MICROBATCHES, schedule, stages_per_rank=None if pp > 1 else 2)
    runner = PipelineRunner(model, config, group, device=device, aux_loss_coef=AUX)
    meta = SequenceMetadata.from_position_ids(batch[2])
    loss = float(runner.step(*batch, meta))
    runner.finish_step()
    worst = 0.0
    for name, param in model.named_parameters():
        want = expected[name]
        assert param.grad is not None, f"{schedule}: no gradient for {name}"
        worst = max(worst, float((param.grad - want).norm() / want.norm().clamp_min(1e-30)))
    ok = worst < 1e-4 and abs(loss - expected_loss) < 1e-5
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        runner.step(*batch, meta)
        runner.finish_step()
        if cuda:
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            times.append(1e3 * (time.perf_counter() - start))
    median = statistics.median(times) if times else float("nan")
    return {
        "pp": pp,
        "schedule": schedule,
        "stages": runner.stages,
        "ok": ok,
        "grad_max_rel_diff": worst,
        "loss": loss,
        "loss_one_process": expected_loss,
        "bubble": runner.bubble,
        "step_ms": median,
        "tokens_per_s": ROWS * seq / (median / 1e3) if times else None,
        "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
    }


def _init(rank: int, world: int, port: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )


def _two_rank_worker(rank: int, port: int, device_type: str, repeats: int, seq: int, out: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    _init(rank, 2, port, device)
    row = check_layout(2, "1f1b", device, dist.group.WORLD, repeats, seq)
    rows: list[Any] = [None, None]
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    leave_world()


def _line(row: dict[str, Any]) -> str:
    peak = f"{row['peak_mib']:.0f}" if row["peak_mib"] is not None else "-"
    return (
        f"| {row['pp']} | {row['schedule']} | {row['stages']} | {'PASS' if row['ok'] else 'FAIL'} | "
        f"{row['grad_max_rel_diff']:.1e} | {row['bubble']:.3f} | {row['step_ms']:.1f} | {peak} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the two-rank part")
    parser.add_argument("--seq", type=int, default=SEQ, help="row length (a short one for a CPU check)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_pipeline: --device cuda but no CUDA device is visible")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    _init(0, 1, free_port(), torch.device("cuda", 0) if device.type == "cuda" else device)
    print("| pp | schedule | stages on rank | check | grad rel diff | bubble | step ms | peak MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for schedule in LOOPED:
        where = device if device.type == "cpu" else torch.device("cuda", 0)
        rows.append(check_layout(1, schedule, where, None, args.repeats, args.seq))
        print(_line(rows[-1]), flush=True)
    dist.destroy_process_group()
    report: dict[str, Any] = {"model": MODEL, "batch": [ROWS, args.seq, MICROBATCHES], "one_rank": rows}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        reason = f"two-rank NCCL pipeline skipped: {gpus} GPU visible and NCCL refuses two ranks on one device"
        print(reason)
        report["two_ranks"] = {"skipped": reason}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "two.json")
            worker_args = (free_port(), device.type, args.repeats, args.seq, out)
            spawn_world(_two_rank_worker, 2, worker_args, args.timeout, "pipeline stage")
            report["two_ranks"] = json.loads(Path(out).read_text())
        for row in report["two_ranks"]:
            print(_line(row), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    two = report["two_ranks"] if isinstance(report["two_ranks"], list) else []
    failed = [f"{r['pp']}/{r['schedule']}" for r in rows + two if not r["ok"]]
    if failed:
        raise SystemExit(f"gpu_pipeline: the pipelined step differs from one process for {failed}")


if __name__ == "__main__":
    main()
