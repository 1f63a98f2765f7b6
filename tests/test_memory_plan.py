"""The memory planner: budgets parsed, ``plan_memory`` exact against brute force and never worse than a single
mechanism, and ``OffloadConfig(plan="auto", budget=...)`` on the reference model: the plan fits, gradients stay
bit-identical, the plan runs as planned."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import (
    ActivationOffloader,
    LayerProfile,
    MemoryProfile,
    OffloadConfig,
    memory_plan,
    plan_memory,
)
from lightning_llmfast.offload.memory_plan import MECHANISMS, mechanism_cost, predict_peak
from lightning_llmfast.offload.must_save import MustSaveCounter
from lightning_llmfast.offload.pool import size_class
from lightning_llmfast.offload.profile import parse_budget, resolve_budget
from lightning_llmfast.offload.recompute import saved_by_policy

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
    """``n`` layers of 1 to 3 saved storages each (one may be empty), with random times and a storage overhead."""
    layers = []
    for _ in range(n):
        sizes = tuple(rng.choice([0, 1, 1000, 4096, 1 << 20, 3 << 20, 7_000_001]) for _ in range(rng.randint(1, 3)))
        saved = sum(sizes)
        layers.append(
            LayerProfile(
                saved,
                rng.randrange(0, saved + 1),
                rng.uniform(0, 5),
                rng.uniform(0, 10),
                rng.uniform(0, 5),
                sizes if saved else (),
            )
        )
    return MemoryProfile(
        tuple(layers), bandwidth_bytes_per_ms=rng.choice([1e3, 1e5, 1e6]), storage_ms=rng.choice([0.0, 0.01, 0.5])
    )


def _peak(profile: MemoryProfile, choice: tuple[str, ...], freed: list[int], prefetch: int) -> int:
    """The step's peak of live saved bytes in closed form: the forward's end, or layer ``j``'s backward, holding what
    layers ``0..j`` keep plus, per buffer set, the largest offload (of a layer ``>= j - prefetch``) of that set."""
    kept = [layer.saved_bytes - f for layer, f in zip(profile.layers, freed)]
    n, sets = len(kept), prefetch + 1
    peaks = [sum(kept)]
    for j in range(n):
        held = [
            max((size_class(_span(profile.layers[k].storages, freed[k])) for k in range(max(j - prefetch, 0), n)
                 if k % sets == s and choice[k] in ("offload", "nvme") and freed[k]),
                default=0)
            for s in range(sets)
        ]  # fmt: skip
        peaks.append(sum(kept[: j + 1]) + sum(held))
    return max(peaks)


def _span(storages: tuple[int, ...], freed: int) -> int:
    """The device bytes the first storages adding up to ``freed`` take, each from a 256-byte boundary."""
    for k in range(len(storages) + 1):
        if sum(storages[:k]) == freed:
            return sum((b + 255) // 256 * 256 for b in storages[:k])
    return freed


def _layer_options(profile: MemoryProfile, i: int, mechanisms: tuple[str, ...]) -> list[tuple[str, int, float]]:
    """Every option of layer ``i``: keep, recompute, and each offload mechanism on its first ``k`` storages, for
    every ``k``, from the published formulas (not the planner's cost function): ``(mechanism, freed, added ms)``."""
    layer, after = profile.layers[i], (profile.layers[i + 1] if i + 1 < len(profile.layers) else None)
    found: list[tuple[str, int, float]] = []
    for m in mechanisms:
        if m in ("keep", "recompute"):
            found.append((m, 0, 0.0) if m == "keep" else (m, layer.recompute_bytes, layer.recompute_ms))
            continue
        for k in range(1, len(layer.storages) + 1):
            nbytes = sum(layer.storages[:k])
            bandwidth = profile.bandwidth_bytes_per_ms if m == "offload" else profile.nvme_bandwidth_bytes_per_ms
            assert bandwidth is not None
            copy = nbytes / bandwidth * 1.2  # AUTO_MARGIN
            if m == "offload" and not profile.copies_overlap:
                added = 2 * copy
            else:
                f, b = (after.forward_ms, after.backward_ms) if after is not None else (0.0, 0.0)
                added = max(0.0, copy - f) + max(0.0, copy - b)
            found.append((m, nbytes, added + k * profile.storage_ms))
    return found


def _brute_force(
    profile: MemoryProfile,
    budget: int,
    prefetch: int = 1,
    mechanisms: tuple[str, ...] = ("keep", "recompute", "offload"),
    pinned: int | None = None,
) -> float | None:
    """Least added ms over every assignment of an option per layer (per storage prefix for offloads) whose step peak
    stays within budget (and whose pinned offloads within ``pinned``)."""
    best = None
    per_layer = [_layer_options(profile, i, mechanisms) for i in range(len(profile.layers))]
    for choice in itertools.product(*per_layer):
        names, freed = tuple(c[0] for c in choice), [c[1] for c in choice]
        pinned_used = sum(c[1] for c in choice if c[0] == "offload")
        if pinned is not None and pinned_used > pinned:
            continue
        if _peak(profile, names, freed, prefetch) <= budget:
            total = sum(c[2] for c in choice)
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_plan_memory_fits_and_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    profile = _random_profile(rng, rng.choice([1, 2, 4, 5]))
    prefetch = seed % 3
    for fraction in (1.0, 0.9, 0.5, 0.2, 0.0):
        budget = max(int(profile.saved_bytes * fraction), 1)
        expected = _brute_force(profile, budget, prefetch)
        if expected is None:
            with pytest.raises(OffloadError, match="no plan keeps the saved bytes under"):
                plan_memory(profile, budget, prefetch_layers=prefetch)
            continue
        plan = plan_memory(profile, budget, prefetch_layers=prefetch)
        assert plan.predicted_peak == _peak(profile, plan.choices, list(plan.freed_bytes), prefetch) <= budget
        assert plan.predicted_ms - profile.step_ms == pytest.approx(expected, abs=1e-9)  # exact
        assert "predicted peak" in plan.table() and len(plan.table().splitlines()) == len(profile.layers) + 2


@pytest.mark.parametrize("seed", range(6))
def test_plan_memory_with_an_nvme_tier_and_a_pinned_budget_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    profile = _random_profile(rng, rng.choice([2, 3, 4]))
    profile = dataclasses.replace(
        profile, nvme_bandwidth_bytes_per_ms=profile.bandwidth_bytes_per_ms / rng.choice([2, 8])
    )
    pinned = rng.choice([0, max(layer.saved_bytes for layer in profile.layers)])
    for fraction in (0.9, 0.5, 0.2):
        budget = max(int(profile.saved_bytes * fraction), 1)
        expected = _brute_force(profile, budget, 1, MECHANISMS, pinned)
        if expected is None:
            with pytest.raises(OffloadError, match="no plan keeps"):
                plan_memory(profile, budget, ("pinned", "nvme"), pinned_bytes=pinned)
            continue
        plan = plan_memory(profile, budget, ("pinned", "nvme"), pinned_bytes=pinned)
        assert plan.predicted_ms - profile.step_ms == pytest.approx(expected, abs=1e-9)
        assert sum(plan.freed_bytes[i] for i in plan.layers("offload")) <= pinned
    with pytest.raises(OffloadError, match="nvme_bandwidth"):
        plan_memory(dataclasses.replace(profile, nvme_bandwidth_bytes_per_ms=None), 1, ("nvme",))


def test_offloading_late_layers_while_keeping_early_ones_counts_the_buffer_sets() -> None:
    # Four equal layers, cheap to offload except the last, recompute useless: at a budget of two layers the forward
    # alone would allow keeping 0-1 and offloading 2-3, but layer 2's backward then holds layers 0-2's kept bytes
    # and two buffer sets. The plan must offload early layers instead.
    size = 1 << 20
    layer = LayerProfile(size, 0, 10.0, 10.0, 1.0)
    profile = MemoryProfile((layer,) * 4, bandwidth_bytes_per_ms=1e9)
    plan = plan_memory(profile, 2 * size)
    assert plan.predicted_peak <= 2 * size and "keep" in plan.choices
    late = ("keep", "keep", "offload", "offload")
    assert predict_peak(profile, late, [0, 0, size, size]) == 4 * size  # 2 kept + 2 sets at layer 1's backward


def test_the_plans_picture_holds_each_layers_kept_bytes_from_its_forward_to_its_backward() -> None:
    profile = _random_profile(random.Random(5), 5)
    plan = plan_memory(profile, profile.saved_bytes // 3)
    bars = plan.step_bars()
    kept = [layer.saved_bytes - f for layer, f in zip(profile.layers, plan.freed_bytes)]
    n = len(kept)
    assert len(bars) == 2 * n
    for step, (start, width, live, mechanism) in enumerate(bars):  # a brute-force reading of the step, bar by bar
        forward = step < n
        i = step if forward else 2 * n - 1 - step
        layers_done = range(step) if forward else range(2 * n - step)
        assert live == sum(kept[k] for k in layers_done) and mechanism == plan.choices[i]
        own = profile.layers[i].forward_ms if forward else profile.layers[i].backward_ms + plan.cost_ms[i]
        assert width == pytest.approx(own)
        assert start == pytest.approx(sum(b[1] for b in bars[:step]))


def test_plan_without_offload_tier_never_offloads_and_recompute_only_profile() -> None:
    profile = MemoryProfile((LayerProfile(100, 60, 1.0, 2.0, 0.5),) * 4, bandwidth_bytes_per_ms=1.0)
    plan = plan_memory(profile, 400 - 120, tiers=())
    assert plan.layers("offload") == frozenset() and len(plan.layers("recompute")) == 2
    with pytest.raises(OffloadError, match="unknown tiers"):
        plan_memory(profile, 100, tiers=("tape",))


def test_recompute_keeps_its_inputs_and_the_policys_outputs_once_each() -> None:
    assert saved_by_policy(torch.ops.aten.mm.default) and saved_by_policy(torch.ops.aten.topk.default)
    assert not saved_by_policy(torch.ops.aten.mul.Tensor) and not saved_by_policy(torch.ops.aten.silu.default)
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w1, w2 = torch.randn(7, 11, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float32)
    with MustSaveCounter() as counter:
        counter.note_inputs([x, x[1:], torch.ones(4)])  # one storage once; an input without grad is not held
        h = torch.nn.functional.silu(x @ w1)  # mm output kept, silu recomputed
        values, indices = torch.topk(h, 2)  # both outputs kept
        y = (h.float() @ w2) * 2  # the mm output kept, the cast and the product recomputed
    # from the shapes: x, x @ w1 (float64), topk's values (float64) and indices (int64), h.float() @ w2 (float32)
    assert counter.kept_bytes == 5 * 7 * 8 + 5 * 11 * 8 + 5 * 2 * 8 + 5 * 2 * 8 + 5 * 3 * 4
    assert y.shape == (5, 3) and values.shape == indices.shape == (5, 2)
    with MustSaveCounter(min_bytes=100) as counter:
        torch.topk(torch.randn(3, 4) @ torch.randn(4, 4), 1)  # 48 bytes, then two outputs of 12 and 24 bytes
        torch.randn(9, 9) @ torch.randn(9, 9)  # 324 bytes
    assert counter.kept_bytes == 324


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
    config = OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=10**12, profile_steps=1)
    off = ActivationOffloader(model.layers, config)
    _train(model, off, 2)  # the first step warms up, the second is profiled
    off.close()
    assert off.memory_plan is not None
    return off.memory_plan.profile


def _single_mechanism_costs(profile: MemoryProfile, budget: int) -> dict[str, float]:
    """Added ms of each plan that uses one mechanism on the fewest leading layers (or all) meeting the budget."""
    found = {}
    for mechanism in ("offload", "recompute"):
        for count in range(len(profile.layers) + 1):
            choice = tuple(mechanism if i < count else "keep" for i in range(len(profile.layers)))
            costs = [mechanism_cost(profile, i, m) for i, m in enumerate(choice)]
            if _peak(profile, choice, [f for f, _ in costs], 1) <= budget:
                found[mechanism] = sum(c for _, c in costs)
                break
    return found


@pytest.mark.parametrize(("hidden", "n_layers"), [(16, 6), (32, 8), (48, 5)])
def test_planner_is_never_worse_than_one_mechanism_on_measured_profiles(hidden: int, n_layers: int) -> None:
    profile = _measured_profile(hidden, n_layers)
    # recomputation frees what a layer saves beyond its inputs and the policy's outputs: at hidden 48 nothing
    assert all(0 <= layer.recompute_bytes < layer.saved_bytes for layer in profile.layers)
    for fraction in (0.9, 0.7, 0.5):
        budget = int(profile.saved_bytes * fraction)
        plan = plan_memory(profile, budget)
        assert plan.predicted_peak <= budget
        singles = _single_mechanism_costs(profile, budget)
        assert singles, "no single mechanism meets the budget: the comparison would be empty"
        for mechanism, cost in singles.items():
            assert plan.predicted_ms - profile.step_ms <= cost + 1e-9, mechanism


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops created inside the block that are still alive (a weak finalizer per storage): an
    account of memory independent of the offloader's."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage (the offloader's pool slices too): not new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                if storage.data_ptr() and storage.data_ptr() not in inputs:
                    self.live[storage.data_ptr()] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, storage.data_ptr(), 0)
        return out


def _live_after_forward(model: MoEGPT, off: ActivationOffloader | None, ids: torch.Tensor) -> tuple[int, list[Any]]:
    """One step: live bytes created by the forward once the loss exists, and the gradients."""
    model.zero_grad(set_to_none=True)
    with off if off is not None else torch.enable_grad():
        with _LiveBytes() as mode:
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        live = sum(mode.live.values())
        loss.backward()
    return live, [p.grad.clone() for p in model.parameters()]


def _plan_and_run(fraction: float, seed: int) -> tuple[ActivationOffloader, int, int]:
    """The 12-layer reference model's warm-up, profiled and planned steps under a plan for ``fraction`` of what it
    saves, against the model without offload (gradients bit-identical at every step): the offloader, its budget and
    the live bytes the planned forward freed (counted independently of the offloader)."""
    profile = _measured_profile(16, 12)
    budget = int(profile.saved_bytes * fraction)
    ref, model = _model(16, 12), _model(16, 12)
    # rebuild=None: the reference keeps what the offloader would otherwise rebuild, so only the plan differs.
    config = OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=budget, rebuild=None, profile_steps=1)
    off = ActivationOffloader(model.layers, config)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    for _ in range(3):  # warm-up, profiled, planned
        live_ref, grads_ref = _live_after_forward(ref, None, ids)
        live_off, grads_off = _live_after_forward(model, off, ids)
        assert all(torch.equal(a, b) for a, b in zip(grads_ref, grads_off))
    return off, budget, live_ref - live_off


@pytest.mark.parametrize(
    "fraction", [pytest.param(0.9, marks=pytest.mark.slow), pytest.param(0.7, marks=pytest.mark.slow), 0.5]
)
def test_auto_plan_on_the_12_layer_reference_model_meets_its_budget_bit_identically(
    fraction: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_llmfast.offload.planner"):
        off, budget, freed_live = _plan_and_run(fraction, seed=3)
    plan = off.memory_plan
    assert plan is not None and plan.predicted_peak <= budget and {"offload", "keep"} <= set(plan.choices)
    assert any("memory plan" in r.getMessage() and "predicted peak" in r.getMessage() for r in caplog.records)
    metrics = off.step_metrics()
    # the step's measured peak of live saved bytes (the offloader's own account) meets the budget and the prediction
    assert metrics["measured_peak"] <= budget
    assert abs(metrics["measured_peak"] - plan.predicted_peak) <= 0.1 * plan.predicted_peak
    # and that account agrees with an independent one: what the plan freed at the forward's end, in live bytes
    freed_counted = plan.profile.saved_bytes - off.meter.forward_bytes
    assert abs(freed_live - freed_counted) <= 0.05 * plan.profile.saved_bytes, (freed_live, freed_counted)
    stats = off.stats
    offloading = plan.layers("offload")
    assert stats["offload_layers"] == len(offloading) and stats["recompute_layers"] == len(plan.layers("recompute"))
    # the plan applied is the plan chosen: per layer call, what it kept is what the profile saved less what the plan
    # frees there (a partly offloading layer stops at its planned storages), and the copies add up to the offloads
    assert len(off.meter.kept_bytes) == len(plan.choices)
    for i, layer in enumerate(plan.profile.layers):
        if plan.choices[i] != "recompute":
            assert off.meter.kept_bytes[i] == layer.saved_bytes - plan.freed_bytes[i], i
    assert stats["offloaded_bytes"] == sum(plan.freed_bytes[i] for i in offloading)
    off.close()


@pytest.mark.parametrize("fraction", [pytest.param(0.9, marks=pytest.mark.slow), 0.5])
def test_a_plan_that_recomputes_keeps_what_it_predicted(fraction: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """What recomputation keeps is measured, not guessed from op names: with recomputation made the cheapest
    mechanism, the plan recomputes, and the step's peak equals the prediction, within the budget, bit-identically."""

    def recompute_first(profile: MemoryProfile, index: int, mechanism: str, margin: float, count: Any = None) -> Any:
        freed, added = mechanism_cost(profile, index, mechanism, margin, count)
        return freed, (0.0 if mechanism == "recompute" else added + 1e3)

    monkeypatch.setattr(memory_plan, "mechanism_cost", recompute_first)
    off, budget, freed_live = _plan_and_run(fraction, seed=5)
    plan = off.memory_plan
    assert plan is not None and "recompute" in plan.choices
    assert off.step_metrics()["measured_peak"] == plan.predicted_peak <= budget
    # an independent count: the live bytes the planned forward leaves against the reference's (the bound of the test
    # above: the live count also sees what no layer call saves)
    freed_counted = plan.profile.saved_bytes - off.meter.forward_bytes
    assert abs(freed_live - freed_counted) <= 0.05 * plan.profile.saved_bytes, (freed_live, freed_counted)
    # per layer call: a recomputing layer keeps exactly what the warm-up step counted it would keep
    for i, layer in enumerate(plan.profile.layers):
        assert off.meter.kept_bytes[i] == layer.saved_bytes - plan.freed_bytes[i], (i, plan.choices[i])
    off.close()


def test_only_the_warm_up_step_runs_the_must_save_counter() -> None:
    """The counter is a dispatch mode with a Python call per op: the profiled steps, whose times the plan predicts
    from, run without it, and what it counted in the warm-up step still reaches their profile."""
    model = _model(16, 3)
    modes: list[list[bool]] = []

    def seen(module: torch.nn.Module, args: Any) -> None:
        modes[-1].append(isinstance(_get_current_dispatch_mode(), MustSaveCounter))

    config = OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=10**12, profile_steps=3)
    off = ActivationOffloader(model.layers, config)
    for layer in model.layers:  # after the offloader's own hook, which enters the counter
        layer.register_forward_pre_hook(seen)
    g = torch.Generator().manual_seed(0)
    while off.memory_plan is None:
        modes.append([])
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        with off:
            F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    off.close()
    # a warm-up step, then three profiled steps alternating with three probe steps
    assert modes == [[True] * 3] + [[False] * 3] * 6
    assert all(0 < layer.recompute_bytes < layer.saved_bytes for layer in off.memory_plan.profile.layers)
