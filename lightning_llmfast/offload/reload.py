"""The copies of offloaded blocks: device-to-host at a layer's end, prefetch into round-robin device buffer sets in
backward, the unpack hook, and the release of host buffers once their copies are done.

The reloader owns the device buffer sets, the blocks whose sources or host buffers are still held, and its counters.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Block, Recipe, Saved, Segment
from lightning_llmfast.offload.layercalls import LayerCalls
from lightning_llmfast.offload.nvme import NvmeTier, NvmeWriteError
from lightning_llmfast.offload.pool import PinnedBufferPool, aligned_bytes, size_class

__all__ = ["Reloader"]


class Reloader:
    """Copies, prefetches, unpacks and releases.

    Args:
        calls: the layer-call policy (this step's calls, read in backward).
        pool: where host buffers go back.
        prefetch_layers: how many layers ahead backward prefetches (``prefetch_layers + 1`` device buffer sets).
    """

    def __init__(self, calls: LayerCalls, pool: PinnedBufferPool, prefetch_layers: int) -> None:
        self.counters = dict.fromkeys(("prefetch_hits", "lazy_reloads", "rebuilds", "spilled_bytes"), 0)
        self.nvme: NvmeTier | None = None  # the NVMe tier, set by the offloader with `nvme_dir`
        self.set_bytes = 0  # device-set bytes of the last backward
        self._calls = calls
        self._pool = pool
        self._copier: Copier | None = None
        self._pending_sources: list[Block] = []  # offloaded, device-to-host copy maybe still reading the source
        self._retired: list[Block] = []  # of ended steps: host buffer back to the pool once every copy is done
        self.set_depth(prefetch_layers)

    def set_depth(self, prefetch_layers: int) -> None:
        """Prefetch ``prefetch_layers`` ahead from now on (the device buffer sets are made anew)."""
        self.prefetch_layers = prefetch_layers
        self._num_sets = prefetch_layers + 1
        self._sets: list[torch.Tensor | None] = [None] * self._num_sets
        self._set_owner = [-1] * self._num_sets

    def begin_step(self, copier: Copier | None) -> None:
        """Copies of this step go through ``copier``; the counters restart."""
        if copier is not None and copier is not self._copier:
            self._sets = [None] * self._num_sets
        self._copier = copier
        self._set_owner = [-1] * self._num_sets
        self.counters = dict.fromkeys(self.counters, 0)

    def end_step(self, blocks: list[Block]) -> None:
        """The step ended: its ``blocks`` wait for release, and the device buffer sets are dropped.

        Device buffer sets live for one backward: between steps (and at the next forward's memory peak) they are
        free memory. Blocks still reading them keep them alive until their copies are released.
        """
        self._retired.extend(blocks)
        self.set_bytes = sum(t.numel() for t in self._sets if t is not None)
        self._sets = [None] * self._num_sets

    def sets_held(self) -> list[torch.Tensor]:
        """The device buffer sets held now."""
        return [t for t in self._sets if t is not None]

    def send(self, seg: Segment) -> None:
        """Issue the device-to-host copies of what ``seg`` offloaded, once its forward has ended.

        Autograd never lets a saved tensor change before backward, so copying at the layer's end reads what was
        saved; the sources stay referenced until the copy's event has completed.
        """
        if not seg.unsent:
            return
        copier = self._copier
        assert copier is not None
        ready = copier.mark_compute()
        spilled = [b for b in seg.unsent if b.to_nvme]
        for block in spilled:
            assert self.nvme is not None and block.source is not None
            block.spill = self.nvme.write(block.source, ready)
            self.counters["spilled_bytes"] += block.nbytes
        # Unsent blocks belong to the running step: their host buffer and source are set until the step's release.
        pairs = [(b.host[: b.nbytes], b.source) for b in seg.unsent if not b.to_nvme]  # type: ignore[index]
        if pairs:
            event = copier.copy(pairs, to_host=True, after=(ready,))  # type: ignore[arg-type]
            for block in seg.unsent:
                block.d2h_event = None if block.to_nvme else event
        seg.unsent.clear()

    def hold_sources(self, seg: Segment) -> None:
        """``seg``'s call ended: its sources are released as soon as their device-to-host copies are done."""
        self._pending_sources.extend(b for b in seg.blocks if b.source is not None)
        self.release_sources()

    def release_sources(self) -> None:
        if self._copier is None:
            return  # nothing was offloaded
        still = []
        for block in self._pending_sources:
            if block.to_nvme:
                if block.spill is None:  # its write failed and a read-back already fell back to the source,
                    continue  # which stays held until the step's end
                if block.spill.written.done():
                    error = block.spill.failed()
                    if error is None:
                        block.source = None
                    else:  # the bytes stay on the device (this source) and are read from it
                        assert self.nvme is not None
                        self.nvme.note_failure(error)
                        block.spill = None
                else:
                    still.append(block)
            elif self._copier.done(block.d2h_event):
                block.source = None
            else:
                still.append(block)
        self._pending_sources = still

    def backward_begins(self, seg_index: int) -> None:
        """Layer call ``seg_index``'s backward starts: prefetch it and the ``prefetch_layers`` calls before it."""
        self.release_sources()
        segments = self._calls.segments
        for j in range(seg_index, max(seg_index - self.prefetch_layers, 0) - 1, -1):
            seg = segments[j]
            if seg.offload and not seg.prefetched and seg.blocks:
                self.prefetch(seg)
        if self.nvme is not None:  # files are read one window further ahead, on the tier's workers
            ahead = seg_index - self.prefetch_layers - 1
            for j in range(ahead, max(ahead - self.prefetch_layers, 0) - 1, -1):
                for block in segments[j].blocks:
                    if block.spill is not None:
                        self.nvme.read_ahead(block.spill)

    def prefetch(self, seg: Segment) -> None:
        """Issue the host-to-device copies of ``seg``'s blocks into the next device buffer set."""
        copier = self._copier
        assert copier is not None
        s = seg.index % self._num_sets
        previous = self._set_owner[s]
        if previous >= 0:
            # That layer's backward is over: its views of the set are gone, and a set that grows below frees the
            # old buffer instead of holding it to the step's end (a partial layer's smaller set would).
            for block in self._calls.segments[previous].blocks:
                block.flat = None
        total = sum(aligned_bytes(b.nbytes) for b in seg.blocks)
        flat = self._sets[s]
        if flat is None or flat.numel() < total:
            # Grows to the largest layer (MoE layers differ per step, a partial layer is smaller), in size classes:
            # the next steps ask the device allocator for the very block it has cached.
            flat = self._sets[s] = torch.empty(size_class(total), dtype=torch.uint8, device=copier.device)
            copier.protect(flat)
        # The set was last used by a layer whose backward has finished; copies wait for that compute.
        compute_done = copier.mark_compute()
        pairs = []
        offset = 0
        for block in seg.blocks:
            block.flat, block.offset, block.set_index = flat, offset, s
            pairs.append((flat[offset : offset + block.nbytes], self._host_bytes(block)))
            offset += aligned_bytes(block.nbytes)
        d2h = {id(b.d2h_event): b.d2h_event for b in seg.blocks}  # one per layer call
        event = copier.copy(pairs, to_host=False, after=(compute_done, *d2h.values()))
        for block in seg.blocks:
            block.h2d_event = event
            block.reads.append(event)
        seg.prefetched = True
        self._set_owner[s] = seg.index

    def unpack(self, saved: Any) -> torch.Tensor:
        """The unpack hook: the saved tensor back, from the device, a buffer set, a lazy reload or a rebuild."""
        if isinstance(saved, Recipe):
            return saved.unpack(self.counters)
        if not isinstance(saved, Saved):
            return saved
        if saved.tensor is not None:
            return saved.tensor
        block = saved.block
        copier = self._copier
        assert block is not None
        if (block.host is None and not block.to_nvme) or copier is None:  # released at the step's end
            raise OffloadError(
                "ActivationOffloader: a saved activation was unpacked after its step ended; run backward inside "
                "the step (retain_graph across steps is not supported with offloading)"
            )
        if block.flat is not None and self._set_owner[block.set_index] == block.segment:
            copier.compute_waits(block.h2d_event)
            flat, offset = block.flat, block.offset
            self.counters["prefetch_hits"] += 1
        else:
            # Fallback: unpacked before its prefetch was issued, or after its buffer set was reused.
            flat = torch.empty(aligned_bytes(block.nbytes), dtype=torch.uint8, device=copier.device)
            copier.compute_waits(block.d2h_event)
            flat[: block.nbytes].copy_(self._host_bytes(block), non_blocking=copier.is_cuda)
            block.reads.append(copier.mark_compute())
            offset = 0
            self.counters["lazy_reloads"] += 1
        # Sets and fallback buffers are multiples of 256 bytes, so every dtype view of them is exact.
        typed = flat.view(saved.dtype)
        return torch.as_strided(typed, saved.size, saved.stride, offset // saved.dtype.itemsize + saved.storage_offset)

    def release_ordered(self) -> None:
        """Give back every ended step's host buffers and device sources without blocking the host.

        A copy that may still run is ordered before the compute stream's next work instead (a device-side wait on its
        event, never ``event.synchronize()``): the next step's device-to-host copies into these buffers wait for
        compute (:meth:`send`), so they come after it, and the device allocator hands a released source to compute
        work only, which now comes after its copy too.
        """
        copier = self._copier
        if copier is not None:
            events = {id(e): e for b in self._retired for e in (b.d2h_event, *b.reads) if e is not None}
            for event in events.values():
                copier.compute_waits(event)
        for block in self._retired:
            self._give_back(block)
        self._retired = []
        self._pending_sources = []  # their blocks were among the retired ones

    def release_all(self) -> None:
        """Wait for every copy of every ended step and give all host buffers back (errors and teardown)."""
        for block in self._retired:
            if self._copier is not None:
                for event in (block.d2h_event, *block.reads):
                    self._copier.wait_host(event)
            self._give_back(block)
        self._retired = []
        self._pending_sources = []

    def _host_bytes(self, block: Block) -> torch.Tensor:
        """Where a block's bytes are read back from: its host buffer, its file, or (a failed spill) its source."""
        if block.host is not None:
            return block.host[: block.nbytes]
        if block.spill is not None:
            assert self.nvme is not None
            try:
                return self.nvme.data(block.spill)
            except NvmeWriteError as err:  # not seen by release_sources yet: the source is still held
                self.nvme.note_failure(err)
                block.spill = None
        assert block.source is not None  # a spill whose write failed keeps its source until the step's end
        return block.source

    def _give_back(self, block: Block) -> None:
        if block.spill is not None:
            assert self.nvme is not None
            self.nvme.discard(block.spill)
            block.spill = None
        block.to_nvme = False
        if block.host is not None:
            self._pool.release(block.host)
        block.host = block.source = block.flat = None
        block.reads.clear()
