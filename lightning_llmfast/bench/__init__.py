"""Benchmark harness and hardware-independent counters (host syncs, ATen ops)."""

from lightning_llmfast.bench.counters import SYNC_OPS, OpCounter, SyncCounter

__all__ = ["SYNC_OPS", "OpCounter", "SyncCounter"]
