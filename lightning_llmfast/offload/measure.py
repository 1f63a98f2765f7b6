"""Measuring the ``"auto"`` steps: turn per-layer timings, bytes and memory counts into a plan.

The offloader records, in each measuring step, each layer call's forward start and end, the start of its backward, the
bytes it would offload and the device memory allocated when its backward started (:class:`~.handles.Segment`); this
module adds a bandwidth probe and hands the numbers to :func:`~lightning_llmfast.offload.plan_offload`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Segment
from lightning_llmfast.offload.memory_plan import MemoryPlan, plan_memory
from lightning_llmfast.offload.nvme import NvmeTier
from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile, resolve_budget
from lightning_llmfast.offload.schedule import AUTO_MARGIN, plan_offload, plan_partial_bytes

__all__ = [
    "auto_plan",
    "fit_storage_ms",
    "layer_times",
    "measure_profile",
    "measured_freed",
    "median_profile",
    "memory_plan",
    "probe_bandwidth",
]

# The bandwidth probe copies the largest layer's bytes, within these bounds (long enough to time, short).
_PROBE_MIN_BYTES = 1 << 20
_PROBE_MAX_BYTES = 64 << 20
_TIMES = ("forward_ms", "backward_ms", "recompute_ms")


def auto_plan(
    segments: list[Segment],
    num_layers: int,
    copier: Copier,
    *,
    eligible: int,
    partial: bool,
    pinned: bool,
    backward_end: Any,
) -> dict[str, Any]:
    """The ``"auto"`` plan from a measuring step's layer calls.

    Args:
        segments: the step's layer calls, in forward order.
        num_layers: how many layers are tracked.
        copier: the copy engine that took the timestamps (and probes the bandwidth).
        eligible: the most layers that may offload (all but ``keep_last_layers``).
        partial: whether the layer after the planned ones may offload part of its bytes.
        pinned: probe through pinned host memory, as the pool's buffers are.
        backward_end: a timestamp at the end of the step's backward.

    Returns:
        The measured numbers and the plan: ``offload_layers``, ``partial_bytes``, ``prefetch_layers``.
    """
    compute_ms, backward, bytes_per_layer = layer_times(segments, num_layers, copier, backward_end)
    freed = measured_freed(segments, num_layers)
    bandwidth = probe_bandwidth(copier, max(bytes_per_layer), pinned)
    chosen, depth = plan_offload(
        compute_ms, bytes_per_layer, bandwidth, margin=AUTO_MARGIN, backward_ms=backward, freed_bytes=freed
    )
    planned = min(chosen, eligible)
    partial_bytes = 0
    if planned < eligible and partial:
        partial_bytes = plan_partial_bytes(
            compute_ms,
            bytes_per_layer,
            bandwidth,
            margin=AUTO_MARGIN,
            offload_layers=planned,
            prefetch_layers=depth,
            backward_ms=backward,
            freed_bytes=freed,
        )
    return {
        "compute_ms": compute_ms,
        "backward_ms": backward,
        "bytes_per_layer": bytes_per_layer,
        "freed_bytes": freed,
        "bandwidth_bytes_per_ms": bandwidth,
        "margin": AUTO_MARGIN,
        "offload_layers": planned,
        "partial_bytes": partial_bytes,
        "prefetch_layers": depth,
    }


def probe_bandwidth(copier: Copier, nbytes: int, pinned: bool) -> float:
    """Host-link bytes/ms of the slower direction, copying ``nbytes`` (within the probe's bounds) each way."""
    probe = min(max(nbytes, _PROBE_MIN_BYTES), _PROBE_MAX_BYTES)
    # A temporary buffer, pinned like the pool's: through the pool it would count towards the pool's sizing.
    return copier.bandwidth(probe, torch.empty(probe, dtype=torch.uint8, pin_memory=pinned))


def measure_profile(
    segments: list[Segment],
    num_layers: int,
    copier: Copier,
    *,
    pinned: bool,
    backward_end: Any,
    recompute_keeps: Sequence[int] = (),
) -> MemoryProfile:
    """The :class:`~lightning_llmfast.offload.MemoryProfile` of a measuring step: per layer its saved and
    recomputable bytes, forward and backward time (backward estimated as twice the forward where a call's was not
    timed), the recompute cost (the replay of its forward), and the host link's bandwidth.

    ``recompute_keeps[i]``: what selective recomputation of layer call ``i`` keeps (counted in an earlier step by
    :class:`~lightning_llmfast.offload.must_save.MustSaveCounter`, whose dispatch mode would slow this step's
    layers); a call it does not cover keeps everything it saves (recomputing it frees nothing).
    """
    forward, backward, saved = layer_times(segments, num_layers, copier, backward_end)
    recompute = [0] * num_layers
    sizes: list[list[int]] = [[] for _ in range(num_layers)]
    for seg in segments:
        # what recomputing the call frees: what it saves less what the replay needs kept (must_save.py)
        keeps = recompute_keeps[seg.index] if seg.index < len(recompute_keeps) else seg.candidate_bytes
        recompute[seg.layer_index] += max(seg.candidate_bytes - keeps, 0)
        sizes[seg.layer_index] += seg.candidate_sizes
    back = backward if backward is not None else [2.0 * f for f in forward]
    layers = tuple(
        LayerProfile(saved[i], recompute[i], forward[i], back[i], forward[i], tuple(sizes[i]))
        for i in range(num_layers)
    )
    return MemoryProfile(layers, probe_bandwidth(copier, max(saved), pinned), copies_overlap=copier.is_cuda)


def median_profile(profiles: Sequence[MemoryProfile]) -> MemoryProfile:
    """One profile from several profiled steps: per layer the median of each time, the bytes of the step in which it
    saved the most (the plan must fit every step) and the median bandwidth.

    A single step's times on a shared host vary by tens of percent (other processes, the allocator, caches); the
    median of a few steps is what the planned steps are compared against.

    Example::

        median_profile([measure_profile(...), measure_profile(...), measure_profile(...)])
    """
    if not profiles:
        raise OffloadError("median_profile: no profiled steps")
    layers = []
    for per_step in zip(*(p.layers for p in profiles), strict=True):
        most = max(per_step, key=lambda layer: layer.saved_bytes)
        times = {name: statistics.median(getattr(layer, name) for layer in per_step) for name in _TIMES}
        layers.append(dataclasses.replace(most, **times))
    nvme = [p.nvme_bandwidth_bytes_per_ms for p in profiles if p.nvme_bandwidth_bytes_per_ms is not None]
    return dataclasses.replace(
        profiles[-1],
        layers=tuple(layers),
        bandwidth_bytes_per_ms=statistics.median(p.bandwidth_bytes_per_ms for p in profiles),
        nvme_bandwidth_bytes_per_ms=statistics.median(nvme) if nvme else None,
    )


def fit_storage_ms(
    profile: MemoryProfile, kept: Sequence[MemoryProfile], probes: Sequence[MemoryProfile], eligible: int
) -> float:
    """Host ms per offloaded storage beyond its copies, from ``probes`` (steps in which the first ``eligible`` layers
    offloaded every storage ``profile`` counts for them) paired with the ``kept`` steps that ran just before each:
    the median over the pairs of the probe's layer time less its kept step's, less the copies at ``profile``'s
    bandwidth (one each way), per storage; 0 where noise makes it negative.

    Pairs of neighbouring steps cancel the drift of a process's step times (its heap and caches settling, other load
    on a shared host), which a difference of the two medians keeps: on the 12-layer reference model at hidden 64
    the latter put the fitted time 2x to 3x above what the planned steps then paid.

    Example::

        fit_storage_ms(median_profile(kept), kept, probes, eligible=11)
    """
    layers = profile.layers[:eligible]
    count = sum(len(layer.storages) for layer in layers)
    if not count or not probes:
        return 0.0
    copies_ms = sum(2.0 * layer.saved_bytes for layer in layers) / profile.bandwidth_bytes_per_ms
    added_ms = statistics.median(p.step_ms - k.step_ms for k, p in zip(kept, probes))
    return max(0.0, (added_ms - copies_ms) / count)


def memory_plan(
    profiles: Sequence[MemoryProfile],
    copier: Copier,
    config: OffloadConfig,
    prefetch_layers: int,
    nvme: NvmeTier | None = None,
    *,
    probes: Sequence[MemoryProfile] = (),
    eligible: int = 0,
) -> MemoryPlan:
    """The ``plan="auto"`` plan: the profiled steps (:func:`measure_profile`) folded into one by
    :func:`median_profile`, with the host time per offloaded storage from ``probes`` (steps in which the first
    ``eligible`` layers offloaded everything; :func:`fit_storage_ms`), planned for ``config.budget`` at the
    offloader's prefetch depth; with an NVMe tier, its bandwidth measured once (a probe file the size of the largest
    layer) and the pinned tier held to ``config.pinned_budget``."""
    assert config.budget is not None
    profile = median_profile(profiles)
    profile = dataclasses.replace(profile, storage_ms=fit_storage_ms(profile, profiles, probes, eligible))
    tiers: tuple[str, ...] = ("pinned",)
    if nvme is not None:
        largest = max(layer.saved_bytes for layer in profile.layers)
        profile = dataclasses.replace(
            profile, nvme_bandwidth_bytes_per_ms=nvme.bandwidth(min(largest, _PROBE_MAX_BYTES))
        )
        tiers = ("pinned", "nvme")
    budget = resolve_budget(config.budget, copier.device)
    return plan_memory(profile, budget, tiers, prefetch_layers=prefetch_layers, pinned_bytes=config.pinned_budget_bytes)


def layer_times(
    segments: list[Segment], num_layers: int, copier: Copier, backward_end: Any
) -> tuple[list[float], list[float] | None, list[int]]:
    """Per layer: forward ms, backward ms (``None`` when some call's backward was not timed) and candidate bytes,
    adding up the calls of a layer called several times.

    A call's forward runs from its start until the next call starts (the last call: until the offloader's work on it
    ended), so the hooks' work between calls (copies issued, buffers placed) is in some call's time: the step's forward
    is then the span :class:`~lightning_llmfast.offload.meter.StepMeter` times a planned step by (first call's start to
    the last call's end). Timing each call alone left that work out of the profile but not out of the planned steps:
    on the 12-layer reference model at hidden 64 on CPU, planned steps then ran up to 1.3x their prediction.
    """
    compute_ms = [0.0] * num_layers
    backward: list[float] | None = [0.0] * num_layers
    bytes_per_layer = [0] * num_layers
    for seg in segments:
        if seg.ended is not None:
            following = segments[seg.index + 1].started if seg.index + 1 < len(segments) else None
            compute_ms[seg.layer_index] += copier.elapsed_ms(seg.started, seg.ended if following is None else following)
        bytes_per_layer[seg.layer_index] += seg.candidate_bytes
        # A call's backward runs from its start until the previous call's backward starts (the step's end for
        # the first call); a call whose output needed no grad leaves the estimate to the forward times.
        after = segments[seg.index - 1].backward_started if seg.index > 0 else backward_end
        if backward is not None and seg.backward_started is not None and after is not None:
            backward[seg.layer_index] += copier.elapsed_ms(seg.backward_started, after)
        else:
            backward = None
    return compute_ms, backward, bytes_per_layer


def measured_freed(segments: list[Segment], num_layers: int) -> list[int] | None:
    """``(L,)`` device bytes freed between the start of the backward and the start of each layer's backward, from
    the allocator's counts in the measuring step; ``None`` unless every layer ran once and was counted.

    Backward frees saved activations but also allocates the weight gradients meanwhile, so this can be much less
    than what the later layers saved.
    """
    counts = [s.backward_allocated for s in segments]
    if len(segments) != num_layers or any(c is None for c in counts):
        return None
    top = counts[-1]  # the last call's backward starts first
    assert top is not None
    freed = [0] * num_layers
    for seg, count in zip(segments, counts):
        assert count is not None
        freed[seg.layer_index] = max(top - count, 0)
    return freed
