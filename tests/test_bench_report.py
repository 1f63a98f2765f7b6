"""The benchmark report shows each variant's spread and warns when it is too wide to trust the ratios.

Timings here are fabricated (a deliberately slowed repeat), so the tests check the reporting, never the speed.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_llmfast.bench import steps
from lightning_llmfast.bench.report import (
    MAX_SPREAD,
    _error_bars,
    _micro_section,
    markdown_report,
    ratio_range,
    spread_warnings,
)
from lightning_llmfast.bench.suite import PROFILES, run_benchmark


def _row(*repeats: float) -> dict[str, Any]:
    ordered = sorted(repeats)
    return {
        "tokens_per_sec": ordered[len(ordered) // 2],
        "tokens_per_sec_min": ordered[0],
        "tokens_per_sec_max": ordered[-1],
        "tokens_per_sec_repeats": list(repeats),
        "host_syncs_per_step": 0.0,
        "metadata_builds_per_step": 1.0,
        "aten_ops_per_step": 10.0,
        "kernels_per_step": 8.0,
        "peak_mem_bytes": 1 << 20,
        "final_loss": 2.0,
    }


def test_a_deliberately_slowed_variant_shows_its_spread_and_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real harness on the tiny profile; only the clock readings of the timed segments are replaced, with
    # `before` slowed five-fold in its second repeat.
    scripted = {"before": [1000.0, 200.0, 1010.0], "llmfast": [1500.0, 1490.0, 1510.0]}
    calls = {variant: 0 for variant in scripted}
    fit = steps.fit_segment

    def fit_with_fake_clock(variant: str, module: Any, segment: Any, probe: Any, *args: Any) -> None:
        fit(variant, module, segment, probe, *args)
        timed_index = calls[variant] - 2  # first the warm-up step, then the counting segment
        calls[variant] += 1
        if timed_index >= 0 and not probe.count:  # not the CUDA path's counting pass after the timed segments
            probe.t0, probe.t1 = 0.0, probe.tokens / scripted[variant][timed_index]

    monkeypatch.setattr(steps, "fit_segment", fit_with_fake_clock)
    settings = PROFILES["tiny"].e2e.with_overrides(repeats=3, measured_steps=1)
    profile = type(PROFILES["tiny"])("tiny", settings, micro_quick=True)
    result = run_benchmark(profile, "cpu", variants=("before", "llmfast"), micro=(), log=lambda _: None)

    before = result["e2e"]["before"]
    assert before["tokens_per_sec_repeats"] == pytest.approx(scripted["before"])
    assert result["e2e"]["llmfast"]["tokens_per_sec_repeats"] == pytest.approx(scripted["llmfast"])
    assert (before["tokens_per_sec_min"], before["tokens_per_sec"], before["tokens_per_sec_max"]) == pytest.approx(
        (200.0, 1000.0, 1010.0)
    )
    assert result["ratios"]["llmfast_vs_before"] == pytest.approx(1500.0 / 1000.0)
    assert result["ratio_ranges"]["llmfast_vs_before"] == pytest.approx((1490.0 / 1010.0, 1510.0 / 200.0))
    # one warning, for the slowed variant only: llmfast's repeats agree and the ratio's range excludes 1
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith("before: repeats range from 200 to 1,010")
    assert "5.05x" in result["warnings"][0]

    text = markdown_report(result)
    assert "| before | 1,000 | 200 - 1,010 | 1.00x |" in text
    assert "| llmfast | 1,500 | 1,490 - 1,510 | 1.50x |" in text
    assert "- llmfast_vs_before = 1.50x [1.48x - 7.55x]" in text
    assert "**Warning: the spread of the repeats is too wide to trust these ratios.**" in text
    assert f"- {result['warnings'][0]}" in text


def test_ratio_range_is_the_extreme_quotients_of_the_repeats() -> None:
    rows = {"a": _row(90.0, 100.0, 110.0), "b": _row(48.0, 50.0, 61.0)}
    low, high = ratio_range(rows, "a", "b")
    assert (low, high) == pytest.approx((90.0 / 61.0, 110.0 / 48.0))
    assert ratio_range(rows, "a", "missing") is None
    assert ratio_range({"a": rows["a"], "b": {"skipped": "no transformers"}}, "a", "b") is None


def test_the_spread_limit_is_inclusive_and_documented() -> None:
    at_limit = {"before": _row(100.0, 100.0 * MAX_SPREAD), "llmfast": _row(400.0, 401.0)}
    assert spread_warnings(at_limit) == []
    above = {"before": _row(100.0, 100.0 * MAX_SPREAD + 0.5), "llmfast": _row(400.0, 401.0)}
    (warning,) = spread_warnings(above)
    assert warning.startswith("before:") and f"above the {MAX_SPREAD}x limit" in warning


def test_ratios_whose_range_contains_one_are_flagged() -> None:
    # each variant is steady (within 10%), but the two overlap: the run cannot tell which one is faster
    rows = {"before": _row(95.0, 100.0, 104.0), "llmfast": _row(98.0, 103.0, 107.0), "peer": _row(40.0, 41.0)}
    (warning,) = spread_warnings(rows)
    assert warning.startswith("llmfast_vs_before: between 0.94x and 1.13x")
    assert "llmfast_vs_peer" not in warning


def test_results_without_a_spread_report_it_as_missing_and_do_not_warn() -> None:
    old = {"tokens_per_sec": 100.0, "host_syncs_per_step": 1.0, "peak_mem_bytes": 1, "final_loss": 1.0}
    result = {
        "profile": "quick",
        "device": "cpu",
        "commit": "abc",
        "e2e": {"before": old, "llmfast": dict(old, tokens_per_sec=120.0)},
        "ratios": {"llmfast_vs_before": 1.2},
    }
    text = markdown_report(result)
    assert spread_warnings(result["e2e"]) == [] and "Warning" not in text
    assert "| llmfast | 120 | n/a | 1.20x |" in text and "- llmfast_vs_before = 1.20x" in text


def test_nested_micro_results_print_as_narrow_tables() -> None:
    modes = {
        name: {f"metric_{i}": i * 1.5 + len(name) for i in range(14)} | {"plan": {"layers": list(range(60))}}
        for name in ("off", "on", "auto")
    }
    entry = {
        "device": "cpu",
        "repeats": 3,
        "per_layer_bytes": list(range(1000, 1100)),
        "modes": modes,
        "step_ms": {"off": 10.0, "on": 12.5},
        "tokens_per_sec": {"off": 800.0, "on": 640.0},
        "stats": {f"counter_{i}": i for i in range(20)},
        "rows": [{"T": t, "ratio": t / 100, "shape": {"E": 8, "k": 2}} for t in (128, 512)],
    }
    text = _micro_section(entry)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    # the metrics of the modes run down the page, one column per mode
    assert "| | off | on | auto |" in lines and "| metric_13 | 22.5 | 21.5 | 23.5 |" in lines
    # dicts keyed alike (per mode) share one table; a long list is cut in its cell
    assert "| | off | on |" in lines and "| tokens_per_sec | 800 | 640 |" in lines
    assert "| counter_19 | 19 |" in lines and "| repeats | 3 |" in lines
    assert any(line.startswith("| per_layer_bytes | [1000, 1001,") and line.endswith("... |") for line in lines)
    assert "| shape.E | 8 | 8 |" in lines and "| ratio | 1.28 | 5.12 |" in lines


class _Bar:
    def __init__(self, x: float) -> None:
        self.x, self.hatch = x, None

    def get_x(self) -> float:
        return self.x

    def get_width(self) -> float:
        return 0.8

    def set_hatch(self, hatch: str) -> None:
        self.hatch = hatch


class _Axes:
    def __init__(self) -> None:
        self.calls: list[tuple[float, float, Any]] = []

    def errorbar(self, x: float, y: float, *, yerr: Any, **kwargs: Any) -> None:
        self.calls.append((x, y, yerr))


def test_plot_error_bars_run_from_min_to_max_and_hatch_wide_spreads() -> None:
    ax, bars = _Axes(), [_Bar(0.0), _Bar(1.0), _Bar(2.0)]
    rows = [_row(100.0, 120.0, 110.0), _row(50.0, 300.0, 290.0), {"tokens_per_sec": 5.0}]
    _error_bars(ax, bars, rows)
    assert ax.calls == [(0.4, 110.0, [[10.0], [10.0]]), (1.4, 290.0, [[240.0], [10.0]])]
    assert [bar.hatch for bar in bars] == [None, "//", None]
