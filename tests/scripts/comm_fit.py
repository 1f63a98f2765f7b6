"""Fit a tiny byte-level LM on the stdlib corpus under LLMFastStrategy with a gradient-reduction setting.

Run by tests/test_grad_compression.py (Lightning launches the second rank). Every rank writes ``<out>.rank<r>.pt``:
the loss of every step (``losses``), its local gradient of the first batch computed outside DDP
(``local_grads``, before any reduction), the reduced gradient the optimizer saw at the first step
(``reduced_grads``) and the bytes the last step's buckets sent (``wire_bytes``). ``--metrics DIR`` adds
``SystemMetricsMonitor`` and a CSVLogger writing into ``DIR``; ``--save-at N`` writes ``<ckpt>`` after step ``N``;
``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_llmfast import LLMFastStrategy, PackedDataModule, SystemMetricsMonitor
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.comm import PowerSGDConfig
from lightning_llmfast.data import IGNORE_INDEX


class TinyLM(L.LightningModule):
    """Embedding, two residual MLP blocks, head; the per-rank mean cross-entropy (so local gradients are its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # The head is registered first but gets its gradient first: DDP's first bucket layout (reversed registration
        # order) differs from the one it rebuilds after the first step (gradient-ready order).
        self.head = nn.Linear(32, 258)
        self.embed = nn.Embedding(258, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))

    def loss(self, batch: Any) -> torch.Tensor:
        h = self.embed(batch.input_ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Recorder(L.Callback):
    def __init__(self, out: str, save_at: int | None, ckpt: str) -> None:
        self.out, self.save_at, self.ckpt = out, save_at, ckpt
        self.record: dict[str, Any] = {"losses": []}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 0:  # this rank's own gradient: autograd.grad fires none of DDP's hooks
            grads = torch.autograd.grad(pl_module.loss(batch), list(pl_module.parameters()))
            self.record["local_grads"] = [g.detach().clone() for g in grads]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.record["reduced_grads"] = [p.grad.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record["losses"].append(float(outputs["loss"]))
        if self.save_at is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.ckpt)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.record["wire_bytes"] = trainer.strategy.grad_reduction.wire_bytes
        torch.save(self.record, f"{self.out}.rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--powersgd", action="store_true")
    parser.add_argument("--metrics", default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default="comm.ckpt")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    compression = PowerSGDConfig(rank=4, start_iter=5) if args.powersgd else None
    strategy = LLMFastStrategy(timeout=timedelta(seconds=60), grad_reduce_dtype=args.dtype,
                               grad_compression=compression)  # fmt: skip
    callbacks: list[L.Callback] = [Recorder(args.out, args.save_at, args.ckpt)]
    if args.metrics:
        callbacks.append(SystemMetricsMonitor(log_every_n_steps=5))
    data = PackedDataModule(corpus="stdlib", max_docs=40, seq_len=32, batch_size=4, num_workers=0,
                            pin_memory=False, val_fraction=0.05, test_fraction=0.0, seed=1)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
        logger=CSVLogger(args.metrics, name="", version="") if args.metrics else False, log_every_n_steps=5,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(TinyLM(), datamodule=data, ckpt_path=args.ckpt if args.resume else None)


if __name__ == "__main__":
    main()
    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
