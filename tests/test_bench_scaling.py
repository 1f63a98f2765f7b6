"""``--profile scaling``: tokens/sec per process count and batch size, efficiency against one process, the table."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from lightning_llmfast import ConfigError
from lightning_llmfast.bench.scaling import SCALING_SETTINGS, plot_scaling, run_scaling_benchmark, scaling_markdown


@pytest.mark.parametrize(("worlds", "sizes"), [((2, 4), (1,)), ((1, 2), ()), ((1, 0), (1,)), ((1,), (0,))])
def test_bad_world_or_batch_sizes_fail_before_any_process_starts(
    worlds: tuple[int, ...], sizes: tuple[int, ...]
) -> None:
    with pytest.raises(ConfigError, match="scaling needs"):
        run_scaling_benchmark(worlds, sizes)


@pytest.mark.slow
def test_scaling_profile_measures_every_world_and_batch_size_and_its_efficiency(tmp_path: Path) -> None:
    tiny = SCALING_SETTINGS.with_overrides(seq_len=32, mean_doc_len=8)
    result = run_scaling_benchmark((1, 2), (1, 2), settings=tiny, repeats=2, measured_steps=1, log=lambda _: None)
    assert result["world_sizes"] == [1, 2] and set(result["scaling"]) == {"1", "2"}
    for size in ("1", "2"):
        one, two = result["scaling"][size]["1"], result["scaling"][size]["2"]
        for entry in (one, two):
            repeats = entry["tokens_per_sec_repeats"]
            assert len(repeats) == 2 and min(repeats) > 0
            assert entry["tokens_per_sec"] == statistics.median(repeats)
            assert entry["tokens_per_sec_min"] <= entry["tokens_per_sec"] <= entry["tokens_per_sec_max"]
        assert one["efficiency"] == 1.0
        assert two["efficiency"] == pytest.approx(two["tokens_per_sec"] / (2 * one["tokens_per_sec"]))
        low, high = two["efficiency_range"]
        assert low <= two["efficiency"] <= high
    table = scaling_markdown(result)
    assert table.count("\n| 1 |") == 1 and table.count("\n| 2 |") == 1 and "B=2: efficiency" in table
    plotted = plot_scaling(result, tmp_path / "scaling.png")
    assert plotted == (importlib.util.find_spec("matplotlib") is not None) == (tmp_path / "scaling.png").exists()


@pytest.mark.slow
def test_the_time_budget_stops_before_a_repeat_that_would_pass_it() -> None:
    tiny = SCALING_SETTINGS.with_overrides(seq_len=32, mean_doc_len=8)
    # Any budget below the first repeat's time: the first repeat always runs, no second starts.
    result = run_scaling_benchmark((1,), (1,), settings=tiny, repeats=3, measured_steps=1, max_seconds=1e-3,
                                   log=lambda _: None)  # fmt: skip
    assert len(result["scaling"]["1"]["1"]["tokens_per_sec_repeats"]) == 1
    assert "time budget: 1 of 3 repeats run" in result["notes"]
