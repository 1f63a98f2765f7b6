"""``HFCausalLMModule``: train any transformers causal LM (dense or MoE) on packed batches, correctly by default."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from typing_extensions import override

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast._compile import check_compile, compile_layers
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.hf.attention import use_varlen_attention
from lightning_llmfast.hf.context import use_context_parallel
from lightning_llmfast.hf.inputs import packed_model_inputs
from lightning_llmfast.modules.grouped_router import GroupedRouterMixin
from lightning_llmfast.modules.losses import causal_lm_loss, scale_by_token_share, shared_batch_losses
from lightning_llmfast.moe.stats import MoELayer
from lightning_llmfast.parallel.export import export_module
from lightning_llmfast.parallel.fsdp import materialize_module
from lightning_llmfast.parallel.pretrained import PRETRAINED_ATTRIBUTE, PretrainedCheckpoint

if TYPE_CHECKING:
    from lightning_llmfast.data import PackedBatch

__all__ = ["HFCausalLMModule"]


class HFCausalLMModule(GroupedRouterMixin, L.LightningModule):
    """Trains a transformers causal LM on :class:`~lightning_llmfast.data.PackedBatch` batches.

    Every forward goes through :func:`~lightning_llmfast.packed_model_inputs`, so each document attends to itself
    only, with no cache and no host sync. Whatever ``attn_implementation`` the model was built with, its attention runs
    through the package's varlen attention (:func:`~lightning_llmfast.hf.attention.use_varlen_attention`, set at
    construction): no ``(B, 1, T, T)`` mask, activation memory linear in the row length. The loss is computed here
    from the logits and the batch's already shifted labels (never passed to the model, which would shift them again),
    token-weighted over the optimizer step with :func:`~lightning_llmfast.causal_lm_loss`. The model's MoE blocks are
    swapped for grouped, sync-free ones at ``configure_model`` (:class:`~lightning_llmfast.GroupedRouterMixin`, same
    parameters) and their load-balancing losses are added with ``aux_loss_coef``, weighted by
    :func:`~lightning_llmfast.scale_by_token_share`. Under ``LLMFastStrategy(context_parallel_size=N)`` each rank
    trains its shard of every batch exactly as one process would the whole batch
    (:func:`~lightning_llmfast.hf.context.use_context_parallel` at setup; multi-head latent attention gathers its
    compressed latent instead of per-head keys and values).

    A local pretrained directory (as ``save_pretrained`` writes it; nothing is downloaded) builds the model on the
    meta device from its ``config.json``, in fp32 and in train mode; the strategy parallelises it, then each rank reads
    from the safetensors shards only the slices it holds (:mod:`~lightning_llmfast.parallel.pretrained`; per-expert
    keys into the fused expert tensors, under expert parallelism only the local experts; a block-FP8 release such as
    DeepSeek-V3 is dequantized on read, its multi-token-prediction layer skipped). Outside a Trainer,
    :meth:`materialize` reads it. The directory is kept in the hyper-parameters, so ``load_from_checkpoint`` works.

    Args:
        model: a transformers causal LM, a transformers config to build one from (randomly initialised, no
            download), or a local pretrained directory (:meth:`from_pretrained`). From LightningCLI:
            ``--model.model=/path/to/dir``, or ``--model.model=transformers.Qwen3MoeConfig
            --model.model.init_args.hidden_size=64 ...``.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW weight decay of matrices (norms, biases and other vectors get none).
        aux_loss_coef: weight of the summed load-balancing losses of the grouped MoE blocks (0 disables it).
        warmup_steps: linear warm-up length in optimizer steps.
        min_lr_ratio: after the warm-up the learning rate follows a cosine from ``lr`` down to ``min_lr_ratio * lr``
            at the run's last optimizer step (``Trainer.estimated_stepping_batches``); ``1.0`` keeps it constant.
        attn_implementation: attention implementation a model is built with from a config (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``...); a given model keeps its own. Packed batches attend through
            ``"llmfast_varlen"`` either way (the model's config then names it); the model called without the
            package's metadata (``module.model.generate``) attends as ``"sdpa"``.
        moe_backend: routing backend of the swapped MoE blocks (``"auto"``, ``"torch"`` or ``"triton"``).
        compile: compile every decoder layer with ``torch.compile(fullgraph=True)`` at ``configure_model``, after the
            MoE swap, as torchtitan does (``True``: the default backend; or a backend name such as ``"aot_eager"``).

    Example::

        config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, vocab_size=258)
        module = HFCausalLMModule(config, lr=3e-3)
        trainer = L.Trainer(strategy="llmfast", callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor()])
        trainer.fit(module, datamodule=PackedDataModule(seq_len=256))

        module = HFCausalLMModule.from_pretrained("Qwen3-30B-A3B", lr=1e-5, min_lr_ratio=0.1)
        L.Trainer(strategy=LLMFastStrategy(sharding="fsdp", expert_parallel_size=8), devices=8).fit(module, dm)
    """

    def __init__(
        self,
        model: PreTrainedModel | PreTrainedConfig | str | os.PathLike[str],
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        aux_loss_coef: float = 0.01,
        warmup_steps: int = 10,
        attn_implementation: str = "sdpa",
        moe_backend: str = "auto",
        compile: bool | str = False,
        min_lr_ratio: float = 1.0,
    ) -> None:
        super().__init__()
        self.compile_layers = check_compile(compile)
        check_number("lr", lr, low=0.0, low_open=True)
        check_number("weight_decay", weight_decay, low=0.0)
        check_number("aux_loss_coef", aux_loss_coef, low=0.0)
        check_int("warmup_steps", warmup_steps, low=0)
        check_number("min_lr_ratio", min_lr_ratio, low=0.0, high=1.0)
        self.source: Path | None = None
        """The pretrained directory the model was built from (its tokenizer and generation config are exported)."""
        if isinstance(model, (str, os.PathLike)):
            model = str(model)  # kept in the hyper-parameters: load_from_checkpoint rebuilds from the directory
            self.save_hyperparameters()
            self.source = Path(model)
            model = _meta_model(PretrainedCheckpoint.open(model), attn_implementation)
        else:
            self.save_hyperparameters(ignore=["model"])
        if isinstance(model, PreTrainedConfig):
            model = AutoModelForCausalLM.from_config(model, attn_implementation=attn_implementation)
        elif not isinstance(model, nn.Module) or not isinstance(getattr(model, "config", None), PreTrainedConfig):
            raise ConfigError(
                f"model: expected a transformers causal LM, its config or a pretrained directory, got "
                f"{type(model).__name__}"
            )
        use_varlen_attention(model)
        self.model = model
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.aux_loss_coef, self.moe_backend, self.min_lr_ratio = aux_loss_coef, moe_backend, min_lr_ratio
        self._val_sums: list[Tensor] = []

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **kwargs: Any) -> HFCausalLMModule:
        """The module for a local pretrained directory (``save_pretrained``'s layout); weights are read per rank
        once the strategy has parallelised the model (or by :meth:`materialize`).

        Args:
            directory: the directory (``config.json``, safetensors shards and index, tokenizer files).
            **kwargs: the other arguments of :class:`HFCausalLMModule`.

        Raises:
            CheckpointError: no ``config.json``, missing or corrupt shards, keys the shards do not hold.
            ConfigError: an unsupported architecture (the supported families are named), or attention that cannot run
            through the package's varlen attention (the model is named).

        Example::

            module = HFCausalLMModule.from_pretrained("checkpoints/Mixtral-8x7B", lr=1e-5, warmup_steps=100)
        """
        return cls(str(directory), **kwargs)

    def materialize(self, device: torch.device | str = "cpu") -> bool:
        """Allocate the weights still on the meta device and read them from the pretrained directory, in one
        process (the strategy does this itself, per rank, after sharding).

        Returns:
            Whether anything was on the meta device.

        Example::

            module = HFCausalLMModule.from_pretrained(directory)
            module.materialize()
            logits = module(batch)
        """
        return materialize_module(self, torch.device(device))

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning hook: a model still on the meta device gets storage (its weights come from ``checkpoint``)."""
        if any(t.is_meta for t in [*self.parameters(), *self.buffers()]):
            setattr(self.model, PRETRAINED_ATTRIBUTE, None)  # the checkpoint's weights replace the directory's
            materialize_module(self, torch.device("cpu"))

    @override
    def setup(self, stage: str) -> None:
        """Lightning hook: under a strategy with ``context_parallel_size > 1``, prepares the model for shards
        (:func:`~lightning_llmfast.hf.context.use_context_parallel`: ``"llmfast_varlen"`` attention whatever was set
        since construction, multi-head latent attention gathering its latent); a model whose attention cannot run
        under context parallelism is refused here with a ``ConfigError`` naming it, before any step."""
        super().setup(stage)
        if getattr(self.trainer.strategy, "context_parallel_size", 1) > 1:
            use_context_parallel(self.model)

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
        if stage == "val":
            self.log_validation_loss(ce, size)
            return ce
        shown_ce, shown = shared_batch_losses(ce, loss, batch.labels, module=self)
        self.log_dict({"train/loss": shown, "train/ce": shown_ce}, batch_size=size)
        return loss

    def log_validation_loss(self, ce: Tensor, batch_size: int) -> None:
        """Logs a validation batch's language-model loss as ``val/loss`` (averaged over ranks) and keeps it for the
        epoch's ``val/ppl``. The validation step calls it, and so does the pipelined strategy with the loss the
        stages computed forward.

        Example::

            module.log_validation_loss(ce, batch.batch_size)
        """
        self.log("val/loss", ce, prog_bar=True, batch_size=batch_size, sync_dist=True)
        self._val_sums.append(torch.stack([ce.detach() * batch_size, ce.new_tensor(float(batch_size))]))

    @override
    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=(0.9, 0.95))
        total = self.trainer.estimated_stepping_batches if self.min_lr_ratio < 1.0 else 0
        factor = lr_factor(self.warmup_steps, int(total) if math.isfinite(total) else 0, self.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_validation_epoch_end(self) -> None:
        """Lightning hook: logs ``val/ppl``, the exponential of the epoch's mean ``val/loss`` over every rank."""
        if not self._val_sums:
            return
        sums = self.trainer.strategy.reduce(torch.stack(self._val_sums).sum(0), reduce_op="sum")
        self._val_sums.clear()
        # Equal on every rank already; sync_dist averages equal values (one all-reduce of a scalar per epoch), which
        # Lightning asks of every epoch-level metric in a distributed run.
        self.log("val/ppl", torch.exp(sums[0] / sums[1]), prog_bar=True, sync_dist=True)

    def save_pretrained(
        self, directory: str | os.PathLike[str], *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB"
    ) -> Path:
        """Write the model as a directory ``AutoModelForCausalLM.from_pretrained`` loads, in one process.

        Sharded safetensors with their index, ``config.json``, the generation config and, for a model built from a
        pretrained directory, its tokenizer files; written into a temporary directory renamed at the end.

        Args:
            directory: the output directory (must not exist yet).
            dtype: the weights' dtype on disk (``None``: the source checkpoint's dtype, bf16 for a block-FP8 source,
                as the export CLI; :func:`~lightning_llmfast.parallel.export.export_dtype`).
            max_shard_size: largest safetensors shard (``"5GB"``, ``"500MB"`` or bytes).

        Raises:
            ConfigError: this process holds only part of the model (FSDP2, expert parallelism under any sharding, or
                a pipeline stage): save a checkpoint and export it with
                ``python -m lightning_llmfast.export CHECKPOINT OUT_DIR``; or ``directory`` exists.

        Example::

            module.save_pretrained("exported/")
            AutoModelForCausalLM.from_pretrained("exported/")
        """
        return export_module(self.model, directory, source=self.source, dtype=dtype, max_shard_size=max_shard_size)


def lr_factor(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The learning-rate multiplier per optimizer step: linear warm-up from ``1 / warmup`` to 1 over
    ``warmup_steps`` steps, then a cosine from 1 to ``min_lr_ratio`` at ``total_steps`` (constant after it, and
    constant 1 with ``min_lr_ratio == 1`` or no known total).

    Example::

        factor = lr_factor(10, 100, 0.1)
        factor(0), factor(9), factor(99)  # (0.1, 1.0, 0.1)
    """
    warmup = max(1, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup - 1:
            return (step + 1) / warmup
        decay = total_steps - warmup
        if min_lr_ratio >= 1.0 or decay <= 0:
            return 1.0
        progress = min(1.0, (step - (warmup - 1)) / decay)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _meta_model(checkpoint: PretrainedCheckpoint, attn_implementation: str) -> PreTrainedModel:
    """The checkpoint's model on the meta device (fp32, train mode), waiting for its weights."""
    config = AutoConfig.from_pretrained(checkpoint.directory, local_files_only=True)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.train()
    setattr(model, PRETRAINED_ATTRIBUTE, checkpoint)
    return model
