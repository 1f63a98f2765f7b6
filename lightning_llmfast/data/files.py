"""Files written whole: beside their target under a name no other writer can take, flushed, then renamed.

Several processes may write the same prepared file at once (ranks and nodes deriving the same layout on shared
storage, a rerun beside a killed one). A temporary name carries the host, the process id and a random part
(:func:`unique_suffix`): process ids repeat across hosts and PID namespaces (containers), the random part does not.

Example::

    with atomic_file(Path("out/manifest.json")) as f:
        f.write(data)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

__all__ = ["atomic_file", "fsync_directory", "npy_from_raw", "sha256_file", "sha256_text", "unique_suffix"]

_COPY_BLOCK = 1 << 18  # bytes copied at once: the memory of a copy, whatever the file's size


def unique_suffix() -> str:
    """``{host}-{pid}-{random}``: a part of a temporary name that no other process, here or elsewhere, produces.

    Example::

        >>> suffix = unique_suffix()
        >>> str(os.getpid()) in suffix and suffix != unique_suffix()
        True
    """
    host = socket.gethostname().replace(os.sep, "_") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def sha256_text(text: str) -> str:
    """Hex sha256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A binary file written beside ``path``, flushed to disk (fsync), then renamed over it; removed on error.

    A reader sees the old file or the whole new one, never a part, whenever the writer is killed. The temporary
    name is ``{name}.tmp-{host}-{pid}-{random}`` (:func:`unique_suffix`), so writers of the same file never meet.

    Example::

        with atomic_file(Path("out/manifest.json")) as f:
            f.write(data)
    """
    tmp = path.with_name(f"{path.name}.tmp-{unique_suffix()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def npy_from_raw(raw: Path, target: Path, columns: int) -> None:
    """Turn a raw file of ``int64`` values (rows of ``columns``) into the ``.npy`` file ``target``, atomically.

    The header is written, then the values copied in blocks: no array of the whole file is held in memory.
    """
    count = raw.stat().st_size // 8
    shape = (count // columns, columns) if columns > 1 else (count,)
    with atomic_file(target) as f, open(raw, "rb") as source:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(f, header)
        shutil.copyfileobj(source, f, _COPY_BLOCK)


def fsync_directory(path: Path) -> None:
    """Make the renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
