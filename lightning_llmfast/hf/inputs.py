"""``packed_model_inputs``: keyword arguments that make a transformers causal LM attend within documents only.

transformers 5 builds its packed-sequence mask from ``position_ids`` only when no cache exists, and
``use_cache=True`` (the config default) creates a ``DynamicCache`` even in training; the mask then is a plain
causal mask over the whole row and every token attends across document boundaries. Its detection also reads the
device (``find_packed_sequence_indices`` ends in a Python ``if`` on a tensor). :func:`packed_model_inputs` avoids
both: ``use_cache=False`` and, for the mask-based implementations (``"sdpa"``, ``"eager"``), the finished
block-diagonal causal mask ``(B, 1, T, T)``, which transformers passes to every layer untouched. FlashAttention
implementations get ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the host-side metadata instead, and the package's
own ``"llmfast_varlen"`` (:mod:`~lightning_llmfast.hf.attention`, what
:class:`~lightning_llmfast.HFCausalLMModule` uses) gets the metadata itself and no mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmfast.data import PackedBatch
from lightning_llmfast.errors import ConfigError, DataError, MetadataError
from lightning_llmfast.hf.attention import METADATA_KWARG, VARLEN_ATTENTION, packed_attention_mask
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

__all__ = ["block_causal_mask", "packed_model_inputs"]

_MASKED = ("sdpa", "eager")


def packed_model_inputs(
    batch: PackedBatch, model: nn.Module, *, metadata: SequenceMetadata | None = None
) -> dict[str, Any]:
    """Returns the keyword arguments of a transformers causal-LM forward on a packed batch.

    The result always holds ``input_ids``, ``position_ids`` (both ``(B, T)``) and ``use_cache=False``. For the
    ``"llmfast_varlen"`` implementation (:func:`~lightning_llmfast.hf.attention.use_varlen_attention`) it adds the
    metadata (``llmfast_metadata``) and a one-byte placeholder ``attention_mask`` that keeps transformers from building
    a mask. For the ``"sdpa"`` and ``"eager"`` attention implementations it adds ``attention_mask``: the
    block-diagonal causal mask of the batch (boolean for SDPA, additive for eager; the config's ``sliding_window``
    applied), built once per metadata and memoised on it. For FlashAttention implementations it adds
    ``cu_seq_lens_q``/``cu_seq_lens_k`` (``int32`` on the batch's device) and ``max_length_q``/``max_length_k`` (host
    ints) over the flattened ``B * T`` positions. Nothing here reads the device.

    The metadata comes from ``metadata`` when given, else from the active
    :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` (what
    :class:`~lightning_llmfast.SequenceMetadataCallback` opens per batch; the read is bound to ``batch.input_ids``,
    so another batch never gets this one's boundaries), else it is built from the batch's host fields.

    ``batch.labels`` are already shifted (next token of the same document); never pass them as ``labels=`` to a
    transformers model, which would shift them again. Compute the loss from the logits (see
    :class:`~lightning_llmfast.HFCausalLMModule`).

    Args:
        batch: the packed batch.
        model: the transformers causal LM (its ``config`` names the attention implementation).
        metadata: the batch's metadata, if already at hand.

    Returns:
        The keyword arguments, to be splatted into ``model(**kwargs)``.

    Raises:
        DataError: ``batch`` is not a :class:`~lightning_llmfast.data.PackedBatch`.
        ConfigError: the model has no ``config``, or its attention implementation (or mask layout) is not supported.
        MetadataError: ``metadata`` does not describe the batch.

    Example::

        logits = model(**packed_model_inputs(batch, model)).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
    """
    if not isinstance(batch, PackedBatch):
        raise DataError(f"batch: packed_model_inputs needs a PackedBatch, got {type(batch).__name__}")
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"model: a transformers model with a `config` is needed, got {type(model).__name__}")
    impl = _attention_implementation(config)
    meta = _metadata(batch, metadata)
    kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    if impl == VARLEN_ATTENTION:
        kwargs["attention_mask"] = packed_attention_mask(meta, batch.batch_size, batch.seq_len)
        kwargs[METADATA_KWARG] = meta
    elif impl in _MASKED:
        dtype = _mask_dtype(model)
        window = getattr(config, "sliding_window", None)
        key = ("hf_mask", impl, dtype, batch.seq_len, window)
        kwargs["attention_mask"] = meta.memo(key, lambda: block_causal_mask(meta, batch.seq_len, impl, dtype, window))
    else:
        kwargs.update(
            cu_seq_lens_q=meta.cu_seqlens,
            cu_seq_lens_k=meta.cu_seqlens,
            max_length_q=meta.max_seqlen,
            max_length_k=meta.max_seqlen,
        )
    return kwargs


def block_causal_mask(
    metadata: SequenceMetadata, seq_len: int, impl: str, dtype: torch.dtype, sliding_window: int | None = None
) -> Tensor:
    """The ``(B, 1, T, T)`` attention mask of packed rows: causal and inside one segment, sync-free.

    Args:
        metadata: boundaries over the flattened ``B * T`` positions (no segment crosses a row).
        seq_len: row length ``T``.
        impl: ``"sdpa"`` (boolean mask, ``True`` = attend) or ``"eager"`` (additive: 0 or the dtype's minimum).
        dtype: dtype of an additive mask.
        sliding_window: when set, a query also sees only the ``sliding_window`` latest keys (transformers' rule).

    Returns:
        The mask on the metadata's device.

    Example::

        mask = block_causal_mask(SequenceMetadata.from_lengths([3, 1, 4]), 8, "sdpa", torch.float32)
    """
    doc = metadata.document_ids.view(-1, seq_len)  # (B, T), from cu_seqlens on the device: no host read
    positions = torch.arange(seq_len, device=doc.device)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (positions[None, :, None] >= positions[None, None, :])
    if sliding_window is not None:
        allowed &= positions[None, None, :] > positions[None, :, None] - sliding_window
    allowed = allowed[:, None]
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=doc.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _attention_implementation(config: Any) -> str:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl == VARLEN_ATTENTION:  # its layers were checked by use_varlen_attention
        return impl
    if impl in _MASKED or "flash" in impl:
        if len(set(getattr(config, "layer_types", None) or ())) > 1 or getattr(config, "attention_chunk_size", None):
            raise ConfigError(
                f"{type(config).__name__}: mixed or chunked attention layers are not supported by packed_model_inputs"
            )
        return impl
    raise ConfigError(
        f"attn_implementation {impl!r} is not supported for packed batches; use {VARLEN_ATTENTION!r} "
        "(use_varlen_attention(model)), 'sdpa', 'eager' or a FlashAttention implementation ('flash_attention_2', ...)"
    )


def _mask_dtype(model: nn.Module) -> torch.dtype:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return weight.dtype if isinstance(weight, Tensor) and weight.is_floating_point() else torch.float32


def _metadata(batch: PackedBatch, metadata: SequenceMetadata | None) -> SequenceMetadata:
    if metadata is not None:
        if metadata.num_tokens != batch.input_ids.numel():
            raise MetadataError(
                f"metadata: describes {metadata.num_tokens} positions, the batch holds {batch.input_ids.numel()}"
            )
        return metadata.to(batch.input_ids.device)
    cache = active_cache()
    if cache is not None and cache.is_open:
        cache.bind(batch.input_ids, source=batch)
        return cache.get(device=batch.input_ids.device)
    return SequenceMetadata.from_batch(batch).to(batch.input_ids.device)
