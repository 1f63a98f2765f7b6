"""Activation offload: pinned host buffer pool, the double-buffered :class:`ActivationOffloader`, its measured
schedule (:func:`plan_offload`), rebuilds of cheap saved tensors and selective recomputation (:mod:`.recompute`).

Plain PyTorch (no Lightning); :class:`~lightning_llmfast.callbacks.ActivationOffload` wires it into any Lightning
strategy. A custom ``autograd.Function`` whose output can be recomputed from what it saves calls
:func:`mark_rebuildable` in its forward; the offloader then rebuilds saved copies of that output in backward.

Example::

    from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

    with ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=1 << 20)) as off:
        model(x).mean().backward()
"""

from __future__ import annotations

from lightning_llmfast._layers import resolve_layers
from lightning_llmfast._rebuild import RebuildRecord, mark_rebuildable
from lightning_llmfast.offload.config import REBUILD_MODES, OffloadConfig
from lightning_llmfast.offload.copier import Copier, CpuCopier, CudaStreamCopier
from lightning_llmfast.offload.memory_plan import MemoryPlan, plan_memory
from lightning_llmfast.offload.offloader import ActivationOffloader
from lightning_llmfast.offload.pool import PinnedBufferPool, size_class
from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile
from lightning_llmfast.offload.recompute import recompute_layer, recompute_policy
from lightning_llmfast.offload.schedule import plan_offload, plan_offload_layers, plan_partial_bytes

__all__ = [
    "REBUILD_MODES",
    "ActivationOffloader",
    "Copier",
    "CpuCopier",
    "CudaStreamCopier",
    "LayerProfile",
    "MemoryPlan",
    "MemoryProfile",
    "OffloadConfig",
    "PinnedBufferPool",
    "RebuildRecord",
    "mark_rebuildable",
    "plan_memory",
    "plan_offload",
    "plan_offload_layers",
    "plan_partial_bytes",
    "recompute_layer",
    "recompute_policy",
    "resolve_layers",
    "size_class",
]
