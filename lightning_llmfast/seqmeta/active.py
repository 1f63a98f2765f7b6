"""The active :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` of the current thread (a stack, innermost last).

Model layers reach the cache of the batch being processed without an extra argument:
``meta = metadata if metadata is not None else active_cache().get(hidden)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_llmfast.seqmeta.cache import SequenceMetadataCache

__all__ = ["activate_cache", "active_cache", "push", "remove"]

_LOCAL = threading.local()


def _stack() -> list[SequenceMetadataCache]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = []
        _LOCAL.stack = stack
    return stack


def active_cache() -> SequenceMetadataCache | None:
    """Returns the cache with an open version in the current thread (the innermost when nested), or ``None``.

    Example::

        cache = active_cache()
        meta = metadata if metadata is not None else cache.get(hidden)
    """
    stack = _stack()
    return stack[-1] if stack else None


@contextmanager
def activate_cache(cache: SequenceMetadataCache | None) -> Iterator[None]:
    """Make ``cache`` the active cache of the *current thread* for the block (``None``: do nothing).

    The active stack is per thread, and the autograd engine runs CUDA backward on its own threads; activation
    recomputation (:mod:`lightning_llmfast.offload.recompute`) replays a layer's forward there and needs the cache
    that was active when the layer first ran. The cache's version is not touched: it must still be open.

    Example::

        with activate_cache(cache_seen_in_forward):
            out = layer_forward(x)
    """
    if cache is None:
        yield
        return
    stack = _stack()
    stack.append(cache)
    try:
        yield
    finally:
        if stack and stack[-1] is cache:
            stack.pop()
        elif cache in stack:
            stack.remove(cache)


def push(cache: SequenceMetadataCache) -> None:
    """Makes ``cache`` the innermost active cache of the current thread."""
    remove(cache)
    _stack().append(cache)


def remove(cache: SequenceMetadataCache) -> None:
    """Takes ``cache`` off the current thread's active stack (if it is there)."""
    stack = _stack()
    if cache in stack:
        stack.remove(cache)
