"""The NVMe tier: offloaded storages that would take the pinned pool past ``OffloadConfig.pinned_budget`` go to files
in ``OffloadConfig.nvme_dir`` instead, written and read on worker threads.

Each spilled storage is one file in a directory of its own (``<nvme_dir>/llmfast-offload-*``). Writes start when the
layer call that saved it ends (as device-to-host copies do) and run on a small :class:`~concurrent.futures.
ThreadPoolExecutor`; the saved bytes stay referenced until the write is done. Backward reads a layer's files ahead of
its prefetch on the same workers, so the read overlaps the backward of the layer after it. Buffers are anonymous
``mmap`` pages rounded up to 4096 bytes, so files open with ``O_DIRECT`` (bypassing the page cache) where the OS and
filesystem allow it, and plainly where they refuse (tmpfs, macOS).

Files go when their block is released (the step's end, or at once after an error), the directory when the tier is
closed, when it is garbage-collected and at interpreter exit (``weakref.finalize``). A write that fails (a full disk:
``ENOSPC``, or any ``OSError``) raises :class:`NvmeWriteError` on its worker; the offloader then keeps that storage
on the device (its bytes were still referenced), spills nothing more for the rest of the step (the layers left in it
that would spill recompute instead), and warns.

On CUDA a worker first copies the device bytes to host memory on a stream of its own, after the compute that made
them (an event), blocking only itself.

Example::

    tier = NvmeTier("/local_nvme/offload")
    spill = tier.write(torch.arange(10, dtype=torch.uint8))
    tier.read_ahead(spill)
    assert torch.equal(tier.data(spill), torch.arange(10, dtype=torch.uint8))
    tier.discard(spill)
    tier.close()
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_llmfast.errors import OffloadError

__all__ = ["NvmeTier", "NvmeWriteError", "Spill", "read_file", "write_file"]

ALIGN = 4096  # O_DIRECT wants buffers, sizes and offsets aligned to the logical block size; 4096 covers NVMe's


class NvmeWriteError(OffloadError):
    """A spill to the NVMe tier could not be written (a full disk, a removed directory); the offloader keeps the
    storage on the device instead."""


def _aligned(nbytes: int) -> int:
    return max(-(-nbytes // ALIGN) * ALIGN, ALIGN)


def _open(path: str, flags: int) -> int:
    """``path`` opened with ``O_DIRECT`` where the OS and filesystem allow it, else plainly."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600)
        except OSError:
            pass  # tmpfs and some filesystems refuse O_DIRECT (EINVAL)
    return os.open(path, flags, 0o600)


def write_file(path: str, data: memoryview) -> None:
    """Write ``data`` (bytes) to a new file ``path`` through a page-aligned buffer padded to :data:`ALIGN`.

    Raises:
        OSError: as the OS reports it (``ENOSPC`` on a full disk), also for a short write.
    """
    buf = mmap.mmap(-1, _aligned(len(data)))
    try:
        buf[: len(data)] = data
        fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view, done = memoryview(buf), 0
            while done < len(view):
                written = os.write(fd, view[done:])
                if written <= 0:
                    raise OSError(28, "short write", path)  # ENOSPC
                done += written
            view.release()
        finally:
            os.close(fd)
    finally:
        buf.close()


def read_file(path: str, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of file ``path`` as a ``(nbytes,)`` uint8 tensor, read through a page-aligned buffer."""
    buf = mmap.mmap(-1, _aligned(nbytes))
    try:
        fd = _open(path, os.O_RDONLY)
        try:
            view, done = memoryview(buf), 0
            while done < nbytes:
                got = os.readv(fd, [view[done:]])
                if got <= 0:
                    raise OffloadError(f"NvmeTier: {path} holds {done} bytes, expected {nbytes}")
                done += got
            view.release()
        finally:
            os.close(fd)
        # numpy, not a torch op: a torch copy on a worker thread would start a second OpenMP team beside compute's
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=nbytes).copy())
    finally:
        buf.close()


@dataclass(eq=False)
class Spill:
    """One spilled storage: its file, size, and the futures of its write and (once asked for) its read."""

    path: str
    nbytes: int
    written: Future[None]
    read: Future[torch.Tensor] | None = None

    def failed(self) -> BaseException | None:
        """The write's error once it is done (``None``: not done yet, or written)."""
        return self.written.exception() if self.written.done() else None


def _cleanup(workers: ThreadPoolExecutor, path: str) -> None:
    workers.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(path, ignore_errors=True)


class NvmeTier:
    """Files for spilled storages in a directory of their own under ``directory``, written and read on workers.

    Args:
        directory: where the tier's directory is made (created if missing): a local NVMe drive.
        workers: writer/reader threads.
        writer: ``writer(path, bytes)`` (``None``: :func:`write_file`; tests inject a failing one).
        reader: ``reader(path, nbytes) -> tensor`` (``None``: :func:`read_file`).

    Raises:
        OffloadError: ``directory`` cannot be created or written.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        workers: int = 2,
        writer: Callable[[str, memoryview], None] | None = None,
        reader: Callable[[str, int], torch.Tensor] | None = None,
    ) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix="llmfast-offload-", dir=directory)
        except OSError as err:
            raise OffloadError(f"OffloadConfig: nvme_dir={str(directory)!r} cannot be used: {err}") from err
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="llmfast-nvme")
        self._writer = writer if writer is not None else write_file
        self._reader = reader if reader is not None else read_file
        self._files = 0
        self._stream: Any = None
        self.full = False  # a write failed in this step: nothing more spills until the next one
        self.failures = 0  # failed writes since the tier was made
        # Removes the directory at close(), when collected, and at interpreter exit.
        self._finalizer = weakref.finalize(self, _cleanup, self._workers, self.path)

    def write(self, source: torch.Tensor, ready: Any = None) -> Spill:
        """Spill ``source`` (a ``(n,)`` uint8 tensor, kept referenced by the caller until the write is done) to a
        new file on a worker; ``ready``: a CUDA event after the compute that made it."""
        path = os.path.join(self.path, f"{self._files}.bin")
        self._files += 1
        return Spill(path, source.numel(), self._workers.submit(self._write, path, source, ready))

    def _write(self, path: str, source: torch.Tensor, ready: Any) -> None:
        host = source
        if source.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(source.device)
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                host = source.to("cpu")  # blocking: this worker waits, compute does not
        try:
            self._writer(path, memoryview(host.numpy()))
        except OSError as err:
            raise NvmeWriteError(f"NvmeTier: writing {source.numel()} bytes to {path} failed: {err}") from err

    def bandwidth(self, nbytes: int) -> float:
        """Bytes/ms of the slower of writing and reading a probe file of ``nbytes`` (at least 1 MiB), best of two."""
        nbytes = max(nbytes, 1 << 20)
        data, path = torch.zeros(nbytes, dtype=torch.uint8), os.path.join(self.path, "probe.bin")
        best = {"write": float("inf"), "read": float("inf")}
        try:
            for _ in range(2):
                start = time.perf_counter()
                self._writer(path, memoryview(data.numpy()))
                best["write"] = min(best["write"], time.perf_counter() - start)
                start = time.perf_counter()
                self._reader(path, nbytes)
                best["read"] = min(best["read"], time.perf_counter() - start)
        finally:
            _unlink(path)
        return nbytes / max(max(best.values()) * 1e3, 1e-3)

    def begin_step(self) -> None:
        """A new step: the tier is tried again after a failure."""
        self.full = False

    def note_failure(self, err: BaseException) -> None:
        """A write failed (``err``): stop spilling for the rest of the step; warn the first time."""
        self.full = True
        self.failures += 1
        if self.failures == 1:
            warnings.warn(
                f"{err}; the offloader keeps such activations on the device for the rest of the step and tries the "
                "NVMe tier again the next step (warned once; count in stats['nvme_failures'])",
                RuntimeWarning,
                stacklevel=2,
            )

    def read_ahead(self, spill: Spill) -> None:
        """Start reading ``spill`` back on a worker (once its write is done), if not started yet."""
        if spill.read is None:
            spill.read = self._workers.submit(self._read, spill)

    def _read(self, spill: Spill) -> torch.Tensor:
        spill.written.result()
        return self._reader(spill.path, spill.nbytes)

    def data(self, spill: Spill) -> torch.Tensor:
        """The spilled bytes, ``(nbytes,)`` uint8 on the host (waits for the read)."""
        self.read_ahead(spill)
        assert spill.read is not None
        return spill.read.result()

    def discard(self, spill: Spill) -> None:
        """Remove ``spill``'s file (once its write is done)."""
        spill.written.add_done_callback(lambda _: _unlink(spill.path))

    def files(self) -> int:
        """Files on disk now."""
        return len(os.listdir(self.path)) if os.path.isdir(self.path) else 0

    def close(self) -> None:
        """Wait for the workers, remove the directory and every file in it (idempotent)."""
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
