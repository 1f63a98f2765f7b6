"""The CPU path of :mod:`bench_offload`: no copy streams, so the forced path runs on a tiny model (under the same bf16
autocast) for the offloader's stats and a bit-identity check of every mode, the peak of live tensor bytes of the modes
that copy nothing, and ``host_ms``: forward and backward time of those modes on a 12-layer model whose step is host
time, as a launch-bound GPU forward is, with the ATen operations a step dispatches in each mode.

Example::

    report = cpu_report(quick=True)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from offload_steps import COPY_FREE_MODES, MODES, SHAPES, forward_backward, saved_inventory, selected, setup, step

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.steps import PeakMemory
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

__all__ = ["cpu_report"]


def cpu_report(quick: bool, names: Sequence[str] | None = None) -> dict[str, Any]:
    ref, ref_opt, ids = setup(SHAPES["cpu"], "cpu")
    inventory = saved_inventory(ref, ids)
    runs = {}
    for name, settings in selected(names).items():
        if settings is not None:
            model, opt, _ = setup(SHAPES["cpu"], "cpu")
            runs[name] = (model, opt, _cpu_offloader(model, settings))
    identical = dict.fromkeys(runs, True)
    for _ in range(2 if quick else 3):
        step(ref, ref_opt, ids, None)
        for name, (model, opt, off) in runs.items():
            step(model, opt, ids, off)
            identical[name] &= all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    report: dict[str, Any] = {
        "device": "cpu",
        "note": "timings and overlap need CUDA (copy streams); CPU runs the forced path for stats, bit-identity and "
        "the peak of live tensor bytes of forward + backward without the offloader, rebuilding weight copies and norm "
        "outputs, and rebuilding the gate/up outputs too",
        "shape": SHAPES["cpu"],
        "modes": {},
        "layer0_saved": inventory,
        "peak_live_bytes": _cpu_peaks(),
        "host_ms": _cpu_host_ms(5 if quick else 20),
    }
    for name, (_, _, off) in runs.items():
        report["modes"][name] = {"bit_identical_params": identical[name], "stats": off.stats, "plan": off.auto_plan}
        off.close()
    return report


def _cpu_offloader(model: MoEGPT, settings: dict[str, Any]) -> ActivationOffloader:
    # Every tensor counts on the tiny CPU model (no 1 MiB floor); the forced path runs without streams.
    return ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, **settings)
    )


def _copy_free_offloaders(model: MoEGPT) -> dict[str, ActivationOffloader | None]:
    """``off`` (``None``) and the CPU offloaders of the two modes that copy nothing and only rebuild (weight copies
    and norm outputs; and the experts' gate/up output): what CPU measurements compare, as offloading to host memory
    frees nothing when the host is the device."""
    return {name: None if MODES[name] is None else _cpu_offloader(model, MODES[name]) for name in COPY_FREE_MODES}


def _close(offloaders: dict[str, ActivationOffloader | None]) -> None:
    for off in offloaders.values():
        if off is not None:
            off.close()


def _cpu_peaks() -> dict[str, int]:
    """Peak live tensor bytes of one forward + backward on CPU in the :func:`_copy_free_offloaders` modes."""
    model, _, ids = setup(SHAPES["cpu"], "cpu")
    offloaders = _copy_free_offloaders(model)
    peaks = {}
    for name, off in offloaders.items():
        model.zero_grad(set_to_none=True)
        with PeakMemory(torch.device("cpu")) as mem:
            forward_backward(model, ids, off)
        peaks[name] = mem.peak_bytes
    _close(offloaders)
    return peaks


def _cpu_host_ms(repeats: int) -> dict[str, Any]:
    """Forward and backward milliseconds of a step that is host time (``SHAPES["host"]``) in the
    :func:`_copy_free_offloaders` modes, interleaved, medians; each mode's forward and backward over ``off``'s; and
    the ATen operations a step dispatches in each mode (``step_ops``: counted in the untimed warm-up round).

    What the offloader's pack and unpack hooks and rebuilds cost the host per step: on a GPU whose forward is
    launch-bound that is step time.
    """
    model, _, ids = setup(SHAPES["host"], "cpu")
    offloaders = _copy_free_offloaders(model)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in offloaders}

    def timed(name: str, off: ActivationOffloader | None) -> Callable[[int], None]:
        def step(r: int) -> None:
            model.zero_grad(set_to_none=True)
            marks: list[float] = []
            start = time.perf_counter()
            forward_backward(model, ids, off, marks=(_HostMark(marks), _HostMark(marks)))
            if r >= 0:
                times[name].append((marks[0] - start, marks[1] - marks[0]))

        return step

    # The counted call (after the warm-up) gives the ATen operations a step dispatches in each mode.
    measured = interleave({name: timed(name, off) for name, off in offloaders.items()}, repeats, count=True)
    ops = {name: m.ops for name, m in measured.items()}
    _close(offloaders)
    forward = {name: statistics.median(f for f, _ in t) * 1e3 for name, t in times.items()}
    backward = {name: statistics.median(b for _, b in t) * 1e3 for name, t in times.items()}
    return {
        "shape": SHAPES["host"],
        "repeats": repeats,
        "forward_ms": forward,
        "backward_ms": backward,
        "forward_ratio": {name: ms / forward["off"] for name, ms in forward.items()},
        "backward_ratio": {name: ms / backward["off"] for name, ms in backward.items()},
        "step_ops": ops,
    }


class _HostMark:
    """A stand-in for a CUDA event in ``forward_backward``'s ``marks``: ``record`` appends the host clock."""

    def __init__(self, marks: list[float]) -> None:
        self.marks = marks

    def record(self) -> None:
        self.marks.append(time.perf_counter())
