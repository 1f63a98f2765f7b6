"""Large CPU row buffers written in one stream (the references' gathers), backed by transparent huge pages.

glibc serves every request of 32 MiB or more with a fresh ``mmap`` (its largest mmap threshold) and unmaps it on
free, so a buffer that size is faulted in again, one 4 KiB page at a time, on every step: at T=8192, k=8, H=256 a
``(T * k, H)`` float32 gather into a fresh 64 MiB buffer measured 40 ms against 13 ms with the buffer advised
``MADV_HUGEPAGE`` before it is written (2 MiB pages: 512 times fewer faults). The advice concerns only the buffer
itself, which glibc unmaps whole when torch frees it; where transparent huge pages are off, or off Linux, it is a
no-op. Smaller buffers come from the heap and are reused without faults: they are left alone. Buffers written band
by band with cache-resident intermediates (the SwiGLU's) are left alone too: a 2 MiB page is zeroed whole at its first
write, which flushes the band's intermediates out of cache; advising them measured no gain.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

import torch

__all__ = ["empty_rows"]

_FRESH_MAPPING_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: from here every buffer is mapped anew
_MADV_HUGEPAGE = 14


def empty_rows(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, advised onto huge pages when on CPU and 32 MiB or more.

    Example::

        out = empty_rows(num_rows, hidden, dtype=x.dtype, device=x.device)
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if out.device.type == "cpu" and nbytes >= _FRESH_MAPPING_BYTES and type(out) is torch.Tensor:  # not a fake
        madvise = _madvise()
        if madvise is not None:
            page = mmap.PAGESIZE
            start = -(-out.data_ptr() // page) * page  # whole pages inside the buffer: never a neighbour's
            end = (out.data_ptr() + nbytes) // page * page
            madvise(start, end - start, _MADV_HUGEPAGE)  # a refusal (THP off) leaves ordinary pages
    return out


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` where transparent huge pages can be asked for (Linux, not ``never``), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
