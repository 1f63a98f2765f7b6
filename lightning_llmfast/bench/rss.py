"""Peak resident memory of this process over a window: ``VmHWM`` reset through ``/proc/self/clear_refs`` (Linux).

Writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark ``VmHWM`` to the current ``VmRSS``; reading
``VmHWM`` after the window gives the peak reached inside it, file pages mapped and touched (safetensors shards)
included. Before the reset, garbage is collected and glibc's ``malloc_trim(0)`` returns freed heap pages to the
system: otherwise memory freed by an earlier window stays resident and is reused unseen by the next one.

Example::

    with PeakRSS() as rss:
        load()
    rss.growth  # bytes above the resident size at the start of the window
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from pathlib import Path
from types import TracebackType

__all__ = ["PeakRSS", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``...) in bytes.

    Example::

        status_bytes("VmRSS")
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRSS:
    """Context manager measuring the peak resident set size inside its window.

    Attributes:
        start: ``VmRSS`` at entry (bytes).
        peak: ``VmHWM`` at exit (bytes).
    """

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0

    def __enter__(self) -> PeakRSS:
        gc.collect()
        _malloc_trim()
        Path("/proc/self/clear_refs").write_text("5")
        self.start = status_bytes("VmRSS")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.peak = status_bytes("VmHWM")

    @property
    def growth(self) -> int:
        """Peak minus the start (bytes)."""
        return max(0, self.peak - self.start)


def _malloc_trim() -> None:
    """Return freed heap memory to the system (glibc; a no-op where there is no ``malloc_trim``)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
