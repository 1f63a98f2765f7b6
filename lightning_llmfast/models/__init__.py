"""The reference MoE GPT (plain PyTorch) and its LightningModule, used by examples, tests and benchmarks."""

from lightning_llmfast.models.model import MoEGPT, MoEGPTConfig
from lightning_llmfast.models.module import MoEGPTLightningModule
from lightning_llmfast.models.rmsnorm import RMSNorm, swap_rms_norms

__all__ = ["MoEGPT", "MoEGPTConfig", "MoEGPTLightningModule", "RMSNorm", "swap_rms_norms"]
