"""``python -m lightning_llmfast.plan``: the strategy's real FSDP2 x EP sharding on a fake process group and a meta
model, every rank's row equal to the closed-form formula of docs/distributed.md."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch.distributed as dist

from lightning_llmfast import ConfigError
from lightning_llmfast.plan import formula_plan, main, sharding_plan

pytest.importorskip("transformers")


def _check_against_formula(name: str, world: int, ep: int) -> None:
    from lightning_llmfast import plan as plan_module

    plan = sharding_plan(name, world, ep, tokens_per_rank=64)
    assert not dist.is_initialized()  # the fake group is gone again
    module, layers, moe_layers, top_k, hidden = plan_module._build(name, "torch")  # unsharded, on the meta device
    shapes = plan_module.param_shapes(module, layers)
    a2a = plan_module.a2a_bytes(64, top_k, hidden, 2, ep, moe_layers)
    expected = formula_plan(name, shapes, world, ep, compute_bytes=2, a2a_bytes=a2a)
    assert plan.rows() == expected.rows()
    assert plan.params == expected.params == sum(math.prod(p.shape) for p in shapes)
    assert plan.all_to_all == expected.all_to_all > 0
    # Every element is held exactly once over the world (dense and experts), in fp32.
    assert sum(r.dense_params + r.expert_params for r in plan.ranks) == 4 * plan.params
    assert any(p.expert for p in shapes) and any(not p.expert for p in shapes)


@pytest.mark.parametrize(("name", "world", "ep"), [("reference", 8, 4), ("reference", 6, 2), ("mixtral-8x22b", 16, 8)])
def test_plan_rows_equal_the_formula(name: str, world: int, ep: int) -> None:
    _check_against_formula(name, world, ep)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "world", "ep"), [("deepseek-v3", 256, 64), ("qwen3-235b-a22b", 256, 64)])
def test_plan_at_the_tutorials_scale_equals_the_formula(name: str, world: int, ep: int) -> None:
    _check_against_formula(name, world, ep)


def test_plan_cli_prints_rows_and_refuses_a_layout_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    plan = main(["reference", "--world", "4", "--ep", "2", "--tokens", "16"])
    out = capsys.readouterr().out
    assert "reference" in out and "all-to-all" in out and len(plan.ranks) == 4
    fp8 = main(["reference", "--world", "4", "--ep", "2", "--tokens", "16", "--dispatch-dtype", "fp8"])
    assert fp8.rows() == plan.rows() and 0 < fp8.all_to_all < plan.all_to_all  # bf16 rows back, H + 4 bytes out
    with pytest.raises(ConfigError, match="must divide the world size"):
        sharding_plan("reference", world=6, ep=4)
    with pytest.raises(ConfigError, match="model must be one of"):
        sharding_plan("gpt-5", world=4, ep=2)
    with pytest.raises(ConfigError, match="number of experts"):
        sharding_plan("mixtral-8x22b", world=48, ep=16)  # 8 experts cannot split over 16 ranks
    assert not dist.is_initialized()


TOKENS = 16  # tokens per rank and step: with top-2 of 8 experts and capacity_factor 1.0, 4 rows per expert exactly


def _measure_step(rank: int, world: int, ep: int, out: str, dispatch_dtype: str | None) -> None:
    """One forward+backward of the "reference" preset (capacity_factor 1.0) under the strategy's FSDP2 x EP layout;
    spies on torch.distributed count the bytes each collective moves for this rank."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_llmfast.expert_parallel import DispatchPayload
    from lightning_llmfast.models import MoEGPT, MoEGPTConfig
    from lightning_llmfast.parallel import ParallelDims, parallelize

    torch.manual_seed(0)
    config = MoEGPTConfig(capacity_factor=1.0, router_backend="torch")
    module = nn.ModuleDict({"model": MoEGPT(config)})
    dims = ParallelDims(world, "fsdp", ep)
    dims.build_mesh("cpu")
    payload = DispatchPayload.of(dispatch_dtype)
    parallelize(module, dims, list(module["model"].layers), device=torch.device("cpu"), dispatch=payload)
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}

    def spy(name: str, real: Any, moved: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += moved(*args, **kwargs)
            return real(*args, **kwargs)

        return call

    def leaving(out: Any, inp: Any, out_splits: Any = None, in_splits: Any = None, group: Any = None, **_: Any) -> int:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = [inp.shape[0] // size] * size if in_splits is None else list(in_splits)
        return (sum(rows) - rows[me]) * inp[:1].numel() * inp.element_size()

    def gathered(out: Any, inp: Any, **_: Any) -> int:
        return (out.numel() - inp.numel()) * out.element_size()

    def scattered(output: Any, input: Any, **_: Any) -> int:
        return (input.numel() - output.numel()) * input.element_size()

    patches = {"all_gather_single": ("all_gather", gathered), "reduce_scatter_single": ("reduce_scatter", scattered),
               "all_to_all_single": ("all_to_all", leaving)}  # fmt: skip
    originals = {attr: getattr(dist, attr) for attr in patches}
    for attr, (name, moved) in patches.items():
        setattr(dist, attr, spy(name, originals[attr], moved))
    try:
        ids = torch.randint(0, config.vocab_size, (1, TOKENS + 1), generator=torch.Generator().manual_seed(rank))
        logits = module["model"](ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).backward()
    finally:
        for attr, real in originals.items():
            setattr(dist, attr, real)
    torch.save(counts, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize(("world", "dispatch_dtype"), [(2, "fp8"), (4, None)])
def test_plan_communication_equals_what_a_real_gloo_run_moves(
    world: int, dispatch_dtype: str | None, tmp_path: Any
) -> None:
    """The plan of the "reference" preset (fp32 compute) against one real FSDP2 x EP(2) step on ``world`` gloo
    processes: all-gather bytes received, reduce-scatter bytes sent and all-to-all bytes leaving each rank, counted
    by spies on the collectives FSDP2 and the token exchange call (on 2 processes with fp8 dispatch: ``H + 4``
    bytes a row out, bf16 back and in the backward)."""
    import torch
    from _distributed import run_distributed

    run_distributed(_measure_step, world, 2, str(tmp_path), dispatch_dtype, timeout=300)
    plan = sharding_plan("reference", world, 2, tokens_per_rank=TOKENS, compute_bytes=4, dispatch_dtype=dispatch_dtype)
    for rank in range(world):
        measured = torch.load(tmp_path / f"rank{rank}.pt")
        assert measured == {
            "all_gather": plan.all_gather[rank], "reduce_scatter": plan.reduce_scatter[rank],
            "all_to_all": plan.all_to_all,
        }, rank  # fmt: skip
    assert plan.all_to_all > 0 and plan.reduce_scatter[0] > 0
