"""Data parallelism that holds up: equal batches on uneven corpora, token-weighted DDP and accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmfast.data import PackedBatch

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[1]
sys.path.insert(0, str(SCRIPTS))
from ddp_steps import STEPS, batches, module  # noqa: E402
from test_resume import _run  # noqa: E402


def _fit_one_process(model: L.LightningModule, micro_batches: list[PackedBatch], accumulate: int) -> None:
    torch.set_num_threads(1)  # as the 2-process run
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="llmfast", max_steps=STEPS, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(micro_batches, batch_size=None))


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k].is_floating_point() and b[k].norm() > 0)


def _concatenated(first: PackedBatch, second: PackedBatch) -> PackedBatch:
    """One batch holding the rows of both (boundaries shifted), built by hand."""
    offset = first.cu_seqlens[-1]
    return PackedBatch(
        input_ids=torch.cat([first.input_ids, second.input_ids]),
        labels=torch.cat([first.labels, second.labels]),
        position_ids=torch.cat([first.position_ids, second.position_ids]),
        cu_seqlens=torch.cat([first.cu_seqlens, second.cu_seqlens[1:] + offset]),
        max_seqlen=max(first.max_seqlen, second.max_seqlen),
        num_tokens=first.num_tokens + second.num_tokens,
    )


@pytest.mark.slow
def test_two_process_ddp_equals_one_process_on_the_same_micro_batches(tmp_path: Path) -> None:
    micro = batches()
    counts = [int((b.labels != -100).sum()) for b in micro]
    assert any(counts[2 * s] != counts[2 * s + 1] for s in range(STEPS))  # the ranks' label counts differ
    out = tmp_path / "ddp.pt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_steps.py"), "--out", str(out)], cwd=tmp_path, capture_output=True,
        text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The strategy shut the process group down at exit on both ranks, before interpreter finalization.
    assert [(tmp_path / f"ddp.pt.exit{r}").read_text() for r in range(2)] == ["initialized=False"] * 2
    ddp = torch.load(out, weights_only=True)
    # One process sees rank 0's and rank 1's micro-batch of every step, accumulated: the same global batch.
    single = module()
    start = {k: v.detach().clone() for k, v in single.state_dict().items()}
    _fit_one_process(single, micro, accumulate=2)
    reference = single.state_dict()
    assert _max_relative_difference(ddp, reference) < 1e-5
    assert _max_relative_difference(start, reference) > 1e-2  # six steps moved the weights: not vacuous


def test_accumulating_two_micro_batches_equals_one_step_on_both_together() -> None:
    # Without the router's aux loss (a batch statistic, not a sum over tokens), the union is exactly one batch.
    micro = batches()
    accumulated, joint = module(aux_loss_coef=0.0), module(aux_loss_coef=0.0)
    _fit_one_process(accumulated, micro, accumulate=2)
    _fit_one_process(joint, [_concatenated(a, b) for a, b in zip(micro[::2], micro[1::2])], accumulate=1)
    assert _max_relative_difference(accumulated.state_dict(), joint.state_dict()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_uneven_corpus_on_two_ranks_fits_and_validates_with_equal_batches(tmp_path: Path, workers: int) -> None:
    # 40 documents, one validation document for two ranks: uneven training shards, and a rank with no validation
    # document of its own (a DDP crash and a validation hang without equal batch counts).
    ranks = _run(tmp_path, "uneven", "--devices", "2", "--workers", str(workers), "--docs", "40",
                 "--val-fraction", "0.025", "--max-epochs", "2", "--validate")  # fmt: skip
    summaries: list[dict[str, Any]] = [rank[-1]["summary"] for rank in ranks]
    assert len(summaries) == 2 and summaries[0] == summaries[1]  # every epoch, the same counts on both ranks
    assert set(summaries[0]["train"]) == {"0", "1"} and min(summaries[0]["train"].values()) > 0
    assert summaries[0]["val"] == {"0": 1, "1": 1, "-1": 1}  # each rank validated (one real, one filler batch)
    for epoch in (0, 1):
        docs = [d for rank in ranks for s in rank[:-1] if s["epoch"] == epoch for d in s["documents"]]
        assert len(docs) == len(set(docs)) > 0
