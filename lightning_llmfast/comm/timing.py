"""Timers that never synchronise the step: stamps are taken in the step and read later, once they have completed.

A *clock* takes stamps and measures between them. :class:`HostClock` stamps with ``time.perf_counter`` (CPU
training, where the host runs the work). :class:`EventClock` records a CUDA event on the current stream and reads
``elapsed_time`` only after ``query()`` says both events completed, so reading never blocks either. A test passes
its own clock (any object with ``stamp()``, ``ready(stamp)`` and ``elapsed_ms(a, b)``).

:class:`SpanTimer` times the gradient reduction of each step: from the first bucket's launch to the completion of
the last one. :class:`BusyTimer` times the fraction of the wall time the device spends inside the steps.
:class:`ExchangeTimer` times the expert-parallel all-to-all exchanges of each step: how long the link was busy and
how long the step waited for it.

Example::

    timer = SpanTimer(HostClock())
    start = timer.begin()      # in the communication hook, per bucket
    timer.end(start, last=True)  # when the bucket's future completed
    timer.read_ms()            # at a log point: mean ms per completed step, or None
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

__all__ = ["BusyTimer", "Clock", "EventClock", "ExchangeTimer", "HostClock", "SpanTimer", "clock_for"]

# Steps kept while waiting to be read; older ones are dropped (a run that never reads must not grow without bound).
_MAX_PENDING = 1024


class Clock(Protocol):
    """Takes stamps and measures between completed ones."""

    def stamp(self) -> Any:
        """A new stamp, now (on the host or in the current stream's order)."""

    def ready(self, stamp: Any) -> bool:
        """Whether ``stamp`` has been reached (non-blocking)."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``; both are ready."""


class HostClock:
    """Host time: every stamp is ready when taken."""

    def stamp(self) -> float:
        return time.perf_counter()

    def ready(self, stamp: float) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class EventClock:
    """CUDA time: a timing event recorded on the current stream; read once ``query()`` is true (no blocking)."""

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, stamp: torch.cuda.Event) -> bool:
        return bool(stamp.query())

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


def clock_for(device: torch.device) -> Clock:
    """:class:`EventClock` for a CUDA device, :class:`HostClock` otherwise."""
    return EventClock() if device.type == "cuda" else HostClock()


class _Span:
    __slots__ = ("ends", "last_launched", "launched", "start")

    def __init__(self, start: Any) -> None:
        self.start, self.ends, self.launched, self.last_launched = start, [], 0, False


class SpanTimer:
    """Per step, the time from the first :meth:`begin` to the last :meth:`end` (the step's gradient reduction).

    ``begin`` is called when a bucket is launched, ``end`` when its future completed (possibly on a communication
    thread: the timer is thread-safe); the bucket launched with ``last=True`` closes the step once every bucket
    launched in it has ended. Nothing here waits for the device.

    Args:
        clock: takes the stamps (:func:`clock_for` the training device).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._open: _Span | None = None
        self._closed: list[_Span] = []

    def begin(self, last: bool = False) -> _Span:
        """Stamp a bucket's launch; returns the handle to pass to :meth:`end`."""
        with self._lock:
            if self._open is None:
                self._open = _Span(self.clock.stamp())
            span = self._open
            span.launched += 1
            if last:
                span.last_launched = True
                self._open = None  # the next bucket starts the next step
            return span

    def end(self, span: _Span) -> None:
        """Stamp a bucket's completion (from the future's callback)."""
        stamp = self.clock.stamp()
        with self._lock:
            span.ends.append(stamp)
            self._close_if_done(span)

    def close(self) -> None:
        """End the open step with the buckets launched so far, for reductions that cannot tell their last bucket
        when they launch it (FSDP2's reduce-scatters: the step ends before the optimizer update)."""
        with self._lock:
            span, self._open = self._open, None
            if span is not None:
                span.last_launched = True
                self._close_if_done(span)

    def _close_if_done(self, span: _Span) -> None:
        if span.last_launched and len(span.ends) == span.launched:
            self._closed.append(span)
            del self._closed[:-_MAX_PENDING]

    def read_ms(self) -> float | None:
        """Mean milliseconds per step over the closed steps whose stamps completed, or ``None`` if there is none.

        Steps read are forgotten; steps whose stamps are still pending stay for the next read.
        """
        with self._lock:
            done = [s for s in self._closed if self.clock.ready(s.start) and all(map(self.clock.ready, s.ends))]
            self._closed = [s for s in self._closed if s not in done]
        if not done:
            return None
        spans = [max(self.clock.elapsed_ms(s.start, end) for end in s.ends) for s in done]
        return sum(spans) / len(spans)


class BusyTimer:
    """The fraction of wall time the device spent inside training steps.

    :meth:`step_start` and :meth:`step_end` stamp each step in the device's order; step ``i`` counts once step
    ``i + 1`` started: ``busy = sum(end_i - start_i) / sum(start_{i+1} - start_i)``. Time between steps (data
    loading, logging, host work the device waits for) lowers it; idle gaps *inside* a step (a host that launches
    kernels slower than the device runs them) do not, since events only mark the stream's order.

    Args:
        clock: takes the stamps (an :class:`EventClock` on CUDA).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._steps: list[tuple[Any, Any | None]] = []

    def step_start(self) -> None:
        """Stamp a step's start (also the previous step's wall-time end)."""
        self._steps.append((self.clock.stamp(), None))
        del self._steps[:-_MAX_PENDING]

    def step_end(self) -> None:
        """Stamp the end of the step started last."""
        if self._steps and self._steps[-1][1] is None:
            self._steps[-1] = (self._steps[-1][0], self.clock.stamp())

    def read(self) -> float | None:
        """The busy fraction over the steps complete so far (read steps are forgotten), or ``None``."""
        busy = total = 0.0
        count = 0
        ready = self.clock.ready
        for (start, end), (following, _) in zip(self._steps, self._steps[1:]):
            if end is None or not (ready(start) and ready(end) and ready(following)):
                break
            busy += self.clock.elapsed_ms(start, end)
            total += self.clock.elapsed_ms(start, following)
            count += 1
        del self._steps[:count]
        return busy / total if count and total > 0 else None


class ExchangeTimer:
    """Per step, the time the exchanges took and the time the step waited for them (``comm/a2a_ms`` and
    ``comm/a2a_exposed_ms``).

    An exchange is a *span* from :meth:`begin` (stamped where it is issued: on the host, or on the communication
    stream) to :meth:`end` (its completion: a future's callback on the host, an event recorded after it on the
    communication stream). The step's exchange time is the length of the union of its spans (the time at least one
    exchange was in flight); its exposed time is the length of the part of that union the :meth:`waited` intervals
    cover (stamped around each wait, on the host or on the compute stream, so that a stream stalled on the exchange
    shows as the gap), so it never exceeds the exchange time. :meth:`close`
    ends a step; :meth:`read_ms` reads the closed steps whose stamps completed, without waiting; :meth:`discard` drops
    the exchanges of a step that is not timed (validation, test, predict).

    Args:
        clock: takes the stamps (:func:`clock_for` the training device).

    Example::

        timer = ExchangeTimer(HostClock())
        span = timer.begin()
        work.get_future().add_done_callback(lambda _: timer.end(span))
        start = timer.clock.stamp(); work.wait(); timer.waited(start, timer.clock.stamp())
        timer.close()
        timer.read_ms()  # (a2a_ms, a2a_exposed_ms), means over the steps read, or None
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._spans: list[list[Any]] = []
        self._waits: list[tuple[Any, Any]] = []
        self._closed: list[tuple[list[list[Any]], list[tuple[Any, Any]]]] = []

    def begin(self) -> list[Any]:
        """Stamp an exchange's issue; returns the span to pass to :meth:`end`."""
        span = [self.clock.stamp(), None]
        with self._lock:
            self._spans.append(span)
        return span

    def end(self, span: list[Any], stamp: Any | None = None) -> None:
        """Stamp an exchange's completion (``stamp``, or now)."""
        span[1] = self.clock.stamp() if stamp is None else stamp

    def waited(self, start: Any, end: Any) -> None:
        """Count ``start`` to ``end`` (stamps around one wait) as time the step waited for an exchange."""
        with self._lock:
            self._waits.append((start, end))

    def close(self) -> None:
        """End the step: its exchanges so far are read by the next :meth:`read_ms` once their stamps completed."""
        with self._lock:
            if self._spans or self._waits:
                self._closed.append((self._spans, self._waits))
                del self._closed[:-_MAX_PENDING]
            self._spans, self._waits = [], []

    def discard(self) -> None:
        """Forget the exchanges since the last :meth:`close` (an evaluation step's: part of no training step). An
        exchange whose completion is stamped later stamps a span no step holds any more."""
        with self._lock:
            self._spans, self._waits = [], []

    def read_ms(self) -> tuple[float, float] | None:
        """``(exchange ms, exposed ms)`` per step, averaged over the closed steps whose stamps completed, or ``None``.

        Steps read are forgotten; steps still pending stay for the next read.
        """
        with self._lock:
            done = [step for step in self._closed if self._ready(step)]
            self._closed = [step for step in self._closed if not any(step is d for d in done)]
        if not done:
            return None
        busy = [self._union_ms(spans) for spans, _ in done]
        exposed = [self._union_ms(spans, waits) for spans, waits in done]
        return sum(busy) / len(busy), sum(exposed) / len(exposed)

    def _ready(self, step: tuple[list[list[Any]], list[tuple[Any, Any]]]) -> bool:
        spans, waits = step
        stamps = [s for span in spans for s in span] + [s for wait in waits for s in wait]
        return all(s is not None and self.clock.ready(s) for s in stamps)

    def _union_ms(self, spans: list[list[Any]], within: list[tuple[Any, Any]] | None = None) -> float:
        """The length of the union of ``spans``; with ``within``, of the part of it that the union of ``within``
        covers (the waits, counted while an exchange was in flight: a host thread woken after the exchange
        completed does not count its wake-up, so the exposed time never exceeds the exchange time)."""
        if not spans:
            return 0.0
        base = spans[0][0]
        merged = self._merged([(self.clock.elapsed_ms(base, a), self.clock.elapsed_ms(base, b)) for a, b in spans])
        if within is None:
            return sum(end - start for start, end in merged)
        waits = self._merged([(self.clock.elapsed_ms(base, a), self.clock.elapsed_ms(base, b)) for a, b in within])
        return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in merged for s2, e2 in waits)

    @staticmethod
    def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """Sorted, disjoint intervals covering the same points as ``intervals``."""
        merged: list[tuple[float, float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged
