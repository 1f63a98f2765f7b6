"""Checkpoints that appear whole or not at all: written under a temporary name beside the target, flushed to the disk,
then renamed over it.

A file is written to ``.<name>.tmp``, fsynced, and moved over ``<name>`` with one ``os.replace``. A directory (a DCP
checkpoint) is filled under ``.<name>.tmp``, its files and itself fsynced, then swapped with ``<name>`` in one
``renameat2(RENAME_EXCHANGE)`` where the file system has it (Linux), else by two renames through ``.<name>.old``;
the previous checkpoint is deleted only after the new one has its name. A kill at any moment leaves ``<name>`` as the
previous or the new checkpoint, whole, and at most a stale temporary beside it, which the next save clears
(:func:`clear_stale`; a kill between the two renames of the fallback leaves the previous checkpoint as ``.old``, and
:func:`recover` puts it back: the strategy does so before Lightning looks for a checkpoint to resume, and
:func:`clear_stale` before the next save). The temporary names start with a dot and end in ``.tmp``/``.old``, so neither
``ckpt_path="last"`` nor a glob of ``*.ckpt`` picks them up.

Example::

    write_file_atomically(Path("ckpts/last.ckpt"), lambda f: torch.save(checkpoint, f))
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "clear_stale",
    "fsync_directory",
    "fsync_file",
    "move_into_place",
    "recover",
    "recover_directory",
    "temporary_beside",
    "write_file_atomically",
]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temporary_beside(path: Path) -> Path:
    """Where ``path`` is written before it is renamed over ``path``: ``.<name>.tmp`` in the same directory."""
    return path.with_name(f".{path.name}.tmp")


def _previous_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def fsync_file(path: Path) -> None:
    """Flushes ``path``'s bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Flushes ``path``'s entries (the names created or renamed in it) to the disk, where the system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a system whose directories cannot be opened (Windows): renames are as durable as it makes them
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF):  # a file system that does not sync directories
            raise
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(path: Path) -> bool:
    """Puts back the previous checkpoint that a kill between the fallback swap's two renames left aside as
    ``.<name>.old``, where ``path`` is missing; returns whether it did.

    Harmless when every rank tries it at once on a shared file system: one rename wins, the others find the
    ``.old`` gone (or ``path`` there) and leave it.

    Example::

        recover(Path("ckpts/last.ckpt"))  # before Lightning looks for ckpt_path="last"
    """
    previous = _previous_beside(path)
    if path.exists() or path.is_symlink() or not previous.exists():
        return False
    try:
        previous.rename(path)
    except OSError as err:  # another process put it back first: the source is gone, or the target is there
        if err.errno in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY) and path.exists():
            return False
        raise
    fsync_directory(path.parent)
    return True


def recover_directory(directory: Path) -> list[Path]:
    """:func:`recover` every checkpoint of ``directory`` that a kill left aside as ``.<name>.old``; returns those put
    back.

    Example::

        recover_directory(Path("ckpts"))  # [Path("ckpts/last.ckpt")] after a kill inside its swap
    """
    if not directory.is_dir():
        return []
    aside = (entry.name[1 : -len(".old")] for entry in directory.glob(".*.old"))
    return [directory / name for name in sorted(aside) if name and recover(directory / name)]


def clear_stale(path: Path) -> None:
    """Before a save of ``path``: removes what an interrupted save left beside it. A previous checkpoint moved aside
    by the fallback swap goes back to ``path`` when ``path`` is missing (the kill fell between the two renames)."""
    previous = _previous_beside(path)
    if not recover(path) and previous.exists():  # beside a whole path: a stale copy
        _remove(previous)
    _remove(temporary_beside(path))


def write_file_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into :func:`temporary_beside` ``path``, fsync it, rename it over ``path``, fsync the directory.

    Example::

        write_file_atomically(Path("last.ckpt"), lambda f: torch.save(checkpoint, f))
    """
    tmp = temporary_beside(path)
    with open(tmp, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    if path.is_dir():  # a distributed checkpoint of the same name gives way to the file, once the file is whole
        move_into_place(tmp, path)
        return
    os.replace(tmp, path)
    fsync_directory(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps ``a`` and ``b`` in one step (Linux ``renameat2``); ``False`` where the system or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def move_into_place(tmp: Path, path: Path) -> None:
    """Puts the finished (fsynced) file or directory ``tmp`` at ``path``; what was there is removed only once ``tmp``
    has the name.

    Example::

        move_into_place(temporary_beside(path), path)
    """
    if not (path.exists() or path.is_symlink()):
        tmp.rename(path)
    elif _exchange(tmp, path):
        _remove(tmp)  # the previous checkpoint, now under the temporary name
    else:
        previous = _previous_beside(path)
        _remove(previous)
        path.rename(previous)
        tmp.rename(path)
        _remove(previous)
    fsync_directory(path.parent)
