"""Worker processes for multi-process benchmarks and tests: a free port, a join with a deadline, a clean exit.

Workers are forked from a server that imported :data:`PRELOAD` once (multiprocessing's ``forkserver``), not spawned
as fresh interpreters: a spawned rank spends seconds importing torch and Lightning before its first collective, and a
test suite starts hundreds of ranks. The server is a clean process (no process group, no threads of a run), started on
the first :func:`spawn_world` of a process; each worker gets the caller's environment of the moment.

A finished gloo rank must not run interpreter finalization: gloo's worker threads can still drop their last
reference to a finished work's tensors then, and a thread taking the GIL during finalization is ended with a forced
unwind that aborts the process ("terminate called without an active exception", pytorch/pytorch#179291). A run that
did all its work then fails on SIGABRT. :func:`leave_world` is the one way a worker ends.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
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


PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "lightning_llmfast")
"""The modules the workers' server imports once."""


def _in_environ(rank: int, environ: dict[str, str], worker: Callable[..., None], *args: Any) -> None:
    """A worker under the caller's environment (the server's own is that of its start)."""
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def spawn_world(worker: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float, what: str) -> None:
    """``worker(rank, *args)`` on ``world`` processes forked from the server; kills them all after ``timeout`` seconds
    (counted from their start: the server's own start on the first call is not in it).

    Raises:
        TimeoutError: the processes ran past ``timeout`` (``what`` names the run in the message).
        torch.multiprocessing.ProcessRaisedException: a rank raised (the others are terminated).

    Example::

        spawn_world(worker, 2, (free_port(), out_dir), timeout=120, what="my benchmark")
    """
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # only the first start of the server reads it
    context = mp.start_processes(
        _in_environ, args=(dict(os.environ), worker, *args), nprocs=world, start_method="forkserver", join=False
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(min(deadline - time.monotonic(), 5.0), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{what} on {world} processes did not finish within {timeout} s")


def leave_world() -> None:
    """End a finished worker: meet the other ranks, close the process group, exit 0 without finalization.

    The barrier keeps a rank from closing its gloo pairs while a peer still exchanges with it. Then what
    ``multiprocessing`` does when a process ends, which ``os._exit`` alone would skip: its finalizers (the named
    semaphores of queues and events, such as a DataLoader's with spawned workers, unlinked and struck from the
    resource tracker, which otherwise reports "leaked semaphore objects" at shutdown), daemonic children (DataLoader
    workers) terminated, the others joined. Call it last, after the worker's results are written.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    multiprocessing.util._exit_function()  # once per process: a multiprocessing child's own end skips it then
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
