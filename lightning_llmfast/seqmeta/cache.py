"""Per-batch cache of :class:`SequenceMetadata`: built once per batch, reused by every layer.

A cache has *versions*: ``begin(source)`` opens one for a batch and builds its metadata there (validated on the host,
outside any compiled region), ``end()`` closes it. Inside a version every ``get()`` returns the same object, after
checking that the caller's hidden states have its token count. Nothing survives ``end()``.

The metadata is *bound* to the tensors it describes, with host values only (tensor identity and version counters,
never a device read; see :mod:`lightning_llmfast.seqmeta.binding`):

- the token ids of every forward are announced with :meth:`SequenceMetadataCache.bind`: the package's models do it at
  the top of their ``forward``, :func:`~lightning_llmfast.packed_model_inputs` does it, and so do the hooks that
  :meth:`~SequenceMetadataCache.watch` (or ``batch(source, model=model)``) puts on a model's input embeddings. A
  forward on any other token tensor than the batch's (a second batch of the same shape inside one version: a teacher,
  a contrastive pair, an edited copy) gets metadata rebuilt for it (from the batch or position ids given to ``bind``,
  or the position ids its first layer passes to ``get``), or ``MetadataError`` when nothing describes it; it never
  gets the first batch's boundaries;
- a ``get(position_ids=...)`` whose position ids are not the tensor the metadata describes is rebuilt for them;
- the fields the metadata was built from (``cu_seqlens``, ``cu_seqlens_cpu``, ``position_ids``) are watched for
  in-place edits: an edited batch is checked again (``PackedBatch.validate``, ``MetadataError`` when its fields now
  disagree) and its metadata rebuilt.

Under ``torch.inference_mode`` (Lightning's validate, test and predict loops) tensors carry no version counter and
cannot be edited outside it: identity alone binds them. Under ``torch.compile`` lookups only read: the metadata was
built at ``begin``/``bind`` outside the compiled region, and a compiled ``bind`` accepts only the version's own token
ids, which Dynamo guards (a traced forward on any other tokens raises; in-place edits are seen by eager binds only).

The cache with an open version in the current thread is reachable through :func:`active_cache` (a per-thread stack,
innermost last, kept here beside the class it holds), so model layers need no extra argument:
``meta = metadata if metadata is not None else active_cache().get(hidden)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_llmfast.errors import MetadataError
from lightning_llmfast.seqmeta.binding import (
    Binding,
    has_source_fields,
    input_embeddings,
    mark_tokens,
    marked_by,
    same_or_none,
    unmark_tokens,
)
from lightning_llmfast.seqmeta.host import field
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["SequenceMetadataCache", "activate_cache", "active_cache"]

_NOT_OPEN = "cache: no open version; call begin(batch) (or use `with cache.batch(batch):`) first"
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


def _push(cache: SequenceMetadataCache) -> None:
    """Makes ``cache`` the innermost active cache of the current thread."""
    _remove(cache)
    _stack().append(cache)


def _remove(cache: SequenceMetadataCache) -> None:
    """Takes ``cache`` off the current thread's active stack (if it is there)."""
    stack = _stack()
    if cache in stack:
        stack.remove(cache)


def _token_count(hidden: torch.Tensor) -> int:
    # Host-side shape arithmetic only: (..., hidden_dim) -> number of token positions.
    if hidden.dim() == 0:
        raise MetadataError("hidden: must have at least one dimension (..., hidden_dim), got a scalar")
    return hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0


class SequenceMetadataCache:
    """Builds a batch's :class:`SequenceMetadata` once and hands the same object to every layer.

    Attributes:
        stats: host-int counters since construction: ``builds`` (metadata built, rebuilds included), ``hits``
            (lookups served from the cache), ``reads`` (lookups by consumers: layers, ``packed_model_inputs``; the
            callback's own first-layer lookup is not one), ``rebinds`` (forwards on another token or position tensor
            than the batch's), ``checks`` and ``version``.

    Example::

        cache = SequenceMetadataCache()
        for batch in loader:
            with cache.batch(batch, model=model):  # model: binds every forward's token ids for the version
                loss = model(batch.input_ids, batch.position_ids)  # layers call active_cache().get(hidden)
                loss.backward()
    """

    def __init__(self) -> None:
        self._main = Binding(None, None)
        self._foreign: Binding | None = None
        self._open = False
        self.stats: dict[str, int] = {"builds": 0, "hits": 0, "reads": 0, "rebinds": 0, "checks": 0, "version": 0}
        self._read_compiled = False

    def _count(self, name: str) -> None:
        if not torch.compiler.is_compiling():
            self.stats[name] += 1
        elif name == "reads":
            # A compiled increment would read the count, and Dynamo would guard on it (a recompilation per lookup);
            # storing a constant is replayed by every run of the compiled code without a guard.
            self._read_compiled = True

    @property
    def read_compiled(self) -> bool:
        """Whether a consumer looked the metadata up from compiled code in the open version (those lookups are not
        in ``stats``: counting them would make every compiled run recompile)."""
        return self._read_compiled

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

    def _binding(self) -> Binding:
        return self._foreign if self._foreign is not None else self._main

    def begin(self, source: Any = None) -> None:
        """Opens a new version for a batch, dropping anything cached before, and builds its metadata.

        Args:
            source: what to build from: a ``PackedBatch``, a ``SequenceMetadata``, a mapping or object holding
                ``cu_seqlens`` (with ``max_seqlen``, ideally ``cu_seqlens_cpu``), transformers' ``cu_seq_lens_q`` or
                ``position_ids``, a tuple/list containing one of those, or ``None`` (or a batch holding none of them:
                build from the ``position_ids`` given to ``bind`` or ``get``). Its ``input_ids``, when it has them,
                are the tokens the version is bound to; otherwise the first :meth:`bind` names them.

        Raises:
            MetadataError: the source's fields disagree (see ``PackedBatch.validate``); the version is not opened.

        Example::

            cache.begin(batch); out = model(batch.input_ids); cache.end()
        """
        if isinstance(source, (tuple, list)):
            source = next((item for item in source if has_source_fields(item)), None)
        tokens = field(source, "input_ids") if source is not None else None
        self._close()
        described = source if has_source_fields(source) else None
        binding = Binding(described, tokens if isinstance(tokens, Tensor) else None)
        self.stats["version"] += 1
        self._read_compiled = False
        if binding.can_build():
            self._build(binding)
        self._main = binding
        mark_tokens(binding.tokens, self)
        _push(self)
        self._open = True

    def end(self) -> None:
        """Closes the open version: the metadata and its source are dropped and the cache leaves the active stack.

        Example::

            cache.end()
        """
        self._close()

    def _close(self) -> None:
        unmark_tokens(self._main.tokens, self)
        self._main = Binding(None, None)
        self._foreign = None
        self._open = False
        _remove(self)

    @contextmanager
    def batch(self, source: Any = None, model: nn.Module | None = None) -> Iterator[SequenceMetadataCache]:
        """Context-manager form of ``begin``/``end`` for plain PyTorch loops.

        Args:
            source: as for :meth:`begin`.
            model: a model whose forwards are bound to their token ids for the version (:meth:`watch`, undone at the
                end); the package's own models bind themselves and need not be given.

        Yields:
            This cache, open for the batch.

        Example::

            with cache.batch(batch, model=model):
                model(batch.input_ids).sum().backward()
        """
        handles = self.watch(model) if model is not None else []
        try:
            self.begin(source)
            yield self
        finally:
            self.end()
            for handle in handles:
                handle.remove()

    def bind(self, tokens: Tensor, *, source: Any = None, position_ids: Tensor | None = None) -> None:
        """Announces the token ids of the forward that is starting; later lookups serve metadata for them.

        The batch's own ``input_ids`` (same tensor, unedited, and the batch's own position ids when given) select the
        version's metadata. Any other tensor starts a separate binding, built here from ``source`` (its host fields:
        no sync) or ``position_ids`` (one sync on an accelerator) when given, else from the position ids the first
        layer passes to :meth:`get`. Only host values are compared. Under ``torch.compile`` only the version's own
        token ids are accepted (a guarded check; nothing is built in a compiled region).

        Args:
            tokens: the forward's ``input_ids``.
            source: a batch (``PackedBatch`` or mapping) describing ``tokens``, to build from.
            position_ids: the forward's position ids, to build from when nothing else describes ``tokens``.

        Raises:
            MetadataError: no open version, ``tokens`` is not a tensor, or the fields to build from disagree.

        Example::

            cache.bind(teacher_batch.input_ids, source=teacher_batch)
        """
        if not self._open:
            raise MetadataError(_NOT_OPEN)
        if not isinstance(tokens, Tensor):
            raise MetadataError(f"tokens: must be the forward's input_ids tensor, got {type(tokens).__name__}")
        if torch.compiler.is_compiling():
            self._bind_traced(tokens)
            return
        main = self._main
        if main.tokens is None and self._foreign is None and same_or_none(source, main.source):
            # The version's source named no tokens: the first forward's are the batch's.
            if main.source is None and source is not None:
                main = self._main = Binding(source, None)
            main.set_tokens(tokens)
            mark_tokens(tokens, self)
        foreign = self._foreign
        if main.matches(tokens, source, position_ids):
            binding, self._foreign = main, None
        elif foreign is not None and foreign.matches(tokens, source, position_ids):
            binding = foreign
        else:
            binding = self._foreign = Binding(source, tokens, position_ids)
            self.stats["rebinds"] += 1
        self._refresh(binding, position_ids)
        if binding.meta is None and binding.can_build():
            self._build(binding)

    def _bind_traced(self, tokens: Tensor) -> None:
        # Dynamo guards the mark (an attribute of the token tensor), not tensor identity: another tensor retraces here.
        if marked_by(tokens) is not self:
            raise MetadataError(
                "cache: under torch.compile a forward may only run on the token ids of the open version (the batch "
                "given to begin(), or the tokens first bound outside the compiled region); bind other batches "
                "eagerly with bind(tokens, source=batch) or compile per layer"
            )
        if self._foreign is not None:
            self._foreign = None

    def _refresh(self, binding: Binding, position_ids: Tensor | None) -> None:
        """Drops metadata whose fields were edited in place and adopts ``position_ids`` when nothing else describes
        the binding."""
        if binding.edited():
            binding.meta = None  # a guarded field changed in place: build (and check the batch) again
        if binding.meta is None and binding.positions is None and position_ids is not None:
            binding.positions = position_ids

    def _build(self, binding: Binding) -> SequenceMetadata:
        meta = binding.build()
        self.stats["builds"] += 1
        return meta

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
        return [emb.register_forward_pre_hook(self._bind_hook) for emb in input_embeddings(module)]

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
        """Returns the metadata of the current forward's tokens (built at ``begin``/``bind``, or at the first call).

        Args:
            hidden: the caller's hidden states ``(..., hidden_dim)``; their token count must equal the metadata's
                ``num_tokens``, and the metadata is placed on their device.
            position_ids: ``(num_tokens,)`` or ``(batch, seq_len)`` positions of the caller. Not the tensor the
                metadata describes: it is rebuilt for them. Used to build when nothing else describes the tokens
                (this path syncs once on an accelerator).
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
            raise MetadataError(_NOT_OPEN)
        binding = self._binding() if torch.compiler.is_compiling() else self._lookup(position_ids)
        built = binding.meta is None
        meta = self._build(self._buildable(binding)) if built else binding.meta
        assert meta is not None
        if hidden is not None:
            if check:
                self._check(meta, hidden)
            if meta.device != hidden.device:
                meta = binding.meta = meta.to(hidden.device)
        elif device is not None and meta.device != torch.device(device):
            meta = binding.meta = meta.to(device)
        if not built:
            self._count("hits")
        if read:
            self._count("reads")
        return meta

    def _lookup(self, position_ids: Tensor | None) -> Binding:
        binding = self._binding()
        if position_ids is not None and not binding.describes(position_ids):
            # Not the position ids the metadata describes (identity, host only): rebuilt for them.
            binding = self._foreign = Binding(None, binding.tokens, position_ids)
            self.stats["rebinds"] += 1
        self._refresh(binding, position_ids)
        return binding

    def _buildable(self, binding: Binding) -> Binding:
        if binding.can_build():
            if torch.compiler.is_compiling():
                raise MetadataError(
                    "cache: the metadata is not built; under torch.compile it must be built outside the compiled "
                    "region: open the version with a batch that describes it (begin(batch)) or bind the tokens first"
                )
            return binding
        if binding is self._foreign:
            raise MetadataError(
                "cache: this forward's input_ids are not the batch the cache version was opened for (another batch "
                "of the same shape, or an in-place edit) and nothing describes them: pass the batch to "
                "bind(tokens, source=batch) (packed_model_inputs does), or let position_ids reach the first layer"
            )
        raise MetadataError(
            "cache: nothing to build metadata from; pass a batch with cu_seqlens or position_ids to begin(), "
            "or position_ids to get()"
        )

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
        self._count("checks")
        count = _token_count(hidden)
        if count != meta.num_tokens:
            raise MetadataError(
                f"hidden: holds {count} tokens (shape {tuple(hidden.shape)}) but the cached metadata of version "
                f"{self.version} describes {meta.num_tokens}; the layer was called with another batch than the one "
                "the cache was opened for (call begin() for each batch)"
            )
