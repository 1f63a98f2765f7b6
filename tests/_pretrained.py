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
    family: str,
    directory: Path,
    *,
    seed: int = 0,
    max_shard_size: str = "8KB",
    vocab_size: int = VOCAB,
    **overrides: Any,
) -> Path:
    """Write a randomly initialised tiny ``family`` model (DeepSeek's correction bias non-zero; ``overrides`` set on
    its config, e.g. ``num_hidden_layers=4``) sharded into ``directory``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size)
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config)
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


FP8_BLOCK = 128
FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def fp8_config() -> Any:
    """A tiny DeepSeek-V3 whose matrices span several 128 x 128 blocks, most sizes not multiples of 128."""
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=144, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=64, initializer_range=0.05, intermediate_size=260, moe_intermediate_size=132,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=136,
        kv_lora_rank=32, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
        routed_scaling_factor=2.5,
    )  # fmt: skip


def _quantized(key: str, tensor: torch.Tensor) -> bool:
    """The matrices DeepSeek-V3 releases in fp8: every projection inside a layer (not norms, not the router)."""
    return key.startswith("model.layers.") and tensor.dim() == 2 and "norm" not in key and ".mlp.gate.weight" not in key


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale_inv, dequantized float64)`` of a matrix in 128 x 128 blocks, one block at a time."""
    rows, cols = weight.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid, dtype=torch.float32)
    real = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            box = (slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK))
            part = weight[box].float()
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            fp8[box] = (part / scale[i, j]).to(torch.float8_e4m3fn)
            real[box] = fp8[box].double() * scale[i, j].double()
    return fp8, scale, real


def save_fp8_release(directory: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """A block-FP8 directory as DeepSeek-V3 is released, and beside it the same model dequantized (float64 per
    block, then float32) as a plain ``save_pretrained`` directory for transformers: ``(fp8 dir, dequantized dir)``.

    Written from a transformers ``save_pretrained`` (several shards): projections in fp8 with ``weight_scale_inv``
    in the same shard, everything else bf16, ``quantization_config`` in config.json, and a multi-token-prediction
    layer ``model.layers.3.*`` (a copy of layer 2 plus DeepSeek's ``enorm``/``hnorm``/``eh_proj``/
    ``shared_head.head``) declared by ``num_nextn_predict_layers: 1``.
    """
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(fp8_config())
    source, fp8_dir, real_dir = directory / "source", directory / "fp8", directory / "dequantized"
    model.save_pretrained(source, max_shard_size="300KB")
    fp8_dir.mkdir(parents=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    real_state: dict[str, torch.Tensor] = {}
    files = sorted(set(index["weight_map"].values()))
    for name in files:
        tensors = load_file(source / name)
        if name == files[-1]:  # the multi-token-prediction layer, in the last shard
            mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if "layers.2." in k}
            mtp["model.layers.3.eh_proj.weight"] = torch.randn(144, 288)
            mtp["model.layers.3.enorm.weight"] = mtp["model.layers.3.hnorm.weight"] = torch.ones(144)
            mtp["model.layers.3.shared_head.head.weight"] = torch.randn(VOCAB, 144)
            tensors.update(mtp)
        out: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            if _quantized(key, tensor):
                out[key], out[key + "_scale_inv"], real = quantize_blocks(tensor)
                real_state[key] = real.float()
            else:
                out[key] = tensor.to(torch.bfloat16)
                real_state[key] = out[key].float()
        if name == files[-1]:
            real_state = {k: v for k, v in real_state.items() if not k.startswith("model.layers.3.")}
        save_file(out, fp8_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
    index["weight_map"] = weight_map
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    config.update(quantization_config=FP8_QUANTIZATION, num_nextn_predict_layers=1, dtype="bfloat16")
    (fp8_dir / "config.json").write_text(json.dumps(config))
    real_dir.mkdir()  # what transformers itself loads (it fuses the per-expert matrices)
    save_file(real_state, real_dir / "model.safetensors", metadata={"format": "pt"})
    (real_dir / "config.json").write_text((source / "config.json").read_text())
    return fp8_dir, real_dir
