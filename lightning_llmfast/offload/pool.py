"""Reusable host buffers for offloaded activations, grouped by size class.

The host allocator behind ``pin_memory`` rounds every request up to a power of two and page-locks it; allocating
fresh pinned memory per step is slow and the rounding makes memory grow by up to 2x. :class:`PinnedBufferPool`
instead hands out flat ``uint8`` buffers from free lists keyed by a *size class* with four classes per octave
(at most 25% rounding waste), sizes itself from the first step's measured need times a headroom factor, and
afterwards only grows when a step needs more than it has: by a buffer of the size class of the request times the
headroom, so that the next larger requests (MoE layers' sizes vary per step) reuse it instead of growing again. The
growth is counted, and reported once by :meth:`PinnedBufferPool.warn_growth` (the offloader calls it when it closes).

Example::

    pool = PinnedBufferPool(headroom=1.5)
    buf = pool.acquire(3000)  # (capacity,) uint8, capacity >= 3000
    pool.release(buf)
    pool.reserve_measured()  # after step 1: keep peak need x headroom, never shrink below it
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import torch

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import OffloadError

__all__ = ["MAX_HEADROOM", "PinnedBufferPool", "size_class"]

# The largest headroom accepted: a pool of 16x the measured need is already more pinned memory than a step uses; a
# larger factor is a mistake (an infinite one would overflow when the pool is sized).
MAX_HEADROOM = 16.0

# Smallest class; everything below shares one class so tiny tensors do not fragment the pool.
_MIN_CLASS_BYTES = 4096
# Four classes per octave: 1, 1.25, 1.5, 1.75 x 2**k. Bounds rounding waste at 25% instead of 100%.
_STEPS_PER_OCTAVE = 4


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class (a multiple of 4096 of the form ``(4 + j) * 2**(k - 2)``).

    Args:
        nbytes: requested size in bytes, ``>= 0``.

    Returns:
        The capacity of the buffer that serves the request.

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


class PinnedBufferPool:
    """Pool of flat host ``uint8`` buffers (page-locked when the build supports it), reused across steps.

    Args:
        headroom: factor in ``[1, MAX_HEADROOM]`` applied to the first step's peak need when the pool is sized.
        pin_memory: page-lock the buffers. ``None`` pins when CUDA is available; if pinning fails (CPU-only
            builds), the pool falls back to plain memory once and reports ``pinned=False`` in :attr:`stats`.

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
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._out: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, for checked-out buffers
        self._count: dict[int, int] = defaultdict(int)  # capacity -> buffers owned (free + out)
        self._out_per_class: dict[int, int] = defaultdict(int)
        self._peak_per_class: dict[int, int] = defaultdict(int)
        self._sized = False
        self.pool_bytes = 0
        self.out_bytes = 0
        self.peak_out_bytes = 0
        self.grow_events = 0
        self.grown_bytes = 0

    def _allocate(self, capacity: int) -> torch.Tensor:
        if self.pinned:
            try:
                buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                # NOTE: CPU-only builds cannot page-lock memory; plain memory keeps the mechanism testable.
                self.pinned = False
                buf = torch.empty(capacity, dtype=torch.uint8)
        else:
            buf = torch.empty(capacity, dtype=torch.uint8)
        self._count[capacity] += 1
        self.pool_bytes += capacity
        return buf

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Check out a buffer of at least ``nbytes`` bytes.

        Prefers a free buffer of the exact size class, then the smallest free larger buffer (varying MoE sizes
        then reuse what the pool has), and only then allocates; after the pool has been sized that allocation
        is counted as growth (see :meth:`warn_growth`).

        Args:
            nbytes: bytes needed.

        Returns:
            A ``(capacity,)`` ``uint8`` CPU tensor, ``capacity >= nbytes``; give it back with :meth:`release`.
        """
        cls = size_class(nbytes)
        if self._free[cls]:
            buf = self._free[cls].pop()
        else:
            larger = [c for c, bufs in self._free.items() if c > cls and bufs]
            if larger:
                cls = min(larger)
                buf = self._free[cls].pop()
            else:
                if self._sized:
                    cls = size_class(math.ceil(cls * self.headroom))
                    self.grow_events += 1
                    self.grown_bytes += cls
                buf = self._allocate(cls)
        self._out[buf.data_ptr()] = buf
        self._out_per_class[cls] += 1
        self._peak_per_class[cls] = max(self._peak_per_class[cls], self._out_per_class[cls])
        self.out_bytes += cls
        self.peak_out_bytes = max(self.peak_out_bytes, self.out_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`acquire` to its free list.

        Args:
            buf: the ``(capacity,)`` buffer.
        """
        if self._out.pop(buf.data_ptr(), None) is None:
            raise OffloadError(f"PinnedBufferPool.release: buffer at {buf.data_ptr():#x} is not checked out")
        cls = buf.numel()
        self._out_per_class[cls] -= 1
        self.out_bytes -= cls
        self._free[cls].append(buf)

    def reserve_measured(self) -> None:
        """Size the pool from the peak need measured so far times the headroom (called after the first step).

        Buffers are only added, never dropped, so the pool is stable from the second step on.
        """
        for cls, peak in self._peak_per_class.items():
            for _ in range(math.ceil(peak * self.headroom) - self._count[cls]):
                self._free[cls].append(self._allocate(cls))
        self._sized = True

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
        """Number of buffers currently checked out."""
        return len(self._out)

    def clear(self) -> None:
        """Drop every buffer (checked-out ones are forgotten; callers release them first)."""
        self._free.clear()
        self._out.clear()
        self._count.clear()
        self._out_per_class.clear()
        self._peak_per_class.clear()
        self._sized = False
        self.pool_bytes = self.out_bytes = self.peak_out_bytes = 0

    def stats(self) -> dict[str, int | bool]:
        """Pool counters: ``pool_bytes``, ``checked_out``, ``pool_buffers``, ``pool_grow_events`` and
        ``pool_grown_bytes`` (growth after sizing, not yet reported by :meth:`warn_growth`), ``pinned``."""
        return {
            "pool_bytes": self.pool_bytes,
            "checked_out": self.checked_out,
            "pool_buffers": sum(self._count.values()),
            "pool_grow_events": self.grow_events,
            "pool_grown_bytes": self.grown_bytes,
            "pinned": self.pinned,
        }
