"""FSDP2 x expert parallelism (2 x 2 on 4 gloo processes) equals one process on the global batch; its DCP
checkpoints resume bitwise, reshard to 2 processes and export to one file.

With 2 experts (one per expert-parallel rank, fewer than the 2 ranks sharding it) the experts are sharded on another
dimension: every rank holds a quarter of the expert bytes (not half on two ranks and nothing on the others), and the
losses, the checkpoint's resume, reshard and export are checked on that layout.

For the reference model and tiny transformers Qwen3-MoE and DeepSeek-V3 models (MoE blocks swapped by the adapters):
the first step's loss and gradients agree to 1e-6 (relative 2-norm), the global gradient norm equals
``torch.nn.utils.clip_grad_norm_``'s on the one-process model, and after 10 AdamW steps with clipping active (the norm
above the threshold at every step) the weights agree to 1e-4. Every rank holds the plan formula's bytes of dense and
expert parameters (``lightning_llmfast.plan.formula_plan``) and twice them in AdamW state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel import (
    ParallelDims,
    clip_grad_norm,
    consolidate_checkpoint,
    load_distributed_checkpoint,
    parallelize,
    save_distributed_checkpoint,
)
from lightning_llmfast.parallel.checkpoint import model_state, optimizer_state
from lightning_llmfast.parallel.clip import sharded_grads
from lightning_llmfast.plan import formula_plan, param_shapes

pytestmark = pytest.mark.slow

EP, ROWS, SEQ, VOCAB, STEPS, CLIP = 2, 4, 8, 64, 10, 0.05
EXPERTS = 4


def _reference_model(experts: int = EXPERTS) -> tuple[nn.Module, Callable[[nn.Module], list[nn.Module]]]:
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=16, num_experts=experts,
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


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _sharded(
    kind: str, world: int, ep: int, seed: int = 0, experts: int = EXPERTS
) -> tuple[nn.Module, nn.Module, ParallelDims]:
    """The model (sharded FSDP2 x EP), an unsharded copy made before sharding, and the layout."""
    torch.manual_seed(seed)
    model, layers = _reference_model(experts) if kind == "reference" else _hf_model(kind)
    reference = copy.deepcopy(model)
    dims = ParallelDims(world, "fsdp", ep)
    dims.build_mesh("cpu")
    parallelize(model, dims, layers(model), device=torch.device("cpu"))
    return model, reference, dims


def _step(model: nn.Module, dims: ParallelDims, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    rank, world = torch.distributed.get_rank(), dims.world_size
    loss = _loss(model, ids[rank * ROWS // world : (rank + 1) * ROWS // world])
    loss.backward()
    norm = clip_grad_norm(sharded_grads(list(model.parameters()), set(), dims.edp), CLIP, dims.dp_group)
    optimizer.step()
    optimizer.zero_grad()
    return norm


def _check_shares(
    model: nn.Module, reference: nn.Module, optimizer: torch.optim.Optimizer, rank: int, experts: int
) -> None:
    """Every rank's dense and expert bytes are the plan formula's row, the expert bytes equal on every rank; its AdamW
    state is twice its parameters."""
    layers = list(reference["model"].layers) if isinstance(reference, nn.ModuleDict) else list(reference.model.layers)
    plan = formula_plan("test", param_shapes(reference, layers), 4, EP, compute_bytes=4, a2a_bytes=0).ranks[rank]
    held = {True: 0, False: 0}
    for name, p in model.named_parameters():
        local = p.to_local()
        held[".experts." in name and p.shape[0] == experts] += local.numel() * local.element_size()
        state = optimizer.state[p]
        assert {k: v.to_local().numel() for k, v in state.items() if k != "step"} == {
            "exp_avg": local.numel(), "exp_avg_sq": local.numel()
        }, name  # fmt: skip
    assert (held[False], held[True]) == (plan.dense_params, plan.expert_params)
    shares = [torch.zeros((), dtype=torch.int64) for _ in range(4)]
    torch.distributed.all_gather(shares, torch.tensor(held[True]))
    routed = [p for n, p in reference.named_parameters() if ".experts." in n and p.shape[0] == experts]
    total = sum(p.numel() * p.element_size() for p in routed)
    assert [int(s) for s in shares] == [total // 4] * 4, shares  # every rank its share, none empty


def _case(rank: int, world: int, kind: str, experts: int = EXPERTS) -> None:
    model, reference, dims = _sharded(kind, world, EP, experts=experts)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step, ids in enumerate(_batches()):
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
    _check_shares(model, reference, optimizers[0], rank, experts)


def _checkpoint_case(rank: int, world: int, root: str) -> None:
    """Save at half-way on 4 ranks (2 experts: sharded on another dimension than the experts); a model built from
    another seed loads it and continues bitwise; rank 0 keeps the uninterrupted run's losses and the half-way full
    weights for the 2-rank resume (there sharded on the experts) and the export."""
    half = STEPS // 2
    model, _, dims = _sharded("reference", world, EP, experts=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step, ids in enumerate(_batches()):
        if step == half:
            state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)]}
            save_distributed_checkpoint({**state, "global_step": half}, f"{root}/half", rank=rank)
            full = {k: _full(v).clone() for k, v in model.state_dict().items()}
        norms.append(_step(model, dims, optimizer, ids))
    resumed, _, _ = _sharded("reference", world, EP, seed=1, experts=2)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    meta = load_distributed_checkpoint(f"{root}/half", resumed, [resumed_optimizer])
    assert meta["global_step"] == half
    resumed_norms = [_step(resumed, dims, resumed_optimizer, ids) for ids in _batches()[half:]]
    assert all(torch.equal(a, b) for a, b in zip(resumed_norms, norms[half:], strict=True))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), name
    if rank == 0:
        torch.save({"full": full, "norms": torch.stack(norms)}, f"{root}/run.pt")


def _reshard_case(rank: int, world: int, root: str) -> None:
    """The 4-rank checkpoint continues on 2 ranks (FSDP over 1 x EP over 2) with the 4-rank run's norms."""
    half = STEPS // 2
    model, _, dims = _sharded("reference", world, EP, seed=2, experts=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_distributed_checkpoint(f"{root}/half", model, [optimizer])
    norms = torch.stack([_step(model, dims, optimizer, ids) for ids in _batches()[half:]])
    expected = torch.load(f"{root}/run.pt", weights_only=True)["norms"][half:]
    assert _rel(norms, expected) < 1e-5, (norms, expected)


def _all_cases(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    for kind in ("reference", "qwen3_moe", "deepseek_v3"):
        _case(rank, world, kind)
    _case(rank, world, "reference", experts=2)  # one local expert, two ranks sharding it
    _checkpoint_case(rank, world, root)


def test_fsdp_x_ep_equals_one_process_and_its_checkpoints_resume_reshard_and_export(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run_distributed(_all_cases, 4, str(tmp_path), timeout=400)
    run_distributed(_reshard_case, 2, str(tmp_path), timeout=200)
    # One file a single process loads: the half-way weights, the routed experts whole.
    export = consolidate_checkpoint(tmp_path / "half", tmp_path / "export.ckpt")
    single, _ = _reference_model(experts=2)
    single.load_state_dict(torch.load(export, weights_only=True)["state_dict"])
    full = torch.load(tmp_path / "run.pt", weights_only=True)["full"]
    for name, value in single.state_dict().items():
        assert torch.equal(value, full[name]), name
