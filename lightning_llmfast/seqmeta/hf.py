"""HuggingFace transformers interop: hand our validated metadata to HF's packed (FlashAttention) code path."""

from __future__ import annotations

from typing import Any

from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["to_flash_attention_kwargs"]


def to_flash_attention_kwargs(metadata: SequenceMetadata) -> dict[str, Any]:
    """Returns HF transformers' packed-sequence kwargs, so an HF model receives the boundaries once per batch.

    With these kwargs HF's flash-attention path skips deriving ``cu_seqlens`` from ``position_ids`` in every layer
    (a ``nonzero`` and an ``.item()`` per layer). Only FlashAttention implementations read them: SDPA and eager
    attention ignore them and, with transformers' default ``use_cache=True``, attend across documents. Use
    :func:`lightning_llmfast.packed_model_inputs`, which returns the right arguments for every implementation.

    Args:
        metadata: the batch's metadata.

    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k"}``: ``(num_sequences + 1,)`` int32 on the metadata's device, and
        ``{"max_length_q", "max_length_k"}``: Python ints.

    Example::

        meta = SequenceMetadata.from_batch(batch)  # a model with attn_implementation="flash_attention_2"
        logits = hf_model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                          **to_flash_attention_kwargs(meta)).logits
    """
    return {
        "cu_seq_lens_q": metadata.cu_seqlens,
        "cu_seq_lens_k": metadata.cu_seqlens,
        "max_length_q": metadata.max_seqlen,
        "max_length_k": metadata.max_seqlen,
    }
