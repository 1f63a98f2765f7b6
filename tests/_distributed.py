"""Run a function on ``world`` CPU processes (forked from ``spawn_world``'s server) joined by gloo, with a timeout on
every collective and the join."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        fn(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world()


def run_distributed(fn: Callable[..., None], world: int, *args: Any, timeout: float = 120.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; a failure on any rank (or a hang) fails the caller."""
    spawn_world(_entry, world, (world, free_port(), fn, args), timeout, "distributed test")
