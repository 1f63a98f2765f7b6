"""Lightning's evaluation loops (``inference_mode=True``) with the metadata callback and the packed data module: the
logged losses equal the token-weighted loss computed by hand on the same batches, on one and on two processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[1]
sys.path.insert(0, str(SCRIPTS))
from eval_loops import run  # noqa: E402


def _check(ranks: list[dict[str, Any]]) -> None:
    for split, loop in (("val", "validate"), ("test", "test")):
        total = sum(r[f"ref_{split}"]["total"] for r in ranks)
        count = sum(r[f"ref_{split}"]["count"] for r in ranks)
        assert count > 0
        for r in ranks:  # every rank logs the loss over all ranks' tokens
            assert r[loop] == pytest.approx(total / count, rel=1e-5, abs=1e-6), (split, r["rank"])
    for r in ranks:
        predicted = r["predict"]
        documents = [d for batch in predicted for d in batch["documents"]]
        losses = torch.cat([batch["loss"] for batch in predicted]).double()
        assert documents == r["ref_test"]["documents"] and documents
        expected = torch.tensor(r["ref_test"]["losses"], dtype=torch.float64)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_validate_test_predict_under_inference_mode_equal_the_hand_computed_loss(num_workers: int) -> None:
    _check([run(1, num_workers)])


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 1])
def test_two_processes_validate_test_predict_equal_the_hand_computed_loss(tmp_path: Path, num_workers: int) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "eval_loops.py"), "--out", str(tmp_path), "--workers", str(num_workers)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    _check(ranks)
