"""Expert-parallel MoE block forward+backward on ``--ep N`` CPU processes (gloo): our dispatch against a baseline
written the way torchtitan's default all-to-all dispatcher is, in one run.

Implementations, on the same weights and tokens, interleaved (median of the repeats, the slowest rank's time):

- ``titan_style``: histogram of the expert ids, an all-to-all of the counts, then the input and output split sizes
  copied to the host and read with ``.tolist()`` (every layer), the tokens' all-to-all, a host-driven regrouping of
  the received rows by local expert, the grouped experts, the reverse all-to-all and a ``scatter_add`` combine;
- ``ours_dropless``: :func:`~lightning_llmfast.expert_parallel.shard_experts` without a capacity limit (one host
  read per layer, issued after the count exchange and the local permutation);
- ``ours_capacity``: the same with ``capacity_factor`` (fixed-size exchanges, nothing read on the host).

Host syncs per step: what :class:`~lightning_llmfast.bench.counters.SyncCounter` sees (every route, ``.tolist()``
included). Bytes: what each rank's dispatch all-to-all sends
per forward (its combine returns as many rows, and each backward exchange mirrors a forward one), against the
information limit ``T * k * H * dtype`` bytes each way.

Measured on this project's shared 2-core CPU box (load average about 10, one thread per process, ``--repeats 5``;
fp32, T=2048 tokens per rank, H=256, F=512, E=8, k=2, capacity factor 1.25):

==============  =============  ===================  ==========================  ===================
implementation  x titan_style  host syncs per step  dispatch bytes per forward  x information limit
==============  =============  ===================  ==========================  ===================
titan_style     1.00           3                    4 194 304                   1.00
ours_dropless   0.93-0.99      1                    4 194 304                   1.00
ours_capacity   1.35-1.38      0                    5 242 880                   1.25
==============  =============  ===================  ==========================  ===================

On CPU a host read costs nothing, so the sync-free capacity mode only pays for its padding here (its experts run
over ``W * C`` slots, 1.25x the rows); the syncs it removes are what stalls an accelerator's launch queue.

Usage::

    python benchmarks/bench_moe.py --ep 2            # T=2048 tokens per rank, H=256, F=512, E=8, k=2
    python benchmarks/bench_moe.py --ep 2 --quick    # small shapes, seconds
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.expert_parallel.payload import exchange
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.experts import expert_swiglu
from lightning_llmfast.moe.kernels import resolve_backend

__all__ = ["init_worker", "run", "spawn", "timed"]


class TitanStyleDispatch(nn.Module):
    """The baseline: torchtitan's default token dispatcher's data flow, on a sharded block's weights."""

    def __init__(self, block: MoEBlock) -> None:
        super().__init__()
        self.block = block
        self.dispatch = block.dispatcher
        self.host_reads = 0

    def forward(self, x: Tensor) -> Tensor:
        block, world, local = self.block, self.dispatch.world, self.dispatch.num_local
        probs = block.router(x).float().softmax(dim=-1)
        weights, ids = torch.topk(probs, block.config.routing.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.flatten()
        counts = torch.histc(flat.float(), bins=block.config.num_experts, min=0, max=block.config.num_experts).long()
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // block.config.routing.top_k)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.dispatch.group)
        # torchtitan copies both split vectors to the host and reads them: the per-layer sync of this design.
        in_splits = counts.view(world, local).sum(dim=1).tolist()
        out_splits = recv_counts.view(world, local).sum(dim=1).tolist()
        self.host_reads += 2
        received = exchange(rows, out_splits, in_splits, self.dispatch.group, wire=None, grad_wire=None)
        # Regroup by local expert: expert id of every received row, from host-side repeats (data-dependent sizes).
        local_ids = torch.arange(local).repeat(world).repeat_interleave(recv_counts.cpu())
        regroup = torch.argsort(local_ids, stable=True)
        grouped = received.index_select(0, regroup)
        offsets = torch.nn.functional.pad(recv_counts.view(world, local).sum(dim=0).cumsum(0), (1, 0))
        experts = block.experts
        rows = ExpertRows(grouped, offsets.to(torch.int32), False, resolve_backend("auto", grouped.device))
        hidden = expert_swiglu(rows, experts.gate_up_proj, experts.down_proj)
        back = torch.empty_like(hidden).index_copy(0, regroup, hidden)
        returned = exchange(back, in_splits, out_splits, self.dispatch.group, wire=None, grad_wire=None)
        weighted = returned * weights.flatten()[order].unsqueeze(1).to(returned.dtype)
        return torch.zeros_like(x).index_add(0, order // block.config.routing.top_k, weighted)


def _step(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> None:
    x.grad = None
    fn(x).backward(grad)


def timed(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> Callable[[int], float | None]:
    """An :func:`interleave` implementation: one forward+backward, timed as its slowest rank's (every rank calls it)."""

    def step(r: int) -> float | None:
        if r < 0:  # warm-up (and the capacity mode's one-time size check) or the counted call
            _step(fn, x, grad)
            return None
        dist.barrier()
        start = time.perf_counter()
        _step(fn, x, grad)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(elapsed)

    return step


def init_worker(rank: int, world: int, port: int) -> None:
    """One thread, and the gloo process group of a spawned benchmark worker (a timeout on every collective)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )


def _worker(rank: int, world: int, port: int, shape: tuple[int, ...], repeats: int, out: str) -> None:
    init_worker(rank, world, port)
    tokens, hidden, ffn, experts, top_k, factor = shape
    torch.manual_seed(0)
    dropless = shard_experts(MoEBlock(MoEConfig.build(hidden, ffn, experts, top_k, backend="torch")))
    torch.manual_seed(0)
    capacity = shard_experts(
        MoEBlock(MoEConfig.build(hidden, ffn, experts, top_k, capacity_factor=factor, backend="torch"))
    )
    impls: dict[str, Callable[[Tensor], Tensor]] = {
        "titan_style": TitanStyleDispatch(dropless),
        "ours_dropless": dropless,
        "ours_capacity": capacity,
    }
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens, hidden, requires_grad=True)
    grad = torch.randn(tokens, hidden)

    # Every rank runs the same rounds in the same rotated order, so the collectives pair up.
    measured = interleave({name: timed(fn, x, grad) for name, fn in impls.items()}, repeats, count=True)
    syncs = {name: m.syncs for name, m in measured.items()}
    limit = tokens * top_k * hidden * x.element_size()
    sent = {name: block.dispatcher.send_rows * hidden * x.element_size() for name, block in
            (("ours_dropless", dropless), ("ours_capacity", capacity))}  # fmt: skip
    sent["titan_style"] = sent["ours_dropless"]  # the same rows travel; only the host handling differs
    if rank == 0:
        median_ms = {name: 1e3 * m.median for name, m in measured.items()}
        report = {
            "shape": dict(zip(("T_per_rank", "H", "F", "E", "k", "capacity_factor"), shape, strict=True)),
            "ep": world,
            "repeats": repeats,
            "median_ms": median_ms,
            "ratio_to_titan_style": {n: ms / median_ms["titan_style"] for n, ms in median_ms.items()},
            "host_syncs_per_step": syncs,
            "dispatch_bytes_per_rank_per_forward": sent,
            "information_limit_bytes": limit,
            "bytes_over_limit": {n: b / limit for n, b in sent.items()},
        }
        Path(out).write_text(json.dumps(report))
    leave_world()


def run(world: int = 2, quick: bool = False, repeats: int | None = None, timeout: float = 600) -> dict[str, Any]:
    """Spawn ``world`` gloo processes, run the three implementations interleaved, return rank 0's report.

    Example::

        report = run(world=2, quick=True)
        report["host_syncs_per_step"]  # {"titan_style": ..., "ours_dropless": 1, "ours_capacity": 0}
    """
    shape = (256, 64, 128, 4 * world, 2, 1.25) if quick else (2048, 256, 512, 8, 2, 1.25)
    return spawn(_worker, world, (shape, repeats or (3 if quick else 7)), timeout)


def spawn(worker: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float) -> dict[str, Any]:
    """``worker(rank, world, port, *args, out)`` on ``world`` spawned processes; the JSON rank 0 wrote to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "report.json")
        spawn_world(worker, world, (world, free_port(), *args, out), timeout, "expert-parallel benchmark")
        return json.loads(Path(out).read_text())


def print_report(report: dict[str, Any]) -> None:
    """Print :func:`run`'s report as a table."""
    shape = ", ".join(f"{k}={v}" for k, v in report["shape"].items())
    print(f"\nExpert-parallel MoE block fwd+bwd, ep={report['ep']} CPU processes ({shape}), ", end="")
    print(f"median of {report['repeats']}")
    print(f"  {'implementation':<14} {'ms':>9} {'x titan':>8} {'host syncs':>11} {'bytes/fwd':>10} {'x limit':>8}")
    for name, ms in report["median_ms"].items():
        print(
            f"  {name:<14} {ms:>9.1f} {report['ratio_to_titan_style'][name]:>8.3f} "
            f"{report['host_syncs_per_step'][name]:>11} {report['dispatch_bytes_per_rank_per_forward'][name]:>10} "
            f"{report['bytes_over_limit'][name]:>8.3f}"
        )
    print(f"  information limit T*k*H*dtype = {report['information_limit_bytes']} bytes each way per exchange")
