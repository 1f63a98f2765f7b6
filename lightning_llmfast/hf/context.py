"""Context parallelism for transformers models: every attention through ``"llmfast_varlen"``, MLA gathering its latent.

Under context parallelism each rank holds a shard of a packed batch (``PackedBatch.context_shard``): queries of its
positions, keys of whole documents. :func:`use_context_parallel` prepares a transformers causal LM for it:

- its attention runs through the package's varlen attention
  (:func:`~lightning_llmfast.hf.attention.use_varlen_attention`), whatever implementation it was built with or set
  to since, so every layer all-gathers its keys and values over the cp group; a model whose attention cannot is
  refused with a ``ConfigError`` naming it;
- multi-head latent attention (DeepSeek-V2/V3 and the other transformers families with the ``expand_kv`` contract)
  all-gathers, instead of per-head keys and values (``heads x (qk_head_dim + v_head_dim)`` values a token), the
  compressed latent after ``kv_a_layernorm`` and the rope key after RoPE (``kv_lora_rank + qk_rope_head_dim``
  values a token), and up-projects the gathered rows with ``kv_b_proj`` on each rank. The module is swapped *in
  place* for a subclass of its own class (:func:`swap_latent_attention`): same object, same parameters and
  state-dict keys, so checkpoints, export and the optimizer see no change; without a shard it runs its class's
  forward unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_llmfast.hf.attention import GATHERED_KWARG, METADATA_KWARG, use_varlen_attention
from lightning_llmfast.seqmeta import SequenceMetadata, context_keys

__all__ = ["LatentGatherAttention", "latent_gather_bytes", "swap_latent_attention", "use_context_parallel"]


class LatentGatherAttention(nn.Module):
    """Mixin put in front of a transformers MLA attention class: on a context-parallel shard, ``expand_kv`` gathers
    the compressed latent and the rope key over the cp group before up-projecting them.

    The class's own ``forward`` runs unchanged (query path, ``kv_a_layernorm``, RoPE, ``o_proj``); this mixin only
    sees the batch's metadata in the forward's keyword arguments and, for a shard, replaces ``expand_kv``'s inputs by
    the gathered rows of every piece's keys and tells the attention function so (:data:`GATHERED_KWARG`).

    Example::

        swap_latent_attention(model)  # every DeepseekV3Attention becomes a LatentGatherDeepseekV3Attention
        logits = model(**packed_model_inputs(shard, model)).logits
    """

    _latent_shard: SequenceMetadata | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The class's forward; on a shard (the metadata's ``context`` spans several ranks) with the latent gathered."""
        meta = kwargs.get(METADATA_KWARG)
        shard = meta.context if isinstance(meta, SequenceMetadata) else None
        if shard is None or shard.size == 1 or kwargs.get("cache") is not None:
            return super().forward(*args, **kwargs)
        self._latent_shard = meta
        try:
            return super().forward(*args, **kwargs, **{GATHERED_KWARG: True})
        finally:
            self._latent_shard = None

    def expand_kv(self, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        """``(1, heads, num_keys, qk_head_dim)`` keys and ``(1, heads, num_keys, v_head_dim)`` values of every piece
        of the shard, from the gathered ``(B, 1, T, kv_lora_rank)`` latent and ``(B, 1, T, qk_rope_head_dim)`` rope
        key; the class's own ``expand_kv`` without a shard."""
        meta = self._latent_shard
        if meta is None:
            return super().expand_kv(kv_nope, k_rot)  # type: ignore[misc]
        # (B, 1, T, dim) -> (B * T, 1, dim) rows -> the pieces' (num_keys, 1, dim) -> (1, 1, num_keys, dim)
        latent, rope = (t.reshape(-1, 1, t.shape[-1]) for t in (kv_nope, k_rot))
        latent, rope = (t.transpose(0, 1)[None] for t in context_keys(latent, rope, meta))
        return super().expand_kv(latent, rope)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def _latent_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LatentGather{cls.__name__}", (LatentGatherAttention, cls), {"__module__": __name__})
    return _CLASSES[cls]


def swap_latent_attention(model: nn.Module) -> int:
    """Makes every multi-head latent attention module of ``model`` gather its latent under context parallelism.

    A module is MLA when its class has transformers' ``expand_kv(kv_nope, k_rot)`` (DeepSeek-V2/V3, GLM-4-MoE-Lite,
    Kimi, MiniCPM3, LongCat-Flash, ...). Its class becomes a subclass with :class:`LatentGatherAttention` in front;
    nothing else changes (same object, parameters and names). Idempotent.

    Returns:
        The number of modules swapped (0 when called again).

    Example::

        assert swap_latent_attention(model) == model.config.num_hidden_layers  # DeepSeek-V3
    """
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if isinstance(module, LatentGatherAttention) or not callable(getattr(cls, "expand_kv", None)):
            continue
        module.__class__ = _latent_class(cls)
        swapped += 1
    return swapped


def latent_gather_bytes(config: Any, element_size: int) -> tuple[int, int]:
    """Bytes a token adds to one layer's context-parallel all-gather: ``(MLA's latent and rope key, full K and V)``.

    ``kv_lora_rank + qk_rope_head_dim`` values against ``heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)``.

    Example::

        latent, full = latent_gather_bytes(DeepseekV3Config(), 2)  # (1152, 81920) in bf16: 71x less
    """
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    full = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return latent * element_size, full * element_size


def use_context_parallel(model: nn.Module) -> int:
    """Prepares a transformers causal LM for context-parallel shards (module docstring).

    Args:
        model: the transformers model.

    Returns:
        The number of MLA modules swapped (:func:`swap_latent_attention`).

    Raises:
        ConfigError: the model's attention cannot run through ``"llmfast_varlen"``, so it cannot attend a shard's
            queries to its documents' gathered keys; the message names the model.

    Example::

        use_context_parallel(module.model)  # HFCausalLMModule does this at setup under context_parallel_size > 1
    """
    use_varlen_attention(model)
    return swap_latent_attention(model)
