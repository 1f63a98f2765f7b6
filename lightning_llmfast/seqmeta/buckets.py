"""The gather plan of ``varlen_attention``'s ``"bucketed"`` path: sequences grouped by their length rounded up to a
power of two, planned on the host from the metadata's lengths and memoised on it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["Bucket", "bucket_plan", "host_tensor"]

_MIN_BUCKET = 16


class Bucket(NamedTuple):
    length: int  # padded length of every sequence in the bucket, a power of two
    gather: torch.Tensor  # (docs * length,) int64 token index of each padded slot
    lengths: torch.Tensor  # (docs, 1) int64 real length of each sequence


def bucket_plan(metadata: SequenceMetadata) -> tuple[list[Bucket], torch.Tensor]:
    """Gather plan of the bucketed path, memoised on the metadata.

    Planned from the host-side lengths (``O(num_sequences)`` Python work) with sync-free tensor ops only, so it also
    traces under ``torch.compile(fullgraph=True)``.

    Returns:
        ``(buckets, row_of_token)``: per bucket the padded length, the ``(docs * length,)`` gather index (a padding
        slot repeats its sequence's first token) and the ``(docs, 1)`` real lengths; ``row_of_token`` ``(num_tokens,)``
        int64 is the row of each token in the concatenation of every bucket's padded ``(docs * length)`` output.
    """

    def build() -> tuple[list[Bucket], torch.Tensor]:
        groups: dict[int, list[int]] = {}
        for doc, length in enumerate(metadata.lengths):
            if length > 0:
                groups.setdefault(max(_MIN_BUCKET, 1 << (length - 1).bit_length()), []).append(doc)
        device = metadata.device
        base = [0] * metadata.num_sequences  # first padded output row of each sequence
        buckets: list[Bucket] = []
        row = 0
        for blen, docs in sorted(groups.items()):
            for doc in docs:
                base[doc] = row
                row += blen
            starts = host_tensor([metadata.starts[d] for d in docs], device)[:, None]
            lengths = host_tensor([metadata.lengths[d] for d in docs], device)[:, None]
            offsets = torch.arange(blen, dtype=torch.int64, device=device)
            # Padding slots repeat the sequence's first token: causal attention never lets a real query see them
            # (they come after every real key), and their outputs are never read, so they get no gradient.
            gather = torch.where(offsets < lengths, starts + offsets, starts).reshape(-1)
            buckets.append(Bucket(blen, gather, lengths))
        row_of_token = host_tensor(base, device)[metadata.document_ids] + metadata.position_ids
        return buckets, row_of_token

    return metadata.memo("bucket_plan", build)


def host_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    # Built on the host and copied asynchronously from pinned memory: a pageable copy would block the host.
    tensor = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
