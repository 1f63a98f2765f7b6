"""Benchmark harness and hardware-independent counters (host syncs, ATen ops).

The counters are plain PyTorch; the harness names resolve lazily because they import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_llmfast.bench.counters import SYNC_OPS, OpCounter, SyncCounter

_LAZY = {
    "run_benchmark": "lightning_llmfast.bench.harness",
    "PROFILES": "lightning_llmfast.bench.harness",
    "BenchProfile": "lightning_llmfast.bench.harness",
    "E2ESettings": "lightning_llmfast.bench.e2e",
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_llmfast.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from lightning_llmfast.bench.e2e import E2ESettings
    from lightning_llmfast.bench.harness import PROFILES, BenchProfile, run_benchmark
    from lightning_llmfast.bench.report import markdown_report, plot_result
