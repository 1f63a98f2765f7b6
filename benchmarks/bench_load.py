"""Loading a sharded pretrained checkpoint: seconds and peak RSS per rank, ours against ``from_pretrained``.

    python benchmarks/bench_load.py --json benchmarks/results/load.json

Two sweeps. **Pieces** (one process): Qwen3-MoE checkpoints of 2 layers with 8 to 256 experts per layer (``--experts``;
every expert is 3 checkpoint tensors, so 60 to 1,550 pieces), each loaded by ours (``materialize``) and by
``from_pretrained``, interleaved; per size: median seconds and their spread, peak RSS growth, and ours' counters:
shard headers parsed, bytes read, tensors read and staging batches (host-to-device copies on CUDA).
**Worlds** (below):
a randomly initialised Qwen3-MoE of about 340 MiB (fp32) is written sharded by ``save_pretrained`` into a temporary
directory. For 1, 2 and 4 gloo processes, every rank loads it in two ways, interleaved (the order alternates every
repeat), and reports the median seconds and peak RSS growth over the repeats:

- ``ours``: ``HFCausalLMModule.from_pretrained`` (meta device), MoE blocks swapped, sharded with FSDP2 over the ranks
  (one process: nothing to shard), each rank reading only its shards (``parallelize`` / ``materialize``);
- ``from_pretrained``: transformers' ``AutoModelForCausalLM.from_pretrained`` on every rank (what a user does before
  FSDP2 shards the model).

Peak RSS growth is ``VmHWM`` (reset through ``/proc/self/clear_refs`` before the load) minus ``VmRSS`` at the reset
(:class:`~lightning_llmfast.bench.rss.PeakRSS`): what loading adds to the process, file pages included. The bound of
ours is the rank's share of the checkpoint + its largest tensor + 16 MiB (the window includes building the
module; ``tests/test_pretrained_load.py`` bounds the load alone with 8 MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.bench.rss import PeakRSS

MIB = 1 << 20
FIXED_OVERHEAD = 16 * MIB  # the window also builds the module (config, meta model, imports)


def _config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=512, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
    )  # fmt: skip


def _load_ours(directory: Path, dims: Any) -> None:
    from lightning_llmfast import HFCausalLMModule
    from lightning_llmfast.parallel import parallelize

    module = HFCausalLMModule.from_pretrained(directory, moe_backend="torch")
    module.configure_model()
    if dims is None:
        module.materialize()
    else:
        parallelize(module, dims, module.model.model.layers, device=torch.device("cpu"))


def _load_transformers(directory: Path, dims: Any) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _pieces_config(experts: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, moe_intermediate_size=64, num_experts=experts, num_experts_per_tok=2,
    )  # fmt: skip


def _pieces_row(directory: Path, experts: int, repeats: int) -> dict[str, Any]:
    """One size of the pieces sweep: both loaders interleaved, ours' counters from a counting ``read_header`` and
    the :class:`~lightning_llmfast.parallel.pretrained.LoadStats` of its load."""
    from lightning_llmfast.parallel import pretrained

    parses: list[Path] = []
    stats: list[Any] = []
    parse, load = pretrained.read_header, pretrained.PretrainedCheckpoint.load_into
    pretrained.read_header = lambda path: parses.append(path) or parse(path)  # type: ignore[assignment]
    pretrained.PretrainedCheckpoint.load_into = lambda self, m: stats.append(load(self, m)) or stats[-1]  # type: ignore[method-assign]
    try:
        loaders = {"ours": _load_ours, "from_pretrained": _load_transformers}
        runs: dict[str, list[tuple[float, int]]] = {name: [] for name in loaders}
        parsed = 0  # headers parsed by one load of ours
        for repeat in range(repeats):
            for name in list(loaders) if repeat % 2 == 0 else list(reversed(loaders)):
                before = len(parses)
                with PeakRSS() as rss:
                    start = time.perf_counter()
                    loaders[name](directory, None)
                    seconds = time.perf_counter() - start
                runs[name].append((seconds, rss.growth))
                parsed = len(parses) - before if name == "ours" else parsed
                gc.collect()
    finally:
        pretrained.read_header, pretrained.PretrainedCheckpoint.load_into = parse, load  # type: ignore[method-assign]
    checkpoint = pretrained.PretrainedCheckpoint.open(directory)
    row: dict[str, Any] = {
        "experts": experts, "pieces": len(checkpoint.files), "files": len(set(checkpoint.files.values())),
        "checkpoint_mib": checkpoint.total_bytes / MIB, "header_parses": parsed,
        "bytes_read": stats[-1].bytes_read, "reads": stats[-1].reads, "staging_batches": stats[-1].batches,
    }  # fmt: skip
    for name, values in runs.items():
        seconds = [s for s, _ in values]
        row[name] = {
            "seconds": statistics.median(seconds), "seconds_min_max": [min(seconds), max(seconds)],
            "peak_rss_growth_mib": statistics.median(p for _, p in values) / MIB,
        }  # fmt: skip
    row["ours_over_from_pretrained"] = row["ours"]["seconds"] / row["from_pretrained"]["seconds"]
    return row


def _pieces_sweep(tmp: str, experts: list[int], repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    rows = []
    for count in experts:
        directory = Path(tmp, f"experts{count}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_pieces_config(count)).save_pretrained(directory, max_shard_size="1MB")
        rows.append(_pieces_row(directory, count, repeats))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _rank(rank: int, world: int, port: int, directory: str, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dims = None
    if world > 1:
        from lightning_llmfast.parallel import ParallelDims

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dims = ParallelDims(world, "fsdp")
        dims.build_mesh("cpu")
    loaders = {"ours": _load_ours, "from_pretrained": _load_transformers}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in loaders}
    for repeat in range(repeats):
        order = list(loaders) if repeat % 2 == 0 else list(reversed(loaders))
        for name in order:
            gc.collect()
            if dist.is_initialized():
                dist.barrier()
            with PeakRSS() as rss:
                start = time.perf_counter()
                loaders[name](Path(directory), dims)
                seconds = time.perf_counter() - start
            runs[name].append((seconds, rss.growth))
            gc.collect()
    Path(out, f"rank{rank}.json").write_text(json.dumps(runs))
    if world > 1:
        leave_world()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--experts", default="8,16,32,64,128,256", help="experts per layer of the pieces sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from lightning_llmfast.parallel.pretrained import PretrainedCheckpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.set_num_threads(1)
        pieces = _pieces_sweep(tmp, [int(e) for e in args.experts.split(",")], args.repeats)
        directory = Path(tmp, "qwen3_moe")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config()).save_pretrained(directory, max_shard_size="50MB")
        checkpoint = PretrainedCheckpoint.open(directory)
        total = checkpoint.total_bytes
        largest = max(torch.Size(s).numel() * checkpoint.dtypes[k].itemsize for k, s in checkpoint.shapes.items())
        for world in (int(w) for w in args.worlds.split(",")):
            out = Path(tmp, f"world{world}")
            out.mkdir()
            spawn_world(_rank, world, (world, free_port(), str(directory), str(out), args.repeats), 900, "bench_load")
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
            row: dict[str, Any] = {"world": world, "bound_mib": (total // world + largest + FIXED_OVERHEAD) / MIB}
            for name in ("ours", "from_pretrained"):
                seconds = [statistics.median(s for s, _ in rank[name]) for rank in ranks]
                peaks = [statistics.median(p for _, p in rank[name]) / MIB for rank in ranks]
                row[name] = {"seconds_per_rank": seconds, "peak_rss_growth_mib_per_rank": peaks}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "checkpoint_mib": total / MIB,
        "largest_tensor_mib": largest / MIB,
        "fixed_overhead_mib": FIXED_OVERHEAD / MIB,
        "repeats": args.repeats,
        "rows": rows,
        "pieces": pieces,
    }
    print("| world | ours s | from_pretrained s | ours peak MiB/rank | from_pretrained peak MiB/rank | bound MiB |")
    for row in rows:
        ours, theirs = row["ours"], row["from_pretrained"]
        print(
            f"| {row['world']} | {max(ours['seconds_per_rank']):.2f} | {max(theirs['seconds_per_rank']):.2f} | "
            f"{max(ours['peak_rss_growth_mib_per_rank']):.0f} | {max(theirs['peak_rss_growth_mib_per_rank']):.0f} | "
            f"{row['bound_mib']:.0f} |"
        )
    print("| experts | pieces | ours s | from_pretrained s | ratio | headers parsed | MiB read | staging batches |")
    for row in pieces:
        print(
            f"| {row['experts']} | {row['pieces']} | {row['ours']['seconds']:.3f} | "
            f"{row['from_pretrained']['seconds']:.3f} | {row['ours_over_from_pretrained']:.2f} | "
            f"{row['header_parses']} ({row['files']} files) | {row['bytes_read'] / MIB:.1f} | "
            f"{row['staging_batches']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
