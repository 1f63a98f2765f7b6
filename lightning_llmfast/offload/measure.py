"""Measuring the ``"auto"`` step: turn one step's per-layer timings, bytes and memory counts into a plan.

The offloader records, in its measuring step, each layer call's forward start and end, the start of its backward, the
bytes it would offload and the device memory allocated when its backward started (:class:`~.handles.Segment`); this
module adds a bandwidth probe and hands the numbers to :func:`~lightning_llmfast.offload.plan_offload`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Segment
from lightning_llmfast.offload.memplan import MemoryPlan, plan_memory
from lightning_llmfast.offload.nvme import NvmeTier
from lightning_llmfast.offload.plan import AUTO_MARGIN, plan_offload, plan_partial_bytes
from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile, resolve_budget

__all__ = ["auto_plan", "layer_times", "measure_profile", "measured_freed", "memory_plan", "probe_bandwidth"]

# The bandwidth probe copies the largest layer's bytes, within these bounds (long enough to time, short).
_PROBE_MIN_BYTES = 1 << 20
_PROBE_MAX_BYTES = 64 << 20


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
    segments: list[Segment], num_layers: int, copier: Copier, *, pinned: bool, backward_end: Any
) -> MemoryProfile:
    """The :class:`~lightning_llmfast.offload.MemoryProfile` of a measuring step: per layer its saved and
    recomputable bytes, forward and backward time (backward estimated as twice the forward where a call's was not
    timed), the recompute cost (the replay of its forward), and the host link's bandwidth."""
    forward, backward, saved = layer_times(segments, num_layers, copier, backward_end)
    recompute = [0] * num_layers
    for seg in segments:
        recompute[seg.layer_index] += seg.recompute_bytes
    back = backward if backward is not None else [2.0 * f for f in forward]
    layers = tuple(LayerProfile(saved[i], recompute[i], forward[i], back[i], forward[i]) for i in range(num_layers))
    return MemoryProfile(layers, probe_bandwidth(copier, max(saved), pinned), copies_overlap=copier.is_cuda)


def memory_plan(
    segments: list[Segment],
    num_layers: int,
    copier: Copier,
    config: OffloadConfig,
    pinned: bool,
    prefetch_layers: int,
    nvme: NvmeTier | None = None,
) -> MemoryPlan:
    """The ``plan="auto"`` plan: the measuring step's profile (:func:`measure_profile`, its backward ending now)
    planned for ``config.budget`` at the offloader's prefetch depth; with an NVMe tier, its bandwidth measured once
    (a probe file the size of the largest layer) and the pinned tier held to ``config.pinned_budget``."""
    assert config.budget is not None
    end = copier.timestamp()
    profile = measure_profile(segments, num_layers, copier, pinned=pinned, backward_end=end)
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
    adding up the calls of a layer called several times."""
    compute_ms = [0.0] * num_layers
    backward: list[float] | None = [0.0] * num_layers
    bytes_per_layer = [0] * num_layers
    for seg in segments:
        if seg.ended is not None:
            compute_ms[seg.layer_index] += copier.elapsed_ms(seg.started, seg.ended)
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
