"""What a planned step really did, for comparison with its :class:`~lightning_llmfast.offload.MemoryPlan`: the peak of
live saved bytes and the step's time, both from the offloader's own records (no host sync in the step).

Live saved bytes follow the model :func:`~lightning_llmfast.offload.memory_plan.predict_peak` predicts with: a layer
call adds, when it ends, what it keeps on the device (counted by the pack hook once per storage, with the outputs a
recomputed layer stores for its backward); its bytes go when the backward of the call before it starts (its own
backward is done then); and the device buffer sets that prefetched layers are reloaded into count from the moment they
are allocated. Transients inside one layer's backward (recomputation, rebuilt tensors, gradients) are not counted, as
they are not predicted.

The step's time is the planned layers' forward (first layer's start to last layer's end) plus the backward (last
layer's backward start to the step's end), as :class:`~lightning_llmfast.offload.MemoryProfile`'s ``step_ms`` counts
it; the timestamps are CUDA events on a GPU, read only once they have completed.

Example::

    meter = StepMeter()
    meter.begin_step()
    meter.layer_ended(0, kept_bytes=4096)
    meter.backward_begins(0, set_bytes=0)
    meter.peak_bytes  # 4096
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.memory_plan import MemoryPlan

__all__ = ["StepMeter"]


class StepMeter:
    """Peak live saved bytes of the current step and the timestamps of the last few steps.

    Attributes:
        peak_bytes: the most live saved bytes at once so far in this step (the last step's, once it ended).
        forward_bytes: the live saved bytes when the forward ended (what every layer call keeps).
    """

    def __init__(self) -> None:
        self._marks: dict[str, Any] = {}
        self._timed: deque[dict[str, Any]] = deque(maxlen=3)  # ended steps' marks, newest last
        self.begin_step()

    def begin_step(self) -> None:
        """A new step: nothing is live."""
        self.peak_bytes = self.forward_bytes = self._live = 0
        self._kept: list[int] = []
        self._done_from: int | None = None  # calls from this index on have finished their backward
        self._marks = {}

    @property
    def kept_bytes(self) -> list[int]:
        """Per layer call of this step (the last step, once it ended), the saved bytes it kept on the device."""
        return list(self._kept)

    def mark(self, name: str, stamp: Any, first: bool = False) -> None:
        """Record timestamp ``name`` (``start``, ``forward_end``, ``backward_start``); ``first``: keep an earlier."""
        if not (first and name in self._marks):
            self._marks[name] = stamp

    def layer_ended(self, seg_index: int, kept_bytes: int) -> None:
        """Layer call ``seg_index`` ended keeping ``kept_bytes`` on the device."""
        self._kept.extend([0] * (seg_index + 1 - len(self._kept)))
        self._kept[seg_index] += kept_bytes
        self._live += kept_bytes
        self.forward_bytes = self._live
        self.peak_bytes = max(self.peak_bytes, self._live)

    def backward_begins(self, seg_index: int, set_bytes: int) -> None:
        """Layer call ``seg_index``'s backward starts with ``set_bytes`` in device buffer sets: the calls after it are
        done with their saved bytes."""
        top = len(self._kept) if self._done_from is None else self._done_from
        for k in range(seg_index + 1, top):
            self._live -= self._kept[k]
        self._done_from = min(top, seg_index + 1)
        self.peak_bytes = max(self.peak_bytes, self._live + set_bytes)

    def end_step(self, stamp: Any) -> None:
        """The step's backward ended at ``stamp``; a step with all four marks can be timed."""
        self._marks["end"] = stamp
        if len(self._marks) == 4:
            self._timed.append(self._marks)
        self._marks = {}

    def measured_ms(self, copier: Copier) -> float | None:
        """Forward plus backward ms of the newest ended step whose timestamps have completed (``None``: none yet)."""
        for marks in reversed(self._timed):
            if copier.stamp_done(marks["end"]) and copier.stamp_done(marks["forward_end"]):
                forward = copier.elapsed_ms(marks["start"], marks["forward_end"])
                return forward + copier.elapsed_ms(marks["backward_start"], marks["end"])
        return None

    def metrics(self, plan: MemoryPlan, copier: Copier) -> dict[str, float]:
        """``predicted_peak``/``measured_peak`` (bytes of live saved activations) and ``predicted_ms``/``measured_ms``
        (the layers' forward and backward; only once the timestamps have completed) of the last step; empty before a
        step has counted anything."""
        if not self.peak_bytes:
            return {}
        metrics = {"predicted_peak": float(plan.predicted_peak), "measured_peak": float(self.peak_bytes)}
        measured_ms = self.measured_ms(copier)
        if measured_ms is not None:
            metrics.update(predicted_ms=plan.predicted_ms, measured_ms=measured_ms)
        return metrics
