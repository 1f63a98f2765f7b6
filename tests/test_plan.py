"""``python -m lightning_llmfast.plan``: the strategy's real FSDP2 x EP sharding on a fake process group and a meta
model, every rank's row equal to the closed-form formula of docs/distributed.md."""

from __future__ import annotations

import math

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
    with pytest.raises(ConfigError, match="must divide the world size"):
        sharding_plan("reference", world=6, ep=4)
    with pytest.raises(ConfigError, match="model must be one of"):
        sharding_plan("gpt-5", world=4, ep=2)
    with pytest.raises(ConfigError, match="number of experts"):
        sharding_plan("mixtral-8x22b", world=48, ep=16)  # 8 experts cannot split over 16 ranks
    assert not dist.is_initialized()
