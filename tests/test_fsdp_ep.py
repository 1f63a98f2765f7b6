"""FSDP2 x expert parallelism (2 x 2 on 4 gloo processes) equals one process on the global batch.

For the reference model and tiny transformers Qwen3-MoE and DeepSeek-V3 models (MoE blocks swapped by the adapters):
the first step's loss and gradients agree to 1e-6 (relative 2-norm), the global gradient norm equals
``torch.nn.utils.clip_grad_norm_``'s on the one-process model, and after 10 AdamW steps with clipping active (the norm
above the threshold at every step) the weights agree to 1e-4. Every rank holds the formula's share of every parameter
and of its optimizer state: dense rows split over the world, experts ``E / ep`` per rank split over ``edp``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel import ParallelDims, clip_grad_norm, parallelize
from lightning_llmfast.parallel.clip import sharded_grads

pytestmark = pytest.mark.slow

EP, ROWS, SEQ, VOCAB, STEPS, CLIP = 2, 4, 8, 64, 10, 0.05
EXPERTS = 4


def _reference_model() -> tuple[nn.Module, Callable[[nn.Module], list[nn.Module]]]:
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=16, num_experts=EXPERTS,
        router_backend="torch",
    )  # fmt: skip
    return nn.ModuleDict({"model": MoEGPT(config)}), lambda m: list(m["model"].layers)


def _hf_model(kind: str) -> tuple[nn.Module, Callable[[nn.Module], list[nn.Module]]]:
    from lightning_llmfast.moe.adapters import swap_moe_blocks

    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    common.update(num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=16, num_experts=EXPERTS,
                                num_experts_per_tok=2, head_dim=8)  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=EXPERTS,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                  v_head_dim=8)  # fmt: skip
        model = DeepseekV3ForCausalLM(config)
    swap_moe_blocks(model, backend="torch")
    return model, lambda m: list(m.model.layers)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, nn.ModuleDict):
        return model["model"](ids)
    return model(input_ids=ids, use_cache=False).logits


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = _logits(model, ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _expected_local_rows(name: str, rows: int, rank: int, world: int) -> int:
    """The formula of docs/distributed.md: dense dim 0 in chunks of ceil(rows / world) over the world; routed
    experts ``E / ep`` per expert-parallel rank, those in chunks of ceil(E / ep / edp) over ``edp``."""
    if ".experts." in name and rows == EXPERTS:
        rows, world, rank = rows // EP, world // EP, rank // EP
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk))


def _case(rank: int, world: int, kind: str) -> None:
    torch.manual_seed(0)
    model, layers = _reference_model() if kind == "reference" else _hf_model(kind)
    reference = copy.deepcopy(model)
    dims = ParallelDims(world, "fsdp", EP)
    dims.build_mesh("cpu")
    parallelize(model, dims, layers(model), device=torch.device("cpu"))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        loss = _loss(model, ids[rank : rank + 1])
        loss.backward()
        ref_loss = _loss(reference, ids)
        ref_loss.backward()
        if step == 0:
            losses = [torch.zeros(()) for _ in range(world)]
            torch.distributed.all_gather(losses, loss.detach())
            assert _rel(torch.stack(losses).mean(), ref_loss.detach()) < 1e-6
            for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert _rel(_full(p.grad), ref.grad) < 1e-6, name
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        norm = clip_grad_norm(sharded_grads(list(model.parameters()), set(), dims.edp), CLIP, dims.dp_group)
        assert ref_norm > CLIP and _rel(norm, ref_norm) < (1e-6 if step == 0 else 1e-4), (step, norm, ref_norm)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert _rel(_full(p.detach()), ref.detach()) < 1e-4, name
        local = p.to_local()
        assert local.shape[1:] == p.shape[1:], name
        assert local.shape[0] == _expected_local_rows(name, p.shape[0], rank, world), name
        state = optimizers[0].state[p]
        assert {k: v.to_local().numel() for k, v in state.items() if k != "step"} == {
            "exp_avg": local.numel(), "exp_avg_sq": local.numel()
        }, name  # fmt: skip
    experts = [n for n, p in model.named_parameters() if ".experts." in n and p.shape[0] == EXPERTS]
    assert experts, "no routed experts were sharded"


def _all_cases(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    for kind in ("reference", "qwen3_moe", "deepseek_v3"):
        _case(rank, world, kind)


def test_fsdp_x_ep_equals_one_process_for_reference_qwen3_moe_and_deepseek_v3() -> None:
    pytest.importorskip("transformers")
    run_distributed(_all_cases, 4, timeout=300)
