"""``HFCausalLMModule``: train any transformers causal LM (dense or MoE) on packed batches, correctly by default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from typing_extensions import override

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast._compile import check_compile, compile_layers
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.hf.inputs import packed_model_inputs
from lightning_llmfast.modules.grouped_router import GroupedRouterMixin
from lightning_llmfast.modules.losses import causal_lm_loss, scale_by_token_share
from lightning_llmfast.moe.stats import MoELayer

if TYPE_CHECKING:
    from lightning_llmfast.data import PackedBatch

__all__ = ["HFCausalLMModule"]


class HFCausalLMModule(GroupedRouterMixin, L.LightningModule):
    """Trains a transformers causal LM on :class:`~lightning_llmfast.data.PackedBatch` batches.

    Every forward goes through :func:`~lightning_llmfast.packed_model_inputs`, so each document attends to itself
    only, with no cache and no host sync. The loss is computed here from the logits and the batch's already shifted
    labels (never passed to the model, which would shift them again), token-weighted over the optimizer step with
    :func:`~lightning_llmfast.causal_lm_loss`. The model's MoE blocks are swapped for grouped, sync-free ones at
    ``configure_model`` (:class:`~lightning_llmfast.GroupedRouterMixin`, same parameters) and their load-balancing
    losses are added with ``aux_loss_coef``, weighted by :func:`~lightning_llmfast.scale_by_token_share`.

    Args:
        model: a transformers causal LM, or a transformers config to build one from (randomly initialised, no
            download). From LightningCLI: ``--model.model=transformers.Qwen3MoeConfig
            --model.model.init_args.hidden_size=64 ...``.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW weight decay of matrices (norms, biases and other vectors get none).
        aux_loss_coef: weight of the summed load-balancing losses of the grouped MoE blocks (0 disables it).
        warmup_steps: linear warm-up length in optimizer steps.
        attn_implementation: attention implementation of a model built from a config (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``...); a given model keeps its own.
        moe_backend: routing backend of the swapped MoE blocks (``"auto"``, ``"torch"`` or ``"triton"``).
        compile: compile every decoder layer with ``torch.compile(fullgraph=True)`` at ``configure_model``, after the
            MoE swap, as torchtitan does (``True``: the default backend; or a backend name such as ``"aot_eager"``).

    Example::

        config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, vocab_size=258)
        module = HFCausalLMModule(config, lr=3e-3)
        trainer = L.Trainer(strategy="llmfast", callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor()])
        trainer.fit(module, datamodule=PackedDataModule(seq_len=256))
    """

    def __init__(
        self,
        model: PreTrainedModel | PreTrainedConfig,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        aux_loss_coef: float = 0.01,
        warmup_steps: int = 10,
        attn_implementation: str = "sdpa",
        moe_backend: str = "auto",
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        self.compile_layers = check_compile(compile)
        check_number("lr", lr, low=0.0, low_open=True)
        check_number("weight_decay", weight_decay, low=0.0)
        check_number("aux_loss_coef", aux_loss_coef, low=0.0)
        check_int("warmup_steps", warmup_steps, low=0)
        if isinstance(model, PreTrainedConfig):
            model = AutoModelForCausalLM.from_config(model, attn_implementation=attn_implementation)
        elif not isinstance(model, nn.Module) or not isinstance(getattr(model, "config", None), PreTrainedConfig):
            raise ConfigError(f"model: expected a transformers causal LM or its config, got {type(model).__name__}")
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.aux_loss_coef, self.moe_backend = aux_loss_coef, moe_backend

    @override
    def configure_model(self) -> None:
        """Lightning hook: swaps the MoE blocks, then compiles the decoder layers once when ``compile`` is set."""
        super().configure_model()
        if self.compile_layers is not False:
            compile_layers(self.model, self.compile_layers)
            self.compile_layers = False

    @override
    def forward(self, batch: PackedBatch) -> Tensor:
        """``(B, T, vocab_size)`` logits of a packed batch, every document attending to itself only."""
        return self.model(**packed_model_inputs(batch, self.model)).logits

    def aux_loss(self) -> Tensor | None:
        """Sum of the load-balancing losses of the grouped MoE blocks' last forward, or ``None`` without any."""
        moe = (m for m in self.model.modules() if isinstance(m, MoELayer) and m.stats is not None)
        losses = [m.stats.aux_loss for m in moe]
        return torch.stack(losses).sum() if losses else None

    def _loss(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        ce = causal_lm_loss(self(batch), batch.labels, module=self)
        aux = self.aux_loss() if self.aux_loss_coef > 0 else None
        if aux is None:
            return ce, ce
        return ce, ce + self.aux_loss_coef * scale_by_token_share(aux, batch.labels, module=self)

    @override
    def training_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        return self._logged_loss(batch, "train")

    @override
    def validation_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        return self._logged_loss(batch, "val")

    def _logged_loss(self, batch: PackedBatch, stage: str) -> Tensor:
        ce, loss = self._loss(batch)
        size = batch.batch_size
        if stage == "val":  # the language-model loss only, averaged over ranks
            self.log("val/loss", ce, prog_bar=True, batch_size=size, sync_dist=True)
            return ce
        self.log_dict({"train/loss": loss, "train/ce": ce}, batch_size=size)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=(0.9, 0.95))
        # LinearLR from lr / warmup to lr over warmup steps, constant afterwards.
        warmup = max(1, self.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup - 1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
