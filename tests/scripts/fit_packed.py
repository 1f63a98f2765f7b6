"""Fit the reference MoE GPT on PackedDataModule under strategy="llmfast" (``--sharding``, ``--ep``); record every
step per rank.

Run by tests/test_resume.py and tests/test_dp_equivalence.py in subprocesses (Lightning launches the second rank).
Each rank appends one JSON line per training batch to ``<out>.rank<r>``: the loss as ``float.hex`` (equality is
bitwise) and the documents that fit one row; at the end, a summary line. ``--kill-at N`` SIGKILLs every rank at
the start of step ``N + 1``, after ``ModelCheckpoint(every_n_train_steps=N)`` has written step ``N``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llmfast import (
    LLMFastStrategy,
    MoEGPTConfig,
    MoEGPTLightningModule,
    PackedDataModule,
    TokenThroughputMonitor,
)
from lightning_llmfast.bench.processes import leave_world


class Recorder(L.Callback):
    def __init__(self, out: str, kill_at: int | None, whole: set[int]) -> None:
        self.out, self.kill_at, self.whole = out, kill_at, whole
        self.counts: dict[str, dict[int, int]] = {"train": {}, "val": {}}

    def _write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        with open(f"{self.out}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no teardown, no final checkpoint: a crash

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        epoch = trainer.current_epoch
        self.counts["train"][epoch] = self.counts["train"].get(epoch, 0) + 1
        loss = float(outputs["loss"])
        self._write(trainer, {"step": trainer.global_step, "epoch": epoch, "loss": loss.hex(),
                              "documents": sorted(d for d in batch.documents if d in self.whole)})  # fmt: skip

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        key = trainer.current_epoch if trainer.state.fn == "fit" else -1
        self.counts["val"][key] = self.counts["val"].get(key, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--docs", type=int, default=60)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--ckpt-dir", default="ckpt")
    parser.add_argument("--sharding", default="ddp")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel_size")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # A rank still running after 200 s (the tests wait 240 s) prints every thread's stack and exits: a hang fails
    # with where it waits instead of a bare timeout.
    faulthandler.dump_traceback_later(200, exit=True)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    config = MoEGPTConfig(hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32, num_experts=4, top_k=2)
    module = MoEGPTLightningModule(config, lr=3e-3, warmup_steps=2)
    data = PackedDataModule(
        corpus="synthetic", synthetic_num_docs=args.docs, synthetic_mean_len=24, seq_len=32, batch_size=2,
        num_workers=args.workers, val_fraction=args.val_fraction, test_fraction=args.val_fraction, seed=3,
    )  # fmt: skip
    # Documents that fit one row are one sequence each: each must appear once per epoch over all ranks.
    whole = {i for i, n in enumerate(data.corpus_for("train").lengths) if n <= data.seq_len}
    recorder, monitor = Recorder(args.out, args.kill_at, whole), TokenThroughputMonitor(log_every_n_steps=1)
    callbacks: list[L.Callback] = [recorder, monitor]
    if args.every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=-1,
                                         save_last=True))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=LLMFastStrategy(
            sharding=args.sharding, expert_parallel_size=args.ep, timeout=timedelta(seconds=60)
        ),
        max_steps=args.max_steps, max_epochs=args.max_epochs, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(args.every), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last" if args.resume else None)
    if args.validate:
        trainer.validate(module, datamodule=data, verbose=False)
    recorder._write(trainer, {"summary": recorder.counts, "tokens": monitor.last_metrics.get("train/tokens"),
                              "world_size": trainer.world_size})  # fmt: skip


if __name__ == "__main__":
    main()
    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
