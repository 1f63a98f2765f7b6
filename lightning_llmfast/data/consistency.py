"""Host-side consistency of a packed batch's fields, and detection of in-place edits without reading the device.

A ``PackedBatch`` carries the same boundaries three times: ``cu_seqlens`` (device), ``cu_seqlens_cpu`` (host) and
``position_ids`` (restarting at every segment); a disagreement makes attention use boundaries the labels and rotary
positions do not follow. :func:`check_packed_fields` compares them once, with NumPy, on host copies. Every torch
tensor has a version counter, a host integer bumped by each in-place op: :func:`field_versions` records them, so a
later edit of any field is seen by comparing integers, with no device access.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor

from lightning_llmfast.errors import MetadataError

__all__ = ["check_packed_fields", "field_versions", "tensor_version"]


def field_versions(tensors: Sequence[Tensor | None]) -> tuple[tuple[int, int], ...]:
    """``(id, version counter)`` of each tensor: equal tuples mean the same, unedited tensors (host ints only).

    Example::

        stamp = field_versions([batch.cu_seqlens, batch.position_ids])
        batch.cu_seqlens[1] += 1
        assert field_versions([batch.cu_seqlens, batch.position_ids]) != stamp
    """
    return tuple((0, 0) if t is None else (id(t), tensor_version(t)) for t in tensors)


def tensor_version(tensor: Tensor) -> int:
    """The tensor's version counter; ``-1`` for inference tensors (made under ``torch.inference_mode``, as evaluation
    loops do), which keep none: outside inference mode they cannot be edited in place, so identity is the stamp."""
    return -1 if tensor.is_inference() else tensor._version


def check_packed_fields(
    cu_seqlens_cpu: Tensor,
    position_ids: Tensor,
    num_tokens: int,
    cu_seqlens_copy: Tensor | None = None,
    segment_offsets: Tensor | None = None,
) -> None:
    """Checks that a packed batch's boundaries, positions and token count describe the same segments.

    Rules: ``cu_seqlens`` starts at 0, is non-decreasing and ends at ``B * T``; every row start ``r * T`` is a
    boundary (no segment crosses a row); ``position_ids`` count ``0, 1, ...`` from every boundary; ``num_tokens``
    (real tokens) is at most ``B * T`` and at least ``B * T`` minus the last segment of every row (the only place a
    padding tail can be).

    Args:
        cu_seqlens_cpu: ``(N + 1,)`` integer boundaries on the CPU.
        position_ids: ``(B, T)`` integer positions; copied to the host when on an accelerator (a sync: callers do
            this once per batch, when it is first used).
        num_tokens: the batch's number of real tokens.
        cu_seqlens_copy: another copy of the boundaries (the batch's ``cu_seqlens`` when it is not
            ``cu_seqlens_cpu`` itself), compared with ``cu_seqlens_cpu`` (a sync when it lives on an accelerator).
        segment_offsets: ``(N,)`` host positions each segment starts counting from (a context-parallel shard's pieces
            start inside their documents); ``None``: every segment counts from 0. With offsets, padding may be
            anywhere, so ``num_tokens`` is only checked to be at most ``B * T``.

    Raises:
        MetadataError: the fields disagree; the message names the first offending index.

    Example::

        check_packed_fields(torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([[0, 1, 2, 0]]), 4)
    """
    rows, seq_len = position_ids.shape
    total = rows * seq_len
    cu = _checked_boundaries(cu_seqlens_cpu, cu_seqlens_copy, total, seq_len)
    row_starts = np.arange(0, total, seq_len)
    # NOTE: host sync when the positions live on an accelerator; done once per batch (see the docstring).
    positions = position_ids.detach().reshape(-1).cpu().numpy().astype(np.int64)
    lengths = np.diff(cu)
    expected = np.arange(total) - np.repeat(cu[:-1], lengths)
    if segment_offsets is not None:
        expected += np.repeat(segment_offsets.numpy().astype(np.int64), lengths)
    wrong = positions != expected
    if wrong.any():
        i = int(np.argmax(wrong))
        raise MetadataError(
            f"PackedBatch: position_ids disagree with cu_seqlens at flat index {i} "
            f"(position {int(positions[i])}, boundaries say {int(expected[i])})"
        )
    ends = row_starts + seq_len  # the last segment of each row ends at its row's end
    last_lengths = ends - cu[np.searchsorted(cu, ends, side="left") - 1]
    low = 0 if segment_offsets is not None else total - int(last_lengths.sum())
    if not low <= num_tokens <= total:
        raise MetadataError(
            f"PackedBatch.num_tokens: {num_tokens} real tokens is impossible for these boundaries (between "
            f"{low} and {total})"
        )


def _checked_boundaries(cu_seqlens_cpu: Tensor, copy_of: Tensor | None, total: int, seq_len: int) -> np.ndarray:
    """The boundaries as an int64 host array, checked: equal to their other copy, rising from 0 to ``total``, and a
    boundary at every row start."""
    cu = cu_seqlens_cpu.numpy().astype(np.int64)
    if copy_of is not None and copy_of is not cu_seqlens_cpu:
        # NOTE: host sync on an accelerator; PackedBatch.validate gets here only for a batch not moved by its `to`
        # (which checks on the host first), or after an in-place edit.
        copy = copy_of.detach().cpu().numpy().astype(np.int64)
        if copy.shape != cu.shape or (copy != cu).any():
            raise MetadataError("PackedBatch: cu_seqlens and cu_seqlens_cpu hold different boundaries")
    if cu.size < 2 or cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
        raise MetadataError(
            f"PackedBatch.cu_seqlens: must rise from 0 to B * T = {total}, got {cu[:4].tolist()}...{cu[-2:].tolist()}"
        )
    row_starts = np.arange(0, total, seq_len)
    missing = ~np.isin(row_starts, cu)
    if missing.any():
        raise MetadataError(
            f"PackedBatch.cu_seqlens: row {int(np.argmax(missing))} does not start a segment (segments cross rows)"
        )
    return cu
