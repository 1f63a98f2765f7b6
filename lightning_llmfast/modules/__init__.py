"""The LightningModules (Lightning layer): the reference MoE GPT's module, the transformers causal-LM module, the
mixin that swaps a module's MoE blocks for grouped ones, and the token-weighted losses they train with.

Example::

    from lightning_llmfast.modules import HFCausalLMModule

    trainer.fit(HFCausalLMModule(hf_model), datamodule=PackedDataModule())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

_LAZY: dict[str, str] = {
    "GroupedRouterMixin": "lightning_llmfast.modules.grouped_router",
    "HFCausalLMModule": "lightning_llmfast.modules.hf",
    "MoEGPTLightningModule": "lightning_llmfast.modules.reference",
    "causal_lm_loss": "lightning_llmfast.modules.losses",
    "scale_by_token_share": "lightning_llmfast.modules.losses",
}

__all__ = ["GroupedRouterMixin", "HFCausalLMModule", "MoEGPTLightningModule", "causal_lm_loss", "scale_by_token_share"]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.modules.grouped_router import GroupedRouterMixin
    from lightning_llmfast.modules.hf import HFCausalLMModule
    from lightning_llmfast.modules.losses import causal_lm_loss, scale_by_token_share
    from lightning_llmfast.modules.reference import MoEGPTLightningModule
