"""The reference MoE GPT (plain PyTorch) and its LightningModule, used by examples, tests and benchmarks.

Names resolve lazily: ``MoEGPT`` and ``RMSNorm`` import without Lightning, ``MoEGPTLightningModule`` needs it.
"""

from __future__ import annotations

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

# public name -> submodule
_LAZY: dict[str, str] = {
    "MoEGPT": "lightning_llmfast.models.model",
    "MoEGPTConfig": "lightning_llmfast.models.config",
    "MoEGPTLightningModule": "lightning_llmfast.modules.reference",
    "RMSNorm": "lightning_llmfast.models.rmsnorm",
    "swap_rms_norms": "lightning_llmfast.models.rmsnorm",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
