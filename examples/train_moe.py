"""Train the reference MoE GPT on packed documents with lightning_llmfast.

    python examples/train_moe.py fit --config examples/configs/tiny.yaml

The default corpus is the running Python's standard library source (no download). Your own data, prepared once with
``python -m lightning_llmfast.prepare``, comes in with ``--data lightning_llmfast.PreparedDataModule --data.path DIR``
(and ``--data.seq_len`` one of the lengths it was prepared for); the reference model's vocabulary follows the data's.
A local pretrained transformers directory is fine-tuned with ``--model lightning_llmfast.HFCausalLMModule
--model.model /path/to/dir`` (``examples/configs/finetune.yaml``). ``fit --model.help MoEGPTLightningModule`` lists
the reference model's size settings (``--model.config.n_layers`` ...). The run ends with one summary line, printed by
rank 0: real tokens/sec of all ranks together over the whole fit (padding excluded; unlike the logged
``train/tokens_per_sec`` it includes the first step and validation) and the first and last training loss (rank 0's).
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

import lightning_llmfast  # noqa: F401  (registers strategy="llmfast")
from lightning_llmfast import MoEGPTLightningModule
from lightning_llmfast.cli import LLMFastCLI

if TYPE_CHECKING:
    from torch import Tensor


class RunSummary(pl.Callback):
    """Prints one line on rank 0 at the end of fit: global tokens/sec and the first and last training loss.

    Losses are kept as device tensors and read once at the end, so the summary adds no per-step host sync.
    """

    def __init__(self) -> None:
        self._first: Tensor | None = None
        self._last: Tensor | None = None
        self._tokens = 0
        self._start = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach()
        if self._first is None:
            self._first = loss
        self._last = loss
        self._tokens += batch.num_tokens

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._first is None or self._last is None:
            return
        elapsed = time.perf_counter() - self._start
        # Every rank counted its own tokens: the rate of the run is their sum (one all-reduce, at the end).
        tokens = trainer.strategy.reduce(torch.tensor(float(self._tokens), device=pl_module.device), reduce_op="sum")
        if not trainer.is_global_zero:
            return
        rate = float(tokens) / elapsed
        print(
            f"summary: steps={trainer.global_step} ranks={trainer.world_size} tokens/sec={rate:,.0f} "
            f"(real tokens of all ranks over the whole fit, validation included) first_loss={self._first.item():.3f} "
            f"last_loss={self._last.item():.3f} time={elapsed:.1f}s"
        )


def import_object(path: str) -> Any:
    """The class at a dotted import path (the parsed ``class_path``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class TrainCLI(LLMFastCLI):
    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Any LightningModule (the reference MoE GPT unless --model names another, e.g. HFCausalLMModule) and any data
        # module (PackedDataModule unless --data names another); the reference model embeds the data's vocabulary.
        parser.set_defaults(
            {
                "model": {"class_path": "lightning_llmfast.MoEGPTLightningModule"},
                "data": {"class_path": "lightning_llmfast.PackedDataModule"},
            }
        )

    @override
    def instantiate_classes(self) -> None:
        # The reference model takes its vocabulary from the data (a link would demand `config` of every model class).
        # Data modules only store their settings when built, so building one here to ask is cheap.
        config = self.config[self.subcommand] if self.subcommand else self.config
        if import_object(config.model.class_path) is MoEGPTLightningModule:
            data = import_object(config.data.class_path)(**config.data.init_args.as_dict())
            config.model.init_args.config.vocab_size = data.vocab_size
        super().instantiate_classes()

    @override
    def before_fit(self) -> None:
        # Appended here rather than in trainer_defaults so a config's own `callbacks:` list does not drop it.
        self.trainer.callbacks.append(RunSummary())


def main(args: list[str] | None = None) -> TrainCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its model, data and trainer)."""
    return TrainCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
