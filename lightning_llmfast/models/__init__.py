"""The reference MoE GPT (plain PyTorch) and its LightningModule, used by examples, tests and benchmarks."""

from lightning_llmfast.models.model import MoEGPT, MoEGPTConfig
from lightning_llmfast.models.module import MoEGPTLightningModule

__all__ = ["MoEGPT", "MoEGPTConfig", "MoEGPTLightningModule"]
