"""The one benchmark loop: warm-up, counted call, rotated interleaving, medians, spread, deadline, failures."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_llmfast.bench.harness import Measurement, count_call, interleave, ratio_range


def test_interleave_warms_up_counts_then_rotates_the_order() -> None:
    calls: list[tuple[str, int]] = []

    def impl(name: str, value: float):
        def run(r: int) -> float | None:
            calls.append((name, r))
            torch.randn(5).nonzero()  # one host sync and a few kernels in every call
            return value + r if r >= 0 else None

        return run

    out = interleave({"a": impl("a", 10.0), "b": impl("b", 20.0), "c": impl("c", 30.0)}, 4, warmup=2, count=True)
    setup = [("a", -1)] * 3 + [("b", -1)] * 3 + [("c", -1)] * 3  # two warm-ups and the counted call each
    rounds = [[("a", 0), ("b", 0), ("c", 0)], [("b", 1), ("c", 1), ("a", 1)], [("c", 2), ("a", 2), ("b", 2)]]
    rounds.append([("a", 3), ("b", 3), ("c", 3)])
    assert calls == setup + [c for r in rounds for c in r]
    assert out["a"].values == [10.0, 11.0, 12.0, 13.0] and out["a"].median == 11.5
    assert (out["b"].low, out["b"].high) == (20.0, 23.0)
    assert out["a"].syncs == 1 and out["a"].sync_names == {"nonzero": 1} and out["a"].kernels >= 2
    assert ratio_range(out["b"], out["a"]) == pytest.approx((20 / 13, 23 / 10))


def test_interleave_times_calls_that_return_nothing_and_stops_at_the_deadline() -> None:
    out = interleave({"sleep": lambda r: time.sleep(0.01)}, 5, deadline=time.perf_counter())
    assert len(out["sleep"].values) == 1 and out["sleep"].values[0] >= 0.01  # the first round always runs
    assert out["sleep"].syncs is None  # not counted


def test_a_failing_implementation_is_recorded_and_dropped_with_catch() -> None:
    def broken(r: int) -> None:
        if r >= 1:
            raise RuntimeError("out of memory\nmore lines")

    logged: list[str] = []
    out = interleave({"ok": lambda r: 1.0, "broken": broken}, 3, catch=True, log=logged.append)
    assert out["broken"].error == "RuntimeError: out of memory" and len(out["broken"].values) == 1
    assert out["ok"].values == [1.0, 1.0, 1.0] and logged == ["[bench] broken failed: RuntimeError: out of memory"]
    with pytest.raises(RuntimeError, match="out of memory"):
        interleave({"broken": broken}, 3)


def test_count_call_and_summary() -> None:
    m = count_call(lambda: torch.randn(4).tolist())
    assert (m.syncs, m.sync_names) == (1, {"tolist": 1}) and m.kernels == 1  # randn
    row = Measurement(values=[3.0, 1.0, 2.0], syncs=0, kernels=7).summary("tokens_per_sec")
    assert row == {
        "tokens_per_sec": 2.0, "tokens_per_sec_min": 1.0, "tokens_per_sec_max": 3.0,
        "tokens_per_sec_repeats": [3.0, 1.0, 2.0], "host_syncs": 0, "kernels": 7,
    }  # fmt: skip
    assert ratio_range(Measurement(), Measurement(values=[1.0])) is None
