"""Exact mid-epoch resume: SIGKILL after a checkpoint, resume with ckpt_path="last", bitwise equal losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_llmfast import DataError, PackedDataModule
from lightning_llmfast.data import IGNORE_INDEX

SCRIPT = Path(__file__).parent / "scripts" / "fit_packed.py"
REPO = Path(__file__).parents[1]


def _run(tmp: Path, name: str, *args: str, expect_kill: bool = False) -> list[list[dict[str, Any]]]:
    """Run the fit script; return each rank's records (steps, then a summary unless killed)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", name, *args], cwd=tmp, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if expect_kill:
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "leaked semaphore" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr[-3000:]
    ranks = sorted(tmp.glob(f"{name}.rank*"))
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in ranks]


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "workers"), [(1, 0), (1, 2), (2, 1)])
def test_sigkill_and_resume_from_last_gives_bitwise_the_same_losses(tmp_path: Path, devices: int, workers: int) -> None:
    common = ["--devices", str(devices), "--workers", str(workers), "--max-epochs", "2", "--docs", "50"]
    full = _run(tmp_path, "full", *common)
    # the checkpoint lies mid-epoch (an epoch has about 15 batches on 1 rank, 7 on 2); steps are 1-based
    every = 3 if devices == 2 else 4
    kill_at = every + 1
    _run(tmp_path, "killed", *common, "--every", str(every), "--kill-at", str(kill_at), expect_kill=True)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    resumed = _run(tmp_path, "resumed", *common, "--every", str(every), "--resume")
    assert len(full) == len(resumed) == devices
    for full_rank, resumed_rank in zip(full, resumed):
        *full_steps, full_summary = full_rank
        *resumed_steps, resumed_summary = resumed_rank
        saved = kill_at - 1
        assert len(full_steps) > saved + 3 and resumed_steps[0]["step"] == saved + 1
        # bitwise: the same batches in the same order, the same weights, the same optimizer state
        assert resumed_steps == full_steps[saved:]
        assert {s["epoch"] for s in resumed_steps} == {0, 1}  # the resumed run crosses into the next epoch
        # the cumulative token count continues from the checkpoint (it would restart from 0 otherwise)
        assert resumed_summary["tokens"] == full_summary["tokens"] > 0
    if devices == 2:
        for epoch in (0, 1):  # no document twice within an epoch, over both ranks
            docs = [d for rank in full for s in rank if s.get("epoch") == epoch for d in s["documents"]]
            assert len(docs) == len(set(docs)) > 0


class _TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(258, 8), nn.Linear(8, 258)
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch.input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
        self.losses.append((self.trainer.current_epoch, float(loss)))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(**kwargs: Any) -> PackedDataModule:
    args = {"corpus": "synthetic", "synthetic_num_docs": 16, "synthetic_mean_len": 20, "seq_len": 16,
            "batch_size": 2, "num_workers": 0, "seed": 1, **kwargs}  # fmt: skip
    return PackedDataModule(**args)


def _fit(module: _TinyLM, steps: int, ckpt_dir: Path | None = None, every: int = 0, **fit_kwargs: Any) -> None:
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(every), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, **{"datamodule": _data(), **fit_kwargs})


def test_resume_at_an_epoch_end_and_twice_in_a_row(tmp_path: Path) -> None:
    data = _data()
    data.setup("fit")
    per_epoch = data._dataset("train").plan(0).per_rank
    full = _TinyLM()
    _fit(full, 3 * per_epoch)
    values = [loss for _, loss in full.losses]
    assert len(values) == 3 * per_epoch
    # a checkpoint after an epoch's last batch: the resumed run starts the next epoch (no replay, no empty epoch)
    _fit(_TinyLM(), per_epoch, tmp_path / "end", every=per_epoch)
    resumed = _TinyLM()
    _fit(resumed, 3 * per_epoch, ckpt_path=str(next((tmp_path / "end").glob("*.ckpt"))))
    assert [loss for _, loss in resumed.losses] == values[per_epoch:]
    # mid-epoch, then again mid-epoch from the resumed run's own checkpoint
    first, second = per_epoch + 2, 2 * per_epoch + 1
    _fit(_TinyLM(), first, tmp_path / "a", every=first)
    _fit(_TinyLM(), second, tmp_path / "b", every=second, ckpt_path=str(next((tmp_path / "a").glob("*.ckpt"))))
    again = _TinyLM()
    _fit(again, 3 * per_epoch, ckpt_path=str(next((tmp_path / "b").glob("*.ckpt"))))
    assert [loss for _, loss in again.losses] == values[second:]


def test_a_checkpoint_from_another_configuration_is_refused(tmp_path: Path) -> None:
    _fit(_TinyLM(), 3, tmp_path, every=3)
    ckpt = str(next(tmp_path.glob("*.ckpt")))
    for kwargs, field in [({"seq_len": 12}, "seq_len"), ({"batch_size": 3}, "batch_size"),
                          ({"synthetic_num_docs": 17}, "num_documents"), ({"seed": 2}, "lengths_crc32")]:  # fmt: skip
        with pytest.raises(DataError, match=f"another configuration.*{field}: checkpoint"):
            _fit(_TinyLM(), 6, datamodule=_data(**kwargs), ckpt_path=ckpt)
    state = torch.load(ckpt, weights_only=True)["PackedDataModule"]
    other_world = {**state, "fingerprint": {**state["fingerprint"], "world_size": 2}}
    data = _data()
    data.load_state_dict(other_world)
    with pytest.raises(DataError, match="world_size: checkpoint 2, now 1"):
        data.train_dataloader()
    with pytest.raises(DataError, match="unreadable data position"):
        _data().load_state_dict({"epoch": 0})
    assert _data().state_dict() == {}  # nothing to save before training


def test_the_modules_own_batch_transfer_hook_still_runs() -> None:
    class _Hooked(_TinyLM):
        calls = 0

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            type(self).calls += 1
            return batch

    _fit(_Hooked(), 3)
    assert _Hooked.calls == 3
