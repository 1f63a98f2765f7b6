"""Worker of tests/test_multinode.py: one node of a ``sharding="hsdp"`` run launched by ``torchrun --nnodes 2``.

Run by torchrun on every node: ``torchrun --nnodes 2 --node-rank I --nproc-per-node 2 --master-addr 127.0.0.1
--master-port P tests/hsdp_worker.py OUT``. Lightning's ``Trainer(num_nodes=2, devices=2)`` picks the ranks up from
torchrun's environment; ``LLMFastStrategy(sharding="hsdp")`` shards the reference model within each node and
replicates it across the two. It fits 2 steps with gradient clipping, saving a DCP checkpoint after the first, then
resumes that checkpoint for the second step again. Every rank writes ``OUT/rank<r>.json``: the losses (mean over the
ranks), the global gradient norms, its share of the parameters, and the resumed run's loss.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsdp_worker import CONFIG, Batches, global_batches, rank_batch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import leave_world

NODES, DEVICES, STEPS, CLIP = 2, 2, 2, 0.5


class Recorder(L.Callback):
    """Every step's loss (mean over the ranks) and global gradient norm; at the end, this rank's parameter share."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.share: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        self.norms.append(trainer.callback_metrics["train/grad_norm"].item())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        params = list(pl_module.parameters())
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        mesh = trainer.strategy.parallel_dims.dp_mesh
        self.share = {"held": held, "full": sum(p.numel() for p in params), "dp_mesh": list(mesh.mesh_dim_names)}


def fit(recorder: Recorder, ckpts: Path | None = None, **kwargs: Any) -> L.Trainer:
    torch.manual_seed(0)
    module = MoEGPTLightningModule(MoEGPTConfig(**CONFIG), lr=1e-2, aux_loss_coef=0.0, warmup_steps=3)
    strategy = LLMFastStrategy(sharding="hsdp", timeout=timedelta(seconds=90))
    callbacks: list[L.Callback] = [recorder]
    if ckpts is not None:  # a DCP directory after every step: every rank writes its shards
        callbacks.append(ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=NODES, devices=DEVICES, strategy=strategy, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=ckpts is not None,
        use_distributed_sampler=False, gradient_clip_val=CLIP, callbacks=callbacks,
    )  # fmt: skip
    data = [rank_batch(step, trainer.global_rank, trainer.world_size) for step in global_batches()]
    trainer.fit(module, train_dataloaders=Batches(data), **kwargs)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    faulthandler.dump_traceback_later(200, exit=True)  # a hang fails with its stacks before the test's timeout
    torch.set_num_threads(1)
    first = Recorder()
    trainer = fit(first, ckpts=args.out / "ckpts")
    resumed = Recorder()
    fit(resumed, ckpt_path=args.out / "ckpts" / "epoch=0-step=1.ckpt")
    record = {"rank": trainer.global_rank, "node": int(os.environ["GROUP_RANK"]), "world": trainer.world_size}
    record.update(losses=first.losses, norms=first.norms, share=first.share, resumed_losses=resumed.losses)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    leave_world()
