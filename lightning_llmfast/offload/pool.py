"""Reusable host memory for offloaded activations: a few large chunks handed out front to back within a step.

A step's offloaded storages vary in size (sequence lengths, MoE loads), but all of them are given back together when
the step ends, and their total varies far less than their sizes. :class:`PinnedBufferPool` therefore keeps a list
of large chunks and hands out aligned slices of them in order (a bump pointer per chunk); when nothing is checked
out, every chunk is free again. Sizing is by bytes: :meth:`PinnedBufferPool.reserve` (the planned bytes of a step
times the headroom) or :meth:`PinnedBufferPool.reserve_measured` (the first offloading step's total times the
headroom), not by the sizes of the first step's tensors, so a later step with other sizes but no more bytes never
grows the pool. A growth after sizing is logged with its cause, counted, and reported once by
:meth:`PinnedBufferPool.warn_growth`.

Chunks are powers of two: PyTorch's host caching allocator rounds every pinned allocation up to one, so the pool asks
for exactly what it is given and ``pool_bytes`` is the real pinned size. When pinning fails (no CUDA driver, locked
memory limit) the pool warns once and continues in pageable memory (copies are then synchronous).

Example::

    pool = PinnedBufferPool(headroom=1.5)
    buf = pool.acquire(3000)  # (>= 3000,) uint8 view of a chunk
    pool.release(buf)
    pool.reserve_measured()  # after step 1: its total x headroom, never shrinks
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import OffloadError

__all__ = ["MAX_HEADROOM", "PinnedBufferPool", "aligned_bytes", "pinned_bytes", "size_class"]

log = logging.getLogger(__name__)

# The largest headroom accepted: a pool of 16x the measured need is already more pinned memory than a step uses; a
# larger factor is a mistake (an infinite one would overflow when the pool is sized).
MAX_HEADROOM = 16.0

# Smallest class; everything below shares one class so tiny tensors do not fragment the pool.
_MIN_CLASS_BYTES = 4096
# Four classes per octave: 1, 1.25, 1.5, 1.75 x 2**k. Bounds rounding waste at 25% instead of 100%.
_STEPS_PER_OCTAVE = 4
# Slices start at multiples of this: every dtype view of a slice is aligned like a fresh allocation.
_ALIGN = 256
# The smallest chunk: a step of many small storages takes a few chunks, not one per storage.
_MIN_CHUNK_BYTES = 1 << 20


def aligned_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 256: the span of one block in a pool slice or a device buffer set.

    Offsets stay aligned so that every reloaded dtype view is aligned like a fresh allocation (vectorised CPU kernels
    and MKL pick their code path by alignment; another path could change rounding).

    Example::

        >>> aligned_bytes(1), aligned_bytes(256), aligned_bytes(0)
        (256, 256, 0)
    """
    return -(-nbytes // _ALIGN) * _ALIGN


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class (a multiple of 4096 of the form ``(4 + j) * 2**(k - 2)``).

    The device buffer sets are sized in these classes, so that steps whose sizes differ a little ask the device
    allocator for the same block again.

    Args:
        nbytes: requested size in bytes, ``>= 0``.

    Returns:
        The class's size.

    Example::

        >>> size_class(5000), size_class(1 << 20)
        (5120, 1048576)
    """
    check_int("size_class: nbytes", nbytes, low=0, error=OffloadError)
    if nbytes <= _MIN_CLASS_BYTES:
        return _MIN_CLASS_BYTES
    octave = 1 << ((nbytes - 1).bit_length() - 1)  # largest power of two strictly below nbytes
    step = octave // _STEPS_PER_OCTAVE
    return min(octave * 2, octave + step * math.ceil((nbytes - octave) / step))


def pinned_bytes(nbytes: int) -> int:
    """The bytes PyTorch's host caching allocator reserves for a pinned request of ``nbytes``: the next power of two.

    Example::

        >>> pinned_bytes(5 << 20) == 8 << 20
        True
    """
    return 1 << max(nbytes - 1, 0).bit_length()


class PinnedBufferPool:
    """Host ``uint8`` chunks (page-locked when the build supports it), handed out in aligned slices, reused every step.

    Args:
        headroom: factor in ``[1, MAX_HEADROOM]`` applied to the bytes a step needs when the pool is sized, and to a
            shortfall when a sized pool has to grow.
        pin_memory: page-lock the chunks. ``None`` pins when CUDA is available; when pinning fails the pool warns
            once, falls back to plain memory and reports ``pinned=False`` in :attr:`stats`.

    Example::

        pool = PinnedBufferPool(headroom=1.5, pin_memory=False)
        a = pool.acquire(10_000)
        assert pool.stats()["checked_out"] == 1
        pool.release(a)
    """

    def __init__(self, headroom: float = 1.5, pin_memory: bool | None = None) -> None:
        self.headroom = check_number(
            "PinnedBufferPool: headroom", headroom, low=1, high=MAX_HEADROOM, error=OffloadError
        )
        self.pinned = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._chunks: list[torch.Tensor] = []
        self._used: list[int] = []  # bytes handed out from the front of each chunk since it was last all free
        self._out: dict[int, int] = {}  # data_ptr -> bytes, of the slices checked out
        self._sized = False
        self.pool_bytes = 0
        self.out_bytes = 0
        self.peak_out_bytes = 0
        self.grow_events = 0
        self.grown_bytes = 0

    def _allocate(self, nbytes: int, cause: str) -> None:
        capacity = pinned_bytes(max(nbytes, _MIN_CHUNK_BYTES))
        chunk = None
        if self.pinned:
            try:
                chunk = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as err:
                self.pinned = False
                warnings.warn(
                    f"PinnedBufferPool: pinning {capacity} bytes of host memory failed ({err}); offloaded activations "
                    "go to pageable memory from now on, so their copies are synchronous",
                    RuntimeWarning,
                    stacklevel=4,
                )
        if chunk is None:
            chunk = torch.empty(capacity, dtype=torch.uint8)
        self._chunks.append(chunk)
        self._used.append(0)
        self.pool_bytes += capacity
        if self._sized:
            self.grow_events += 1
            self.grown_bytes += capacity
            log.warning(
                "PinnedBufferPool grew by %d bytes to %d after it was sized: %s", capacity, self.pool_bytes, cause
            )

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Check out ``nbytes`` bytes: a slice of the first chunk with room (a new chunk only when none has).

        After the pool has been sized, a new chunk is counted and logged as growth (see :meth:`warn_growth`).

        Args:
            nbytes: bytes needed.

        Returns:
            A ``(>= nbytes,)`` ``uint8`` CPU tensor; give it back with :meth:`release`.
        """
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        index = next((i for i, c in enumerate(self._chunks) if self._used[i] + size <= c.numel()), None)
        if index is None:
            # The pool grows by the shortfall times the headroom, so that the next larger step fits as well.
            need = self.out_bytes + size
            self._allocate(
                max(size, math.ceil(need * self.headroom) - self.capacity()),
                f"a step needed {need} bytes at once ({size} requested with {self.out_bytes} out), more than sized",
            )
            index = len(self._chunks) - 1
        start = self._used[index]
        self._used[index] = start + size
        buf = self._chunks[index][start : start + size]
        self._out[buf.data_ptr()] = size
        self.out_bytes += size
        self.peak_out_bytes = max(self.peak_out_bytes, self.out_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a slice obtained from :meth:`acquire`; when none is out, every chunk is free again.

        Args:
            buf: the slice.
        """
        size = self._out.pop(buf.data_ptr(), None)
        if size is None:
            raise OffloadError(f"PinnedBufferPool.release: buffer at {buf.data_ptr():#x} is not checked out")
        self.out_bytes -= size
        if not self._out:
            self._used = [0] * len(self._chunks)

    def reserve(self, nbytes: int) -> None:
        """Size the pool for steps that need ``nbytes`` at once (times the headroom); never shrinks it.

        Args:
            nbytes: bytes a step checks out at most (e.g. what the plan offloads).
        """
        check_int("PinnedBufferPool.reserve: nbytes", nbytes, low=0, error=OffloadError)
        missing = math.ceil(nbytes * self.headroom) - self.capacity()
        if missing > 0:
            self._allocate(missing, f"reserved for {nbytes} bytes")
        self._sized = True

    def reserve_measured(self) -> None:
        """Size the pool from the most bytes checked out at once so far, times the headroom (after the first step)."""
        if not self._sized:
            self.reserve(self.peak_out_bytes)

    def capacity(self) -> int:
        """The bytes of all chunks (a step's slices spread over them)."""
        return sum(c.numel() for c in self._chunks)

    def warn_growth(self, owner: str = "PinnedBufferPool") -> bool:
        """Warn once about the growth since the pool was sized (if any), with its total, and reset the count.

        Returns:
            Whether it warned.
        """
        if not self.grow_events:
            return False
        warnings.warn(
            f"{owner}: the pinned pool grew {self.grow_events} times by {self.grown_bytes} bytes in total after it was "
            f"sized (to {self.pool_bytes} bytes); raise pool_headroom (now {self.headroom:g}) to size it once",
            RuntimeWarning,
            stacklevel=3,
        )
        self.grow_events = self.grown_bytes = 0
        return True

    def reset_peak(self) -> None:
        """Start a new measurement window for :attr:`peak_out_bytes` (per step)."""
        self.peak_out_bytes = self.out_bytes

    @property
    def checked_out(self) -> int:
        """Number of slices currently checked out."""
        return len(self._out)

    def clear(self) -> None:
        """Drop every chunk (checked-out slices are forgotten; callers release them first)."""
        self._chunks.clear()
        self._used.clear()
        self._out.clear()
        self._sized = False
        self.pool_bytes = self.out_bytes = self.peak_out_bytes = 0

    def stats(self) -> dict[str, int | bool]:
        """Pool counters: ``pool_bytes`` (real host bytes), ``checked_out``, ``pool_buffers`` (chunks),
        ``pool_grow_events`` and ``pool_grown_bytes`` (growth after sizing, not yet reported by :meth:`warn_growth`),
        ``pinned``."""
        return {
            "pool_bytes": self.pool_bytes,
            "checked_out": self.checked_out,
            "pool_buffers": len(self._chunks),
            "pool_grow_events": self.grow_events,
            "pool_grown_bytes": self.grown_bytes,
            "pinned": self.pinned,
        }
