"""Large CPU buffers of the MoE references, reused from step to step instead of mapped afresh.

glibc serves every request of 32 MiB or more with a fresh ``mmap`` (its largest mmap threshold) and unmaps it on
free, so each such buffer is faulted in again, one zeroed 4 KiB page at a time, on every step. At T=8192, k=8,
H=256, F=512 the MoE block's buffers of that size (row gathers, the grouped GEMMs' outputs, the SwiGLU's) add up to
about 1 GB a step: 254k page faults, about 10% of the step on this project's CPU (a ``(65536, 256) x (64, 256,
1024)`` grouped GEMM took 560 ms into a fresh buffer, 430 ms into one already mapped).

:func:`empty_rows` hands out such buffers from a pool of anonymous mappings. A buffer is free again when no tensor
uses its memory any more: :func:`torch.frombuffer` keeps a reference to the mapping for as long as any view of the
returned tensor lives (saved for backward, sliced, transposed), so the mapping's reference count tells. Buffers are
matched by byte size (a training step repeats its shapes); idle ones beyond :data:`MAX_IDLE_BYTES` are unmapped,
least recently used first, and :func:`release` unmaps every idle one. Smaller buffers come from the heap, which
glibc reuses without faults: they are left to torch.

Example::

    out = empty_rows(num_rows, hidden, dtype=x.dtype, device=x.device)  # (num_rows, hidden), uninitialised
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
import threading
from collections.abc import Iterator, Sequence

import torch

__all__ = ["MAX_IDLE_BYTES", "MIN_POOLED_BYTES", "empty_rows", "held_bytes", "pooled", "pooling", "release"]

MIN_POOLED_BYTES = 32 << 20
"""From this size a CPU buffer is pooled: glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit, where it maps anew."""

MAX_IDLE_BYTES = 4 << 30
"""Idle bytes the pool keeps mapped for the next step; beyond them the least recently used are unmapped."""

_LOCK = threading.Lock()
_STATE = threading.local()  # .enabled: False inside ``pooling(False)``


class _Pool:
    """Anonymous mappings by byte size, in order of last use (oldest first)."""

    def __init__(self) -> None:
        self.mappings: list[mmap.mmap] = []

    def _idle(self) -> list[int]:
        """Indices of the mappings no storage uses: referenced by the list alone."""
        return [i for i in range(len(self.mappings)) if sys.getrefcount(self.mappings[i]) == _LIST_ONLY]

    def take(self, nbytes: int) -> mmap.mmap:
        with _LOCK:
            found = next((i for i in self._idle() if len(self.mappings[i]) == nbytes), None)
            mapping = mmap.mmap(-1, nbytes) if found is None else self.mappings.pop(found)
            self.mappings.append(mapping)  # most recently used last
            idle = self._idle()  # not the one just taken: `mapping` holds it
            excess = sum(len(self.mappings[i]) for i in idle) - MAX_IDLE_BYTES
            unmap = []
            for i in idle:  # oldest first
                if excess <= 0:
                    break
                excess -= len(self.mappings[i])
                unmap.append(i)
            self._unmap(unmap)
        return mapping

    def _unmap(self, indices: list[int]) -> None:
        for i in sorted(indices, reverse=True):
            self.mappings.pop(i).close()

    def release(self) -> int:
        with _LOCK:
            idle = self._idle()
            self._unmap(idle)
            return len(idle)

    def held_bytes(self) -> int:
        with _LOCK:
            return sum(len(m) for m in self.mappings)


def _list_only_refcount() -> int:
    """What ``sys.getrefcount`` reports here for an object held by a list alone (interpreters count differently)."""
    probe = [mmap.mmap(-1, mmap.PAGESIZE)]
    count = sys.getrefcount(probe[0])
    probe[0].close()
    return count


_LIST_ONLY = _list_only_refcount()
_POOL = _Pool()


def empty_rows(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, from the pool when on CPU and 32 MiB or more.

    Example::

        out = empty_rows(num_rows, hidden, dtype=x.dtype, device=x.device)
    """
    if device.type != "cpu" or not pooled(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    return torch.frombuffer(_POOL.take(numel * dtype.itemsize), dtype=dtype, count=numel).view(shape)


def pooled(shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether :func:`empty_rows` takes a CPU buffer of ``shape`` and ``dtype`` from the pool (in this thread)."""
    return math.prod(shape) * dtype.itemsize >= MIN_POOLED_BYTES and getattr(_STATE, "enabled", True)


def release() -> int:
    """Unmaps every idle pooled buffer (those in use stay); returns how many were unmapped.

    Example::

        trainer.fit(model)
        host_memory.release()  # give the pool's memory back before other work
    """
    return _POOL.release()


def held_bytes() -> int:
    """Bytes the pool has mapped, in use or idle."""
    return _POOL.held_bytes()


@contextlib.contextmanager
def pooling(enabled: bool) -> Iterator[None]:
    """Turns the pool on or off in this thread (fresh buffers from torch when off), e.g. to measure without it.

    Example::

        with pooling(False):
            step()
    """
    previous = getattr(_STATE, "enabled", True)
    _STATE.enabled = enabled
    try:
        yield
    finally:
        _STATE.enabled = previous
