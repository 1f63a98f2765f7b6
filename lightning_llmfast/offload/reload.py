"""The copies of offloaded blocks: device-to-host at a layer's end, prefetch into round-robin device buffer sets in
backward, the unpack hook, and the release of host buffers once their copies are done.

A mixin of :class:`~lightning_llmfast.offload.ActivationOffloader`: it reads the offloader's per-step state.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Block, Recipe, Saved, Segment
from lightning_llmfast.offload.pool import PinnedBufferPool

__all__ = ["Reloader"]

# Device-side offsets are aligned so that every reloaded dtype view is aligned like a fresh allocation (vectorised
# CPU kernels and MKL pick their code path by alignment; a different path could change rounding).
_ALIGN = 256


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class Reloader:
    """Copies, prefetches and releases; the attributes are the offloader's per-step state."""

    pool: PinnedBufferPool
    prefetch_layers: int
    _copier: Copier | None
    _segments: list[Segment]
    _current: Segment | None
    _unassigned: list[Saved]
    _measuring: bool
    _num_sets: int
    _sets: list[torch.Tensor | None]
    _set_owner: list[int]
    _pending_sources: list[Block]
    _retired: list[Block]
    _counters: dict[str, int]

    def _send(self, seg: Segment) -> None:
        """Issue the device-to-host copies of what ``seg`` offloaded, once its forward has ended.

        Autograd never lets a saved tensor change before backward, so copying at the layer's end reads what was
        saved; the sources stay referenced until the copy's event has completed.
        """
        if not seg.unsent:
            return
        copier = self._copier
        assert copier is not None
        # Unsent blocks belong to the running step: their host buffer and source are set until the step's release.
        pairs = [(b.host[: b.nbytes], b.source) for b in seg.unsent]  # type: ignore[index]
        event = copier.copy(pairs, to_host=True, after=(copier.mark_compute(),))  # type: ignore[arg-type]
        for block in seg.unsent:
            block.d2h_event = event
        seg.unsent.clear()

    def _release_sources(self) -> None:
        if self._copier is None:
            return  # nothing was offloaded
        still = []
        for block in self._pending_sources:
            if self._copier.done(block.d2h_event):
                block.source = None
            else:
                still.append(block)
        self._pending_sources = still

    def _backward_begins(self, seg_index: int) -> None:
        if not self._segments:
            return  # the step already ended (graph retained past it)
        if self._measuring and self._segments[seg_index].backward_started is None:
            assert self._copier is not None
            self._segments[seg_index].backward_started = self._copier.timestamp()
            self._segments[seg_index].backward_allocated = self._copier.allocated()
        self._release_sources()
        for j in range(seg_index, max(seg_index - self.prefetch_layers, 0) - 1, -1):
            seg = self._segments[j]
            if seg.offload and not seg.prefetched and seg.blocks:
                self._prefetch(seg)

    def _prefetch(self, seg: Segment) -> None:
        copier = self._copier
        assert copier is not None
        s = seg.index % self._num_sets
        previous = self._set_owner[s]
        if previous >= 0:
            # That layer's backward is over: its views of the set are gone, and a set that grows below frees the
            # old buffer instead of holding it to the step's end (a partial layer's smaller set would).
            for block in self._segments[previous].blocks:
                block.flat = None
        total = sum(_aligned(b.nbytes) for b in seg.blocks)
        flat = self._sets[s]
        if flat is None or flat.numel() < total:
            # Grows to the largest layer (MoE layers differ per step, a partial layer is smaller).
            flat = self._sets[s] = torch.empty(total, dtype=torch.uint8, device=copier.device)
            copier.protect(flat)
        # The set was last used by a layer whose backward has finished; copies wait for that compute.
        compute_done = copier.mark_compute()
        pairs = []
        offset = 0
        for block in seg.blocks:
            assert block.host is not None
            block.flat, block.offset, block.set_index = flat, offset, s
            pairs.append((flat[offset : offset + block.nbytes], block.host[: block.nbytes]))
            offset += _aligned(block.nbytes)
        d2h = {id(b.d2h_event): b.d2h_event for b in seg.blocks}  # one per layer call
        event = copier.copy(pairs, to_host=False, after=(compute_done, *d2h.values()))
        for block in seg.blocks:
            block.h2d_event = event
            block.reads.append(event)
        seg.prefetched = True
        self._set_owner[s] = seg.index

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, Recipe):
            return saved.unpack(self._counters)
        if not isinstance(saved, Saved):
            return saved
        if saved.tensor is not None:
            return saved.tensor
        block = saved.block
        copier = self._copier
        assert block is not None
        if block.host is None or copier is None:
            raise OffloadError(
                "ActivationOffloader: a saved activation was unpacked after its step ended; run backward inside "
                "the step (retain_graph across steps is not supported with offloading)"
            )
        if block.flat is not None and self._set_owner[block.set_index] == block.segment:
            copier.compute_waits(block.h2d_event)
            flat, offset = block.flat, block.offset
            self._counters["prefetch_hits"] += 1
        else:
            # Fallback: unpacked before its prefetch was issued, or after its buffer set was reused.
            flat = torch.empty(_aligned(block.nbytes), dtype=torch.uint8, device=copier.device)
            copier.compute_waits(block.d2h_event)
            flat[: block.nbytes].copy_(block.host[: block.nbytes], non_blocking=copier.is_cuda)
            block.reads.append(copier.mark_compute())
            offset = 0
            self._counters["lazy_reloads"] += 1
        # Sets and fallback buffers are multiples of _ALIGN bytes, so every dtype view of them is exact.
        typed = flat.view(saved.dtype)
        return torch.as_strided(typed, saved.size, saved.stride, offset // saved.dtype.itemsize + saved.storage_offset)

    def _release_done(self) -> None:
        copier = self._copier
        if copier is None:
            return  # nothing was offloaded
        still = []
        for block in self._retired:
            if all(copier.done(e) for e in (block.d2h_event, *block.reads)):
                self._give_back(block)
            else:
                still.append(block)
        self._retired = still

    def _release_all(self) -> None:
        self._retired.extend(b for seg in self._segments for b in seg.blocks)
        self._segments = []
        self._current = None
        self._unassigned.clear()
        for block in self._retired:
            if self._copier is not None:
                for event in (block.d2h_event, *block.reads):
                    self._copier.wait_host(event)
            self._give_back(block)
        self._retired = []
        self._pending_sources = []

    def _give_back(self, block: Block) -> None:
        if block.host is not None:
            self.pool.release(block.host)
        block.host = block.source = block.flat = None
        block.reads.clear()
