"""PowerSGD state that follows DDP's bucket layout: resumable in a new process, where the buckets start out different.

torch's ``PowerSGDState`` keys its error feedback and warm-start factors by bucket index. DDP builds its buckets
from the reversed parameter order and rebuilds them once after the first step in the order gradients became ready,
so a resumed process starts with another layout than the one the state was saved in. :class:`BucketLayouts` notes
each bucket's parameters (their indices in ``module.parameters()``) when the hook sees it; when a bucket index
arrives with other parameters, the state saved for every bucket is split per parameter and reassembled for the new
layouts, in the order torch's hook reads it (error feedback in bucket order; factors of the compressed tensors
grouped by shape, first-seen shape first).

Example::

    layouts = BucketLayouts(model.parameters())
    layouts.follow(state, bucket)  # in the hook, before torch's powerSGD_hook
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

__all__ = ["BucketLayouts"]

Layout = tuple[int, ...]


class BucketLayouts:
    """Each bucket index's parameters, and the remapping of a PowerSGD state when they change.

    Args:
        parameters: the DDP module's parameters, in ``module.parameters()`` order.
    """

    def __init__(self, parameters: Iterable[Tensor]) -> None:
        self.params = list(parameters)
        self._index = {p.data_ptr(): i for i, p in enumerate(self.params)}
        self.layouts: dict[int, Layout] = {}
        """Bucket index -> parameter indices, as last seen (or as saved)."""
        self._error: dict[int, Tensor] = {}  # per parameter, between two layouts
        self._q: dict[int, Tensor] = {}

    def follow(self, state: PowerSGDState, bucket: dist.GradBucket) -> None:
        """Before torch's hook runs on ``bucket``: bring ``state`` into the bucket's current layout."""
        layout = tuple(self._index[p.data_ptr()] for p in bucket.parameters())
        index = bucket.index()
        known = self.layouts.get(index)
        if known is not None and known != layout:
            for old_index, old_layout in self.layouts.items():  # every bucket was rebuilt: split them all
                self._split(state, old_index, old_layout)
            self.layouts.clear()
        if (self._error or self._q) and index not in state.error_dict:
            self._assemble(state, index, layout)
        self.layouts[index] = layout

    def _compressed(self, state: PowerSGDState, layout: Layout) -> list[tuple[int, int, int]]:
        """``(parameter, P length, Q length)`` of the tensors torch's hook compresses, in the order of its factors."""
        by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for i in layout:
            n = self.params[i].shape[0]
            m = self.params[i].numel() // n
            rank = min(n, m, state.matrix_approximation_rank)
            if (n + m) * rank * state.min_compression_rate < n * m:  # torch's _should_compress
                by_shape.setdefault((n, m), []).append((i, n * rank, m * rank))
        return [entry for group in by_shape.values() for entry in group]

    def _split(self, state: PowerSGDState, index: int, layout: Layout) -> None:
        error = state.error_dict.pop(index, None)
        if error is not None:
            sizes = [self.params[i].numel() for i in layout]
            self._error.update(zip(layout, error.split(sizes), strict=True))
        q = state.q_memory_dict.pop(index, None)
        state.p_memory_dict.pop(index, None)
        if q is not None:
            compressed = self._compressed(state, layout)
            pieces = q.split([q_length for _, _, q_length in compressed])
            self._q.update(zip((i for i, _, _ in compressed), pieces, strict=True))

    def _assemble(self, state: PowerSGDState, index: int, layout: Layout) -> None:
        if all(i in self._error for i in layout):
            state.error_dict[index] = torch.cat([self._error.pop(i) for i in layout])
        compressed = self._compressed(state, layout)
        if compressed and all(i in self._q for i, _, _ in compressed):
            q = state.q_memory_dict[index] = torch.cat([self._q.pop(i) for i, _, _ in compressed])
            # Only its presence matters to torch's hook (warm start): P is recomputed before it is read.
            state.p_memory_dict[index] = q.new_empty(sum(p_length for _, p_length, _ in compressed))

    def state_dict(self) -> dict[int, list[int]]:
        """The layouts, for a checkpoint."""
        return {index: list(layout) for index, layout in self.layouts.items()}

    def load_state_dict(self, layouts: dict[int, Sequence[int]]) -> None:
        """Layouts saved with the state they describe."""
        self.layouts = {int(index): tuple(layout) for index, layout in layouts.items()}
