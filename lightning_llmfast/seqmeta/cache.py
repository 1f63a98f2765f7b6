"""Per-batch cache of :class:`SequenceMetadata`: built at the first layer, reused by every later one.

A cache has *versions*: ``begin(source)`` opens one for a batch, ``end()`` closes it. Inside a version the first
``get()`` builds the metadata (from the source, or from the position ids the first layer sees) and every later
``get()`` returns the same object, after checking that the caller's hidden states have its token count, so a layer
run on another batch can never read stale boundaries. Nothing survives ``end()``.

The cache with an open version in the current thread is reachable through :func:`active_cache`, so model layers
need no extra argument: ``meta = metadata if metadata is not None else active_cache().get(hidden)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from lightning_llmfast.errors import MetadataError
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["SequenceMetadataCache", "activate_cache", "active_cache"]

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


def _has_source_fields(obj: Any) -> bool:
    if isinstance(obj, SequenceMetadata):
        return True
    if isinstance(obj, Mapping):
        return obj.get("cu_seqlens") is not None or obj.get("position_ids") is not None
    return getattr(obj, "cu_seqlens", None) is not None or getattr(obj, "position_ids", None) is not None


def _token_count(hidden: torch.Tensor) -> int:
    # Host-side shape arithmetic only: (..., hidden_dim) -> number of token positions.
    if hidden.dim() == 0:
        raise MetadataError("hidden: must have at least one dimension (..., hidden_dim), got a scalar")
    return hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0


class SequenceMetadataCache:
    """Builds a batch's :class:`SequenceMetadata` once and hands the same object to every layer.

    Attributes:
        stats: ``{"builds", "hits", "checks", "version"}`` counters since construction (host ints).

    Example::

        cache = SequenceMetadataCache()
        for batch in loader:
            with cache.batch(batch):
                loss = model(batch.input_ids, batch.position_ids)  # layers call active_cache().get(hidden)
                loss.backward()
    """

    def __init__(self) -> None:
        self._source: Any = None
        self._metadata: SequenceMetadata | None = None
        self._open = False
        self.stats: dict[str, int] = {"builds": 0, "hits": 0, "checks": 0, "version": 0}

    @property
    def version(self) -> int:
        """Number of versions opened so far (the current one when open)."""
        return self.stats["version"]

    @property
    def is_open(self) -> bool:
        """Whether a version is open."""
        return self._open

    @property
    def metadata(self) -> SequenceMetadata | None:
        """The metadata of the open version if already built, else ``None``."""
        return self._metadata

    def begin(self, source: Any = None) -> None:
        """Opens a new version for a batch, dropping anything cached before.

        Args:
            source: what to build from at the first ``get()``: a ``PackedBatch``, a ``SequenceMetadata``, a mapping or
                object holding ``cu_seqlens`` (with ``max_seqlen``, ideally ``cu_seqlens_cpu``) or ``position_ids``,
                a tuple/list containing one of those, or ``None`` (build from the ``position_ids`` given to ``get``).

        Example::

            cache.begin(batch); out = model(batch.input_ids); cache.end()
        """
        if isinstance(source, (tuple, list)):
            source = next((item for item in source if _has_source_fields(item)), None)
        self._source = source
        self._metadata = None
        self.stats["version"] += 1
        stack = _stack()
        if self in stack:
            stack.remove(self)
        stack.append(self)
        self._open = True

    def end(self) -> None:
        """Closes the open version: the metadata and its source are dropped and the cache leaves the active stack.

        Example::

            cache.end()
        """
        self._source = None
        self._metadata = None
        self._open = False
        stack = _stack()
        if self in stack:
            stack.remove(self)

    @contextmanager
    def batch(self, source: Any = None) -> Iterator[SequenceMetadataCache]:
        """Context-manager form of ``begin``/``end`` for plain PyTorch loops.

        Args:
            source: as for :meth:`begin`.

        Yields:
            This cache, open for the batch.

        Example::

            with cache.batch(batch):
                model(batch.input_ids).sum().backward()
        """
        self.begin(source)
        try:
            yield self
        finally:
            self.end()

    def get(
        self, hidden: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None, check: bool = True
    ) -> SequenceMetadata:
        """Returns the open version's metadata, building it at the first call and reusing it afterwards.

        Args:
            hidden: the caller's hidden states ``(..., hidden_dim)``; their token count must equal the metadata's
                ``num_tokens``, and the metadata is placed on their device.
            position_ids: ``(num_tokens,)`` or ``(batch, seq_len)`` positions, used to build when the version's source
                holds nothing to build from (this path syncs once on an accelerator).
            check: compare ``hidden``'s token count with the metadata (host-side shape arithmetic, no sync).

        Returns:
            The version's metadata.

        Raises:
            MetadataError: no open version, nothing to build from, or a token-count mismatch (stale metadata).

        Example::

            meta = active_cache().get(hidden)
        """
        if not self._open:
            raise MetadataError("cache: no open version; call begin(batch) (or use `with cache.batch(batch):`) first")
        meta = self._metadata
        built = meta is None
        if meta is None:
            meta = self._build(hidden, position_ids)
        if hidden is not None:
            if check:
                self._check(meta, hidden)
            if meta.device != hidden.device:
                meta = meta.to(hidden.device)
        # Counted only once checked: a rejected call neither caches nor counts as a reuse.
        self.stats["builds" if built else "hits"] += 1
        self._metadata = meta
        return meta

    def check(self, hidden: torch.Tensor) -> None:
        """Checks ``hidden`` against the open version's metadata without building (host-side, no sync).

        Args:
            hidden: ``(..., hidden_dim)`` hidden states of a layer.

        Raises:
            MetadataError: the token count differs from the metadata's, or nothing is built yet.

        Example::

            cache.check(hidden)  # in a forward pre-hook of every layer
        """
        if not self._open or self._metadata is None:
            raise MetadataError("cache: no metadata built for this batch yet; the first layer must call get() first")
        self._check(self._metadata, hidden)

    def _check(self, meta: SequenceMetadata, hidden: torch.Tensor) -> None:
        self.stats["checks"] += 1
        count = _token_count(hidden)
        if count != meta.num_tokens:
            raise MetadataError(
                f"hidden: holds {count} tokens (shape {tuple(hidden.shape)}) but the cached metadata of version "
                f"{self.version} describes {meta.num_tokens}; the layer was called with another batch than the one "
                "the cache was opened for (call begin() for each batch)"
            )

    def _build(self, hidden: torch.Tensor | None, position_ids: torch.Tensor | None) -> SequenceMetadata:
        source = self._source
        if source is not None:
            meta = SequenceMetadata.from_batch(source)
        elif position_ids is not None:
            meta = SequenceMetadata.from_position_ids(position_ids)
        else:
            raise MetadataError(
                "cache: nothing to build metadata from; pass a batch with cu_seqlens or position_ids to begin(), "
                "or position_ids to get()"
            )
        if hidden is not None and meta.device != hidden.device:
            meta = meta.to(hidden.device)
        return meta
