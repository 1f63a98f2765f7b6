"""Kill -9 during checkpoint saves, then resume: the loop of tests/test_atomic_checkpoints.py.

``python kill_saves.py loop --root DIR --runs N [--devices D] [--sharding S]`` starts the ``fit`` below until N kills
landed inside a save (at most 2N kills), each run resuming from ``last`` (``ModelCheckpoint(save_last=True,
save_top_k=0, every_n_train_steps=1)``) with a slowed writer (every ``os.fsync`` and ``torch.save`` sleeps, so nearly
all the time of a step is inside a save), and SIGKILLs its whole process group once a checkpoint exists, at a random
moment (within ``--window`` seconds, then within the first slowed stage of the next save to begin: its temporary
appeared less than one slowed call ago, or no temporary appeared within four, as with a writer that makes none); a
last run without the slowed writer resumes and trains two more steps. It prints one JSON line: the runs that could
not resume (an error before the first step, or a fresh start although a checkpoint was there), the kills, those that
left a save's temporary directory or file behind (so they landed inside a save), and the first error line of each
failed run.

``fit`` is the training run itself (Lightning launches its second rank by running this file again): the tiny
reference MoE GPT under ``LLMFastStrategy(sharding=S)`` (``"fsdp"``: DCP directories; ``"ddp"`` on one device:
``.ckpt`` files); every rank appends ``{"start": global_step}`` to ``<root>/start.rank<r>`` when training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.data import pack_documents

SLOW_S = 0.2  # per fsync and per torch.save of the slowed writer


class _Start(L.Callback):
    def __init__(self, root: Path, extra_steps: int | None) -> None:
        self.root, self.extra_steps = root, extra_steps

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.extra_steps is not None:  # the last run: a few more steps after the checkpoint it resumed
            trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + self.extra_steps
        with open(self.root / f"start.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps({"start": trainer.global_step}) + "\n")


def _slow_writer() -> None:
    """Every fsync and ``torch.save`` sleeps first: the kill lands inside a save, at any of its stages."""
    fsync, save = os.fsync, torch.save

    def slow_fsync(fd: int) -> None:
        time.sleep(SLOW_S)
        fsync(fd)

    def slow_save(*args: Any, **kwargs: Any) -> None:
        save(*args, **kwargs)
        time.sleep(SLOW_S)

    os.fsync, torch.save = slow_fsync, slow_save  # type: ignore[assignment]


def fit(args: argparse.Namespace) -> None:
    if args.slow:
        _slow_writer()
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 15, (400,), generator=gen)
    docs = [torch.randint(1, 64, (int(k),), generator=gen).tolist() for k in lengths]
    batches = list(pack_documents(docs, seq_len=19, batch_size=2, vocab_size=64))
    root = Path(args.root)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=10_000, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=LLMFastStrategy(sharding=args.sharding, timeout=timedelta(seconds=60)),
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1),
                   _Start(root, args.extra_steps)],
    )  # fmt: skip
    trainer.fit(MoEGPTLightningModule(config), DataLoader(batches, batch_size=None), ckpt_path="last")


def _starts(root: Path, devices: int) -> list[int] | None:
    """Every rank's start step of the current run, once every rank has started."""
    files = [root / f"start.rank{r}" for r in range(devices)]
    if not all(f.is_file() and f.read_text().strip() for f in files):
        return None
    return [json.loads(f.read_text().splitlines()[-1])["start"] for f in files]


def _launch(args: argparse.Namespace, *extra: str) -> subprocess.Popen[str]:
    for file in Path(args.root).glob("start.rank*"):
        file.unlink()
    command = [sys.executable, __file__, "fit", "--root", args.root, "--devices", str(args.devices),
               "--sharding", args.sharding, *extra]  # fmt: skip
    with open(Path(args.root) / "run.log", "w") as log:  # the child writes into its own copy of the descriptor
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_started(args: argparse.Namespace, proc: subprocess.Popen[str], saved: bool) -> list[int] | None:
    """The ranks' start steps; ``None`` if the run ended (or hung) before every rank started."""
    root, deadline = Path(args.root), time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        starts = _starts(root, args.devices)
        if starts is not None and (saved or (root / "ckpt" / "last.ckpt").exists()):
            return starts
        time.sleep(0.05)
    return None


def _wait_for_a_save(directory: Path, timeout: float) -> None:
    """Until a save's temporary appears beside the checkpoint (or ``timeout``: a writer that makes none)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(directory.glob(".*.tmp")):
        time.sleep(0.005)


def _error_line(root: Path) -> str:
    lines = [ln for ln in (root / "run.log").read_text(errors="replace").splitlines() if "Error" in ln]
    return lines[-1][-300:] if lines else "(no error line)"


def _failed(proc: subprocess.Popen[str], root: Path, starts: list[int] | None, saved: bool) -> str | None:
    """Why the run could not resume, or ``None``: every rank started from the same step, above 0 if saved."""
    if starts is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return _error_line(root)
    if len(set(starts)) != 1 or (saved and starts[0] == 0):
        return f"ranks started at steps {starts}"
    return None


def loop(args: argparse.Namespace) -> None:
    """Kill runs until ``--runs`` kills landed inside a save (a kill that missed every save, as a loaded host's late
    poll can make it, is tried again, up to ``--runs`` more times), then resume once more without the slowed writer."""
    root, rng = Path(args.root), random.Random(args.seed)
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"runs": args.runs, "failed_resumes": 0, "kills": 0, "kills_inside_save": 0, "errors": []}
    for _ in range(4 * args.runs + 1):
        last_run = result["kills_inside_save"] >= args.runs or result["kills"] >= 2 * args.runs
        saved = (root / "ckpt" / "last.ckpt").exists()
        proc = _launch(args, *(["--extra-steps", "2"] if last_run else ["--slow"]))
        error = _failed(proc, root, _wait_started(args, proc, saved), saved)
        if error is not None:
            result["failed_resumes"] += 1
            result["errors"].append(error)
            shutil.rmtree(root / "ckpt", ignore_errors=True)  # start the next run afresh
            continue
        if last_run:
            result["last_run_rc"] = proc.wait(timeout=180)
            break
        time.sleep(rng.uniform(0.0, args.window))
        _wait_for_a_save(root / "ckpt", timeout=4 * SLOW_S)
        time.sleep(rng.uniform(0.0, SLOW_S))  # within the first slowed stage of the save that just began
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result["kills"] += 1
        result["kills_inside_save"] += any((root / "ckpt").glob(".*.tmp"))
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fit", "loop"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--extra-steps", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=float, default=1.5, help="kill within this many seconds of the start")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    fit(args) if args.mode == "fit" else loop(args)


if __name__ == "__main__":
    main()
