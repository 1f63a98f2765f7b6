"""The one benchmark loop: warm-up, interleaved repeats, median and spread, and the hardware-independent counters.

Every profile of ``python -m lightning_llmfast.bench`` and every ``benchmarks/bench_*.py`` script measures through
:func:`interleave`: each implementation is warmed up, optionally counted once (host syncs with
:class:`~lightning_llmfast.bench.counters.SyncCounter`, kernels with
:class:`~lightning_llmfast.bench.kernels.KernelCounter`), then the repeats run round-robin with a rotating start,
so machine noise hits every implementation alike. A :class:`Measurement` holds the repeats in order; its median is
the reported figure and its min/max the spread. Ratios between implementations come with their range over the
repeats (:func:`ratio_range`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.kernels import KernelCounter

__all__ = ["Measurement", "count_call", "interleave", "ratio_range"]


@dataclass
class Measurement:
    """What :func:`interleave` measured for one implementation.

    Attributes:
        values: one value per repeat, in the order run (seconds, unless the implementation returned its own value
            such as tokens/sec).
        syncs: host syncs of the counted call, or per step of a counted segment (``None``: not counted).
        kernels: kernel launches, likewise.
        ops: ATen ops, likewise.
        sync_names: the counted host syncs by name.
        extra: what a custom count adds (metadata builds, peak memory...).
        error: the first exception the implementation raised (it then ran no further repeats).
    """

    values: list[float] = field(default_factory=list)
    syncs: float | None = None
    kernels: float | None = None
    ops: float | None = None
    sync_names: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def median(self) -> float:
        """Median over the repeats (``nan`` without any)."""
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def low(self) -> float:
        """Smallest repeat (``nan`` without any)."""
        return min(self.values, default=float("nan"))

    @property
    def high(self) -> float:
        """Largest repeat (``nan`` without any)."""
        return max(self.values, default=float("nan"))

    def summary(self, unit: str = "") -> dict[str, Any]:
        """``{"<unit>", "<unit>_min", "<unit>_max", "<unit>_repeats"}`` plus the counters that were taken."""
        out: dict[str, Any] = {unit: self.median, f"{unit}_min": self.low, f"{unit}_max": self.high}
        out[f"{unit}_repeats"] = list(self.values)
        if self.syncs is not None:
            out["host_syncs"], out["kernels"] = self.syncs, self.kernels
        return out


def count_call(fn: Callable[[], Any], device: torch.device | str = "cpu", host: Any = ()) -> Measurement:
    """Host syncs, kernels and ATen ops of one call of ``fn`` (see :class:`SyncCounter` for ``device``/``host``).

    Example::

        m = count_call(lambda: block(x).sum().backward())
        m.syncs, m.kernels
    """
    with SyncCounter(device, host=host) as syncs, KernelCounter() as kernels:
        fn()
    return Measurement(syncs=syncs.num_syncs, kernels=kernels.kernels, ops=kernels.total, sync_names=dict(syncs.syncs))


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        # NOTE: host sync at the two ends of a timed call (never inside it): the timer must see the kernels end.
        torch.cuda.synchronize(device)


def interleave(
    impls: Mapping[str, Callable[[int], float | None]],
    repeats: int,
    *,
    warmup: int = 1,
    count: bool | Callable[[str], Measurement] = False,
    device: torch.device | str | None = None,
    deadline: float | None = None,
    host: Any = (),
    catch: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Measurement]:
    """Measure every implementation in one run: warm-up, an optional counted call, then interleaved repeats.

    Args:
        impls: ``name -> fn(repeat)``; ``repeat`` is ``-1`` for warm-up and counted calls, else the repeat index
            (a profile that feeds each repeat fresh data uses it). ``fn`` returns ``None`` to be timed by the loop
            (seconds), or its own measured value (tokens/sec from the steps it timed itself).
        repeats: timed rounds; in round ``r`` the implementations run in order, rotated by ``r``.
        warmup: untimed calls of each implementation first (lazy initialisation, compilation, allocator).
        count: ``True``: one more call of each under the sync and kernel counters (:func:`count_call`); a callable
            ``count(name) -> Measurement``: the profile's own counting (per-step windows of a training segment).
        device: where the implementations compute (synchronised around each timed call on CUDA; the counters').
        deadline: a ``time.perf_counter()`` value after which no further round starts (the first always runs).
        host: tensors that stay on the host on an accelerator, for the counters (:class:`SyncCounter`).
        catch: record an implementation's exception in its :class:`Measurement` (and call it no more), not raise.
        log: progress messages.

    Returns:
        ``name -> Measurement``. Example::

        m = interleave({"ours": lambda r: step(ours), "peer": lambda r: step(peer)}, repeats=5)
        m["ours"].median / m["peer"].median
    """
    dev = torch.device(device) if device is not None else None
    out = {name: Measurement() for name in impls}

    def call(name: str, fn: Callable[[], Any]) -> Any:
        return _guarded(out[name], name, fn, catch, log)

    for name, fn in impls.items():
        for _ in range(warmup):
            call(name, lambda fn=fn: fn(-1))
        if count:
            counter = count if callable(count) else (lambda _, fn=fn: count_call(lambda: fn(-1), dev or "cpu", host))
            _adopt(out, name, call(name, lambda name=name, counter=counter: counter(name)))
    names = list(impls)
    for r in range(repeats):
        if r > 0 and deadline is not None and time.perf_counter() > deadline:
            if log is not None:
                log(f"[bench] time budget reached: {r} of {repeats} rounds ran")
            break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _synchronize(dev)
            start = time.perf_counter()
            value = call(name, lambda name=name, r=r: impls[name](r))
            _synchronize(dev)
            if out[name].error is None:
                out[name].values.append(time.perf_counter() - start if value is None else float(value))
    return out


def _adopt(out: dict[str, Measurement], name: str, counted: Measurement | None) -> None:
    """Keep the counters of ``counted`` (``None``: the counted call failed) in ``out[name]``."""
    if counted is not None:
        counted.values, counted.error = out[name].values, out[name].error
        out[name] = counted


def _guarded(m: Measurement, name: str, fn: Callable[[], Any], catch: bool, log: Callable[[str], None] | None) -> Any:
    """``fn()``, unless ``m`` already failed; with ``catch`` an exception is recorded in ``m`` instead of raised."""
    if m.error is not None:
        return None
    try:
        return fn()
    except Exception as err:
        if not catch:
            raise
        m.error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        if log is not None:
            log(f"[bench] {name} failed: {m.error}")
        return None


def ratio_range(num: Measurement, den: Measurement) -> tuple[float, float] | None:
    """``(low, high)`` of ``num / den`` over the repeats' extremes, or ``None`` when either has no repeat.

    Example::

        ratio_range(m["ours"], m["peer"])  # (0.91, 1.04)
    """
    if not num.values or not den.values or den.high <= 0 or den.low <= 0:
        return None
    return num.low / den.high, num.high / den.low
