"""Pipeline stages of a transformers decoder-only causal LM: :class:`HFDecoderStageAdapter`.

The pipeline runner (:mod:`~lightning_llmfast.parallel.pipeline`) reaches a model only through its stage adapter
(:class:`~lightning_llmfast.parallel.pipeline_stage.StageAdapter`, a structural protocol this class implements). For
the transformers families whose decoder forward is ``lm_head(model.norm(layers(model.embed_tokens(ids))))`` with one
``model.rotary_emb`` (Qwen3-MoE, DeepSeek-V3, Mixtral, Qwen2-MoE, OLMoE, Llama, Qwen3, ...), a stage runs its
decoder layers as the model's own forward does: every layer gets the rotary embeddings, computed on the stage from
the microbatch's positions (never sent through the pipe), and attends through the package's ``"llmfast_varlen"``
attention with the microbatch's :class:`~lightning_llmfast.seqmeta.SequenceMetadata` from the active metadata cache
(:mod:`~lightning_llmfast.hf.attention`: no ``(B, 1, T, T)`` mask).

Example::

    adapter = HFDecoderStageAdapter(module.model)    # a Qwen3MoeForCausalLM
    adapter.parts["layers"]                          # (module.model.model, "layers")
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.hf.attention import METADATA_KWARG, packed_attention_mask, use_varlen_attention
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

__all__ = ["HFDecoderStageAdapter"]

# Config attributes that put a step between the parts outside them (scaled embeddings or logits, soft-capped
# logits), which a stage running the parts alone would miss; any value but these is refused.
_OUTSIDE_THE_PARTS: dict[str, tuple[Any, ...]] = {
    "embedding_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "logit_scale": (None, 1, 1.0),
    "final_logit_softcapping": (None,),
}
_NEEDED = "model.embed_tokens, model.layers (a ModuleList), model.norm, lm_head and model.rotary_emb"


class HFDecoderStageAdapter:
    """The stage adapter of a transformers decoder-only causal LM (module docstring).

    Args:
        model: the ``...ForCausalLM`` (a ``PreTrainedModel``). Its attention is set to ``"llmfast_varlen"``
            (:func:`~lightning_llmfast.hf.attention.use_varlen_attention`), as
            :class:`~lightning_llmfast.HFCausalLMModule` sets it at construction.

    Raises:
        ConfigError: an encoder-decoder model; a part missing (the message names every one a split needs); a config
            that scales the embeddings or the logits, or soft-caps the logits, outside the parts; attention that
            cannot run through ``"llmfast_varlen"``.

    Example::

        adapter = HFDecoderStageAdapter(model)
        hidden = adapter.embed(input_ids)
        inputs = adapter.layer_inputs(hidden, position_ids)  # rotary tables, the cache's metadata
        hidden = adapter.run_layer(model.model.layers[0], hidden, inputs)
    """

    def __init__(self, model: nn.Module) -> None:
        name = type(model).__name__
        config = getattr(model, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            raise ConfigError(
                f"pipeline: cannot split {name}, an encoder-decoder model; pipelining needs a decoder-only causal LM "
                f"with {_NEEDED}"
            )
        decoder = getattr(model, "model", None)
        found = {
            "model.embed_tokens": isinstance(getattr(decoder, "embed_tokens", None), nn.Module),
            "model.layers": isinstance(getattr(decoder, "layers", None), nn.ModuleList),
            "model.norm": isinstance(getattr(decoder, "norm", None), nn.Module),
            "lm_head": isinstance(getattr(model, "lm_head", None), nn.Module),
            "model.rotary_emb": isinstance(getattr(decoder, "rotary_emb", None), nn.Module),
        }
        missing = [part for part, ok in found.items() if not ok]
        if missing:
            raise ConfigError(
                f"pipeline: cannot split {name}: it has no {', '.join(missing)}; pipelining needs a decoder-only "
                f"causal LM with {_NEEDED}"
            )
        outside = [
            f"{attr}={getattr(config, attr)}"
            for attr, plain in _OUTSIDE_THE_PARTS.items()
            if getattr(config, attr, None) not in plain
        ]
        if outside:
            raise ConfigError(
                f"pipeline: cannot split {name}: its forward applies {', '.join(outside)} outside the embedding, "
                "layers, norm and head a stage runs"
            )
        use_varlen_attention(model)
        assert decoder is not None
        self.model, self.decoder = model, decoder
        self.parts: dict[str, tuple[nn.Module, str]] = {
            "embed": (decoder, "embed_tokens"),
            "layers": (decoder, "layers"),
            "norm": (decoder, "norm"),
            "head": (model, "lm_head"),
        }
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.needs_metadata = True

    def embed(self, input_ids: Tensor) -> Tensor:
        """``model.embed_tokens(input_ids)``."""
        return self.decoder.embed_tokens(input_ids)

    def layer_inputs(self, hidden: Tensor, position_ids: Tensor) -> dict[str, Any]:
        """The keyword arguments of a decoder layer: positions, their rotary embeddings (``model.rotary_emb``), the
        microbatch's metadata (from the active cache; built from the positions without one) and the placeholder mask
        that goes with it."""
        cache = active_cache()
        meta = SequenceMetadata.from_position_ids(position_ids) if cache is None else cache.get(hidden)
        rows, seq_len = position_ids.shape
        return {
            "attention_mask": packed_attention_mask(meta, rows, seq_len),
            "position_ids": position_ids,
            "position_embeddings": self.decoder.rotary_emb(hidden, position_ids),
            "use_cache": False,
            METADATA_KWARG: meta,
        }

    def run_layer(self, layer: nn.Module, hidden: Tensor, inputs: dict[str, Any]) -> Tensor:
        """``layer(hidden, **inputs)`` (the hidden states of a layer that returns a tuple)."""
        out = layer(hidden, **inputs)
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: Tensor) -> Tensor:
        """``lm_head(model.norm(hidden))``."""
        return self.model.lm_head(self.decoder.norm(hidden))
