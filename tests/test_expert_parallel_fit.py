"""LLMFastStrategy(expert_parallel_size=2) on 2 gloo processes equals a one-process fit on the same global batches,
with gradient clipping by the global norm active, across a checkpoint and resume: its checkpoints are DCP directories
each rank writes its own experts into (peak memory of a save: no gathered copy), resumed on 2 processes and on 1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _distributed import run_distributed
from torch.utils.data import DataLoader

from lightning_llmfast import ConfigError, LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.parallel import consolidate_checkpoint

VOCAB, SEQ, ROWS, STEPS_PER_EPOCH = 64, 16, 2, 10  # ROWS per rank; two epochs make the 20 steps
CLIP = 0.05  # below the gradient norm of every step: clipping is active throughout


def _module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=64, num_experts=4,
        router_backend="torch",
    )  # fmt: skip
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2)


def _batches(world: int, rank: int | None) -> list[PackedBatch]:
    """Per step, ``world * ROWS`` documents of exactly SEQ tokens (one per row, so every rank has as many labels);
    rank ``r`` gets rows ``r * ROWS ...``, the one-process run (``rank=None``) all of them."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS_PER_EPOCH):
        docs = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(world * ROWS)]
        mine = docs if rank is None else docs[rank * ROWS : (rank + 1) * ROWS]
        out.extend(pack_documents(mine, SEQ, len(mine)))
    return out


def _trainer(strategy: LLMFastStrategy, devices: int, epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        gradient_clip_val=CLIP,
    )


def _fit_worker(rank: int, world: int, tmp: str) -> None:
    # Lightning joins the process group that run_distributed created (LightningEnvironment reads these).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    data = DataLoader(_batches(world, rank), batch_size=None)
    first = _trainer(LLMFastStrategy(expert_parallel_size=2, process_group_backend="gloo"), world, epochs=1)
    module = _module()
    first.fit(module, data)
    local = module.model.layers[0].ffn.experts.gate_up_proj
    assert local.shape[0] == 2  # this rank's half of the 4 experts
    assert first.callback_metrics["train/grad_norm"] > CLIP
    first.save_checkpoint(f"{tmp}/mid.ckpt")
    second = _trainer(LLMFastStrategy(expert_parallel_size=2, process_group_backend="gloo"), world, epochs=2)
    second.fit(_module(), data, ckpt_path=f"{tmp}/mid.ckpt")
    second.save_checkpoint(f"{tmp}/end.ckpt")


def _one_process(epochs: int, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    module = _module()
    data = DataLoader(_batches(2, None), batch_size=None)
    _trainer(LLMFastStrategy(), 1, epochs).fit(module, data, ckpt_path=ckpt_path)
    return module.state_dict()


def _saved_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full weights of a DCP checkpoint directory, read in this process."""
    return torch.load(consolidate_checkpoint(checkpoint, checkpoint.with_suffix(".pt")), weights_only=True)


def _assert_same_state(actual: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_expert_parallel_fit_equals_one_process_fit_and_resumes_exactly(tmp_path: Path) -> None:
    run_distributed(_fit_worker, 2, str(tmp_path), timeout=240)
    assert (tmp_path / "mid.ckpt" / ".metadata").is_file()  # a DCP directory: each rank wrote its experts
    mid = _saved_weights(tmp_path / "mid.ckpt")
    end = _saved_weights(tmp_path / "end.ckpt")
    # The checkpoints hold the full experts: the keys and shapes of a one-process checkpoint.
    _assert_same_state(mid["state_dict"], _one_process(epochs=1))
    two_epochs = _one_process(epochs=2)
    _assert_same_state(end["state_dict"], two_epochs)
    assert end["global_step"] == 2 * STEPS_PER_EPOCH
    # The 2-rank checkpoint resumes on one process, experts and their Adam moments read back whole.
    _assert_same_state(_one_process(epochs=2, ckpt_path=tmp_path / "mid.ckpt"), two_epochs)


def test_expert_parallel_size_is_checked() -> None:
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        LLMFastStrategy(expert_parallel_size=0)
    # One process has no expert-parallel group: a clear error before any step.
    trainer = _trainer(LLMFastStrategy(expert_parallel_size=2), 1, epochs=1)
    data = DataLoader(_batches(1, None)[:1], batch_size=None)
    with pytest.raises(ConfigError, match="must divide the world size 1"):
        trainer.fit(_module(), data)


def _rss_worker(rank: int, world: int, tmp: str) -> None:
    """One step with 8 experts of 1.5 MiB in each of 2 layers, then a save under ``PeakRSS``: the growth, this rank's
    expert state (experts and both Adam moments) and its largest tensor go to ``rss<rank>.pt``."""
    from lightning_llmfast.bench.rss import PeakRSS
    from lightning_llmfast.expert_parallel import expert_parameters

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=512, num_experts=8,
        router_backend="torch",
    )  # fmt: skip
    module = MoEGPTLightningModule(config, lr=1e-2, warmup_steps=1)
    trainer = _trainer(LLMFastStrategy(expert_parallel_size=2, process_group_backend="gloo"), world, epochs=1)
    trainer.fit_loop.epoch_loop.max_steps = 1
    trainer.fit(module, DataLoader(_batches(world, rank)[:1], batch_size=None))
    optimizer = trainer.optimizers[0]
    states = [module.state_dict(), *(optimizer.state[p] for p in module.parameters())]
    largest = max(t.nbytes for state in states for t in state.values() if isinstance(t, torch.Tensor))
    experts = [p for _, p, _ in expert_parameters(module)]
    share = sum(p.nbytes + sum(t.nbytes for t in optimizer.state[p].values() if t.dim()) for p in experts)
    with PeakRSS() as rss:
        trainer.save_checkpoint(f"{tmp}/save.ckpt")
    torch.save({"growth": rss.growth, "share": share, "largest": largest}, f"{tmp}/rss{rank}.pt")


def test_expert_parallel_save_holds_no_gathered_copy_of_the_experts(tmp_path: Path) -> None:
    run_distributed(_rss_worker, 2, str(tmp_path), timeout=240)
    for rank in range(2):
        rss = torch.load(tmp_path / f"rss{rank}.pt")
        assert rss["share"] == 2 * 8 // 2 * 3 * 256 * 512 * 4 * 3  # layers x local experts x 3 H F x fp32 x (w, m, v)
        # A gathered copy of the experts and their moments alone would be twice the rank's share.
        assert rss["growth"] < rss["share"] + rss["largest"], (rank, rss)
    assert (tmp_path / "save.ckpt" / ".metadata").is_file()
