"""A two-process FSDP2 x EP fit of a transformers Qwen3-MoE in ``bf16-mixed``, validated, warns neither that an in-place
op on the swapped MoE block's output drops FSDP2's pre-backward hook nor that ``val/ppl`` is logged without
``sync_dist`` (every warning of every rank recorded)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from _distributed import run_distributed
from torch.utils.data import DataLoader

from lightning_llmfast import HFCausalLMModule, LLMFastStrategy
from lightning_llmfast.data import pack_documents

pytest.importorskip("transformers")

VOCAB, SEQ = 64, 12


def _module() -> HFCausalLMModule:
    from transformers import Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32,
    )  # fmt: skip
    return HFCausalLMModule(config, lr=1e-2, warmup_steps=1, moe_backend="torch")


def _worker(rank: int, world: int, out: str) -> None:
    # Lightning joins the process group run_distributed created (LightningEnvironment reads these).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    g = torch.Generator().manual_seed(rank)
    data = DataLoader(list(pack_documents([torch.randint(0, VOCAB, (SEQ,), generator=g)] * 2, SEQ, 1)), batch_size=None)
    strategy = LLMFastStrategy(sharding="fsdp", expert_parallel_size=2, process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2, precision="bf16-mixed",
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_module(), data, data)
    assert "val/ppl" in trainer.callback_metrics
    messages = [str(w.message) for w in caught]
    Path(out, f"rank{rank}.txt").write_text("\n".join(messages))
    assert not [m for m in messages if "pre-backward hook" in m or "sync_dist" in m], messages


def test_fsdp_ep_bf16_fit_warns_of_no_dropped_hook_nor_unsynced_metric(tmp_path: Path) -> None:
    run_distributed(_worker, 2, str(tmp_path), timeout=240)
