"""``benchmarks/gpu_memplan.py`` (the memory-plan stage of ``gpu_check.sh``) in its CPU dry run, and the stage listed
by the script's dry run: a GPU session must not lose its time to a bug in either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def test_gpu_memplan_runs_every_mode_and_its_plans_fit_their_budgets_on_cpu() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_memplan
    finally:
        sys.path.pop(0)
    report = gpu_memplan.run(device="cpu", tiny=True, repeats=1)
    modes = report["modes"]
    assert list(modes) == ["off", "offload", "recompute", "plan_60", "plan_50"]
    assert all(m["tokens_per_sec"] > 0 and m["peak_act_bytes"] is None for m in modes.values())  # no CPU device peak
    assert modes["offload"]["stats"]["offloaded_bytes"] > 0 and modes["recompute"]["stats"]["recompute_layers"] == 12
    for name, fraction in (("plan_60", 0.6), ("plan_50", 0.5)):
        plan = modes[name]
        assert plan["budget_bytes"] == int(report["saved_bytes"] * fraction)
        assert plan["predicted_peak"] <= plan["budget_bytes"] and plan["last_measured_peak"] <= plan["budget_bytes"]
        assert len(plan["choices"]) == len(plan["storages"]) == 12
        assert set(plan["vs_single"]) == {"offload", "recompute"}
    text = gpu_memplan.summary(report)
    assert text.count("\n| ") == 1 + len(modes)  # the separator and one row per mode


def test_gpu_check_dry_run_lists_the_memory_plan_stage() -> None:
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_STAGES": "offload memplan"}
    out = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    if out.returncode == 127:
        pytest.skip("bash is not available")
    assert "memplan: limit" in out.stdout and "benchmarks/gpu_memplan.py --device cuda" in out.stdout, out.stdout
    assert "| memplan | planned |" in out.stdout
