"""Packed-sequence metadata built once per batch, validated on the host, reused by every layer (plain PyTorch).

Example::

    from lightning_llmfast.seqmeta import SequenceMetadataCache, active_cache, varlen_attention

    cache = SequenceMetadataCache()
    with cache.batch(packed_batch):
        meta = active_cache().get(hidden)          # built at the first layer, reused by the others
        out = varlen_attention(q, k, v, meta)      # never attends across documents

Context parallelism: :func:`context_split` says which positions of a packed batch each of ``cp`` ranks holds
(balanced causal work, exact counts); ``PackedBatch.context_shard`` makes a rank's share, whose metadata carries a
:class:`ContextShard`, and ``varlen_attention`` on it all-gathers K and V over the cp group inside::

    shard = batch.context_shard(cp_rank, cp_size, cp_group)
    with cache.batch(shard):
        out = varlen_attention(q, k, v, active_cache().get(hidden))  # queries of this rank, keys of its documents
"""

from __future__ import annotations

from lightning_llmfast.data.context import ContextShard, balanced_min_positions, context_split
from lightning_llmfast.seqmeta.attention import (
    context_attention,
    context_keys,
    dense_block_causal_mask,
    start_context_keys,
    varlen_attention,
)
from lightning_llmfast.seqmeta.cache import SequenceMetadataCache, activate_cache, active_cache
from lightning_llmfast.seqmeta.context import CONTEXT_STATS, ContextStats, offset_causal_attention
from lightning_llmfast.seqmeta.hf import to_flash_attention_kwargs
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = [
    "CONTEXT_STATS",
    "ContextShard",
    "ContextStats",
    "SequenceMetadata",
    "SequenceMetadataCache",
    "activate_cache",
    "active_cache",
    "balanced_min_positions",
    "context_attention",
    "context_keys",
    "start_context_keys",
    "context_split",
    "dense_block_causal_mask",
    "offset_causal_attention",
    "to_flash_attention_kwargs",
    "varlen_attention",
]
