"""transformers causal LMs on packed batches: :func:`packed_model_inputs` and :class:`HFCausalLMModule`.

Example::

    from lightning_llmfast.hf import HFCausalLMModule, packed_model_inputs

    logits = hf_model(**packed_model_inputs(batch, hf_model)).logits  # documents never attend to each other
    trainer.fit(HFCausalLMModule(hf_model), datamodule=PackedDataModule())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

_LAZY = {
    "packed_model_inputs": "lightning_llmfast.hf.inputs",
    "block_causal_mask": "lightning_llmfast.hf.inputs",
    "HFCausalLMModule": "lightning_llmfast.modules.hf",
    "use_varlen_attention": "lightning_llmfast.hf.attention",
}

__all__ = ["HFCausalLMModule", "block_causal_mask", "packed_model_inputs", "use_varlen_attention"]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.hf.attention import use_varlen_attention
    from lightning_llmfast.hf.inputs import block_causal_mask, packed_model_inputs
    from lightning_llmfast.modules.hf import HFCausalLMModule
