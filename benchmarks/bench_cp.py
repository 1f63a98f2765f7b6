"""Context parallelism on CPU processes (gloo): per-rank saved activations, tokens/s and gathered K/V bytes of a tiny
MoE GPT's training step for cp in {1, 2, 4}.

One world of ``max(cp)`` processes; the ranks ``[0, cp)`` form the cp group of each size (``dist.new_group``), the
others wait. A step is what ``LLMFastStrategy(context_parallel_size=cp)`` runs on one rank: the rank's share of the
packed row (``PackedBatch.context_shard``), its metadata built once on the host (``SequenceMetadata.from_batch``),
the forward with ``metadata=`` (every layer all-gathers K and V over the group), the token-weighted cross entropy
plus the MoE balance loss over the group (``expert_parallel.share_batch``), and the backward. cp=1 is one process
holding the whole row, no group.

Measured per (layout, row length, cp):

- ``saved_bytes``: every distinct storage autograd saves for backward in one step on each rank
  (:class:`~lightning_llmfast.bench.saved.SavedBytes`, parameters excluded): activations, masks, indices, the
  gathered K/V; with the largest storages, to say what dominates;
- ``tokens_per_s``: the row's tokens over the step time of the group's slowest rank; median of ``--repeats``
  interleaved rounds (cp=1, 2, 4 in turn, rotated), with min and max. CPU numbers on a shared machine (``cores`` in
  the JSON): read the trend, not the value; the CPU attention path is the readable reference, not a fast one;
- ``gathered_kv_bytes_per_layer``: the ``[K | V]`` buffer each rank all-gathers per layer
  (:data:`~lightning_llmfast.seqmeta.CONTEXT_STATS`): ``N x 2 x kv_heads x head_dim`` values, whatever cp;
- ``work_max_over_mean``: the split's causal attention work (held positions, each weighted by the keys it attends)
  of the busiest rank over the mean.

Layouts: ``one_document`` (the row is one document) and ``short_documents`` (documents of 16 to 512 tokens filling
the row exactly).

``--device cuda --dtype bfloat16`` (the ``cp`` stage of ``benchmarks/gpu_check.sh``): the ranks share the one GPU, the
groups stay gloo (NCCL refuses two ranks on one device; gloo moves CUDA tensors through the host), attention is
FlashAttention varlen with ``cu_seqlens_q != cu_seqlens_k``; saved bytes are then the GPU path's, tokens/s counts the
gloo copies.

Usage::

    PYTHONPATH=. python benchmarks/bench_cp.py                  # rows of 4096 and 8192 tokens, 3 repeats (~3 min)
    PYTHONPATH=. python benchmarks/bench_cp.py --lengths 4096,8192,16384,32768 --repeats 5
    PYTHONPATH=. python benchmarks/bench_cp.py --lengths 4096 --layouts one_document --repeats 1   # the figure only
    python benchmarks/bench_cp.py --device cuda --dtype bfloat16 --lengths 4096,16384 --json $OUT/cp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llmfast import expert_parallel
from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.bench.saved import SavedBytes
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.data.packing import IGNORE_INDEX
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.seqmeta import CONTEXT_STATS, SequenceMetadata, context_split

CP_SIZES = (1, 2, 4)
LAYOUTS = ("one_document", "short_documents")
AUX_LOSS_COEF = 0.01
SHORT_DOCUMENTS = (16, 512)  # lengths of the short documents, inclusive
RESULTS = Path(__file__).parent / "results" / "cp.json"
FIGURE_LIMIT = 0.6  # issue 55: per-rank saved activations at cp=2 <= 0.6x cp=1 on one 4096-token document


def model_config(hidden: int = 64) -> MoEGPTConfig:
    """The tiny MoE GPT of the benchmark (and of tests/test_cp_memory.py): 2 layers, 4 heads over 2 kv heads."""
    return MoEGPTConfig(vocab_size=256, hidden_size=hidden, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=2 * hidden,
                        num_experts=4, top_k=2, router_backend="torch")  # fmt: skip


def document_lengths(layout: str, tokens: int, seed: int = 0) -> list[int]:
    """The documents of one row of ``tokens``: one document, or short ones (``SHORT_DOCUMENTS``) summing to it."""
    if layout == "one_document":
        return [tokens]
    if layout != "short_documents":
        raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    gen = torch.Generator().manual_seed(seed)
    low, high = SHORT_DOCUMENTS
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(low, high + 1, (), generator=gen)), tokens - sum(lengths)))
    return lengths


def make_batch(lengths: list[int], vocab: int, seed: int = 0) -> PackedBatch:
    """One packed row holding exactly the documents ``lengths`` (no padding), random tokens."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    tokens = sum(lengths)
    (batch,) = pack_documents(docs, tokens, 1, vocab_size=vocab, lookahead=len(docs) + 1)
    assert batch.input_ids.shape == (1, tokens) and batch.cu_seqlens.numel() == len(lengths) + 1, lengths
    return batch


def attention_work_balance(batch: PackedBatch, cp: int) -> float:
    """Busiest rank's causal attention work over the mean for :func:`context_split` of ``batch`` over ``cp`` ranks
    (a held position's work: the keys it attends, its place in its document plus one)."""
    assert batch.cu_seqlens_cpu is not None
    keys = batch.position_ids.flatten().to(torch.float64) + 1
    work = torch.stack([keys[part].sum() for part in context_split(batch.cu_seqlens_cpu, cp)])
    return float(work.max() / work.mean())


def build_model(
    config: MoEGPTConfig, group: dist.ProcessGroup | None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> MoEGPT:
    """The model on every rank with the same weights; under cp its MoE blocks balance over the whole shared row."""
    torch.manual_seed(0)
    model = MoEGPT(config).to(device=device, dtype=dtype)
    if group is not None:
        expert_parallel.share_batch(model, group)
    return model


def training_step(model: MoEGPT, batch: PackedBatch, shard: PackedBatch, cp: int) -> torch.Tensor:
    """Forward of one rank's share and its loss (cross entropy over the whole row's label tokens, the group's
    balance loss split over its ranks); the caller runs the backward."""
    metadata = SequenceMetadata.from_batch(shard)  # once per batch, on the host
    logits = model(shard.input_ids, shard.position_ids, metadata=metadata)
    labels = int((batch.labels != IGNORE_INDEX).sum())
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), shard.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return ce / labels + AUX_LOSS_COEF * model.aux_loss() / cp


def measure_saved(model: MoEGPT, batch: PackedBatch, shard: PackedBatch, cp: int, top: int = 6) -> dict[str, Any]:
    """One step under :class:`SavedBytes` and the K/V gather counters: bytes saved, gathered K/V per layer, and the
    ``top`` largest saved storages (bytes) to show what dominates."""
    CONTEXT_STATS.reset()
    with SavedBytes(exclude=model.parameters()) as saved:
        loss = training_step(model, batch, shard, cp)
    loss.backward()
    model.zero_grad(set_to_none=True)
    gathers = CONTEXT_STATS.gathers
    return {
        "saved_bytes": saved.nbytes,
        "saved_storages": saved.storages,
        "largest_saved": sorted(saved.sizes, reverse=True)[:top],
        "gathered_kv_bytes_per_layer": CONTEXT_STATS.gathered_bytes // gathers if gathers else 0,
        "gathers_per_step": gathers,
    }


def _timed(model: MoEGPT | None, batch: PackedBatch, shard: PackedBatch | None, cp: int) -> Callable[[int], float]:
    """An :func:`interleave` implementation every rank calls: the group's ranks step, the step lasts as long as the
    slowest of them."""

    def step(repeat: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        if model is not None and shard is not None:
            training_step(model, batch, shard, cp).backward()
            model.zero_grad(set_to_none=True)
            if shard.input_ids.is_cuda:
                torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start if model is not None else 0.0, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    return step


def _worker(rank: int, world: int, port: int, options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=options["collective_timeout"]),
    )  # fmt: skip
    cps = [cp for cp in CP_SIZES if cp <= world]
    groups = {cp: dist.new_group(list(range(cp))) for cp in cps if cp > 1}  # every rank creates every group
    config = model_config(options["hidden"])
    device, dtype = options["device"], getattr(torch, options["dtype"])
    models = {cp: build_model(config, groups.get(cp), device, dtype) if rank < cp else None for cp in cps}
    rows = []
    for tokens in options["lengths"]:
        for layout in options["layouts"]:
            batch = make_batch(document_lengths(layout, tokens), config.vocab_size)
            shards = {
                # Cut on the host, then copied (as the strategy does).
                cp: (batch if cp == 1 else batch.context_shard(rank, cp, groups[cp])).to(device)
                for cp in cps
                if rank < cp
            }
            saved = {}
            for cp in cps:
                mine = measure_saved(models[cp], batch, shards[cp], cp) if rank < cp else None  # type: ignore[arg-type]
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, mine)
                saved[cp] = everyone[:cp]
            impls = {f"cp{cp}": _timed(models[cp], batch, shards.get(cp), cp) for cp in cps}
            measured = interleave(impls, options["repeats"], warmup=1)
            for cp in cps:
                per_rank = saved[cp]
                speeds = sorted(tokens / s for s in measured[f"cp{cp}"].values)
                rows.append({
                    "layout": layout, "tokens": tokens, "documents": batch.cu_seqlens.numel() - 1, "cp": cp,
                    "saved_bytes_per_rank": [r["saved_bytes"] for r in per_rank],
                    "saved_bytes_max": max(r["saved_bytes"] for r in per_rank),
                    "largest_saved_rank0": per_rank[0]["largest_saved"],
                    "gathered_kv_bytes_per_layer": per_rank[0]["gathered_kv_bytes_per_layer"],
                    "gathers_per_step": per_rank[0]["gathers_per_step"],
                    "tokens_per_s": statistics.median(speeds),
                    "tokens_per_s_min": speeds[0], "tokens_per_s_max": speeds[-1],
                    "step_s_repeats": measured[f"cp{cp}"].values,
                    "work_max_over_mean": attention_work_balance(batch, cp),
                })  # fmt: skip
            if rank == 0 and options["verbose"]:
                print(f"[bench_cp] {layout} {tokens} tokens done", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    leave_world()


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its saved bytes over cp=1's (largest rank) for the same layout and length."""
    base = {(r["layout"], r["tokens"]): r["saved_bytes_max"] for r in rows if r["cp"] == 1}
    return [{**r, "saved_ratio_to_cp1": r["saved_bytes_max"] / base[(r["layout"], r["tokens"])]} for r in rows]


def run(
    lengths: list[int], layouts: list[str], repeats: int, hidden: int = 64, world: int = max(CP_SIZES),
    timeout: float = 900, collective_timeout: float = 300, verbose: bool = False, device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:  # fmt: skip
    """Runs the benchmark on ``world`` processes; returns the report :func:`main` writes.

    Example::

        report = run([4096], ["one_document"], repeats=1)
        report["figure"]["cp2_over_cp1"]  # per-rank saved activations at cp=2 over cp=1, one 4096-token document
    """
    options = {"lengths": lengths, "layouts": layouts, "repeats": repeats, "hidden": hidden,
               "collective_timeout": collective_timeout, "verbose": verbose, "device": device,
               "dtype": dtype}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        spawn_world(_worker, world, (world, free_port(), options, out), timeout, "context-parallel benchmark")
        rows = _with_ratios(json.loads(Path(out).read_text()))
    report: dict[str, Any] = {
        "date": date.today().isoformat(), "device": device, "dtype": dtype, "backend": "gloo",
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "cores": os.cpu_count(),
        "threads_per_rank": 1, "torch": torch.__version__, "python": platform.python_version(),
        "model": {k: v for k, v in vars(model_config(hidden)).items() if not k.startswith("_")},
        "repeats": repeats, "rows": rows,
    }  # fmt: skip
    figure = [r for r in rows if r["layout"] == "one_document" and r["tokens"] == 4096 and r["cp"] == 2]
    if figure:
        ratio = figure[0]["saved_ratio_to_cp1"]
        report["figure"] = {"what": "per-rank saved bytes, cp=2 over cp=1, one 4096-token document",
                            "cp2_over_cp1": ratio, "limit": FIGURE_LIMIT, "passed": ratio <= FIGURE_LIMIT}  # fmt: skip
    return report


def print_report(report: dict[str, Any]) -> None:
    """The rows as a Markdown table."""
    print(
        f"\nContext parallelism, tiny MoE GPT (hidden {report['model']['hidden_size']}, 2 layers), "
        f"{report['device']} {report['dtype']}, gloo, {report['cores']} cores, median of {report['repeats']}"
    )
    print("| layout | tokens | cp | saved MiB/rank (max) | x cp=1 | tokens/s (min-max) | gathered K/V KiB/layer "
          "| work max/mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['layout']} | {r['tokens']} | {r['cp']} | {r['saved_bytes_max'] / 2**20:.2f} | "
              f"{r['saved_ratio_to_cp1']:.3f} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-"
              f"{r['tokens_per_s_max']:.0f}) | {r['gathered_kv_bytes_per_layer'] / 2**10:.0f} | "
              f"{r['work_max_over_mean']:.4f} |")  # fmt: skip
    if "figure" in report:
        f = report["figure"]
        print(f"\nfigure: {f['what']}: {f['cp2_over_cp1']:.3f} (limit {f['limit']}): "
              f"{'PASS' if f['passed'] else 'FAIL'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lengths", default="4096,8192", help="row lengths in tokens, comma-separated")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {LAYOUTS}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--collective-timeout", type=float, default=300, help="seconds for any one collective")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", default=str(RESULTS))
    args = parser.parse_args(argv)
    report = run(
        [int(n) for n in args.lengths.split(",")], args.layouts.split(","), args.repeats, args.hidden,
        timeout=args.timeout, collective_timeout=args.collective_timeout, verbose=True, device=args.device,
        dtype=args.dtype,
    )  # fmt: skip
    report["command"] = "python benchmarks/bench_cp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print_report(report)
    return 0 if report.get("figure", {}).get("passed", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
