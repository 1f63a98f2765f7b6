"""The package's varlen attention as a transformers attention implementation, ``"llmfast_varlen"``.

A transformers model with ``config._attn_implementation == "llmfast_varlen"`` attends over a packed batch through
:func:`~lightning_llmfast.seqmeta.varlen_attention`, driven by the batch's
:class:`~lightning_llmfast.seqmeta.SequenceMetadata`: each document attends to itself only, with no
``(B, 1, T, T)`` mask (transformers' ``sdpa``/``eager`` need one for packed rows: 1 GiB for one 32k-token row) and
activation memory linear in the row length. :func:`~lightning_llmfast.packed_model_inputs` hands the metadata to every
layer in the forward's keyword arguments (transformers passes them down to the attention function) together with a
zero-stride placeholder mask, which makes transformers skip building a mask of its own.

Called without the package's metadata (``model.generate``, a plain ``model(input_ids)``), the implementation is
transformers' ``"sdpa"``, mask included: the model stays usable outside packed training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.seqmeta import SequenceMetadata, varlen_attention

__all__ = [
    "METADATA_KWARG",
    "VARLEN_ATTENTION",
    "packed_attention_mask",
    "use_varlen_attention",
    "varlen_attention_forward",
]

VARLEN_ATTENTION = "llmfast_varlen"
"""The name the package's varlen attention is registered under in transformers' ``AttentionInterface``."""

METADATA_KWARG = "llmfast_metadata"
"""The forward keyword argument that carries the batch's :class:`SequenceMetadata` down to every attention layer."""

# Layer kinds whose attention goes through the attention function: sliding layers get their window as an argument.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
# Attention-function arguments that change the result and have no varlen equivalent here.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature over :func:`~lightning_llmfast.seqmeta.varlen_attention`.

    Args:
        module: the calling attention module (its class names it in errors).
        query: ``(B, heads, T, head_dim)``.
        key: ``(B, kv_heads, T, head_dim)``; ``kv_heads`` divides ``heads`` (grouped-query attention, no repeat).
        value: ``(B, kv_heads, T, v_head_dim)``; ``v_head_dim`` may differ from ``head_dim`` (MLA).
        attention_mask: ``None`` or the placeholder of :func:`packed_attention_mask` (a packed call); any mask
            transformers built (a call without the metadata).
        scaling: softmax scale (``None``: ``1 / sqrt(head_dim)``).
        dropout: attention dropout probability; only 0 with the metadata.
        **kwargs: the forward's keyword arguments; :data:`METADATA_KWARG` holds the batch's metadata over the
            flattened ``B * T`` positions, ``sliding_window`` a layer's window.

    Returns:
        ``(B, T, heads, v_head_dim)`` output and ``None`` (no attention weights).

    Raises:
        ConfigError: with the metadata: dropout, a logit soft-cap, attention sinks, a position bias, non-causal
            attention, a mask the package did not build, or a sliding window shorter than the batch's longest document
            (the window then changes the result).
        MetadataError: the metadata describes another number of positions than ``B * T``.

    Example::

        AttentionInterface.register("llmfast_varlen", varlen_attention_forward)  # done at import
        model.set_attn_implementation("llmfast_varlen")
        logits = model(**packed_model_inputs(batch, model)).logits
    """
    meta = kwargs.pop(METADATA_KWARG, None)
    if meta is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _check_packed_call(module, meta, attention_mask, dropout, kwargs)
    batch, heads, seq_len, dim = query.shape
    v_dim = value.shape[-1]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and v_dim < dim <= 256 and dim % 8 == 0:
        # FlashAttention varlen takes one head_dim for q, k and v: pad v as transformers' flash path does (MLA).
        value = F.pad(value, (0, dim - v_dim))
    q, k, v = (t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = varlen_attention(q, k, v, meta, scale=scaling)
    return out[..., :v_dim].view(batch, seq_len, heads, v_dim), None


def _check_packed_call(
    module: nn.Module, meta: Any, attention_mask: Tensor | None, dropout: float, kwargs: dict[str, Any]
) -> None:
    name = f"{type(module).__name__} ({VARLEN_ATTENTION} attention)"
    if not isinstance(meta, SequenceMetadata):
        raise ConfigError(f"{METADATA_KWARG}: must be a SequenceMetadata, got {type(meta).__name__}")
    if dropout:
        raise ConfigError(f"{name}: attention dropout {dropout} is not supported; set the config's attention_dropout=0")
    for arg in _UNSUPPORTED_KWARGS:
        if kwargs.get(arg) is not None:
            raise ConfigError(f"{name}: the model passes `{arg}`, which varlen attention does not apply")
    causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if causal is None else causal):
        raise ConfigError(f"{name}: only causal attention is supported")
    if attention_mask is not None and any(attention_mask.stride()):
        raise ConfigError(
            f"{name}: got an attention mask the package did not build, which varlen attention would ignore; pass "
            "the inputs of packed_model_inputs(batch, model)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and meta.max_seqlen > window:
        raise ConfigError(
            f"{name}: a sliding window of {window} tokens and a document of {meta.max_seqlen}: varlen attention "
            f"is exact only for documents up to the window; pack documents of at most {window} tokens"
        )


def packed_attention_mask(metadata: SequenceMetadata, batch_size: int, seq_len: int) -> Tensor:
    """The placeholder ``attention_mask`` of a packed call: ``(B, 1, T, T)`` of zero strides over one ``False``.

    A 4-D mask is what makes transformers skip building a mask; this one holds one byte, and forbids every pair, so
    an attention implementation that read it as a mask would produce no plausible output. Memoised on ``metadata``.

    Example::

        mask = packed_attention_mask(meta, 2, 4096)  # shape (2, 1, 4096, 4096), 1 byte of storage
    """

    def build() -> Tensor:
        return torch.zeros((), dtype=torch.bool, device=metadata.device).expand(batch_size, 1, seq_len, seq_len)

    return metadata.memo(("hf_varlen_placeholder", batch_size, seq_len), build)


def use_varlen_attention(model: nn.Module) -> None:
    """Makes a transformers model attend through :data:`VARLEN_ATTENTION` (its config's attention implementation).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention layers call transformers' ``AttentionInterface``.

    Raises:
        ConfigError: the model's attention cannot run through it: attention outside the ``AttentionInterface``,
            layers that are not (sliding-window) attention (linear attention, chunked attention), attention dropout,
            or a logit soft-cap; the message names the model.

    Example::

        model = AutoModelForCausalLM.from_config(config)
        use_varlen_attention(model)
        logits = model(**packed_model_inputs(batch, model)).logits  # no (B, 1, T, T) mask
    """
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or not type(model)._can_set_attn_implementation():
        raise ConfigError(
            f"{name}: its attention does not dispatch through transformers' AttentionInterface, so it cannot attend "
            f"through {VARLEN_ATTENTION!r} over packed batches"
        )
    config = model.config
    reasons = []
    other_layers = set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYERS
    if other_layers:
        reasons.append(f"layers of kind {sorted(other_layers)} do not attend through the attention function")
    if getattr(config, "attention_chunk_size", None):
        reasons.append(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "attention_dropout", 0.0):
        reasons.append(f"attention_dropout={config.attention_dropout} (set it to 0)")
    if getattr(config, "attn_logit_softcapping", None):
        reasons.append(f"attn_logit_softcapping={config.attn_logit_softcapping}")
    if not getattr(config, "is_causal", True):
        reasons.append("non-causal attention")
    if reasons:
        raise ConfigError(f"{name}: cannot attend through {VARLEN_ATTENTION!r}: {'; '.join(reasons)}")
    model.set_attn_implementation(VARLEN_ATTENTION)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
# Calls without the metadata get sdpa's mask; packed calls pass a 4-D placeholder, which transformers returns as is.
AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)
