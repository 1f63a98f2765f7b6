"""Benchmark harness and hardware-independent counters (host syncs, ATen ops).

The counters are plain PyTorch; the harness names resolve lazily because they import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr
from lightning_llmfast.bench.counters import SYNC_OPS, OpCounter, SyncCounter

_LAZY = {
    "run_benchmark": "lightning_llmfast.bench.suite",
    "PROFILES": "lightning_llmfast.bench.suite",
    "BenchProfile": "lightning_llmfast.bench.suite",
    "E2ESettings": "lightning_llmfast.bench.steps",
    "markdown_report": "lightning_llmfast.bench.report",
    "plot_result": "lightning_llmfast.bench.report",
}

__all__ = [
    "PROFILES",
    "SYNC_OPS",
    "BenchProfile",
    "E2ESettings",
    "OpCounter",
    "SyncCounter",
    "markdown_report",
    "plot_result",
    "run_benchmark",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.bench.report import markdown_report, plot_result
    from lightning_llmfast.bench.steps import E2ESettings
    from lightning_llmfast.bench.suite import PROFILES, BenchProfile, run_benchmark
