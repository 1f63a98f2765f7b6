"""benchmarks/gpu_check.sh cannot rot: its dry run on CPU, and the `cuda` marker that selects its test stage."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
STAGES = ("env", "cuda_tests", "nccl", "kernel_check", "cuda_graphs", "offload", "memplan", "overlap", "cp", "pipeline",
          "bench")  # fmt: skip
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_check.sh is a bash script")


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY": "1", **env}
    script = ROOT / "benchmarks" / "gpu_check.sh"
    return subprocess.run(["bash", str(script)], env=environ, capture_output=True, text=True, timeout=60)


@needs_bash
def test_dry_run_plans_every_stage_within_eight_minutes(tmp_path: Path) -> None:
    run = _dry_run(tmp_path)
    assert run.returncode == 0, run.stderr
    limits = {name: int(s) for name, s in re.findall(r"\| (\w+) \| planned \| (\d+) \|", run.stdout)}
    assert tuple(limits) == STAGES  # correctness first, the benchmarks last
    assert sum(limits.values()) <= 480 and all(s >= 10 for s in limits.values())
    assert "-m cuda" in run.stdout and "LLMFAST_TEST_DEVICE=cuda" in run.stdout
    assert "gpu_nccl_check.py --backend nccl" in run.stdout
    assert "gpu_cuda_graphs.py --json" in run.stdout  # capture, replay, compare with eager, time both
    assert "bench_overlap.py --device cuda" in run.stdout  # ep_overlap on NCCL over a slowed link
    assert "bench_cp.py --device cuda --dtype bfloat16" in run.stdout  # context parallelism's saved bytes per rank
    assert "gpu_pipeline.py --device cuda" in run.stdout  # looped stages on one GPU, two NCCL ranks with two GPUs
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


@needs_bash
@pytest.mark.parametrize(
    ("budget", "expected"), [("100", "| nccl | planned | 40 |"), ("65", "nccl: SKIP (no time left)")]
)
def test_dry_run_reserves_time_only_for_selected_stages(tmp_path: Path, budget: str, expected: str) -> None:
    run = _dry_run(tmp_path, GPU_CHECK_STAGES="nccl bench", GPU_CHECK_BUDGET_S=budget)
    assert "| env | not selected | 0 |" in run.stdout and "| offload | not selected | 0 |" in run.stdout
    # the bench stage's 60 s minimum is held back from nccl: 100 s leaves nccl 40 s, 65 s leaves it 5 s (skipped)
    assert expected in run.stdout
    assert run.returncode == (0 if budget == "100" else 1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how the cuda-marked tests skip on a machine without CUDA")
def test_cuda_marker_selects_tests_that_skip_without_cuda_and_name_their_reason(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = ("test_cuda_step.py", "test_grouped_fallback.py", "test_kernels.py", "test_offload.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs",
           *(str(ROOT / "tests" / name) for name in files)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    summary = run.stdout.strip().splitlines()[-1]
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert skipped >= 10 and "passed" not in summary and "failed" not in summary and "error" not in summary, summary
    reasons = re.findall(r"^SKIPPED \[\d+\] (\S+): (.+)$", run.stdout, flags=re.MULTILINE)
    assert sum(1 for _ in reasons) > 0 and all("CUDA" in why or "cuda" in why for _, why in reasons), reasons
    named = {Path(where.split(":")[0]).name for where, _ in reasons}
    assert set(files) == named


@pytest.mark.slow
def test_nccl_stage_script_runs_its_checks_on_gloo(tmp_path: Path) -> None:
    """The NCCL stage's script, on a one-rank gloo group: FSDP2 sharding, the DCP round trip, expert parallelism,
    fp8 dispatch."""
    out = tmp_path / "nccl_check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_nccl_check.py"), "--backend", "gloo", "--device", "cpu"]
    run = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PASS fsdp_dcp" in run.stdout and "PASS expert_parallel" in run.stdout and "PASS fp8_dispatch" in run.stdout
    assert '"passed": true' in out.read_text()


@pytest.mark.slow
def test_pipeline_stage_script_checks_its_steps_on_gloo(tmp_path: Path) -> None:
    """The pipeline stage's script on the CPU: one rank holding both looped stages of each multi-stage schedule, and
    two gloo ranks of 1F1B, each equal to one process accumulating the microbatches."""
    out = tmp_path / "pipeline.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_pipeline.py"), "--device", "cpu", "--seq", "32"]
    run = subprocess.run([*cmd, "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["schedule"] for r in report["one_rank"]] == ["interleaved_1f1b", "interleaved_zero_bubble", "zbv"]
    assert all(r["ok"] and r["stages"] == [0, 1] for r in report["one_rank"])
    assert [r["stages"] for r in report["two_ranks"]] == [[0], [1]] and all(r["ok"] for r in report["two_ranks"])
