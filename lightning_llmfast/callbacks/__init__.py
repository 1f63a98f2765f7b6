"""Lightning callbacks: packed-sequence metadata, real-token throughput, expert load (and its torchmetrics metric),
expert balance, activation offload and system metrics (device busy, memory, gradient-sync time)."""

from __future__ import annotations

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

_LAZY = {
    "SequenceMetadataCallback": "lightning_llmfast.callbacks.seqmeta",
    "TokenThroughputMonitor": "lightning_llmfast.callbacks.throughput",
    "ExpertLoadMonitor": "lightning_llmfast.callbacks.moe",
    "ExpertBalanceCallback": "lightning_llmfast.callbacks.moe",
    "ExpertLoadMetric": "lightning_llmfast.callbacks.expert_metric",
    "ActivationOffload": "lightning_llmfast.callbacks.offload",
    "SystemMetricsMonitor": "lightning_llmfast.callbacks.system",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
