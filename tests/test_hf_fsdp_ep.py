"""A transformers Qwen3-MoE in ``HFCausalLMModule``, fitted by ``Trainer.fit`` with
``LLMFastStrategy(sharding="fsdp", expert_parallel_size=2)``, activation offload of every layer and
``gradient_clip_val=1.0`` on 4 gloo processes (FSDP2(2) x EP(2)), equals a one-process fit on the same global batches:
every step's loss and global gradient norm, and the weights after the last step. Resumed from its half-way DCP
checkpoint, the 4-process run continues bitwise. The same model built on the meta device trains under FSDP2 x EP in
``"bf16-mixed"`` with offload (sharded first, then materialised shard by shard).

Every rank gets one document of exactly ``SEQ`` tokens per step, so the ranks have equal label counts and the mean of
their losses is the one-process loss. The router's load-balancing loss depends on how tokens are split over the
expert-parallel groups, so its weight is 0 here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _distributed import run_distributed
from fsdp_worker import Batches
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_llmfast import HFCausalLMModule, LLMFastStrategy
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.offload import OffloadConfig

pytestmark = pytest.mark.slow

VOCAB, SEQ, STEPS, CLIP, WORLD = 64, 16, 4, 1.0, 4


def _module(device: str = "cpu") -> HFCausalLMModule:
    from transformers import Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    with torch.device(device):
        return HFCausalLMModule(config, lr=1e-2, aux_loss_coef=0.0, warmup_steps=1, moe_backend="torch")


def _batches(rank: int | None) -> list[PackedBatch]:
    """Per step ``WORLD`` documents of ``SEQ`` tokens; rank ``r`` gets the ``r``-th, one process all of them."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        docs = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(WORLD)]
        mine = docs if rank is None else docs[rank : rank + 1]
        out.extend(pack_documents(mine, SEQ, len(mine)))
    return out


class _Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean"))
        self.norms.append(trainer.callback_metrics["train/grad_norm"].detach().clone())


def _fit(
    strategy: LLMFastStrategy,
    devices: int,
    rank: int | None,
    *,
    ckpt: Path | None = None,
    resume: Path | None = None,
    device: str = "cpu",
    precision: str = "32-true",
) -> tuple[HFCausalLMModule, _Record]:
    module, record = _module(device), _Record()
    assert all(p.is_meta == (device == "meta") for p in module.parameters())
    callbacks: list[L.Callback] = [record]
    if ckpt is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt, every_n_train_steps=STEPS // 2, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, gradient_clip_val=CLIP,
        precision=precision, callbacks=callbacks, use_distributed_sampler=False, logger=False,
        enable_checkpointing=ckpt is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    data = Batches(_batches(rank)) if devices > 1 else DataLoader(_batches(rank), batch_size=None)
    trainer.fit(module, data, ckpt_path=resume)
    return module, record


def _fsdp_ep() -> LLMFastStrategy:
    offload = OffloadConfig(force=True, min_offload_bytes=0, keep_last_layers=0)  # every layer, also on CPU
    return LLMFastStrategy(sharding="fsdp", expert_parallel_size=2, offload=offload, process_group_backend="gloo")


def _worker(rank: int, world: int, out: str) -> None:
    # Lightning joins the process group run_distributed created (LightningEnvironment reads these).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    strategy = _fsdp_ep()
    module, record = _fit(strategy, world, rank, ckpt=Path(out, "ckpt"))
    assert strategy.offload_stats is not None and strategy.offload_stats["offloaded_bytes"] > 0
    experts = [p for n, p in module.named_parameters() if ".experts." in n]
    assert experts and all(isinstance(p, DTensor) and p.to_local().shape[0] == 1 for p in experts)  # 4 / (2 x 2)
    resumed, again = _fit(_fsdp_ep(), world, rank, resume=Path(out, "ckpt", f"epoch=0-step={STEPS // 2}.ckpt"))
    assert [t.item() for t in again.losses] == [t.item() for t in record.losses[STEPS // 2 :]]
    assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(module.parameters(), resumed.parameters()))
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}
    meta, meta_record = _fit(_fsdp_ep(), world, rank, device="meta", precision="bf16-mixed")
    assert all(isinstance(p, DTensor) and not p.is_meta and p.dtype == torch.float32 for p in meta.parameters())
    assert all(torch.isfinite(t) for t in meta_record.losses) and len(meta_record.losses) == STEPS
    assert meta.model.model.norm.weight.full_tensor().sub(1).abs().max() < 0.1  # ones, then a few small steps
    if rank == 0:
        torch.save({"losses": record.losses, "norms": record.norms, "weights": weights}, f"{out}/fsdp_ep.pt")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_qwen3_moe_fit_under_fsdp_x_ep_with_clipping_equals_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run_distributed(_worker, WORLD, str(tmp_path), timeout=400)
    got = torch.load(tmp_path / "fsdp_ep.pt", weights_only=True)
    module, record = _fit(LLMFastStrategy(), 1, None)
    assert len(got["losses"]) == len(record.losses) == STEPS
    assert _rel(torch.stack(got["losses"]), torch.stack(record.losses)) < 1e-5
    norms = torch.stack(record.norms)
    assert (norms > CLIP).all(), norms  # clipping was active at every step
    assert _rel(torch.stack(got["norms"]), norms) < 1e-5
    reference = dict(module.named_parameters())
    assert got["weights"].keys() == reference.keys()
    for name, weight in got["weights"].items():
        assert _rel(weight, reference[name].detach()) < 1e-4, name
    assert not torch.equal(reference["model.model.embed_tokens.weight"], _module().model.model.embed_tokens.weight)
