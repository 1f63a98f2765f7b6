"""Spawned worker processes for multi-process benchmarks and tests: a free port, a join with a deadline, a clean exit.

A finished gloo rank must not run interpreter finalization: gloo's worker threads can still drop their last
reference to a finished work's tensors then, and a thread taking the GIL during finalization is ended with a forced
unwind that aborts the process ("terminate called without an active exception", pytorch/pytorch#179291). A run that
did all its work then fails on SIGABRT. :func:`leave_world` is the one way a worker ends.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT`` or a ``tcp://`` init method)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(worker: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float, what: str) -> None:
    """``worker(rank, *args)`` on ``world`` spawned processes; kills them all after ``timeout`` seconds.

    Raises:
        TimeoutError: the processes ran past ``timeout`` (``what`` names the run in the message).
        torch.multiprocessing.ProcessRaisedException: a rank raised (the others are terminated).

    Example::

        spawn_world(worker, 2, (free_port(), out_dir), timeout=120, what="my benchmark")
    """
    context = mp.start_processes(worker, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(min(deadline - time.monotonic(), 5.0), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{what} on {world} processes did not finish within {timeout} s")


def leave_world() -> None:
    """End a finished worker: meet the other ranks, close the process group, exit 0 without finalization.

    The barrier keeps a rank from closing its gloo pairs while a peer still exchanges with it. Call it last, after
    the worker's results are written.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
