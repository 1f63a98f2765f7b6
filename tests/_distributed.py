"""Run a function on ``world`` spawned CPU processes joined by gloo, with a timeout on every collective and the join."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank closes its gloo pairs while a peer still exchanges with it
    finally:
        dist.destroy_process_group()
    # A clean rank leaves without interpreter finalization: gloo's worker threads can still drop their last reference
    # to a finished work's tensors then, and a thread taking the GIL during finalization is ended with a forced
    # unwind that aborts the process ("terminate called without an active exception", pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., None], world: int, *args: Any, timeout: float = 120.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; a failure on any rank (or a hang) fails the caller."""
    context = mp.start_processes(
        _entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"distributed test did not finish within {timeout} s")
