"""Every transformers 5 MoE family with the fused top-k/experts layout, DeepSeek-V3 routing included: after the swap,
the same Parameters and the outputs and gradients of transformers' own eager implementation.

Tiny blocks built from configs (nothing downloaded); the DeepSeek-V3 routers get a random correction bias so the
biased, group-limited selection is exercised.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.moe.adapters import _HF_DEEPSEEK_BLOCKS, _HF_SOFTMAX_BLOCKS, HFGroupedMoeBlock, swap_moe_blocks

pytest.importorskip("transformers")

H = 16
_SMALL = {
    "hidden_size": H,
    "intermediate_size": 32,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "shared_expert_intermediate_size": 24,
    "shared_experts_intermediate_size": 24,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
}
# Modules holding several configs: the one their MoE block is built from.
_CONFIGS = {
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": "Qwen3OmniMoeTextConfig",
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": "Qwen3OmniMoeTalkerTextConfig",
    "Qwen4ExpTextSparseMoeBlock": "Qwen4ExpTextConfig",
    "Dots3NoteTextMoE": "Dots3NoteTextConfig",
    "Glm4vMoeTextMoE": "Glm4vMoeTextConfig",
}


def _families() -> list[object]:
    params = []
    for model, block_name in _HF_SOFTMAX_BLOCKS + _HF_DEEPSEEK_BLOCKS:
        try:
            module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        except ImportError:
            continue
        if hasattr(module, block_name):
            params.append(pytest.param(module, block_name, id=block_name))
    return params


def _tiny_block(module: object, block_name: str, seed: int, **overrides: object) -> nn.Module:
    config_cls = getattr(module, _CONFIGS.get(block_name, ""), None)
    if config_cls is None:
        (config_cls,) = (
            v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type) and "Vision" not in k
        )
    config = config_cls()
    for key, value in {**_SMALL, **overrides}.items():
        setattr(config, key, value)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    block_cls = getattr(module, block_name)
    # Build with whatever the constructor takes: newer families also want their layer's index (BailingHybridMoE).
    extra = {"layer_idx": 0} if "layer_idx" in inspect.signature(block_cls.__init__).parameters else {}
    block = block_cls(config, **extra)
    for p in block.parameters():  # transformers leaves them uninitialised until a PreTrainedModel inits them
        nn.init.normal_(p, std=0.3)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        bias.normal_(std=0.1)
    return block


def _run(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    block.zero_grad()
    x = x.detach().requires_grad_()
    y = block(x.clone())
    (y * g).sum().backward()
    return (y.detach(), x.grad, *(p.grad.clone() for _, p in sorted(block.named_parameters())))


@pytest.mark.parametrize(("module", "block_name"), _families())
def test_swap_keeps_parameters_outputs_and_gradients(module: object, block_name: str) -> None:
    block = _tiny_block(module, block_name, seed=len(block_name))
    assert sum(p.numel() for p in block.parameters()) < 100_000  # the tiny config did take
    container = nn.Sequential(block)
    x, g = torch.randn(2, 7, H), torch.randn(2, 7, H)  # prime token count
    before = _run(block, x, g)
    params = dict(container.named_parameters())
    buffers = dict(container.named_buffers())
    assert swap_moe_blocks(container, backend="torch") == 1
    swapped = container[0]
    assert isinstance(swapped, HFGroupedMoeBlock)
    assert all(p is params[n] for n, p in container.named_parameters())
    assert all(b is buffers[n] for n, b in container.named_buffers())
    with SyncCounter() as counter:
        after = _run(swapped, x, g)
    assert counter.num_syncs == 0, counter.syncs
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert int(swapped.stats.tokens_per_expert.sum()) == 14 * 2


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_group": 1, "topk_group": 1},  # one group: plain biased top-k
        {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4},  # k = group size: the whole best group
    ],
    ids=["one_group", "k_is_group"],
)
def test_deepseek_v3_group_corner_cases(overrides: dict[str, object]) -> None:
    module = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    # (Groups of one are tested in test_router_conventions.py: transformers' router needs 2 experts a group.)
    block = _tiny_block(module, "DeepseekV3MoE", seed=6, **overrides)
    container = nn.Sequential(block)
    x, g = torch.randn(1, 5, H), torch.randn(1, 5, H)
    before = _run(block, x, g)
    swap_moe_blocks(container, backend="torch")
    for a, b in zip(_run(container[0], x, g), before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
