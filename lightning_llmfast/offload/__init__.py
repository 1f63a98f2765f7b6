"""Activation offload: pinned host buffer pool, the double-buffered :class:`ActivationOffloader`, its measured
schedule (:func:`plan_offload`) and selective recomputation for the layers it does not offload (:mod:`.recompute`).

Plain PyTorch (no Lightning); :class:`~lightning_llmfast.LLMFastStrategy` wires it around ``training_step``. A custom
``autograd.Function`` whose output can be recomputed from what it saves declares ``llmfast_rebuild(ctx, *saved)`` and
calls :func:`mark_rebuildable` in its forward; the offloader then rebuilds saved copies of that output in backward.

Example::

    from lightning_llmfast.offload import ActivationOffloader

    with ActivationOffloader(model.layers, min_offload_bytes=1 << 20) as off:
        model(x).mean().backward()
"""

from __future__ import annotations

from lightning_llmfast._autograd import mark_rebuildable
from lightning_llmfast.offload.offloader import (
    ActivationOffloader,
    plan_offload,
    plan_offload_layers,
    plan_partial_bytes,
    resolve_layers,
)
from lightning_llmfast.offload.pool import PinnedBufferPool, size_class
from lightning_llmfast.offload.recompute import recompute_layer, recompute_policy

__all__ = [
    "ActivationOffloader",
    "PinnedBufferPool",
    "mark_rebuildable",
    "plan_offload",
    "plan_offload_layers",
    "plan_partial_bytes",
    "recompute_layer",
    "recompute_policy",
    "resolve_layers",
    "size_class",
]
