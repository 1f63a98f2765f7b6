"""A save that fails on one rank stops every rank alike, and a checkpoint left aside by a kill is found again.

Ranks started as ``torchrun`` and ``srun`` start them (independent processes with the torchelastic environment, forked
from ``spawn_world``'s server; no Lightning launcher, nobody who kills a peer that left): a save failing on one rank,
with any exception, raises the same ``CheckpointError`` naming that rank and the cause on every rank within seconds,
and the previous ``last`` stays whole and resumes. A kill between the two renames of the fallback swap leaves
``.last.ckpt.old`` and no ``last.ckpt``: ``ckpt_path="last"`` and the explicit path still resume from it, one rename
winning when every rank tries (``parallel/atomic.py``, ``strategy/recovery.py``).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _distributed import COLLECTIVE_TIMEOUT
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.data import pack_documents
from lightning_llmfast.parallel import atomic

WORLD = 2
FAIL_STEP = 2
STOP_S = 20.0  # from the failure to every rank raising (the collectives' own bound is 60 s)


def _full_disk(*args: Any) -> None:
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 0 vs 1024: No space left on device")


class _Inject(L.Callback):
    """Records the step a fit starts from; the save of :data:`FAIL_STEP` fails on ``rank`` only, with ``error``:
    ``"runtime"`` (the ``RuntimeError`` of a full disk, from the flush of the rank's files) or ``"pickle"`` (callback
    state that cannot be pickled, in the file rank 0 writes)."""

    def __init__(self, root: Path, rank: int | None, error: str | None) -> None:
        self.root, self.rank, self.error = root, rank, error

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start = trainer.global_step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != FAIL_STEP:
            return
        (self.root / "injected").write_text(str(time.time()))
        if self.error == "pickle":
            checkpoint["callbacks"]["schedule"] = lambda step: step  # a local function: torch.save cannot pickle it
        else:
            atomic.fsync_file = _full_disk  # type: ignore[assignment]


def _rank(rank: int, port: int, root: str, sharding: str, fail_rank: int | None, error: str | None) -> None:
    """One rank as ``torchrun`` or ``srun`` starts it: the torchelastic environment, no Lightning launcher, nobody to
    kill a peer that left. A tiny fit of 3 steps saving ``last`` every step (``ckpt_path="last"``); writes
    ``rank<r>.json``: the error ``fit`` raised (class, message, moment), or its start and end steps."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="save-failures",
    )  # fmt: skip
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16,
                          num_experts=2, router_backend="torch")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (int(k),), generator=g).tolist() for k in torch.randint(1, 15, (40,), generator=g)]
    batches = list(pack_documents(docs, seq_len=19, batch_size=2, vocab_size=64))
    inject = _Inject(Path(root), fail_rank, error)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=LLMFastStrategy(sharding=sharding, process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT),
        callbacks=[ModelCheckpoint(dirpath=Path(root, "ckpt"), save_last=True, save_top_k=0, every_n_train_steps=1),
                   inject],
    )  # fmt: skip
    try:
        trainer.fit(MoEGPTLightningModule(config), DataLoader(batches, batch_size=None), ckpt_path="last")
        result: dict[str, Any] = {"start": inject.start, "end": trainer.global_step}
    except Exception as err:
        result = {"type": type(err).__name__, "message": str(err), "time": time.time()}
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))
    leave_world()


def _fit_ranks(root: Path, sharding: str, fail_rank: int | None = None, error: str | None = None) -> list[Any]:
    """:func:`_rank` on :data:`WORLD` processes; every rank's result. A rank left waiting for a peer fails the test
    (the timeout) instead of hanging it."""
    for file in root.glob("rank*.json"):
        file.unlink()
    spawn_world(_rank, WORLD, (free_port(), str(root), sharding, fail_rank, error), 180, "save failure")
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize(
    ("sharding", "fail_rank", "error", "cause"),
    [
        ("fsdp", 1, "runtime", r"RuntimeError: .*No space left on device"),
        ("ddp", 0, "pickle", r"\w+: .*pickle"),
    ],
    ids=["dcp-full-disk-on-rank-1", "file-pickling-error-on-rank-0"],
)
def test_a_save_failing_on_one_rank_stops_every_rank_alike_and_the_last_checkpoint_resumes(
    tmp_path: Path, sharding: str, fail_rank: int, error: str, cause: str
) -> None:
    results = _fit_ranks(tmp_path, sharding, fail_rank, error)
    assert len({(r.get("type"), r.get("message")) for r in results}) == 1, results  # the same error on every rank
    assert results[0]["type"] == "CheckpointError", results
    message = results[0]["message"]
    assert "last.ckpt" in message and f"rank {fail_rank} failed with" in message, message
    assert re.search(cause, message), message
    injected = float((tmp_path / "injected").read_text())
    assert max(r["time"] for r in results) - injected < STOP_S, (results, injected)
    # the previous last (step 1) is whole, and resumes; under FSDP also after a kill between the directory swap's
    # two renames (as on NFS or Lustre) left it aside, every rank trying to put it back
    ckpt = tmp_path / "ckpt"
    if sharding == "fsdp":
        (ckpt / "last.ckpt").rename(ckpt / ".last.ckpt.old")
    assert _fit_ranks(tmp_path, sharding) == [{"start": 1, "end": 3}] * WORLD


class _Start(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def _fit(ckpt: Path, sharding: str, steps: int, ckpt_path: str | Path | None) -> int:
    """A one-process fit to ``steps`` saving every step into ``ckpt``; returns the step it started from."""
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=32, hidden_size=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=8,
                          num_experts=2, router_backend="torch")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batches = [next(pack_documents([torch.randint(1, 32, (9,), generator=g).tolist()], 9, 1)) for _ in range(3)]
    start = _Start()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=LLMFastStrategy(sharding=sharding),
        callbacks=[ModelCheckpoint(dirpath=ckpt, save_last=True, save_top_k=0, every_n_train_steps=1), start],
    )  # fmt: skip
    trainer.fit(MoEGPTLightningModule(config), DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return start.step


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"], ids=["file", "dcp-directory"])
def test_a_checkpoint_left_aside_between_the_renames_resumes_by_last_and_by_path(tmp_path: Path, sharding: str) -> None:
    ckpt = tmp_path / "ckpt"
    assert _fit(ckpt, sharding, 2, None) == 0
    for ckpt_path, steps in (("last", 3), (ckpt / "last.ckpt", 4)):
        (ckpt / "last.ckpt").rename(ckpt / ".last.ckpt.old")  # the kill fell between the fallback's two renames
        atomic.temporary_beside(ckpt / "last.ckpt").mkdir()  # the new checkpoint, never renamed into place
        assert _fit(ckpt, sharding, steps, ckpt_path) == steps - 1, ckpt_path
    assert sorted(os.listdir(ckpt)) == ["last.ckpt"]


def _race(directory: Path, racers: int) -> tuple[list[list[Path]], list[Exception]]:
    """``racers`` threads put back what was left aside in ``directory`` at the same moment."""
    barrier, results, errors = threading.Barrier(racers), [], []

    def racer() -> None:
        barrier.wait()
        try:
            results.append(atomic.recover_directory(directory))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=racer) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_every_rank_may_put_back_the_same_checkpoint_at_once(tmp_path: Path) -> None:
    # Eight racers on one directory (ranks on shared storage): one rename wins, nobody raises, the checkpoint whole.
    for round_ in range(20):
        target = tmp_path / f"r{round_}" / "last.ckpt"
        aside = target.with_name(".last.ckpt.old")
        aside.mkdir(parents=True)
        (aside / "step").write_text(str(round_))
        results, errors = _race(target.parent, 8)
        assert not errors and sorted(map(len, results)) == [0] * 7 + [1], (errors, results)
        assert (target / "step").read_text() == str(round_) and not aside.exists()
