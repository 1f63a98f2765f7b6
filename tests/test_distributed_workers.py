"""A two-rank fit whose data module packs in one DataLoader worker per rank completes (workers are spawned, not
forked from ranks with live gloo threads: such forks hung or aborted with exit -6). A kill -9 of the ranks with spawned
workers leaves no process behind: tests/test_resume.py's two-rank case."""

from __future__ import annotations

import os

import lightning as L
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule, PackedDataModule


def _worker(rank: int, world: int) -> None:
    # Lightning joins the process group run_distributed created (LightningEnvironment reads these).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    config = MoEGPTConfig(vocab_size=258, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16,
                          num_experts=2, router_backend="torch")  # fmt: skip
    data = PackedDataModule(
        corpus="synthetic", synthetic_num_docs=24, synthetic_mean_len=20.0, seq_len=32, batch_size=2, num_workers=1,
        limit_batches=2,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=LLMFastStrategy(process_group_backend="gloo"), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,  # one worker start per rank: each imports the package (seconds on a loaded machine)
    )  # fmt: skip
    trainer.fit(MoEGPTLightningModule(config, warmup_steps=1), datamodule=data)
    assert trainer.global_step == 2 and dist.is_initialized()
    assert trainer.train_dataloader.multiprocessing_context.get_start_method() == "spawn"


def test_two_rank_fit_with_a_dataloader_worker_completes() -> None:
    run_distributed(_worker, 2, timeout=240)
