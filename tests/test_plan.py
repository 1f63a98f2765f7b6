"""``python -m lightning_llmfast.plan``: the strategy's real FSDP2 x EP sharding on a fake process group and a meta
model, every rank's row equal to the closed-form formula of docs/distributed.md."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch.distributed as dist

from lightning_llmfast import ConfigError
from lightning_llmfast.expert_parallel import DispatchPayload
from lightning_llmfast.moe import RoutingConfig
from lightning_llmfast.plan import exchange_overlap, formula_plan, main, sharding_plan

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
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0, "size_check": 0}

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
        moved = (out.numel() - inp.numel()) * out.element_size()
        if inp.dtype == torch.int64:  # the capacity dispatch's size check, not FSDP2's parameters
            counts["size_check"] += moved
            return 0
        return moved

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

    from lightning_llmfast.models import MoEGPTConfig

    run_distributed(_measure_step, world, 2, str(tmp_path), dispatch_dtype, timeout=300)
    plan = sharding_plan("reference", world, 2, tokens_per_rank=TOKENS, compute_bytes=4, dispatch_dtype=dispatch_dtype)
    config = MoEGPTConfig()
    # Every MoE layer's capacity dispatch gathers, from the other rank of its EP group, its E + 1 balance-loss counts
    # and 5 sizes (tokens, capacity, dtype, hidden, payload) as int64.
    size_check = config.n_layers * (2 - 1) * (config.num_experts + 1 + 5) * 8
    for rank in range(world):
        measured = torch.load(tmp_path / f"rank{rank}.pt")
        assert measured == {
            "all_gather": plan.all_gather[rank], "reduce_scatter": plan.reduce_scatter[rank],
            "all_to_all": plan.all_to_all, "size_check": size_check,
        }, rank  # fmt: skip
    assert plan.all_to_all > 0 and plan.reduce_scatter[0] > 0


def test_exchange_overlap_equals_a_hand_computation() -> None:
    """8 experts, top-2, H = 16, F = 12 on 2 nodes of 2 ranks, 10 tokens a rank, 100 Gbit/s, 2 TFLOP/s."""
    routing = RoutingConfig(top_k=2)
    args = {"ep": 4, "gpus_per_node": 2, "tokens_per_rank": 10, "link_gbps": 100.0, "tflops": 2.0}
    gemm = 10 * 2 * (2 * 16 * 24 + 2 * 12 * 16) / 2e12 * 1e3  # T k pairs, H -> 2F and F -> H, 2 FLOPs a MAC
    pairs = 2 * 1 / 2  # each of the 2 experts on the other node with probability 1/2
    reached = 1 - math.comb(4, 2) / math.comb(8, 2)  # P(both experts on this node's 4) = 6/28
    link = 100e9 / 8 / 1e3  # bytes per millisecond
    for payload, out, back in ((None, 32, 32), (DispatchPayload("fp8"), 16 + 4, 32)):  # bf16 rows of 16: 32 bytes
        times = exchange_overlap(routing, 8, 16, 12, payload=payload, **args)
        assert times.gemm_ms == pytest.approx((gemm, 2 * gemm), rel=1e-12)
        assert times.flat_ms == pytest.approx((10 * pairs * (out + back) / link, 10 * pairs * 2 * back / link))
        assert times.hierarchical_ms == pytest.approx(
            (10 * reached * (out + back + 8 * 2) / link, 10 * reached * (2 * back + 4 * 2) / link), rel=1e-12
        )
    # One node: nothing crosses, everything hides.
    alone = exchange_overlap(routing, 8, 16, 12, **{**args, "gpus_per_node": 4})
    assert alone.flat_ms == alone.hierarchical_ms == (0.0, 0.0)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="link_gbps must be a positive number"):
            exchange_overlap(routing, 8, 16, 12, **{**args, "link_gbps": bad})
        with pytest.raises(ConfigError, match="tflops must be a positive number"):
            exchange_overlap(routing, 8, 16, 12, **{**args, "tflops": bad})


def test_plan_cli_prints_the_exchange_against_the_gemms(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_llmfast.models import MoEGPTConfig

    base = ["reference", "--nodes", "2", "--gpus-per-node", "2", "--ep", "4", "--tokens", "16"]
    plan = main([*base, "--link-gbps", "50", "--tflops", "0.5"])
    out = capsys.readouterr().out
    assert "exchange_ms" in out and "hierarchical  backward" in out
    config = MoEGPTConfig()
    expected = exchange_overlap(
        RoutingConfig(top_k=config.top_k), config.num_experts, config.hidden_size, config.ffn_size, ep=4,
        gpus_per_node=2, tokens_per_rank=16, link_gbps=50, tflops=0.5,
    )  # fmt: skip
    assert plan.overlap == expected
    for flags, message in [
        (["--link-gbps", "0", "--tflops", "1"], "link_gbps must be a positive number"),
        (["--link-gbps", "nan", "--tflops", "1"], "link_gbps must be a positive number"),
        (["--link-gbps", "10", "--tflops", "-2"], "tflops must be a positive number"),
        (["--link-gbps", "10"], "go together"),
        (["--link-gbps", "fast", "--tflops", "1"], "invalid float value"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):
        main(["reference", "--world", "4", "--ep", "2", "--link-gbps", "10", "--tflops", "1"])  # no --nodes
    assert "go together" in capsys.readouterr().err
    assert not dist.is_initialized()
