"""The memory planner: budgets parsed, ``plan_memory`` exact against brute force and never worse than a single
mechanism, and ``OffloadConfig(plan="auto", budget=...)`` on the reference model: the plan fits, gradients stay
bit-identical, the plan runs as planned."""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import (
    ActivationOffloader,
    LayerProfile,
    MemoryProfile,
    OffloadConfig,
    plan_memory,
)
from lightning_llmfast.offload.memplan import MECHANISMS, mechanism_cost
from lightning_llmfast.offload.profile import parse_budget, resolve_budget
from lightning_llmfast.offload.recompute import recomputed_by_selective

VOCAB = 32


def test_budget_spellings_and_bad_budgets() -> None:
    assert parse_budget(1234) == 1234 and parse_budget("40GiB") == 40 << 30 and parse_budget("1.5 kb") == 1500
    assert parse_budget(0.5) == 0.5 and resolve_budget("2MiB", torch.device("cpu")) == 2 << 20
    assert 0 < resolve_budget(0.25, torch.device("cpu")) < resolve_budget(1.0, torch.device("cpu"))
    for bad in (True, 0, -5, 1.5, 0.0, float("nan"), "40 parsecs", "GiB", "-1GiB", None):
        with pytest.raises(OffloadError, match="budget"):
            parse_budget(bad)  # type: ignore[arg-type]
    with pytest.raises(OffloadError, match="go together"):
        OffloadConfig(plan="auto")
    with pytest.raises(OffloadError, match="go together"):
        OffloadConfig(budget="1GiB")
    with pytest.raises(OffloadError, match="chooses offload_layers and recompute"):
        OffloadConfig(plan="auto", budget=0.5, offload_layers=2)
    with pytest.raises(OffloadError, match="plan must be"):
        OffloadConfig(plan="fast", budget=0.5)  # type: ignore[arg-type]


def _random_profile(rng: random.Random, n: int) -> MemoryProfile:
    layers = []
    for _ in range(n):
        saved = rng.choice([1, 1000, 4096, 1 << 20, 3 << 20, 7_000_001])
        layers.append(
            LayerProfile(saved, rng.randrange(0, saved + 1), rng.uniform(0, 5), rng.uniform(0, 10), rng.uniform(0, 5))
        )
    return MemoryProfile(tuple(layers), bandwidth_bytes_per_ms=rng.choice([1e3, 1e5, 1e6]))


def _brute_force(profile: MemoryProfile, budget: int) -> float | None:
    """Least added ms over every assignment of a mechanism per layer that keeps the saved bytes within budget."""
    best = None
    for choice in itertools.product(MECHANISMS, repeat=len(profile.layers)):
        costs = [mechanism_cost(profile, i, m) for i, m in enumerate(choice)]
        if profile.saved_bytes - sum(f for f, _ in costs) <= budget:
            total = sum(c for _, c in costs)
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_plan_memory_fits_and_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    profile = _random_profile(rng, rng.choice([1, 2, 5, 6]))
    for fraction in (1.0, 0.9, 0.5, 0.2, 0.0):
        budget = max(int(profile.saved_bytes * fraction), 1)
        expected = _brute_force(profile, budget)
        if expected is None:
            with pytest.raises(OffloadError, match="no plan keeps the saved bytes under"):
                plan_memory(profile, budget)
            continue
        plan = plan_memory(profile, budget)
        assert plan.predicted_peak <= budget
        assert plan.predicted_ms - profile.step_ms == pytest.approx(expected, abs=1e-9)  # exact
        assert "predicted peak" in plan.table() and len(plan.table().splitlines()) == len(profile.layers) + 2


def test_plan_without_offload_tier_never_offloads_and_recompute_only_profile() -> None:
    profile = MemoryProfile((LayerProfile(100, 60, 1.0, 2.0, 0.5),) * 4, bandwidth_bytes_per_ms=1.0)
    plan = plan_memory(profile, 400 - 120, tiers=())
    assert plan.layers("offload") == frozenset() and len(plan.layers("recompute")) == 2
    with pytest.raises(OffloadError, match="unknown tiers"):
        plan_memory(profile, 100, tiers=("tape",))


def test_selective_recompute_classification_of_node_names() -> None:
    assert recomputed_by_selective("MulBackward0") and recomputed_by_selective("SiluBackward0")
    for kept in ("MmBackward0", "AddmmBackward0", "ScaledDotProductFlashAttentionForCpuBackward0", "TopkBackward0"):
        assert not recomputed_by_selective(kept)


# ---------------------------------------------------------------------------------------------- measured profiles
def _model(hidden: int, n_layers: int, seed: int = 0) -> MoEGPT:
    torch.manual_seed(seed)
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=hidden, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_size=2 * hidden
    )
    return MoEGPT(config)


def _train(model: MoEGPT, off: ActivationOffloader | None, steps: int, seq: int = 24) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, seq), generator=g)
        opt.zero_grad(set_to_none=True)
        with off if off is not None else torch.enable_grad():
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
            loss.backward()
        out.append(([p.grad.clone() for p in model.parameters()], dict(off.stats) if off is not None else None))
        opt.step()
    return out


def _measured_profile(hidden: int, n_layers: int) -> MemoryProfile:
    model = _model(hidden, n_layers)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=10**12))
    _train(model, off, 1)
    off.close()
    assert off.memory_plan is not None
    return off.memory_plan.profile


def _single_mechanism_costs(profile: MemoryProfile, budget: int) -> dict[str, float]:
    """Added ms of each plan that uses one mechanism on the fewest leading layers (or all) meeting the budget."""
    found = {}
    for mechanism in ("offload", "recompute"):
        for count in range(len(profile.layers) + 1):
            costs = [mechanism_cost(profile, i, mechanism if i < count else "keep") for i in range(len(profile.layers))]
            if profile.saved_bytes - sum(f for f, _ in costs) <= budget:
                found[mechanism] = sum(c for _, c in costs)
                break
    return found


@pytest.mark.parametrize(("hidden", "n_layers"), [(16, 4), (32, 6), (48, 3)])
def test_planner_is_never_worse_than_one_mechanism_on_measured_profiles(hidden: int, n_layers: int) -> None:
    profile = _measured_profile(hidden, n_layers)
    assert all(layer.saved_bytes > 0 and layer.recompute_bytes > 0 for layer in profile.layers)
    for fraction in (0.9, 0.7, 0.5):
        budget = int(profile.saved_bytes * fraction)
        plan = plan_memory(profile, budget)
        assert plan.predicted_peak <= budget
        for mechanism, cost in _single_mechanism_costs(profile, budget).items():
            assert plan.predicted_ms - profile.step_ms <= cost + 1e-9, mechanism


@pytest.mark.parametrize(
    "fraction", [pytest.param(0.9, marks=pytest.mark.slow), pytest.param(0.7, marks=pytest.mark.slow), 0.5]
)
def test_auto_plan_on_the_12_layer_reference_model_is_bit_identical_and_runs_as_planned(
    fraction: float, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _train(_model(16, 12), None, 2)
    profile = _measured_profile(16, 12)
    budget = int(profile.saved_bytes * fraction)
    model = _model(16, 12)
    config = OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=budget)
    off = ActivationOffloader(model.layers, config)
    with caplog.at_level(logging.INFO, logger="lightning_llmfast.offload.offloader"):
        got = _train(model, off, 2)
    plan = off.memory_plan
    assert plan is not None and plan.predicted_peak <= budget
    assert any("memory plan" in r.getMessage() and "predicted peak" in r.getMessage() for r in caplog.records)
    for (g_ref, _), (g_off, _) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g_off))
    stats = got[-1][1]
    offloading = plan.layers("offload")
    assert stats["offload_layers"] == len(offloading) and stats["recompute_layers"] == len(plan.layers("recompute"))
    # what the planned step copied is what the profile said those layers save (same shapes), within 10%
    planned = sum(plan.profile.layers[i].saved_bytes for i in offloading)
    assert abs(stats["offloaded_bytes"] - planned) <= 0.1 * max(planned, 1)
    off.close()
