"""LightningModule around :class:`~lightning_llmfast.models.MoEGPT` for packed batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_llmfast.errors import MetadataError
from lightning_llmfast.models.model import MoEGPT, MoEGPTConfig

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_llmfast.data import PackedBatch

__all__ = ["MoEGPTLightningModule"]

# Checkpoints store the config object among the hyper-parameters; allow it under torch.load(weights_only=True),
# Lightning's default, so resuming needs no unsafe loading.
torch.serialization.add_safe_globals([MoEGPTConfig])

_DEFAULT_CONFIG = MoEGPTConfig()  # never used itself: each module gets a fresh copy


class MoEGPTLightningModule(L.LightningModule):
    """Trains :class:`MoEGPT` with cross-entropy over ``labels`` plus the router's load-balancing loss.

    Args:
        config: the model's hyper-parameters (LightningCLI: ``model.config`` in YAML, ``--model.config.n_layers``
            etc. on the command line); default ``MoEGPTConfig()``.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` and kept constant afterwards.
        weight_decay: AdamW weight decay, applied to matrices only (not norms).
        aux_loss_coef: weight of the summed Switch load-balancing loss of all MoE layers.
        warmup_steps: linear warm-up length in optimizer steps.

    Example::

        module = MoEGPTLightningModule(MoEGPTConfig(n_layers=2), lr=3e-3)
        trainer = L.Trainer(max_steps=20)
        trainer.fit(module, datamodule=PackedDataModule())
    """

    def __init__(
        self,
        config: MoEGPTConfig = _DEFAULT_CONFIG,  # not None: LightningCLI then lists the fields in --help
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        aux_loss_coef: float = 0.01,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = MoEGPTConfig() if config is None or config is _DEFAULT_CONFIG else config
        self.model = MoEGPT(self.config)
        self.lr, self.weight_decay = lr, weight_decay
        self.aux_loss_coef, self.warmup_steps = aux_loss_coef, warmup_steps

    @override
    def forward(self, batch: PackedBatch) -> Tensor:
        return self.model(batch.input_ids, batch.position_ids)

    def _loss(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        logits = self(batch)
        # ignore_index drops padding and each document's last token; the mean divides by the count on the device,
        # so no host sync is needed here.
        ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=-100)
        return ce, ce + self.aux_loss_coef * self.model.aux_loss()

    @override
    def training_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        ce, loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        self.log("train/ce", ce, batch_size=batch.batch_size)
        return loss

    @override
    def validation_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        ce, _ = self._loss(batch)
        self.log("val/loss", ce, prog_bar=True, batch_size=batch.batch_size, sync_dist=True)
        return ce

    def flops_per_batch(self, batch: PackedBatch) -> int:
        """Training FLOPs of ``batch``, from its host-side boundaries (no device sync); used for MFU."""
        cu = batch.cu_seqlens_cpu if batch.cu_seqlens_cpu is not None else batch.cu_seqlens
        if cu.device.type != "cpu":
            raise MetadataError("flops_per_batch needs host-side cu_seqlens (PackedBatch.cu_seqlens_cpu), got none")
        lengths = (cu[1:] - cu[:-1]).tolist()
        return self.model.flops_per_batch(lengths)

    @override
    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        warmup = max(1, self.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
