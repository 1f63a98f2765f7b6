"""Context parallelism inside Lightning: ranks that split the positions of every packed batch train the reference
MoE GPT exactly as one process holding the whole batch (losses logged on every rank, weights after four AdamW steps),
with DDP, FSDP2 x dp and expert parallelism drawn from the cp ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[1]
sys.path.insert(0, str(SCRIPTS))
from cp_steps import fit, module  # noqa: E402


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k].is_floating_point() and b[k].norm() > 0)


_REFERENCES: dict[int, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _one_process(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process accumulating the micro-batches of ``dp`` streams per step (memoised: one fit per ``dp``)."""
    if dp not in _REFERENCES:
        model, log, _ = fit("llmfast", 1, dp)
        _REFERENCES[dp] = (log.losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return _REFERENCES[dp]


@pytest.mark.parametrize(
    ("devices", "cp", "sharding", "ep"),
    [(2, 2, "ddp", 1), (2, 2, "ddp", 2), (4, 2, "fsdp", 1), (4, 4, "ddp", 1)],
    ids=["cp2", "cp2-ep2", "fsdp-dp2-cp2", "cp4"],
)
def test_context_parallel_fit_equals_one_process(tmp_path: Path, devices: int, cp: int, sharding: str, ep: int) -> None:
    out = tmp_path / "cp"
    args = ["--out", str(out), "--devices", str(devices), "--cp", str(cp), "--sharding", sharding, "--ep", str(ep)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "cp_steps.py"), *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    dp = devices // cp
    losses, state = _one_process(dp)
    for rank in range(devices):
        saved = torch.load(f"{out}.rank{rank}", weights_only=True)
        # Every rank logs its cp group's batch loss: the one-process loss of that stream's micro-batch.
        assert saved["losses"] == pytest.approx(losses[rank // cp :: dp], rel=1e-5, abs=1e-6)
        assert _max_relative_difference(saved["state"], state) < 1e-5
    assert _max_relative_difference(module().state_dict(), state) > 1e-2  # the steps moved the weights
