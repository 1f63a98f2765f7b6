"""Lightning callbacks: packed-sequence metadata, real-token throughput, expert load."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SequenceMetadataCallback": "lightning_llmfast.callbacks.seqmeta",
    "TokenThroughputMonitor": "lightning_llmfast.callbacks.throughput",
    "ExpertLoadMonitor": "lightning_llmfast.callbacks.moe",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_llmfast.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
