"""Context parallelism's setup shares every MoE block's balance loss over the cp group (a sequence-level block is told
its group too, so that boundaries without it are refused at its forward), and a batch it cannot split is refused."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel import SharedBatchDispatcher
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.parallel import ParallelDims


def _module(aux_loss: str) -> MoEGPTLightningModule:
    config = MoEGPTConfig(vocab_size=32, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_size=16,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    module = MoEGPTLightningModule(config)
    module.model.layers[1].ffn = MoEBlock(MoEConfig.build(16, 16, 4, 2, aux_loss=aux_loss, backend="torch"))
    return module


def _setup_context_parallel(module: MoEGPTLightningModule) -> None:
    """The strategy's context-parallel setup step on rank 0 of a fake 2-rank world with cp=2."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims(2, "ddp", context_parallel_size=2)
        dims.build_mesh("cpu")
        strategy = LLMFastStrategy(context_parallel_size=2)
        strategy.connect(module)
        strategy._parallel_dims = dims
        strategy._setup_context_parallel()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("aux_loss", ["micro_batch", "global", "sequence"])
def test_batch_and_step_balance_losses_are_shared_over_the_cp_group(aux_loss: str) -> None:
    module = _module(aux_loss)
    assert module.model.layers[1].ffn.batch_group is None
    _setup_context_parallel(module)
    blocks = [layer.ffn for layer in module.model.layers]
    assert all(isinstance(block.dispatcher, SharedBatchDispatcher) for block in blocks)
    assert all(block.batch_group is not None for block in blocks)


def test_a_batch_that_is_not_packed_is_refused_naming_the_fix() -> None:
    strategy = LLMFastStrategy(context_parallel_size=2)
    with pytest.raises(ConfigError, match=r"yields dict, not a PackedBatch .*context_parallel_size=1"):
        strategy._context_shard({"input_ids": None}, ParallelDims(2, "ddp", context_parallel_size=2))
