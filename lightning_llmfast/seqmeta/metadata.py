"""Validated, immutable packed-sequence metadata (``cu_seqlens``, ``max_seqlen`` and what derives from them).

All validation and every shape-deciding value (``num_tokens``, ``max_seqlen``, the document lengths) is computed on
the host from a CPU copy of ``cu_seqlens``, with NumPy, so building a :class:`SequenceMetadata` from a batch whose
collator already produced ``cu_seqlens`` on the CPU never waits for the device. Per-token tensors
(``position_ids``, ``document_ids``) are derived on the target device with sync-free ops, lazily and once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_llmfast.data.batch import PackedBatch
from lightning_llmfast.data.context import ContextShard
from lightning_llmfast.errors import MetadataError
from lightning_llmfast.seqmeta.host import (
    INTEGER_DTYPES,
    field,
    first_index,
    host_int_array,
    same_device,
    validate_cu_seqlens,
)

__all__ = ["SequenceMetadata"]


class SequenceMetadata:
    """Boundaries of the sequences packed into a flattened batch of ``num_tokens`` positions; immutable.

    Build it with one of the ``from_*`` constructors. Everything the host needs (``num_tokens``, ``max_seqlen``,
    ``num_sequences``, the per-sequence lengths and the ``fingerprint``) comes from ``cu_seqlens_cpu`` and never
    reads the device. Per-token tensors and attention masks are built lazily on the target device and memoised,
    so every layer that receives the same object shares them.

    Attributes:
        cu_seqlens: ``(num_sequences + 1,)`` int32 on the target device.
        cu_seqlens_cpu: ``(num_sequences + 1,)`` int32 on the CPU (pinned when this object copies it to CUDA).
        max_seqlen: the longest sequence length (or the caller's upper bound), a Python int.
        num_tokens: ``cu_seqlens[-1]``, the number of flattened positions (padding segments included).
        num_sequences: number of sequences (segments), a Python int.

    Example::

        meta = SequenceMetadata.from_lengths([3, 1, 4])
        meta.cu_seqlens          # tensor([0, 3, 4, 8], dtype=torch.int32)
        meta.position_ids        # tensor([0, 1, 2, 0, 0, 1, 2, 3])
        meta.max_seqlen, meta.num_tokens, meta.num_sequences  # (4, 8, 3)
    """

    __slots__ = (
        "_context",
        "_cu_cpu",
        "_cu_device",
        "_device",
        "_lengths",
        "_max_seqlen",
        "_memo",
        "_num_tokens",
        "_starts",
    )

    def __init__(
        self,
        cu_seqlens: torch.Tensor | Sequence[int] | np.ndarray,
        *,
        num_tokens: int | None = None,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
        device_cu_seqlens: torch.Tensor | None = None,
        context: ContextShard | None = None,
    ) -> None:
        """Validates ``cu_seqlens`` on the host and places a copy on ``device``.

        Prefer the ``from_*`` constructors; this is their common core.

        Args:
            cu_seqlens: ``(num_sequences + 1,)`` integer boundaries; a CPU tensor or a Python sequence keeps the host
                free of syncs, an accelerator tensor is copied to the host once (a sync).
            num_tokens: expected ``cu_seqlens[-1]``, checked when given.
            max_seqlen: upper bound of the sequence lengths, checked when given (defaults to the true maximum).
            device: target device (defaults to the device of ``cu_seqlens`` when it is a tensor, else CPU).
            device_cu_seqlens: an existing copy of the same boundaries already on ``device`` (e.g. the batch's),
                reused instead of copying again. It is trusted: checking it would read the device.
            context: a context-parallel shard's plan (``PackedBatch.context``): the sequences are then the rank's
                query pieces, each attending its document's keys up to its end (see :attr:`context`).
        """
        if isinstance(cu_seqlens, torch.Tensor) and device is None:
            device = cu_seqlens.device
        target = torch.device(device) if device is not None else torch.device("cpu")
        host = host_int_array(cu_seqlens, "cu_seqlens")
        true_max = validate_cu_seqlens(host, num_tokens, max_seqlen)
        cu_cpu = torch.from_numpy(host.astype(np.int32))
        if target.type == "cuda" and device_cu_seqlens is None and torch.cuda.is_available():
            # Pinned so that the host-to-device copy below (and any later .to()) is truly asynchronous.
            cu_cpu = cu_cpu.pin_memory()
        if device_cu_seqlens is not None:
            cu_dev = device_cu_seqlens.to(device=target, dtype=torch.int32, non_blocking=True)
        else:
            cu_dev = cu_cpu if target.type == "cpu" else cu_cpu.to(target, non_blocking=True)
        self._cu_cpu = cu_cpu
        self._cu_device = cu_dev
        self._device = target
        self._max_seqlen = int(max_seqlen) if max_seqlen is not None else true_max
        # Host-side copies used to plan attention (per-document slices, length buckets) without the device.
        self._starts: tuple[int, ...] = tuple(int(s) for s in host[:-1])
        self._lengths: tuple[int, ...] = tuple(int(n) for n in np.diff(host))
        # One int, not derived from the tuples above: torch.compile guards on what it reads, and reading the tuples
        # would specialise a compiled graph on every boundary of the batch.
        self._num_tokens = int(host[-1])
        if context is not None and (
            not isinstance(context, ContextShard)
            or context.positions.numel() != self._num_tokens
            or context.cu_seqlens_k.numel() != host.size
        ):
            raise MetadataError(
                f"context: must be the ContextShard of these {host.size - 1} pieces over {self._num_tokens} positions "
                f"(PackedBatch.context_shard builds both), got {context!r}"
            )
        self._context = context
        self._memo: dict[Any, Any] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(
        cls, lengths: torch.Tensor | Sequence[int] | np.ndarray, *, device: torch.device | str | None = None
    ) -> SequenceMetadata:
        """Builds metadata from per-sequence lengths.

        Args:
            lengths: ``(num_sequences,)`` non-negative integers (a tensor on an accelerator is read once: a sync).
            device: target device of ``cu_seqlens`` and the lazily built tensors (default: CPU).

        Returns:
            The validated metadata.

        Example::

            meta = SequenceMetadata.from_lengths(torch.tensor([5, 2]), device="cuda")
        """
        host = host_int_array(lengths, "lengths")
        negative = host < 0
        if negative.any():
            i = first_index(negative)
            raise MetadataError(f"lengths: must be non-negative; first offending index {i} (value {int(host[i])})")
        cu = np.zeros(host.size + 1, dtype=np.int64)
        np.cumsum(host, out=cu[1:])
        return cls(cu, device=device)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor | Sequence[int] | np.ndarray,
        *,
        num_tokens: int | None = None,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> SequenceMetadata:
        """Builds metadata from cumulative sequence lengths.

        Args:
            cu_seqlens: ``(num_sequences + 1,)`` integers starting at 0. When it lives on an accelerator it is copied
                to the host once to be validated (a sync) and reused as the device copy.
            num_tokens: expected ``cu_seqlens[-1]``, checked when given.
            max_seqlen: upper bound of the lengths, checked when given.
            device: target device (default: the device of ``cu_seqlens``, or CPU for Python sequences).

        Returns:
            The validated metadata.

        Example::

            meta = SequenceMetadata.from_cu_seqlens([0, 3, 8], num_tokens=8, max_seqlen=5)
        """
        reuse = None
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
            reuse = cu_seqlens
        return cls(cu_seqlens, num_tokens=num_tokens, max_seqlen=max_seqlen, device=device, device_cu_seqlens=reuse)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> SequenceMetadata:
        """Builds metadata from per-token positions: a sequence starts wherever the position is the smallest one
        (0, or a constant start offset such as RoBERTa's 2) and at every row.

        If ``position_ids`` lives on an accelerator, this path syncs once (one device-to-host copy of the positions),
        which is why the collator's ``cu_seqlens`` is preferred; it is still once per batch, not once per layer.

        Args:
            position_ids: ``(num_tokens,)`` or ``(batch, seq_len)`` integer positions, counting up by one inside each
                sequence from a common start value. The metadata is placed on their device; its own
                :attr:`position_ids` count from 0.

        Returns:
            The validated metadata over the ``batch * seq_len`` flattened positions.

        Example::

            meta = SequenceMetadata.from_position_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
            meta.cu_seqlens  # tensor([0, 3, 5, 7, 10], dtype=torch.int32)
        """
        if not isinstance(position_ids, torch.Tensor):
            raise MetadataError(f"position_ids: must be a tensor, got {type(position_ids).__name__}")
        if position_ids.dtype not in INTEGER_DTYPES:
            raise MetadataError(f"position_ids: must have an integer dtype, got {position_ids.dtype}")
        if position_ids.device.type == "meta":
            raise MetadataError("position_ids: a meta-device tensor holds no positions to read boundaries from")
        if position_ids.dim() not in (1, 2):
            raise MetadataError(f"position_ids: must be 1-D or [batch, seq_len], got shape {tuple(position_ids.shape)}")
        row_len = position_ids.shape[-1]
        # NOTE: host sync when the positions live on an accelerator (one copy per batch, documented above).
        flat = position_ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        negative = flat < 0
        if negative.any():
            i = first_index(negative)
            raise MetadataError(f"position_ids: must be non-negative; first offending index {i} (value {int(flat[i])})")
        # A constant start offset (every sequence counting from the same value) marks its starts as 0 would.
        offset = int(flat.min()) if flat.size else 0
        starts = flat == offset
        if row_len > 0:
            starts[::row_len] = True
        # Inside a sequence the position must count up by one, or boundaries would be silently misread.
        broken = ~starts[1:] & (flat[1:] != flat[:-1] + 1)
        if broken.any():
            i = first_index(broken) + 1
            raise MetadataError(
                f"position_ids: must restart at {offset} or count up by one; first offending flat index {i} "
                f"(value {int(flat[i])} after {int(flat[i - 1])})"
            )
        cu = np.append(np.flatnonzero(starts), flat.size).astype(np.int64)
        if flat.size == 0:
            cu = np.zeros(1, dtype=np.int64)
        return cls(cu, num_tokens=int(flat.size), device=position_ids.device)

    @classmethod
    def from_batch(cls, batch: Any) -> SequenceMetadata:
        """Builds metadata from a ``PackedBatch`` or any mapping/object with ``cu_seqlens`` or ``position_ids``.

        ``cu_seqlens_cpu`` (the collator's host copy) is used when present, so no device value is read; the batch's
        ``max_seqlen`` is checked and kept. transformers' names (``cu_seq_lens_q`` and ``max_length_q``, as
        ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` returns them) stand for ``cu_seqlens`` and
        ``max_seqlen``. A ``PackedBatch`` is first checked with :meth:`PackedBatch.validate` (once per batch).
        The metadata's ``num_tokens`` is ``cu_seqlens[-1]``, the number of flattened positions (``B * T``); a
        ``PackedBatch``'s own ``num_tokens`` counts real tokens only and is a different quantity.

        Args:
            batch: a ``PackedBatch``, a ``SequenceMetadata`` (returned as is), or a mapping/object holding
                ``cu_seqlens`` (optionally ``cu_seqlens_cpu`` and ``max_seqlen``), ``cu_seq_lens_q`` (optionally
                ``max_length_q``) or ``position_ids``.

        Returns:
            The validated metadata, on the device of the batch's ``cu_seqlens`` (or ``position_ids``).

        Example::

            for batch in pack_documents(docs, seq_len=256, batch_size=8):
                meta = SequenceMetadata.from_batch(batch)
        """
        if isinstance(batch, SequenceMetadata):
            return batch
        if isinstance(batch, PackedBatch):
            batch.validate()
        cu, max_seqlen = field(batch, "cu_seqlens"), field(batch, "max_seqlen")
        if cu is None:
            cu, max_seqlen = field(batch, "cu_seq_lens_q"), field(batch, "max_length_q")
        if cu is not None:
            cu_cpu = field(batch, "cu_seqlens_cpu")
            if isinstance(max_seqlen, torch.Tensor):
                raise MetadataError("max_seqlen: must be a Python int computed on the host, got a tensor")
            if cu_cpu is not None or not isinstance(cu, torch.Tensor):
                device = cu.device if isinstance(cu, torch.Tensor) else None
                reuse = cu if isinstance(cu, torch.Tensor) and cu.device.type != "cpu" else None
                host = cu_cpu if cu_cpu is not None else cu
                context = field(batch, "context")
                return cls(host, max_seqlen=max_seqlen, device=device, device_cu_seqlens=reuse, context=context)
            return cls.from_cu_seqlens(cu, max_seqlen=max_seqlen)
        position_ids = field(batch, "position_ids")
        if position_ids is not None:
            return cls.from_position_ids(position_ids)
        raise MetadataError(
            f"batch: a {type(batch).__name__} holds neither cu_seqlens nor position_ids to build metadata from"
        )

    # ------------------------------------------------------------------ attributes
    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``(num_sequences + 1,)`` int32 boundaries on the target device."""
        return self._cu_device

    @property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        """``(num_sequences + 1,)`` int32 boundaries on the CPU."""
        return self._cu_cpu

    @property
    def context(self) -> ContextShard | None:
        """The context-parallel shard this metadata describes, or ``None``.

        With a shard, the sequences are the rank's *pieces* (``cu_seqlens`` is ``cu_seqlens_q``): piece ``j`` starts
        ``context.offsets[j]`` positions into its document and attends the keys ``context.cu_seqlens_k`` ranges over
        (its document from the start up to the piece's end), which ``varlen_attention`` all-gathers over
        ``context.group``; :attr:`position_ids` are the places inside the documents.
        """
        return self._context

    @property
    def device(self) -> torch.device:
        """The target device of ``cu_seqlens`` and of the lazily built tensors."""
        return self._device

    @property
    def max_seqlen(self) -> int:
        """The longest sequence length (or the caller's upper bound)."""
        return self._max_seqlen

    @property
    def num_tokens(self) -> int:
        """Number of flattened positions, ``cu_seqlens[-1]``."""
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        """Number of sequences (segments), empty ones included."""
        return len(self._lengths)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Per-sequence lengths as host ints, ``(num_sequences,)``."""
        return self._lengths

    @property
    def starts(self) -> tuple[int, ...]:
        """Per-sequence first flattened position as host ints, ``(num_sequences,)``."""
        return self._starts

    @property
    def fingerprint(self) -> tuple[int, int, int, bytes]:
        """Hashable identity from host values only: ``(num_tokens, num_sequences, max_seqlen, boundary bytes)``."""
        fp = self._memo.get("fingerprint")
        if fp is None:
            fp = (self.num_tokens, self.num_sequences, self._max_seqlen, self._cu_cpu.numpy().tobytes())
            self._memo["fingerprint"] = fp
        return fp

    @property
    def document_ids(self) -> torch.Tensor:
        """``(num_tokens,)`` int64 index of the sequence each position belongs to, on the target device; memoised."""
        ids = self._memo.get("document_ids")
        if ids is None:
            positions = torch.arange(self.num_tokens, device=self._device, dtype=torch.int32)
            # searchsorted over the upper boundaries skips empty sequences and reads nothing back to the host.
            ids = torch.searchsorted(self._cu_device[1:], positions, right=True)
            self._memo["document_ids"] = ids
        return ids

    @property
    def position_ids(self) -> torch.Tensor:
        """``(num_tokens,)`` int64 position of each token inside its sequence (inside its document for a
        context-parallel shard), on the target device; memoised."""
        pos = self._memo.get("position_ids")
        if pos is None:
            positions = torch.arange(self.num_tokens, device=self._device, dtype=torch.int64)
            starts = self._cu_device.to(torch.int64)
            if self._context is not None:
                # A piece's first position is context.offsets[j] into its document, not 0.
                offsets = self._context.offsets.to(self._device, non_blocking=True)
                starts = starts[:-1] - offsets
            pos = positions - starts[self.document_ids]
            self._memo["position_ids"] = pos
        return pos

    def memo(self, key: Any, build: Any) -> Any:
        """Returns the value memoised under ``key``, building it with ``build()`` on first use.

        Derived structures (masks, gather plans) live here so every layer sharing this metadata builds them once.

        Args:
            key: any hashable key.
            build: a zero-argument callable.

        Returns:
            The memoised value.

        Example::

            mask = meta.memo(("my_mask", 128), lambda: build_mask(meta, 128))
        """
        value = self._memo.get(key)
        if value is None:
            value = build()
            self._memo[key] = value
        return value

    def to(self, device: torch.device | str) -> SequenceMetadata:
        """Returns this metadata on ``device``, copying ``cu_seqlens`` non-blocking from (pinned) host memory.

        Args:
            device: the new target device.

        Returns:
            ``self`` when already there, else a new metadata sharing the host copy (memoised tensors are rebuilt
            lazily on the new device).

        Example::

            meta = SequenceMetadata.from_lengths([4, 4]).to("cuda")
        """
        target = torch.device(device)
        if same_device(target, self._device):
            return self
        new = object.__new__(SequenceMetadata)
        cu_cpu = self._cu_cpu
        if target.type == "cuda" and not cu_cpu.is_pinned():
            cu_cpu = cu_cpu.pin_memory()
        new._cu_cpu = cu_cpu
        new._cu_device = cu_cpu if target.type == "cpu" else cu_cpu.to(target, non_blocking=True)
        new._device = target
        new._max_seqlen = self._max_seqlen
        new._starts = self._starts
        new._lengths = self._lengths
        new._num_tokens = self._num_tokens
        new._context = self._context
        new._memo = {"fingerprint": self._memo["fingerprint"]} if "fingerprint" in self._memo else {}
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "_memo"):
            raise AttributeError(f"SequenceMetadata is immutable; cannot set {name!r}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (
            f"SequenceMetadata(num_tokens={self.num_tokens}, num_sequences={self.num_sequences}, "
            f"max_seqlen={self._max_seqlen}, device={self._device})"
        )
