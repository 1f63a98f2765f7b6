"""Tiny transformers checkpoints of the supported families, written sharded by ``save_pretrained`` into a directory.

Sizes are small and awkward (a prime vocabulary, 3 layers, experts that do not fill a power of two of rows) so that
shards split tensors across files and FSDP2 chunks are uneven.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 61
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "llama", "qwen3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


def tiny_config(family: str, vocab_size: int = VOCAB) -> Any:
    """A transformers config of ``family`` with a few thousand parameters."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "max_position_embeddings": 64, "initializer_range": 0.2,
    }  # fmt: skip
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=8, intermediate_size=24, moe_intermediate_size=12,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        )  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common, num_key_value_heads=2, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=24, moe_intermediate_size=12, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1,
            routed_scaling_factor=2.5,
        )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=2, intermediate_size=24)
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=8, intermediate_size=24, tie_word_embeddings=True
        )
    raise AssertionError(family)


def save_tiny(
    family: str, directory: Path, *, seed: int = 0, max_shard_size: str = "8KB", vocab_size: int = VOCAB
) -> Path:
    """Write a randomly initialised tiny ``family`` model (DeepSeek's correction bias non-zero) sharded into
    ``directory``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf))
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def reference_logits(directory: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' own ``from_pretrained`` of ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=input_ids).logits
