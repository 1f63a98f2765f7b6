"""Spawned workers: a finished rank exits 0 past gloo's teardown, a raising rank fails the caller, a hang times out;
a process that ends through ``leave_world`` (and a 2-process FSDP2 x EP fit with a spawned DataLoader worker) leaves
no semaphore to Python's resource tracker and no child behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _distributed import run_distributed


def _writes(rank: int, world: int, out: str) -> None:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    Path(out, f"rank{rank}").write_text(str(total.item()))


def _raises(rank: int, world: int) -> None:
    dist.barrier()
    raise ValueError(f"rank {rank} fails")


def _hangs(rank: int, world: int) -> None:
    time.sleep(60)


def test_finished_ranks_exit_cleanly_after_their_collectives(tmp_path: Path) -> None:
    run_distributed(_writes, 2, str(tmp_path), timeout=120)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["3.0", "3.0"]


def test_a_raising_rank_fails_the_caller_with_its_error() -> None:
    with pytest.raises(mp.ProcessRaisedException, match=r"ValueError: rank [01] fails"):
        run_distributed(_raises, 2, timeout=120)


def test_a_hanging_world_is_killed_at_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 8"):
        run_distributed(_hangs, 2, timeout=8)
    assert time.monotonic() - start < 40


REPO = Path(__file__).parents[1]
_QUIET = (
    "leaked semaphore",
    "resource_tracker",
)  # what Python's resource tracker prints for the named semaphores a process left behind


def _quiet_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [word for word in _QUIET if word in proc.stderr], proc.stderr[-3000:]
    return proc


_LEAVES = """
import multiprocessing, time
from lightning_llmfast.bench.processes import leave_world
ctx = multiprocessing.get_context("spawn")
queue, event = ctx.Queue(), ctx.Event()  # named semaphores, as a DataLoader with spawned workers makes
child = ctx.Process(target=time.sleep, args=(120,), daemon=True)  # a worker still running
child.start()
print(child.pid, flush=True)
leave_world()
"""


def test_leave_world_leaves_no_semaphore_and_no_worker_behind(tmp_path: Path) -> None:
    # The resource tracker prints on the process's stderr once its last user exited (the run waits for it).
    proc = _quiet_run([sys.executable, "-c", _LEAVES], tmp_path)
    pid = int(proc.stdout.split()[0])
    with pytest.raises(ProcessLookupError):  # the daemonic worker was ended with its parent
        os.kill(pid, 0)


@pytest.mark.slow
def test_a_two_process_fsdp_x_ep_fit_with_a_worker_ends_quietly(tmp_path: Path) -> None:
    script = Path(__file__).parent / "scripts" / "fit_packed.py"
    args = ["--devices", "2", "--workers", "1", "--max-steps", "2", "--docs", "16", "--sharding", "fsdp", "--ep", "2"]
    _quiet_run([sys.executable, str(script), "--out", "fit", *args], tmp_path)
    assert len(list(tmp_path.glob("fit.rank*"))) == 2
