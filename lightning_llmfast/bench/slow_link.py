"""A slow network on one machine: every ``all_to_all_single`` completes as if its bytes crossed a link of ``B`` bytes/s.

CPU processes on one host exchange through memory, so no exchange costs what it costs between GPUs on a network and
nothing is left to hide. :class:`SlowLink` replaces ``torch.distributed.all_to_all_single`` in this process: the
real exchange runs, and its work object completes (``wait()`` returns, the future is set) ``bytes / B`` after the
link took it, where ``bytes`` is what this rank sends to other ranks: the link takes an exchange once its real
transfer completed (every rank has joined it) and the exchange before it has left the link (exchanges in flight
queue, as on one link). So one exchange of ``2 N`` bytes and two of ``N`` take the same link time: chunking does not
shrink the total, it can only hide it; and the time added does not depend on which rank joined last. A synchronous
call returns at the same time as its asynchronous twin's ``wait()``.

On CUDA the host never waits: after the real exchange, the link time is a ``torch.cuda._sleep`` of ``bytes / B``
(calibrated once) on the stream that issued it, so whatever waits for that stream waits for the link, and exchanges
issued on one stream queue on it. With one process (a world of 1), every byte counts as crossing the link: the rows
a rank sends itself stand for those a larger group would send away.

Example::

    with SlowLink(bytes_per_s=50e6):
        loss = model(batch).sum()  # every expert-parallel exchange now takes bytes / 50 MB/s
        loss.backward()
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast.errors import ConfigError

__all__ = ["SlowLink"]

_CYCLES_PER_S: dict[int, float] = {}  # torch.cuda._sleep's clock, per device


class _SlowWork:
    """A work object that completes ``num_bytes / B`` after ``link`` takes it (once the real one completed)."""

    def __init__(self, work: Any, link: SlowLink, num_bytes: int) -> None:
        self._work, self._link, self._bytes = work, link, num_bytes
        self._future: torch.futures.Future[None] = torch.futures.Future()
        self._done = threading.Event()
        work.get_future().add_done_callback(self._arrived)

    def _arrived(self, _: Any) -> None:
        delay = self._link._take(self._bytes) - time.perf_counter()
        timer = threading.Timer(max(delay, 0.0), self._complete)
        timer.daemon = True
        timer.start()

    def _complete(self) -> None:
        self._done.set()
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()
        self._done.wait()
        return True

    def get_future(self) -> torch.futures.Future[None]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class SlowLink:
    """Slows this process's ``all_to_all_single`` to ``bytes_per_s`` while active (module docstring).

    Args:
        bytes_per_s: the link's bandwidth, > 0.

    Attributes:
        sent_bytes: bytes sent to other ranks while active.

    Raises:
        ConfigError: a bandwidth that is not a number > 0.
    """

    def __init__(self, bytes_per_s: float) -> None:
        if not isinstance(bytes_per_s, (int, float)) or not bytes_per_s > 0:
            raise ConfigError(f"SlowLink needs a bandwidth > 0 bytes/s, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self.sent_bytes = 0
        self._free_at = 0.0
        self._lock = threading.Lock()
        self._original: Any = None

    def _take(self, num_bytes: int) -> float:
        """When an exchange of ``num_bytes`` whose real transfer completed now leaves the link."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + num_bytes / self.bytes_per_s
            self.sent_bytes += num_bytes
            return self._free_at

    def _all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input.shape[0] if input.dim() else 1
        to_self = 0 if world == 1 else input_split_sizes[rank] if input_split_sizes is not None else rows // world
        num_bytes = (rows - to_self) * (input.numel() * input.element_size() // max(rows, 1))
        work = self._original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=True)
        if input.is_cuda:
            work.wait()  # the issuing stream waits for the exchange, then for the link
            self.sent_bytes += num_bytes
            torch.cuda._sleep(int(num_bytes / self.bytes_per_s * self._cuda_cycles_per_s()))
            return work if async_op else None
        slow = _SlowWork(work, self, num_bytes)
        if async_op:
            return slow
        slow.wait()
        return None

    @staticmethod
    def _cuda_cycles_per_s() -> float:
        """``torch.cuda._sleep`` cycles per second on the current device, measured on first use in this process
        (one host wait: warm a benchmark up before timing it)."""
        device = torch.cuda.current_device()
        if device not in _CYCLES_PER_S:
            cycles = 10**7
            with torch.cuda.stream(torch.cuda.Stream()):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
            _CYCLES_PER_S[device] = cycles / (start.elapsed_time(end) / 1e3)
        return _CYCLES_PER_S[device]

    def __enter__(self) -> SlowLink:
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._all_to_all_single  # type: ignore[assignment]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        dist.all_to_all_single = self._original  # type: ignore[assignment]
        self._original = None
