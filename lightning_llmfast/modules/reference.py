"""LightningModule around :class:`~lightning_llmfast.models.MoEGPT` for packed batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import Metric
from typing_extensions import override

from lightning_llmfast._compile import check_compile, compile_layers
from lightning_llmfast.data.packing import IGNORE_INDEX
from lightning_llmfast.errors import ConfigError, MetadataError
from lightning_llmfast.models.config import MoEGPTConfig
from lightning_llmfast.models.model import MoEGPT
from lightning_llmfast.modules.losses import causal_lm_loss, scale_by_token_share, shared_batch_losses
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_llmfast.data import PackedBatch

__all__ = ["MoEGPTLightningModule"]

_DEFAULT_CONFIG = MoEGPTConfig()  # never used itself: each module gets a fresh copy


class MoEGPTLightningModule(L.LightningModule):
    """Trains :class:`MoEGPT` with cross-entropy over ``labels`` plus the router's load-balancing loss.

    Both are token-weighted over the optimizer step (:func:`~lightning_llmfast.causal_lm_loss`,
    :func:`~lightning_llmfast.scale_by_token_share`), so ``N`` ranks with gradient accumulation compute the
    gradients of one process on all their batches. ``val/loss`` and ``test/loss`` are the token-weighted cross
    entropy over the whole split and all ranks; :meth:`predict_step` returns per-sequence losses.

    Args:
        config: the model's hyper-parameters (LightningCLI: ``model.config`` in YAML, ``--model.config.n_layers``
            etc. on the command line); default ``MoEGPTConfig()``.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` and kept constant afterwards.
        weight_decay: AdamW weight decay, applied to matrices only (not norms).
        aux_loss_coef: weight of the summed Switch load-balancing loss of all MoE layers.
        warmup_steps: linear warm-up length in optimizer steps.
        compile: compile every transformer layer with ``torch.compile(fullgraph=True)`` at ``configure_model``, as
            torchtitan does (``True``: the default backend; or a backend name such as ``"aot_eager"``). The model's
            ``forward``, which binds the batch's tokens to the packed metadata, stays eager.

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
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        self.compile_layers = check_compile(compile)
        self.save_hyperparameters()
        self.config = MoEGPTConfig() if config is None or config is _DEFAULT_CONFIG else config
        self.model = MoEGPT(self.config)
        self.lr, self.weight_decay = lr, weight_decay
        self.aux_loss_coef, self.warmup_steps = aux_loss_coef, warmup_steps
        self.val_ce, self.test_ce = _TokenMean(), _TokenMean()

    @override
    def configure_model(self) -> None:
        """Lightning hook: compiles the transformer layers once when ``compile`` is set."""
        if self.compile_layers is not False:
            compile_layers(self.model, self.compile_layers, self.model.layers)
            self.compile_layers = False

    @override
    def forward(self, batch: PackedBatch) -> Tensor:
        # A context-parallel shard's pieces are not whole documents: its metadata comes from the shard's plan (the
        # open metadata cache builds the same from the batch), never from its positions.
        if batch.context is not None and self.model.config.attention_metadata != "cached":
            raise ConfigError(
                f"context parallelism gathers keys and values inside varlen attention: attention_metadata="
                f"{self.model.config.attention_metadata!r} would attend only this rank's positions; use "
                "attention_metadata='cached' (the default)"
            )
        shard = batch.context is not None and active_cache() is None
        metadata = SequenceMetadata.from_batch(batch) if shard else None
        return self.model(batch.input_ids, batch.position_ids, metadata=metadata)

    def _loss(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        logits = self(batch)
        # Token-weighted over the optimizer step (all ranks, all accumulated micro-batches), and so is the router's
        # aux loss; counts stay on the device, so no host sync is needed here.
        ce = causal_lm_loss(logits, batch.labels, module=self, ignore_index=IGNORE_INDEX)
        aux = scale_by_token_share(self.model.aux_loss(), batch.labels, module=self, ignore_index=IGNORE_INDEX)
        return ce, ce + self.aux_loss_coef * aux

    @override
    def training_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        ce, loss = self._loss(batch)
        shown_ce, shown = shared_batch_losses(ce, loss, batch.labels, module=self, ignore_index=IGNORE_INDEX)
        self.log("train/loss", shown, prog_bar=True, batch_size=batch.batch_size)
        self.log("train/ce", shown_ce, batch_size=batch.batch_size)
        return loss

    @override
    def validation_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        return self._evaluate(batch, self.val_ce, "val/loss")

    @override
    def test_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        return self._evaluate(batch, self.test_ce, "test/loss")

    def _evaluate(self, batch: PackedBatch, metric: _TokenMean, name: str) -> Tensor:
        """Cross entropy of ``batch``; the logged value is token-weighted over the whole split and all ranks."""
        ce, _ = self._loss(batch)
        # Weighted by label tokens: filler batches (all labels ignored) weigh nothing, and the epoch value is the
        # split's mean token loss, not a mean of per-batch or per-rank means.
        metric.update(ce, (batch.labels != IGNORE_INDEX).sum())
        self.log(name, metric, prog_bar=True, batch_size=batch.batch_size)
        return ce

    @override
    def predict_step(self, batch: PackedBatch, batch_idx: int) -> dict[str, Any]:
        """Per-sequence losses: ``{"documents": list[int], "loss": (S,), "tokens": (S,)}``.

        One entry per real sequence of the batch (padding tails and filler batches are left out): its corpus
        document (``batch.documents``), its mean token cross entropy and its number of label tokens. A document
        longer than ``seq_len`` comes as several entries (its chunks); its loss is
        ``sum(loss * tokens) / sum(tokens)`` over them. ``trainer.predict`` returns one such dict per batch.

        Raises:
            MetadataError: the batch has no host-side ``documents`` or ``cu_seqlens_cpu``.
        """
        if batch.documents is None or batch.cu_seqlens_cpu is None:
            raise MetadataError("predict_step needs batches with host-side documents and cu_seqlens_cpu")
        logits = self(batch)
        token_losses = F.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        cu = batch.cu_seqlens_cpu
        segments = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
        segments = segments.to(logits.device, non_blocking=True)
        count = torch.zeros(cu.numel() - 1, device=logits.device).index_add_(
            0, segments, (batch.labels.flatten() != IGNORE_INDEX).float()
        )
        total = torch.zeros_like(count).index_add_(0, segments, token_losses)
        real = [i for i, document in enumerate(batch.documents) if document >= 0]
        keep = torch.tensor(real, dtype=torch.long).to(logits.device, non_blocking=True)
        return {
            "documents": [batch.documents[i] for i in real],
            "loss": total[keep] / count[keep].clamp_min(1),
            "tokens": count[keep],
        }

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


class _TokenMean(Metric):
    """Mean of per-batch means weighted by their label tokens, summed over ranks (no host sync per update).

    torchmetrics' ``MeanMetric`` checks every update for NaN with a host sync, and ignores weights without the check.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, mean: Tensor, count: Tensor) -> None:
        self.total += mean.detach().double() * count
        self.count += count

    @override
    def compute(self) -> Tensor:
        return (self.total / self.count.clamp_min(1)).float()
