"""Trials as processes: each one the example CLI, forked from a server that imported torch and Lightning once, in a
session of its own that ends whole with it (:class:`SubprocessRunner`), and what it measured (:func:`read_metrics`).

A trial's process group (the trial, a DDP trial's other ranks, the DataLoader workers, trackers it started) is killed
when the trial ends, whatever ended it: a clean exit, a crash, a kill of rank 0 (the OOM killer's SIGKILL), its
timeout, or the tuner interrupted (Ctrl-C: the runner kills the group before the interrupt goes on). Every trial also
starts a watchdog in its group, a forked process that looks at the tuner's pid and start time five times a second and
kills the group once the tuner has ended without cleaning up (``kill -9``): the trials are the trial server's
children, so a parent-death signal would watch the server, not the tuner, and reach the trial's first process alone
(the server itself exits when the tuner's end closes its pipe).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import multiprocessing
import os
import runpy
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_llmfast.tune.records import Measurement, Trial

__all__ = ["PRELOAD", "SubprocessRunner", "read_metrics", "trial_config"]

_MONITORS = ("TokenThroughputMonitor", "SystemMetricsMonitor")
_GIB = float(1 << 30)
_WATCH_PERIOD = 0.2
"""Seconds between a watchdog's looks at the tuner: how long a trial outlives a killed tuner."""


def _callbacks(trainer: dict[str, Any]) -> list[Any]:
    """The config's callbacks less the monitors a trial configures itself, plus those monitors logging each step."""
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    kept = [c for c in callbacks if not (isinstance(c, dict) and str(c.get("class_path", "")).endswith(_MONITORS))]
    return kept + [
        {"class_path": f"lightning_llmfast.{name}", "init_args": {"log_every_n_steps": 1}} for name in _MONITORS
    ]


def trial_config(trial: Trial) -> dict[str, Any]:
    """The config a trial runs: the candidate's, for ``warmup_steps + steps`` optimizer steps, every step logged to
    a CSV file under the trial's directory, no validation, checkpoints, progress bar or model summary."""
    config = copy.deepcopy(trial.config)
    trainer = config.setdefault("trainer", {})
    for key in ("val_check_interval", "check_val_every_n_epoch", "max_epochs", "max_time"):
        trainer.pop(key, None)
    trainer.update(
        max_steps=trial.warmup_steps + trial.steps, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(trial.directory), "name": "csv", "version": 0}},
    )  # fmt: skip
    trainer["callbacks"] = _callbacks(trainer)
    return config


def read_metrics(path: Path, steps: int) -> Measurement:
    """The median of the last ``steps`` logged ``train/tokens_per_sec`` and the peak memory (CUDA's
    ``train/peak_memory``, else the peak RSS) of a trial's ``metrics.csv``."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["train/tokens_per_sec"]) for r in rows if r.get("train/tokens_per_sec")]
    device = [float(r["train/peak_memory"]) for r in rows if r.get("train/peak_memory")]
    host = [float(r["train/host_peak_rss"]) for r in rows if r.get("train/host_peak_rss")]
    peak = round(max(device or host) * _GIB) if device or host else None
    if len(rates) < steps:
        return Measurement("failed", None, peak, f"logged {len(rates)} rates, {steps} wanted")
    return Measurement("ok", statistics.median(rates[-steps:]), peak)


PRELOAD: tuple[str, ...] = (
    "torch", "torch._dynamo", "torch.optim", "lightning.pytorch", "lightning.pytorch.cli", "lightning_llmfast",
    "lightning_llmfast.cli",
)  # fmt: skip
"""What the trial server imports once: a fresh interpreter spends most of a short trial importing them (about 10 s on
the 2-core development VM, 2026-12-06; ``torch._dynamo`` is imported by the optimizer's first step)."""


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), ``None`` if it has ended (no such
    process, or a zombie) or there is no ``/proc``: a pid and its start time name one process, a reused pid another."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()  # the name before ")" may hold spaces
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # fields 3 (state) and 22 (start time)


def _watch(tuner: int, started: int) -> None:
    """The watchdog's life (a process forked into the trial's group): wait for the tuner's end (its pid gone, a
    zombie or another process's), then kill the group, itself included."""
    try:
        while _start_time(tuner) == started:
            time.sleep(_WATCH_PERIOD)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)
        os._exit(0)


def _run_trial(
    script: str, config: str, stdout: str, stderr: str, environ: dict[str, str], tuner: tuple[int, int | None]
) -> None:
    """A trial process: its own session (the runner kills the group, DDP's children included) with a watchdog in it
    (:func:`_watch` on ``tuner``: pid and start time), the runner's environment of now (the server's is that of its
    start), its output to the trial's files, the example CLI run as ``python SCRIPT fit --config CONFIG`` would run
    it."""
    os.setsid()
    if tuner[1] is not None and os.fork() == 0:  # without /proc there is no start time to watch
        _watch(*tuner)
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, "fit", "--config", config]  # Lightning's DDP launcher re-runs sys.argv for the other ranks
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def _failure(code: int, stderr: Path) -> str:
    """Why a trial that exited with ``code`` failed: the exit status or the signal, and its stderr's last line."""
    lines = stderr.read_text(errors="replace").strip().splitlines()
    last = lines[-1][-300:] if lines else ""
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}{' (the OOM killer?)' if name == 'SIGKILL' else ''}: {last}"
    return f"exit status {code}: {last}"


class SubprocessRunner:
    """Runs a trial as ``python SCRIPT fit --config DIR/config.yaml`` in a process of its own, forked from a server
    that imported :data:`PRELOAD` once (multiprocessing's ``forkserver``), so a trial pays for its configuration and
    steps, not for the interpreter's start-up. The trial's process group ends with it on every exit (its timeout,
    an interrupt of the tuner and the tuner's death included: see the module's docstring).

    Args:
        script: the example CLI.
        preload: the modules the server imports. The server starts here, once per process, and serves every
            trial after (so its start counts in the search's time budget, not in a trial's timeout).

    Example::

        runner = SubprocessRunner(Path("examples/train_moe.py"))
        measurement = runner(trial)  # Measurement("ok", tokens_per_sec=..., peak_memory=...)
    """

    def __init__(self, script: Path, preload: Sequence[str] = PRELOAD) -> None:
        self.script = Path(script).resolve()
        self._tuner = (os.getpid(), _start_time(os.getpid()))
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))
        ready = self._context.Process(target=os.getpid)  # returns once the server has imported ``preload``
        ready.start()
        ready.join()

    def __call__(self, trial: Trial) -> Measurement:
        """Run ``trial``; its stdout and stderr go to ``stdout.txt``/``stderr.txt`` in its directory."""
        shutil.rmtree(trial.directory, ignore_errors=True)
        trial.directory.mkdir(parents=True)
        path = trial.directory / "config.yaml"
        path.write_text(yaml.safe_dump(trial_config(trial), sort_keys=False))
        files = [str(trial.directory / name) for name in ("stdout.txt", "stderr.txt")]
        args = (str(self.script), str(path), *files, dict(os.environ), self._tuner)
        process = self._context.Process(target=_run_trial, args=args)
        process.start()
        try:
            process.join(trial.timeout)
            code = process.exitcode
        finally:  # on every exit, an interrupt included: the group goes, then the trial if it had no group yet
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.kill()
            process.join()
        if code is None:
            return Measurement("timeout", reason=f"no result within {trial.timeout:.0f}s")
        if code != 0:
            return Measurement("failed", reason=_failure(code, trial.directory / "stderr.txt"))
        found = sorted(trial.directory.rglob("metrics.csv"))
        if not found:
            return Measurement("failed", reason="no metrics.csv written")
        return read_metrics(found[0], trial.steps)
