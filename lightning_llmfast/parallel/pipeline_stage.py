"""The seam between the pipeline runner and a model family: :class:`StageAdapter`.

:class:`~lightning_llmfast.parallel.pipeline.PipelineRunner` cuts, prunes and runs a model through this seam only,
never through a family's own attributes. An adapter says

- where the model's four parts are registered (:data:`PARTS`: the embedding, the list of transformer layers, the
  final norm and the head), as an owner module and an attribute name each, so that pruning replaces them in place
  and every kept parameter keeps the full model's name;
- how one stage runs forward: the embedding lookup (first stage), the inputs every layer of a stage takes besides
  the hidden states (:meth:`StageAdapter.layer_inputs`: computed on every stage from the microbatch's positions and
  its packed metadata, the rotary tables included; only hidden states travel through the pipe), one layer's call,
  and the final norm and head (last stage).

Two implementations: :class:`MoEGPTStageAdapter` for the package's :class:`~lightning_llmfast.models.MoEGPT`, and
:class:`~lightning_llmfast.hf.pipeline.HFDecoderStageAdapter` for transformers decoder-only causal LMs
(``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``, ``model.rotary_emb``: Qwen3-MoE,
DeepSeek-V3, Mixtral, ...). :func:`stage_adapter` picks one, or refuses the model with a ``ConfigError`` naming what
a split needs.

Example::

    adapter = stage_adapter(model)
    owner, name = adapter.parts["layers"]   # (model, "layers") for a MoEGPT, (model.model, "layers") for Mixtral
    hidden = adapter.embed(input_ids)
    inputs = adapter.layer_inputs(hidden, position_ids)
    for layer in getattr(owner, name):
        hidden = adapter.run_layer(layer, hidden, inputs)
    logits = adapter.head(hidden)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Protocol

from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models.model import MoEGPT, dense_document_mask, rope_tables
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

__all__ = ["PARTS", "MoEGPTStageAdapter", "StageAdapter", "stage_adapter"]

PARTS = ("embed", "layers", "norm", "head")
"""The parts a :class:`StageAdapter` locates: the embedding, the layer list, the final norm and the head."""


class StageAdapter(Protocol):
    """What the pipeline needs to know about a model family (module docstring).

    Attributes:
        parts: for each name of :data:`PARTS`, the module that registers that part and its attribute name.
        hidden_size: width of the hidden states sent between stages.
        vocab_size: width of the logits the last stage returns.
        needs_metadata: whether the stages read the microbatch's packed metadata from the active
            :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` (the runner then cuts and opens it).

    Example::

        class MyAdapter:  # structural: no base class to inherit
            parts = {"embed": (model, "wte"), "layers": (model, "blocks"), "norm": (model, "ln_f"),
                     "head": (model, "out")}
            hidden_size, vocab_size, needs_metadata = 512, 32000, True
            ...
    """

    @property
    def parts(self) -> Mapping[str, tuple[nn.Module, str]]: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def needs_metadata(self) -> bool: ...

    def embed(self, input_ids: Tensor) -> Tensor:
        """``(b, T, hidden)`` hidden states of ``(b, T)`` token ids (first stage)."""
        ...

    def layer_inputs(self, hidden: Tensor, position_ids: Tensor) -> Any:
        """What every layer of a stage takes besides the hidden states, from the microbatch's ``(b, T)`` positions
        and its metadata (rotary tables, metadata or mask): built once per stage forward."""
        ...

    def run_layer(self, layer: nn.Module, hidden: Tensor, inputs: Any) -> Tensor:
        """One layer's forward on ``hidden`` with :meth:`layer_inputs`' result."""
        ...

    def head(self, hidden: Tensor) -> Tensor:
        """``(b, T, vocab)`` logits: the final norm, then the head (last stage)."""
        ...


class MoEGPTStageAdapter:
    """The :class:`StageAdapter` of a :class:`~lightning_llmfast.models.MoEGPT`: ``embed``, ``layers``, ``norm``,
    ``lm_head``; the rotary tables from the positions, the attention metadata as the config's
    ``attention_metadata`` says (the cache's metadata for ``"cached"``, a dense document mask for ``"dense"``).

    Example::

        adapter = MoEGPTStageAdapter(model)
        adapter.parts["head"]  # (model, "lm_head")
    """

    def __init__(self, model: MoEGPT) -> None:
        config = model.config
        self.model = model
        self.parts: dict[str, tuple[nn.Module, str]] = {
            "embed": (model, "embed"),
            "layers": (model, "layers"),
            "norm": (model, "norm"),
            "head": (model, "lm_head"),
        }
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.needs_metadata = config.attention_metadata == "cached"

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embedding."""
        return self.model.embed(input_ids)

    def layer_inputs(self, hidden: Tensor, position_ids: Tensor) -> Any:
        """``(rope tables, positions, metadata or mask)``: the arguments of a ``Block`` after the hidden states."""
        config = self.model.config
        meta: SequenceMetadata | Tensor | None = None
        if config.attention_metadata == "dense":
            meta = dense_document_mask(position_ids)
        elif config.attention_metadata == "cached":
            cache = active_cache()
            meta = SequenceMetadata.from_position_ids(position_ids) if cache is None else cache.get(hidden)
        return rope_tables(position_ids, config.head_dim, config.rope_theta), position_ids, meta

    def run_layer(self, layer: nn.Module, hidden: Tensor, inputs: Any) -> Tensor:
        """``layer(hidden, rope, positions, metadata)``."""
        return layer(hidden, *inputs)

    def head(self, hidden: Tensor) -> Tensor:
        """``lm_head(norm(hidden))``."""
        return self.model.lm_head(self.model.norm(hidden))


def stage_adapter(model: nn.Module) -> StageAdapter:
    """The :class:`StageAdapter` of ``model``.

    Args:
        model: a :class:`~lightning_llmfast.models.MoEGPT` or a transformers decoder-only causal LM (a
            ``PreTrainedModel`` with ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head`` and
            ``model.rotary_emb``).

    Raises:
        ConfigError: any other model, or a transformers model that cannot be cut (encoder-decoder, a part missing,
            attention that cannot run through the package's varlen attention); the message says what is needed.

    Example::

        adapter = stage_adapter(module.model)  # MoEGPTLightningModule's or HFCausalLMModule's model
    """
    if isinstance(model, MoEGPT):
        return MoEGPTStageAdapter(model)
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported already
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from lightning_llmfast.hf.pipeline import HFDecoderStageAdapter

        return HFDecoderStageAdapter(model)
    raise ConfigError(
        f"pipeline: cannot split a {type(model).__name__}; pipelining needs a MoEGPT (embed, layers, norm, lm_head) "
        "or a transformers decoder-only causal LM (model.embed_tokens, model.layers, model.norm, lm_head, "
        "model.rotary_emb)"
    )
