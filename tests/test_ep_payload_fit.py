"""``LLMFastStrategy(expert_parallel_size=2, dispatch_dtype="fp8")`` on 2 gloo processes trains like the fp32
one-process fit on the same global batch (one batch, seen ``STEPS`` times, so that the loss must fall): every step's
loss within 1% of the fp32 one (the tolerance argued in docs/distributed.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed
from test_expert_parallel_fit import _batches, _module, _trainer
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy

LOSS_RTOL = 0.01
STEPS = 6


class _Losses(L.Callback):
    """Every step's training loss, averaged over the ranks (each rank's loss is its share of the global mean)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())


def _fit(strategy: LLMFastStrategy, devices: int, data: DataLoader) -> list[float]:
    trainer = _trainer(strategy, devices, epochs=1)
    recorder = _Losses()
    trainer.callbacks.append(recorder)
    trainer.fit(_module(), data)
    return recorder.losses


def _fp8_worker(rank: int, world: int, tmp: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    strategy = LLMFastStrategy(expert_parallel_size=2, dispatch_dtype="fp8", process_group_backend="gloo")
    losses = _fit(strategy, world, DataLoader(_batches(world, rank)[:1] * STEPS, batch_size=None))
    dispatcher = strategy.lightning_module.model.layers[0].ffn.dispatcher
    assert dispatcher.payload.dispatch == "fp8" and dispatcher.payload.combine == "bf16"
    if rank == 0:
        torch.save(losses, f"{tmp}/losses.pt")


@pytest.mark.slow
def test_fp8_dispatch_fit_trains_like_the_fp32_fit(tmp_path: Path) -> None:
    run_distributed(_fp8_worker, 2, str(tmp_path), timeout=240)
    fp8 = torch.tensor(torch.load(tmp_path / "losses.pt"))
    fp32 = torch.tensor(_fit(LLMFastStrategy(), 1, DataLoader(_batches(2, None)[:1] * STEPS, batch_size=None)))
    assert fp8.shape == fp32.shape == (STEPS,)
    assert fp8[-1] < 0.9 * fp8[0]  # it learns the batch
    relative = ((fp8 - fp32).abs() / fp32).max()
    assert relative <= LOSS_RTOL, (relative, fp8.tolist(), fp32.tolist())
    assert relative > 0  # the tokens did travel in fp8
