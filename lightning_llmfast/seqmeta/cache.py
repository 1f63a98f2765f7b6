"""Per-batch cache of :class:`SequenceMetadata`: built at the first layer, reused by every later one.

A cache has *versions*: ``begin(source)`` opens one for a batch, ``end()`` closes it. Inside a version the first
``get()`` builds the metadata (from the source, or from the position ids the first layer sees) and every later
``get()`` returns the same object, after checking that the caller's hidden states have its token count. Nothing
survives ``end()``.

The metadata is *bound* to the tensors it describes, with host integers only (tensor identity and version
counter, never a device read):

- the token ids of every forward are announced with :meth:`SequenceMetadataCache.bind` (the hooks that
  :meth:`~SequenceMetadataCache.watch` puts on a model's input embeddings do it, and so does
  :func:`~lightning_llmfast.packed_model_inputs`). A forward on any other token tensor than the batch's (a second
  batch of the same shape inside one version: a teacher, a contrastive pair, an edited copy) gets metadata rebuilt
  for it (from the batch passed to ``bind``, or the position ids its first layer sees), or ``MetadataError`` when
  there is nothing to rebuild from; it never gets the first batch's boundaries;
- the fields the metadata was built from (``cu_seqlens``, ``cu_seqlens_cpu``, ``position_ids``) are watched for
  in-place edits: an edited batch is checked again (``PackedBatch.validate``, ``MetadataError`` when its fields now
  disagree) and its metadata rebuilt.

The cache with an open version in the current thread is reachable through :func:`active_cache`, so model layers
need no extra argument: ``meta = metadata if metadata is not None else active_cache().get(hidden)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_llmfast.errors import MetadataError
from lightning_llmfast.seqmeta.consistency import tensor_version
from lightning_llmfast.seqmeta.metadata import SequenceMetadata, _field

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


_SOURCE_FIELDS = ("cu_seqlens", "cu_seq_lens_q", "position_ids")
_GUARDED_FIELDS = ("cu_seqlens", "cu_seqlens_cpu", "cu_seq_lens_q", "position_ids")


def _has_source_fields(obj: Any) -> bool:
    return isinstance(obj, SequenceMetadata) or any(_field(obj, name) is not None for name in _SOURCE_FIELDS)


def _token_count(hidden: torch.Tensor) -> int:
    # Host-side shape arithmetic only: (..., hidden_dim) -> number of token positions.
    if hidden.dim() == 0:
        raise MetadataError("hidden: must have at least one dimension (..., hidden_dim), got a scalar")
    return hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0


def _same_or_none(a: Any, b: Any) -> bool:
    # Identity, never ==: a dataclass batch compares its tensors element-wise.
    return a is None or b is None or a is b


class _Binding:
    """The metadata of one token tensor: what it is built from, and the tensors whose edits invalidate it."""

    __slots__ = ("guarded", "meta", "source", "tokens", "tokens_version", "versions")

    def __init__(self, source: Any, tokens: Tensor | None) -> None:
        self.source = source
        self.tokens = tokens
        self.tokens_version = tensor_version(tokens) if tokens is not None else 0
        self.meta: SequenceMetadata | None = None
        self.guarded: list[Tensor] = []
        self.versions: list[int] = []

    def matches(self, tokens: Tensor) -> bool:
        return tokens is self.tokens and tensor_version(tokens) == self.tokens_version

    def set_meta(self, meta: SequenceMetadata, used: Sequence[Any]) -> None:
        self.meta = meta
        self.guarded = [t for t in used if isinstance(t, Tensor)]
        self.versions = [t._version for t in self.guarded]

    def edited(self) -> bool:
        # Host ints only: each in-place op on a guarded tensor bumps its version counter.
        return self.meta is not None and [t._version for t in self.guarded] != self.versions


class SequenceMetadataCache:
    """Builds a batch's :class:`SequenceMetadata` once and hands the same object to every layer.

    Attributes:
        stats: host-int counters since construction: ``builds`` (metadata built, rebuilds included), ``hits``
            (lookups served from the cache), ``reads`` (lookups by consumers: layers, ``packed_model_inputs``; the
            callback's own first-layer build is not one), ``rebinds`` (forwards on another token tensor than the
            batch's), ``checks`` and ``version``.

    Example::

        cache = SequenceMetadataCache()
        handles = cache.watch(model)  # binds every forward's token ids
        for batch in loader:
            with cache.batch(batch):
                loss = model(batch.input_ids, batch.position_ids)  # layers call active_cache().get(hidden)
                loss.backward()
    """

    def __init__(self) -> None:
        self._main = _Binding(None, None)
        self._foreign: _Binding | None = None
        self._open = False
        self.stats: dict[str, int] = {"builds": 0, "hits": 0, "reads": 0, "rebinds": 0, "checks": 0, "version": 0}

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
        """The metadata of the current forward's tokens if already built, else ``None``."""
        return self._binding().meta

    def _binding(self) -> _Binding:
        return self._foreign if self._foreign is not None else self._main

    def begin(self, source: Any = None) -> None:
        """Opens a new version for a batch, dropping anything cached before.

        Args:
            source: what to build from at the first ``get()``: a ``PackedBatch``, a ``SequenceMetadata``, a mapping or
                object holding ``cu_seqlens`` (with ``max_seqlen``, ideally ``cu_seqlens_cpu``), transformers'
                ``cu_seq_lens_q`` or ``position_ids``, a tuple/list containing one of those, or ``None`` (build from
                the ``position_ids`` given to ``get``). Its ``input_ids``, when it has them, are the tokens the
                version is bound to; otherwise the first :meth:`bind` names them.

        Example::

            cache.begin(batch); out = model(batch.input_ids); cache.end()
        """
        if isinstance(source, (tuple, list)):
            source = next((item for item in source if _has_source_fields(item)), None)
        tokens = _field(source, "input_ids") if source is not None else None
        self._main = _Binding(source, tokens if isinstance(tokens, Tensor) else None)
        self._foreign = None
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
        self._main = _Binding(None, None)
        self._foreign = None
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

    def bind(self, tokens: Tensor, *, source: Any = None) -> None:
        """Announces the token ids of the forward that is starting; later lookups serve metadata for them.

        The batch's own ``input_ids`` (same tensor, unedited) select the version's metadata. Any other tensor
        starts a separate binding, rebuilt from ``source`` when given (its host fields: no sync) or else from the
        position ids the first layer passes to :meth:`get`. Only host integers are compared.

        Args:
            tokens: the forward's ``input_ids``.
            source: a batch (``PackedBatch`` or mapping) describing ``tokens``, to build from.

        Raises:
            MetadataError: no open version, or ``tokens`` is not a tensor.

        Example::

            cache.bind(teacher_batch.input_ids, source=teacher_batch)
        """
        if not self._open:
            raise MetadataError("cache: no open version; call begin(batch) (or use `with cache.batch(batch):`) first")
        if not isinstance(tokens, Tensor):
            raise MetadataError(f"tokens: must be the forward's input_ids tensor, got {type(tokens).__name__}")
        main = self._main
        if main.tokens is None and self._foreign is None and _same_or_none(source, main.source):
            # The version's source named no tokens: the first forward's are the batch's.
            main.tokens, main.tokens_version = tokens, tensor_version(tokens)
            main.source = main.source if source is None else source
        if main.matches(tokens):
            self._foreign = None
            return
        foreign = self._foreign
        if foreign is not None and foreign.matches(tokens) and (source is None or source is foreign.source):
            return
        self._foreign = _Binding(source, tokens)
        self.stats["rebinds"] += 1

    def watch(self, module: nn.Module) -> list[RemovableHandle]:
        """Binds every forward of ``module``'s input embeddings to its token ids (forward pre-hooks).

        The input embeddings are those named by ``get_input_embeddings()`` of any submodule that has it (transformers
        models), else the first ``nn.Embedding`` of ``module``. A forward outside an open version is left alone.

        Args:
            module: the model (or the LightningModule holding it).

        Returns:
            The hook handles (``handle.remove()`` undoes them); empty when ``module`` holds no embedding.

        Example::

            handles = cache.watch(model)
        """
        embeddings: dict[int, nn.Module] = {}
        for sub in module.modules():
            get = getattr(sub, "get_input_embeddings", None)
            found = get() if callable(get) else None
            if isinstance(found, nn.Module):
                embeddings.setdefault(id(found), found)
        if not embeddings:
            first = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
            if first is not None:
                embeddings[id(first)] = first
        return [emb.register_forward_pre_hook(self._bind_hook) for emb in embeddings.values()]

    def _bind_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        tokens = args[0] if args else None
        if self._open and isinstance(tokens, Tensor) and not tokens.is_floating_point():
            self.bind(tokens)

    def get(
        self,
        hidden: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        check: bool = True,
        read: bool = True,
        device: torch.device | str | None = None,
    ) -> SequenceMetadata:
        """Returns the metadata of the current forward's tokens, building it at the first call and reusing it.

        Args:
            hidden: the caller's hidden states ``(..., hidden_dim)``; their token count must equal the metadata's
                ``num_tokens``, and the metadata is placed on their device.
            position_ids: ``(num_tokens,)`` or ``(batch, seq_len)`` positions, used to build when the binding's source
                holds nothing to build from (this path syncs once on an accelerator).
            check: compare ``hidden``'s token count with the metadata (host-side shape arithmetic, no sync).
            read: count this lookup in ``stats["reads"]`` (a consumer uses the metadata).
            device: where to place the metadata when ``hidden`` is not given.

        Returns:
            The metadata.

        Raises:
            MetadataError: no open version, nothing to build from, a token-count mismatch (stale metadata), or an
                in-place edit that made the batch's fields disagree.

        Example::

            meta = active_cache().get(hidden)
        """
        if not self._open:
            raise MetadataError("cache: no open version; call begin(batch) (or use `with cache.batch(batch):`) first")
        binding = self._foreign if self._foreign is not None else self._main
        if binding.edited():
            binding.meta = None  # a guarded field changed in place: build (and check the batch) again
        meta = binding.meta
        built = meta is None
        if meta is None:
            meta = self._build(binding, position_ids)
        if hidden is not None:
            if check:
                self._check(meta, hidden)
            if meta.device != hidden.device:
                meta = meta.to(hidden.device)
        elif device is not None and meta.device != torch.device(device):
            meta = meta.to(device)
        # Counted only once checked: a rejected call neither caches nor counts as a reuse.
        self.stats["builds" if built else "hits"] += 1
        self.stats["reads"] += int(read)
        if built:
            binding.set_meta(meta, binding.guarded)
        else:
            binding.meta = meta
        return meta

    def check(self, hidden: torch.Tensor) -> None:
        """Checks ``hidden`` against the current forward's metadata without building (host-side, no sync).

        Args:
            hidden: ``(..., hidden_dim)`` hidden states of a layer.

        Raises:
            MetadataError: the token count differs from the metadata's, or nothing is built yet.

        Example::

            cache.check(hidden)  # in a forward pre-hook of every layer
        """
        meta = self._binding().meta if self._open else None
        if meta is None:
            raise MetadataError("cache: no metadata built for this batch yet; the first layer must call get() first")
        self._check(meta, hidden)

    def _check(self, meta: SequenceMetadata, hidden: torch.Tensor) -> None:
        self.stats["checks"] += 1
        count = _token_count(hidden)
        if count != meta.num_tokens:
            raise MetadataError(
                f"hidden: holds {count} tokens (shape {tuple(hidden.shape)}) but the cached metadata of version "
                f"{self.version} describes {meta.num_tokens}; the layer was called with another batch than the one "
                "the cache was opened for (call begin() for each batch)"
            )

    def _build(self, binding: _Binding, position_ids: torch.Tensor | None) -> SequenceMetadata:
        source = binding.source
        if source is not None:
            meta = SequenceMetadata.from_batch(source)
            # A SequenceMetadata is immutable (and reading its position_ids would build them): nothing to guard.
            fields = () if isinstance(source, SequenceMetadata) else _GUARDED_FIELDS
            binding.guarded = [_field(source, name) for name in fields]
        elif position_ids is not None:
            meta = SequenceMetadata.from_position_ids(position_ids)
            binding.guarded = [position_ids]
        elif binding is self._foreign:
            raise MetadataError(
                "cache: this forward's input_ids are not the batch the cache version was opened for (another batch "
                "of the same shape, or an in-place edit) and nothing describes them: pass the batch to "
                "bind(tokens, source=batch) (packed_model_inputs does), or let position_ids reach the first layer"
            )
        else:
            raise MetadataError(
                "cache: nothing to build metadata from; pass a batch with cu_seqlens or position_ids to begin(), "
                "or position_ids to get()"
            )
        return meta
