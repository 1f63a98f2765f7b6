"""What a cached :class:`SequenceMetadata` is bound to: the token and position ids it describes, compared on the host.

A binding holds the tensors of one forward (its token ids, its position ids, the batch it is built from) and the
metadata built for them. Whether a later forward may reuse it is decided with host values only: tensor identity
and version counters (a host integer bumped by each in-place op), never a device read. Inference tensors (made under
``torch.inference_mode``, as Lightning's evaluation loops do) keep no version counter; outside inference mode they
cannot be edited in place, so their identity is their stamp.

Under ``torch.compile`` identity comparisons are not guarded by Dynamo (a compiled ``a is b`` is frozen at trace
time), so the cache also marks the token ids of its open version with an attribute naming the cache
(:func:`mark_tokens`): Dynamo guards that attribute, so a compiled forward on any other token tensor is traced again
and refused there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from lightning_llmfast.data.consistency import tensor_version
from lightning_llmfast.seqmeta.host import field
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = [
    "Binding",
    "has_source_fields",
    "input_embeddings",
    "mark_tokens",
    "marked_by",
    "same_or_none",
    "unmark_tokens",
]

_MARK = "_llmfast_seqmeta_cache"
_SOURCE_FIELDS = ("cu_seqlens", "cu_seq_lens_q", "position_ids")
_GUARDED_FIELDS = ("cu_seqlens", "cu_seqlens_cpu", "cu_seq_lens_q", "position_ids")


def same_or_none(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same object, or either is ``None`` (identity, never ``==``: a dataclass batch
    compares its tensors element-wise)."""
    return a is None or b is None or a is b


def input_embeddings(module: nn.Module) -> list[nn.Module]:
    """The input embeddings named by ``get_input_embeddings()`` of any submodule (transformers models), else the first
    ``nn.Embedding`` of ``module`` (or none)."""
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
    return list(embeddings.values())


def has_source_fields(obj: Any) -> bool:
    """Whether ``obj`` holds something metadata can be built from."""
    return isinstance(obj, SequenceMetadata) or any(field(obj, name) is not None for name in _SOURCE_FIELDS)


def mark_tokens(tokens: Tensor | None, cache: object) -> None:
    """Marks ``tokens`` as the token ids of ``cache``'s open version (a Python attribute Dynamo guards)."""
    if tokens is not None:
        setattr(tokens, _MARK, cache)


def unmark_tokens(tokens: Tensor | None, cache: object) -> None:
    """Removes ``cache``'s mark from ``tokens`` (another cache's mark stays)."""
    if tokens is not None and getattr(tokens, _MARK, None) is cache:
        delattr(tokens, _MARK)


def marked_by(tokens: Tensor) -> object:
    """The cache whose open version ``tokens`` belong to, or ``None``."""
    return getattr(tokens, _MARK, None)


class Binding:
    """The metadata of one forward's tokens: what it is built from, and the tensors whose edits invalidate it.

    Attributes:
        source: the batch to build from (``None``: build from ``positions``).
        tokens: the forward's token ids, or ``None`` until the first forward names them.
        positions: the position ids the metadata describes (the source's, or those it was built from), or ``None``.
        meta: the built metadata, or ``None``.
    """

    __slots__ = ("guarded", "meta", "positions", "source", "tokens", "tokens_version", "versions")

    def __init__(self, source: Any, tokens: Tensor | None, positions: Tensor | None = None) -> None:
        self.source = source
        self.tokens = tokens
        self.tokens_version = tensor_version(tokens) if tokens is not None else 0
        source_positions = field(source, "position_ids") if source is not None else None
        self.positions = source_positions if isinstance(source_positions, Tensor) else positions
        self.meta: SequenceMetadata | None = None
        self.guarded: list[Tensor] = []
        self.versions: list[int] = []

    def set_tokens(self, tokens: Tensor) -> None:
        self.tokens, self.tokens_version = tokens, tensor_version(tokens)

    def matches(self, tokens: Tensor, source: Any = None, positions: Tensor | None = None) -> bool:
        """Whether a forward on ``tokens`` (described by ``source``/``positions`` when given) may use this binding."""
        if tokens is not self.tokens or tensor_version(tokens) != self.tokens_version:
            return False
        return (source is None or source is self.source) and self.describes(positions)

    def describes(self, positions: Tensor | None) -> bool:
        """Whether ``positions`` are the tensor this binding's metadata describes (identity; ``None`` always is)."""
        return positions is None or self.positions is None or positions is self.positions

    def can_build(self) -> bool:
        return self.source is not None or self.positions is not None

    def build(self) -> SequenceMetadata:
        """Builds (and validates) the metadata from the source, or from the position ids."""
        if self.source is not None:
            meta = SequenceMetadata.from_batch(self.source)
            # A SequenceMetadata is immutable (and reading its position_ids would build them): nothing to guard.
            fields = () if isinstance(self.source, SequenceMetadata) else _GUARDED_FIELDS
            used: Sequence[Any] = [field(self.source, name) for name in fields]
        else:
            assert self.positions is not None
            meta = SequenceMetadata.from_position_ids(self.positions)
            used = [self.positions]
        self.guarded = [t for t in used if isinstance(t, Tensor)]
        self.versions = [tensor_version(t) for t in self.guarded]
        self.meta = meta
        return meta

    def edited(self) -> bool:
        """Whether a tensor the metadata was built from changed in place since (host ints only)."""
        return self.meta is not None and [tensor_version(t) for t in self.guarded] != self.versions
