"""Packed-sequence metadata built once per batch, validated on the host, reused by every layer (plain PyTorch).

Example::

    from lightning_llmfast.seqmeta import SequenceMetadataCache, active_cache, varlen_attention

    cache = SequenceMetadataCache()
    with cache.batch(packed_batch):
        meta = active_cache().get(hidden)          # built at the first layer, reused by the others
        out = varlen_attention(q, k, v, meta)      # never attends across documents
"""

from __future__ import annotations

from lightning_llmfast.data.context import context_split
from lightning_llmfast.seqmeta.attention import dense_block_causal_mask, varlen_attention
from lightning_llmfast.seqmeta.cache import SequenceMetadataCache, activate_cache, active_cache
from lightning_llmfast.seqmeta.hf import to_flash_attention_kwargs
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = [
    "SequenceMetadata",
    "SequenceMetadataCache",
    "activate_cache",
    "active_cache",
    "context_split",
    "dense_block_causal_mask",
    "to_flash_attention_kwargs",
    "varlen_attention",
]
