"""What selective recomputation keeps beyond what autograd saves: counted in a measuring step's layer calls.

:func:`~lightning_llmfast.offload.recompute.recompute_policy` must save the output of every matmul, grouped GEMM,
attention kernel and ``topk`` of a recomputed layer, whether or not autograd saves it: the replay of the cheap ops in
backward starts from them (the router's logits feed a recomputed softmax, an output projection a recomputed residual
add). The memory profile sees only what autograd saves (the pack hook), and a guess from the saving ops' names
overstated what recomputation frees: on the 12-layer reference model at hidden 16 it credited a layer with 18,048
bytes, where recomputing it kept 49,152 of its 62,664. So a memory plan's warm-up step counts, with a dispatch
mode around each layer call, what recomputation would keep; the profiled steps run without it, as its per-op Python
cost would slow the layers they time (:func:`~lightning_llmfast.offload.measure.measure_profile`).

Example::

    with MustSaveCounter() as counter:
        counter.note_inputs([x])
        y = layer(x)
    counter.kept_bytes  # what the layer keeps when it recomputes
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_llmfast.offload.recompute import saved_by_policy

__all__ = ["MustSaveCounter"]


class MustSaveCounter(TorchDispatchMode):
    """The bytes a layer call would keep under selective recomputation: the hidden states it starts from
    (:meth:`note_inputs`) and the outputs :func:`recompute_policy` saves, recorded while active (forward ops only:
    dispatch modes sit below autograd), each storage once, storages under ``min_bytes`` left out as the offloader
    leaves them."""

    def __init__(self, min_bytes: int = 0) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.kept_bytes = 0
        self._live: dict[int, Any] = {}  # storage ptr -> weakref: an address freed and reused is a new storage

    def note_inputs(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the layer's inputs that need grad: checkpointing holds them until the replay."""
        for t in tensors:
            if t.requires_grad:
                self._note(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if saved_by_policy(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._note(t)
        return out

    def _note(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        known = self._live.get(storage.data_ptr())
        if (known is None or known() is not storage) and storage.nbytes() >= self.min_bytes:
            self._live[storage.data_ptr()] = weakref.ref(storage)
            self.kept_bytes += storage.nbytes()
