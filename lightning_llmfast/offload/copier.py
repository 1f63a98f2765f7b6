"""The copy engine: the only place where CUDA (side streams, events) and the CPU path (synchronous copies) differ.

:class:`Copier` is the interface the offloader drives; :class:`CudaStreamCopier` copies on one device-to-host and one
host-to-device stream with an event per batch of copies, :class:`CpuCopier` copies synchronously (``force=True`` on
CPU: the tests prove the bookkeeping with it, or with a subclass that defers every copy until something waits).

A copier asked to (:attr:`Copier.timed`, set when ``offload/overlap`` is logged) times its copies: ``copy`` spans
(how long the copies ran) and ``wait`` spans (how long compute waited for them), read after the step with
:meth:`Copier.copy_times` once they have completed (no host sync). On CUDA both are event pairs: a copy span on its
side stream, a wait span on the compute stream around the first wait for each copy event (later waits on a completed
event cost nothing). On CPU a copy runs on the host thread that computes, so every copy span is also a wait span: the
overlap is 0 by construction. An untimed copier takes no timestamps for its copies: on CUDA one plain event per batch
of copies (what the next stream waits for), no timing events.

Example::

    copier = make_copier(torch.device("cpu"))
    event = copier.copy([(host_buf[:n], source)], to_host=True)
    copier.compute_waits(event)
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override

__all__ = ["Copier", "CpuCopier", "CudaStreamCopier", "make_copier"]

# Copy pairs: (destination, source) flat uint8 views.
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class Copier(ABC):
    """What the offloader needs from a copy engine. ``copy`` returns an event, or ``None`` when the copies have
    completed by the time it returns; every method accepts ``None`` where it takes an event.

    Attributes:
        timed: time every copy and every first wait on one for :meth:`copy_times` (``False`` by default: nothing is
            timed, and :meth:`copy_times` reads ``None``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.timed = False
        self._spans: list[tuple[str, Any, Any]] = []  # this step's ("copy" | "wait", start, end)
        self._ended: list[tuple[str, Any, Any]] = []  # the last ended step's
        self._waited: set[int] = set()  # ids of the events compute has waited on this step

    def _span(self, kind: str, start: Any, end: Any) -> None:
        self._spans.append((kind, start, end))

    def end_step(self) -> None:
        """The step ended: its spans are the ones :meth:`copy_times` reads from now on."""
        self._ended, self._spans = self._spans, []
        self._waited = set()

    def copy_times(self) -> tuple[float, float] | None:
        """``(copy_ms, exposed_copy_ms)`` of the last ended step: the time its copies ran, and the time compute waited
        on them; ``None`` when it copied nothing or some span has not completed yet (read again later: never blocks).

        Example::

            times = copier.copy_times()
            overlap = None if times is None or not times[0] else 1 - times[1] / times[0]
        """
        spans = self._ended
        if not spans or not all(self.stamp_done(end) for _, _, end in spans):
            return None
        total = {"copy": 0.0, "wait": 0.0}
        for kind, start, end in spans:
            total[kind] += self.elapsed_ms(start, end)
        return total["copy"], total["wait"]

    @abstractmethod
    def mark_compute(self) -> Any:
        """An event on the compute stream: copies issued after waiting on it see all prior compute."""

    @abstractmethod
    def copy(self, pairs: Pairs, to_host: bool, after: Sequence[Any] = ()) -> Any:
        """Copy every ``(dst, src)`` in order on one stream after ``after``; one event marks them all done.

        One layer's copies go in one call: a stream switch, one wait per event and one event per layer instead of
        per tensor (each is a driver call on a forward that is often launch-bound).
        """

    @abstractmethod
    def compute_waits(self, event: Any) -> None:
        """Make the compute stream wait for ``event``."""

    @abstractmethod
    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed, without blocking."""

    @abstractmethod
    def wait_host(self, event: Any) -> None:
        """Block the host until ``event`` has completed (step boundaries, errors and teardown only)."""

    @abstractmethod
    def timestamp(self) -> Any:
        """A point on the compute stream, for the ``"auto"`` plan's timings."""

    @abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two :meth:`timestamp` points."""

    def stamp_done(self, stamp: Any) -> bool:
        """Whether the device has reached :meth:`timestamp` point ``stamp`` (reading it then never blocks)."""
        return self.done(stamp)

    @abstractmethod
    def allocated(self) -> int | None:
        """Device bytes handed out now (a host-side counter, no sync); ``None`` where there is no such count."""

    def protect(self, tensor: torch.Tensor) -> None:  # noqa: B027 (a no-op unless copies are asynchronous)
        """Keep the allocator from reusing ``tensor`` (written by host-to-device copies) before they are done."""

    def bandwidth(self, nbytes: int, host: torch.Tensor) -> float:
        """Copy bandwidth in bytes/ms of the slower direction between the device and ``host`` (``(>= nbytes,)``).

        Best of four timed copies per direction (the first one doubles as the warm-up).
        """
        device_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        best = {True: float("inf"), False: float("inf")}
        for to_host in (True, False) * 4:
            dst, src = (host[:nbytes], device_buf) if to_host else (device_buf, host[:nbytes])
            with self._on_stream(to_host):
                start = self.timestamp()
                dst.copy_(src, non_blocking=self.is_cuda)
                best[to_host] = min(best[to_host], self.elapsed_ms(start, self.timestamp()))
        # A copy too short for the clock would read as infinitely fast; floor it at one microsecond.
        return nbytes / max(max(best.values()), 1e-3)

    def _on_stream(self, to_host: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class CpuCopier(Copier):
    """Synchronous copies: an event is ``None``, a copy has completed when :meth:`copy` returns.

    Args:
        device: the device copied from (the CPU).
        clock: the seconds its timestamps read: wall time by default; ``time.thread_time`` counts only this thread's
            CPU time, which other processes on a shared host do not enter (a benchmark's choice, with one intra-op
            thread: then every op runs on the calling thread).
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(device)
        self._clock = clock

    @override
    def mark_compute(self) -> None:
        return None

    @override
    def copy(self, pairs: Pairs, to_host: bool, after: Sequence[Any] = ()) -> Any:
        start = self.timestamp() if self.timed else None
        for dst, src in pairs:
            dst.copy_(src)
        if start is not None:
            end = self.timestamp()
            self._span("copy", start, end)
            self._span("wait", start, end)  # the host that computes ran the copy: all of it is exposed
        return None

    @override
    def compute_waits(self, event: Any) -> None:
        pass

    @override
    def done(self, event: Any) -> bool:
        return True

    @override
    def wait_host(self, event: Any) -> None:
        pass

    @override
    def timestamp(self) -> float:
        return self._clock()

    @override
    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    @override
    def stamp_done(self, stamp: Any) -> bool:
        return True  # the host clock: read when taken

    @override
    def allocated(self) -> int | None:
        return None


class CudaStreamCopier(Copier):
    """Copies on a device-to-host and a host-to-device side stream, ordered against compute by events."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    @override
    def mark_compute(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self.device).record_event()

    @override
    def copy(self, pairs: Pairs, to_host: bool, after: Sequence[Any] = ()) -> torch.cuda.Event:
        stream = self.d2h if to_host else self.h2d
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            # On the copy stream, once its waits are met: the copies' own time.
            start = self.timestamp() if self.timed else None
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if start is None:
                return stream.record_event()  # what the next stream waits for; no timing
            end = self.timestamp()
        self._span("copy", start, end)
        return end

    @override
    def compute_waits(self, event: Any) -> None:
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if not self.timed or id(event) in self._waited:
            stream.wait_event(event)
            return
        self._waited.add(id(event))
        # Compute reaches `before` when its earlier work is done and `after` once the copy is too: the stall.
        before = self.timestamp()
        stream.wait_event(event)
        self._span("wait", before, self.timestamp())

    @override
    def done(self, event: Any) -> bool:
        return event is None or event.query()  # asks the driver without blocking; not a host sync

    @override
    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()  # NOTE: host sync; only at step boundaries and on error/teardown paths.

    @override
    def timestamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the current stream: the copy stream inside copy()
        return event

    @override
    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()  # NOTE: host sync; once, when the "auto" plan is made after the first step.
        return float(start.elapsed_time(end))

    @override
    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    @override
    def protect(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.h2d)

    @override
    def _on_stream(self, to_host: bool) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.d2h if to_host else self.h2d)


def make_copier(device: torch.device) -> Copier:
    """The copy engine for ``device``: CUDA streams on a CUDA device, synchronous copies elsewhere."""
    return CudaStreamCopier(device) if device.type == "cuda" else CpuCopier(device)
