"""Byte ranges of files into tensors on any device: read into a pinned host buffer, copied to the device in batches.

Loading a checkpoint of tens of thousands of small tensors one synchronous copy at a time from pageable memory costs
a host sync and a launch per tensor. A :class:`StagedReader` reads the ranges its callers ask for (``pread``-style,
no memory map, so the file pages a process touches are not counted in its resident memory) one after the other
into a host buffer; when the buffer is full it moves the whole buffer to the device with one asynchronous copy and
hands each caller its bytes *on the device*, where the caller converts them (views, dtype casts, dequantization)
and copies them into place. On CUDA there are two pinned host buffers: the next one is filled from the file while
the previous one is still being copied, and the host waits for a copy only before refilling its buffer (one wait per
buffer, never per range). On the CPU the buffer is ordinary memory and the callers get its bytes directly.

Example::

    with StagedReader(torch.device("cuda"), capacity=16 << 20) as reader:
        reader.add([(path, offset, nbytes)], lambda parts: target.copy_(parts[0].view(torch.bfloat16).view(shape)))
    reader.bytes_read, reader.batches
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch
from torch import Tensor

from lightning_llmfast.errors import CheckpointError

__all__ = ["ALIGNMENT", "Finish", "StagedReader"]

ALIGNMENT = 64
"""Every range starts at a multiple of this many bytes of the buffer, so its bytes view as any dtype."""

Finish = Callable[[list[Tensor]], None]
"""What a caller does with its ranges' bytes (``uint8`` tensors on the device, in the order asked)."""


class StagedReader:
    """Reads byte ranges of files into a host buffer and hands them to their callers on ``device`` in batches.

    Args:
        device: where the callers' bytes are delivered.
        capacity: bytes of one buffer; no single :meth:`add` may ask for more (aligned).

    Attributes:
        bytes_read: bytes read from files so far.
        batches: buffers delivered so far (on CUDA: host-to-device copies).
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = _aligned(capacity)
        self._cuda = device.type == "cuda"
        self._host = [
            torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2 if self._cuda else 1)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._device = torch.empty(self.capacity, dtype=torch.uint8, device=device) if self._cuda else None
        self._current, self._used = 0, 0
        self._pending: list[tuple[list[tuple[int, int]], Finish]] = []
        self._files: dict[Path, BinaryIO] = {}
        self.bytes_read = 0
        self.batches = 0

    def add(self, ranges: Sequence[tuple[Path, int, int]], finish: Finish) -> None:
        """Read ``(file, offset, nbytes)`` ranges; ``finish`` gets their bytes on the device when the batch goes.

        Raises:
            CheckpointError: a file that is absent or shorter than a range (naming it).
        """
        needed = sum(_aligned(n) for _, _, n in ranges)
        if needed > self.capacity:
            raise ValueError(f"StagedReader: {needed} bytes in one add, more than the capacity {self.capacity}")
        if self._used + needed > self.capacity:
            self.flush()
        host = self._host[self._current]
        spans = []
        for path, offset, nbytes in ranges:
            self._read(path, offset, host[self._used : self._used + nbytes])
            spans.append((self._used, nbytes))
            self._used += _aligned(nbytes)
            self.bytes_read += nbytes
        self._pending.append((spans, finish))

    def flush(self) -> None:
        """Deliver the buffer's ranges to their callers now (one host-to-device copy on CUDA)."""
        if not self._pending:
            return
        host = self._host[self._current]
        source = host
        if self._device is not None:
            self._device[: self._used].copy_(host[: self._used], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[self._current] = event
            source = self._device
        for spans, finish in self._pending:
            finish([source[start : start + n] for start, n in spans])
        self._pending.clear()
        self._used = 0
        self.batches += 1
        self._current = (self._current + 1) % len(self._host)
        waiting = self._copied[self._current]
        if waiting is not None:
            waiting.synchronize()  # its previous batch must have left before the buffer is refilled

    def close(self) -> None:
        """Deliver what is left, wait for the last copies (the host buffers are freed next), close the files."""
        try:
            self.flush()
            for event in self._copied:
                if event is not None:
                    event.synchronize()
        finally:
            for file in self._files.values():
                file.close()
            self._files.clear()

    def __enter__(self) -> StagedReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _read(self, path: Path, offset: int, target: Tensor) -> None:
        file = self._files.get(path)
        try:
            if file is None:
                file = self._files[path] = path.open("rb", buffering=0)
            file.seek(offset)
            view = memoryview(target.numpy())
            done = 0
            while done < len(view):
                got = file.readinto(view[done:])
                if not got:
                    raise EOFError(f"{len(view) - done} bytes missing at offset {offset + done}")
                done += got
        except (OSError, EOFError) as err:
            raise CheckpointError(f"{path}: truncated or unreadable ({err})") from err


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT
