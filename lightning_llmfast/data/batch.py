"""``PackedBatch``: a batch of packed rows plus the sequence metadata computed for it on the CPU."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.data.consistency import check_packed_fields, field_versions
from lightning_llmfast.data.context import ContextShard, context_shard_plan
from lightning_llmfast.errors import DataError

__all__ = ["PackedBatch"]

# id(batch) -> version stamp of its fields when they were last found consistent (kept off the instance, so that
# ``vars(batch)`` stays the constructor's keyword arguments).
_CHECKED: dict[int, tuple[tuple[int, int], ...]] = {}


@dataclass
class PackedBatch:
    """Rows of ``seq_len`` tokens, each filled with whole documents, and the metadata describing them.

    Every row is a run of sequences (documents, or chunks of documents longer than ``seq_len``) followed by an
    optional padding tail. Over the flattened ``B * T`` positions, ``cu_seqlens`` lists the boundaries of every
    sequence *and* of every padding tail (each tail is a segment of its own), so no segment crosses a row.

    The integers ``max_seqlen`` and ``num_tokens`` and the host copy ``cu_seqlens_cpu`` are computed by the packer on
    the CPU; consumers on an accelerator read them instead of the device tensors, so they never sync the host.
    Treat the tensors as read-only: ``cu_seqlens_cpu`` may be the (pinned) source of an in-flight device copy.
    :meth:`validate` checks the fields against each other on the host once (:meth:`to` does it before a move, so the
    copy on the device needs no check) and again only after an in-place edit, seen through the version counters.

    Lightning moves a ``PackedBatch`` with :meth:`to` (it has a ``to`` method, so
    ``move_data_to_device`` treats it as one transferable object) and a ``DataLoader(pin_memory=True)`` pins it
    with :meth:`pin_memory`. When logging from ``training_step``, pass ``batch_size=batch.batch_size``: Lightning
    cannot infer it from a dataclass whose tensors have different first dimensions.

    Attributes:
        input_ids: ``(B, T)`` int64 token ids; padding positions hold the packer's ``pad_id``.
        labels: ``(B, T)`` int64: the next token of the same sequence, ``-100`` at each sequence's last token and
            on padding.
        position_ids: ``(B, T)`` int64, restarting at 0 at every sequence and at every padding tail.
        cu_seqlens: ``(N + 1,)`` int32 cumulative segment boundaries over the flattened ``B * T`` positions;
            ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == B * T``.
        max_seqlen: length of the longest segment (padding tails included), a Python int.
        num_tokens: number of real (non-padding) tokens, a Python int.
        cu_seqlens_cpu: ``(N + 1,)`` int32 host copy of ``cu_seqlens``. Set automatically when ``cu_seqlens`` is
            built on the CPU, and kept by :meth:`to`, so boundaries stay readable on the host after the move.
        documents: host list with the document of every ``cu_seqlens`` segment (the stream index for
            :func:`~lightning_llmfast.data.pack_documents`, the corpus index for ``PackedDocumentDataset``), ``-1``
            for padding tails and for every segment of a filler batch (labels all ignored); ``None`` if unknown.
        context: set on a context-parallel shard (:meth:`context_shard`): the rank's pieces' key ranges, the
            all-gather's group and order; ``None`` for a whole batch.

    Example::

        >>> import torch
        >>> from lightning_llmfast.data import pack_documents
        >>> batch = next(pack_documents([[5, 6, 7], [8, 9]], seq_len=4, batch_size=2))
        >>> batch.input_ids
        tensor([[5, 6, 7, 0],
                [8, 9, 0, 0]])
        >>> batch.cu_seqlens.tolist(), batch.max_seqlen, batch.num_tokens
        ([0, 3, 4, 6, 8], 3, 5)
        >>> batch.to("cpu").cu_seqlens_cpu is not None
        True
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    num_tokens: int
    cu_seqlens_cpu: Tensor | None = None
    documents: list[int] | None = None
    context: ContextShard | None = None

    def __post_init__(self) -> None:
        # Shapes, dtypes and devices only: reading tensor values here would sync when a batch is rebuilt on a
        # device (``to``), and the packer already guarantees the values.
        for name in ("input_ids", "labels", "position_ids"):
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.dim() != 2 or value.dtype != torch.int64:
                raise DataError(f"PackedBatch.{name} must be a 2-D int64 tensor (B, T), got {_describe(value)}")
        shape = self.input_ids.shape
        for name in ("labels", "position_ids"):
            if getattr(self, name).shape != shape:
                raise DataError(
                    f"PackedBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                    f"expected {tuple(shape)} like input_ids"
                )
        for name in ("cu_seqlens", "cu_seqlens_cpu"):
            value = getattr(self, name)
            if name == "cu_seqlens_cpu" and value is None:
                continue
            if not isinstance(value, Tensor) or value.dim() != 1 or value.dtype != torch.int32 or value.numel() < 2:
                raise DataError(
                    f"PackedBatch.{name} must be a 1-D int32 tensor of N + 1 >= 2 boundaries, got {_describe(value)}"
                )
        if self.cu_seqlens_cpu is not None:
            if self.cu_seqlens_cpu.device.type != "cpu":
                raise DataError(f"PackedBatch.cu_seqlens_cpu must live on the CPU, got {self.cu_seqlens_cpu.device}")
            if self.cu_seqlens_cpu.shape != self.cu_seqlens.shape:
                raise DataError(
                    f"PackedBatch.cu_seqlens_cpu has {self.cu_seqlens_cpu.numel()} boundaries but cu_seqlens has "
                    f"{self.cu_seqlens.numel()}"
                )
        total = shape[0] * shape[1]
        for name, low, high in (("max_seqlen", 0, shape[1]), ("num_tokens", 0, total)):
            # Host ints (NumPy's pass and are stored as Python ints): a tensor here would be read with a sync.
            value = getattr(self, name)
            try:
                setattr(self, name, check_int(f"PackedBatch.{name}", value, low=low, high=high, error=DataError))
            except DataError:
                raise DataError(f"PackedBatch.{name} must be a Python int in [{low}, {high}], got {value!r}") from None
        if self.documents is not None and len(self.documents) != self.cu_seqlens.numel() - 1:
            raise DataError(
                f"PackedBatch.documents has {len(self.documents)} entries for {self.cu_seqlens.numel() - 1} segments"
            )
        if self.cu_seqlens_cpu is None and self.cu_seqlens.device.type == "cpu":
            self.cu_seqlens_cpu = self.cu_seqlens

    def validate(self) -> None:
        """Checks ``cu_seqlens``, ``cu_seqlens_cpu``, ``position_ids`` and ``num_tokens`` against each other.

        The check runs once on the host (NumPy); later calls compare the fields' version counters (host ints) and
        return at once unless a field was edited in place or replaced. A batch built directly on an accelerator,
        or edited there, is copied to the host for its check (a sync, once); batches moved by :meth:`to` are not.

        Raises:
            MetadataError: the fields disagree.

        Example::

            batch.validate()
            batch.cu_seqlens[1] += 1
            batch.validate()  # MetadataError: position_ids disagree with cu_seqlens
        """
        stamp = self._stamp()
        if _CHECKED.get(id(self)) == stamp:
            return
        offsets = self.context.offsets if self.context is not None else None
        if self.cu_seqlens_cpu is None:
            check_packed_fields(self.cu_seqlens.cpu(), self.position_ids, self.num_tokens, segment_offsets=offsets)
        else:
            check_packed_fields(
                self.cu_seqlens_cpu,
                self.position_ids,
                self.num_tokens,
                cu_seqlens_copy=self.cu_seqlens,
                segment_offsets=offsets,
            )
        self._mark_checked(stamp)

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        return field_versions([self.cu_seqlens, self.cu_seqlens_cpu, self.position_ids])

    def _mark_checked(self, stamp: tuple[tuple[int, int], ...]) -> None:
        if id(self) not in _CHECKED:
            weakref.finalize(self, _CHECKED.pop, id(self), None)
        _CHECKED[id(self)] = stamp

    @property
    def batch_size(self) -> int:
        """Number of rows ``B``."""
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        """Row length ``T``."""
        return self.input_ids.shape[1]

    @property
    def padding_fraction(self) -> float:
        """Share of the ``B * T`` positions that are padding, computed from host integers (no sync)."""
        total = self.input_ids.numel()
        return 1.0 - self.num_tokens / total if total else 0.0

    def to(self, device: torch.device | str | int, non_blocking: bool = True) -> PackedBatch:
        """Return a new batch with its tensors on ``device``; the ints and the host copy of ``cu_seqlens`` stay.

        Args:
            device: target device.
            non_blocking: issue asynchronous copies (effective from pinned memory); ignored when the target is the
                CPU, where an asynchronous device-to-host copy could be read before it lands.

        Returns:
            A new ``PackedBatch``; ``self`` is unchanged.

        Raises:
            MetadataError: the fields of a batch on the CPU disagree (see :meth:`validate`).

        Example::

            batch = batch.pin_memory().to("cuda")  # batch.cu_seqlens_cpu is still readable without a sync
        """
        device = torch.device(device)
        non_blocking = non_blocking and device.type != "cpu"
        # The host copy must be taken from the CPU tensor *before* the move: afterwards it could only be
        # read back from the device with a sync.
        cu_seqlens_cpu = self.cu_seqlens_cpu
        if cu_seqlens_cpu is None and self.cu_seqlens.device.type == "cpu":
            cu_seqlens_cpu = self.cu_seqlens
        if self.position_ids.device.type == "cpu":
            self.validate()  # on the host now, so the device copy never needs a sync to be checked
        checked = _CHECKED.get(id(self)) == self._stamp()
        moved = PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking),
            max_seqlen=self.max_seqlen,
            num_tokens=self.num_tokens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            documents=self.documents,
            context=self.context,
        )
        if checked:
            moved._mark_checked(moved._stamp())
        return moved

    def pin_memory(self) -> PackedBatch:
        """Return a new batch whose CPU tensors are in page-locked memory, for asynchronous host-to-device copies.

        ``DataLoader(pin_memory=True)`` calls this in its pinning thread. Needs an accelerator (as
        :meth:`torch.Tensor.pin_memory` does).

        Returns:
            A new ``PackedBatch``; when ``cu_seqlens_cpu`` is ``cu_seqlens`` itself it stays shared (pinned once).

        Example::

            loader = DataLoader(dataset, batch_size=None, pin_memory=True)  # yields pinned PackedBatch objects
        """
        cu_seqlens = self.cu_seqlens.pin_memory()
        shared = self.cu_seqlens_cpu is self.cu_seqlens
        checked = _CHECKED.get(id(self)) == self._stamp()
        pinned = PackedBatch(
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            position_ids=self.position_ids.pin_memory(),
            cu_seqlens=cu_seqlens,
            max_seqlen=self.max_seqlen,
            num_tokens=self.num_tokens,
            cu_seqlens_cpu=cu_seqlens if shared else self.cu_seqlens_cpu,
            documents=self.documents,
            context=self.context,
        )
        if checked:
            pinned._mark_checked(pinned._stamp())
        return pinned

    def rows(self, start: int, stop: int) -> PackedBatch:
        """The rows ``[start, stop)`` as a batch of their own (a pipeline microbatch), cut on the host.

        Every row boundary is a segment boundary, so the rows' segments are whole: ``cu_seqlens`` (and its host
        copy) are the batch's boundaries inside the rows, shifted to 0, ``documents`` their entries, ``num_tokens``
        the rows' real tokens counted as :meth:`context_shard` counts a shard's.

        Args:
            start: the first row.
            stop: one past the last row.

        Returns:
            A new ``PackedBatch`` of ``stop - start`` rows (views of this batch's tensors); ``self`` is unchanged.

        Raises:
            DataError: ``[start, stop)`` is not a non-empty range of the batch's rows, or the batch is a shard.

        Example::

            first = batch.rows(0, batch.batch_size // 2)  # the first half of the rows
        """
        if self.context is not None:
            raise DataError("PackedBatch.rows: a context-parallel shard has no rows to cut (cut the rows first)")
        if not (0 <= start < stop <= self.batch_size):
            raise DataError(f"PackedBatch.rows: [{start}, {stop}) is not a non-empty range of {self.batch_size} rows")
        self.validate()
        host = self.cu_seqlens_cpu if self.cu_seqlens_cpu is not None else self.cu_seqlens.cpu()
        cu = host.numpy().astype(np.int64)
        lo, hi = start * self.seq_len, stop * self.seq_len
        first, last = int(np.searchsorted(cu, lo, side="left")), int(np.searchsorted(cu, hi, side="left"))
        cut = torch.from_numpy((cu[first : last + 1] - lo).astype(np.int32))
        segment = np.searchsorted(cu, np.arange(lo, hi), side="right") - 1
        return PackedBatch(
            input_ids=self.input_ids[start:stop],
            labels=self.labels[start:stop],
            position_ids=self.position_ids[start:stop],
            cu_seqlens=cut.to(self.cu_seqlens.device, non_blocking=True),
            max_seqlen=int(np.diff(cu[first : last + 1]).max()),
            num_tokens=self._real_tokens(cu, segment),
            cu_seqlens_cpu=cut,
            documents=self.documents[first:last] if self.documents is not None else None,
        )

    def context_shard(self, cp_rank: int, cp_size: int, group: Any = None) -> PackedBatch:
        """This context-parallel rank's share of the batch, as a batch of shape ``(1, B * T / cp_size)``.

        The positions are :func:`~lightning_llmfast.data.context.context_split`'s for ``cp_rank``, in ascending
        global order; ``position_ids`` are each position's place in its document (the RoPE positions), ``labels``
        the batch's (already the next token of the same document), ``cu_seqlens`` the rank's *pieces* (runs of
        consecutive positions of one document) and ``context`` the rest attention needs: each piece's key range, the
        group and the order of the all-gathered keys (:class:`~lightning_llmfast.data.context.ContextShard`). All of
        it is planned on the host from ``cu_seqlens_cpu``; the tensors are gathered on the batch's device.
        ``SequenceMetadata.from_batch`` builds the rank's metadata from it, and ``varlen_attention`` all-gathers
        K and V over ``group`` inside. ``num_tokens`` counts the shard's real tokens where the padding segments are
        known (``documents`` of ``-1``, or the last segments of the rows when they hold exactly the padding), else
        the batch's share rounded.

        Args:
            cp_rank: this rank's index in the context-parallel group.
            cp_size: ranks in the group; must divide ``B * T``.
            group: the group's ``ProcessGroup`` (``None``: the default group).

        Returns:
            A new ``PackedBatch`` with ``context`` set; ``self`` is unchanged.

        Raises:
            ConfigError: ``cp_size`` does not divide ``B * T``, or ``cp_rank`` is outside ``[0, cp_size)``.
            DataError: the batch is already a shard.
            MetadataError: the batch's fields disagree (:meth:`validate`).

        Example::

            shard = batch.context_shard(dims.cp_rank, dims.cp, dims.cp_group)
            logits = model(shard.input_ids, shard.position_ids)  # (1, B * T / cp, vocab)
        """
        if self.context is not None:
            raise DataError("PackedBatch.context_shard: this batch is already a context-parallel shard")
        self.validate()
        host = self.cu_seqlens_cpu if self.cu_seqlens_cpu is not None else self.cu_seqlens.cpu()
        shard, cu_q = context_shard_plan(host, cp_rank, cp_size, group)
        cu = host.numpy().astype(np.int64)
        held = shard.positions.numpy()
        segment = np.searchsorted(cu, held, side="right") - 1  # the non-empty segment of each held position
        device = self.input_ids.device
        index = shard.positions.to(device, non_blocking=True)

        def take(t: Tensor) -> Tensor:
            return t.reshape(-1).index_select(0, index).view(1, -1)

        pieces = np.diff(cu_q.numpy())
        first = segment[cu_q.numpy()[:-1]]
        return PackedBatch(
            input_ids=take(self.input_ids),
            labels=take(self.labels),
            position_ids=torch.from_numpy(held - cu[segment]).view(1, -1).to(device, non_blocking=True),
            cu_seqlens=cu_q.to(device, non_blocking=True),
            max_seqlen=int(pieces.max()) if pieces.size else 0,
            num_tokens=self._real_tokens(cu, segment),
            cu_seqlens_cpu=cu_q,
            documents=[self.documents[int(s)] for s in first] if self.documents is not None else None,
            context=shard,
        )

    def _real_tokens(self, cu: np.ndarray, segment: np.ndarray) -> int:
        """Real tokens among the held positions whose segments are ``segment`` (see :meth:`context_shard`)."""
        total = self.input_ids.numel()
        padding = total - self.num_tokens
        if padding == 0:
            return int(segment.size)
        lengths = np.diff(cu)
        candidates = []
        if self.documents is not None:
            candidates.append(np.asarray(self.documents) == -1)
        ends = np.arange(1, self.batch_size + 1) * self.seq_len
        row_last = np.zeros(lengths.size, dtype=bool)
        row_last[np.searchsorted(cu, ends, side="left") - 1] = True
        candidates.append(row_last)
        for pad in candidates:
            if int(lengths[pad].sum()) == padding:
                return int(segment.size - pad[segment].sum())
        return round(self.num_tokens * segment.size / total)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__}"
