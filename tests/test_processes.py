"""Spawned workers: a finished rank exits 0 past gloo's teardown, a raising rank fails the caller, a hang times out."""

from __future__ import annotations

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
