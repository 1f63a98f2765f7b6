"""The search: every point of the space priced and pruned (:func:`plan_candidates`), then successive halving over
the rest within the time budget, resumed from ``trials.jsonl`` (:func:`tune`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.tune.config import TuneConfig
from lightning_llmfast.tune.memory import Probe, predict_memory
from lightning_llmfast.tune.records import (
    Trial,
    TrialLog,
    TrialRecord,
    TrialRunner,
    TuneResult,
    settings_key,
    write_atomic,
)
from lightning_llmfast.tune.report import Progress, write_plot, write_report
from lightning_llmfast.tune.runner import SubprocessRunner
from lightning_llmfast.tune.space import (
    ACCUMULATE,
    accumulation,
    apply_settings,
    canonical_settings,
    config_global_batch,
    default_space,
    invalid,
    load_space,
    pipeline_invalid,
    world_size,
)

__all__ = ["Candidate", "plan_candidates", "tune"]


@dataclass
class Candidate:
    """A point of the space: its settings (the accumulation included), predicted memory, and why it is pruned
    (``""``: it runs)."""

    settings: dict[str, Any]
    predicted: int | None
    pruned: str


def plan_candidates(
    tc: TuneConfig, config: dict[str, Any], space: dict[str, list[Any]], world: int
) -> tuple[list[Candidate], int]:
    """Every point of the space with its accumulation, predicted memory and pruning reason; the global batch.

    Raises:
        ConfigError: the space sets the accumulation while ``--global-batch`` is given.
    """
    if tc.global_batch is not None and ACCUMULATE in space:
        raise ConfigError(f"space sets {ACCUMULATE}, which --global-batch sets per candidate; drop one of them")
    global_batch = tc.global_batch if tc.global_batch is not None else config_global_batch(config, world)
    probes: dict[str, tuple[Probe, list[int]]] = {}
    out: list[Candidate] = []
    seen: set[str] = set()
    for values in itertools.product(*space.values()):
        settings = dict(zip(space, values))
        key = settings_key(canonical_settings(settings, config))
        if key in seen:  # the same run as a candidate already listed (pipeline knobs without pipelining)
            continue
        seen.add(key)
        refused = invalid(settings) or pipeline_invalid(apply_settings(config, settings), world)
        reason = refused
        if ACCUMULATE not in space:
            reason = accumulation(settings, config, global_batch, world) or reason
        predicted = None
        if not refused:
            merged = apply_settings(config, {k: v for k, v in settings.items() if v is not None or k != ACCUMULATE})
            predicted = predict_memory(merged, world, probes)
        if not reason and tc.memory_budget is not None and predicted is not None and predicted > tc.memory_budget:
            reason = f"predicted {predicted:,} bytes > memory budget {tc.memory_budget:,}"
        out.append(Candidate(settings, predicted, reason))
    return out, global_batch


def _identity(tc: TuneConfig, config_text: str, space: dict[str, list[Any]], global_batch: int) -> dict[str, Any]:
    return {
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "space": space,
        "global_batch": global_batch,
        "memory_budget": tc.memory_budget,
        "steps": tc.steps,
        "warmup_steps": tc.warmup_steps,
        "eta": tc.eta,
    }


def _check_identity(out: Path, identity: dict[str, Any]) -> None:
    """``DIR/search.json`` records what the search is; a rerun must be the same search to continue it."""
    path = out / "search.json"
    text = json.dumps(identity, sort_keys=True, indent=1, default=str)
    if path.exists():
        held = json.loads(path.read_text())
        differ = sorted(k for k in set(held) | set(identity) if held.get(k) != json.loads(text).get(k))
        if differ:
            raise ConfigError(f"{out} holds another search ({', '.join(differ)} differ); use a new --out")
        return
    write_atomic(path, text)


def _pruned_record(candidate: Candidate) -> TrialRecord:
    return TrialRecord(candidate.settings, "pruned", None, candidate.predicted, None, candidate.pruned, 0, 0)


class _Search:
    """Successive halving over the candidates, resuming from the records of an earlier run of the same search."""

    def __init__(
        self, tc: TuneConfig, config: dict[str, Any], runner: TrialRunner, log: TrialLog, progress: Progress
    ) -> None:
        self.tc, self.config, self.runner, self.log, self.progress = tc, config, runner, log, progress
        self.records = log.read()
        self.done: dict[str, list[TrialRecord]] = {}
        for record in self.records:
            self.done.setdefault(settings_key(record.settings), []).append(record)
        self.rungs: list[list[TrialRecord]] = []  # per rung: its measured records
        self.deadline = progress.start + tc.time_budget if tc.time_budget is not None else math.inf
        self.stopped = False

    def _record(
        self, settings: dict[str, Any], rung: int, make: Callable[[], TrialRecord | None]
    ) -> TrialRecord | None:
        """The candidate's record of ``rung``: from the earlier run's log if there (its ``rung``-th), else made and
        appended."""
        held = self.done.setdefault(settings_key(settings), [])
        if len(held) > rung:
            self.progress.record(held[rung], resumed=True)
            return held[rung]
        record = make()
        if record is not None:
            held.append(record)
            self.records.append(record)
            self.log.append(record)
            self.progress.record(record)
        return record

    def _measure(self, candidate: Candidate, steps: int, rung: int) -> TrialRecord | None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.stopped = True
            return None
        timeout = min(self.tc.trial_timeout, remaining)
        name = hashlib.sha256(settings_key(candidate.settings).encode()).hexdigest()[:12]
        merged = apply_settings(self.config, candidate.settings)
        trial = Trial(candidate.settings, merged, steps, self.tc.warmup_steps, timeout,
                      Path(self.tc.out) / "runs" / f"{name}-s{steps}")  # fmt: skip
        measured = self.runner(trial)
        if measured.status == "timeout" and timeout < self.tc.trial_timeout:
            self.stopped = True  # stopped by the time budget, not by its own timeout: not a finished trial
            return None
        return TrialRecord(candidate.settings, measured.status, measured.tokens_per_sec, candidate.predicted,
                           measured.peak_memory, measured.reason, steps, rung)  # fmt: skip

    def run(self, candidates: list[Candidate]) -> None:
        """Prune, then rung after rung while more than one candidate goes on, within the budget."""
        alive = []
        for c in candidates:
            if c.pruned:
                self._record(c.settings, 0, lambda c=c: _pruned_record(c))
            else:
                alive.append(c)
        steps, rung = self.tc.steps, 0
        while alive and not self.stopped:
            self.progress.rung(rung, len(alive), steps)
            results = []
            for c in alive:
                record = self._record(c.settings, rung, lambda c=c, s=steps, r=rung: self._measure(c, s, r))
                if record is None:
                    break
                results.append((c, record))
            measured = [(c, r) for c, r in results if r.status == "ok"]
            if measured:  # a rung cut short by the budget still ranks what it measured
                self.rungs.append([r for _, r in measured])
            keep = math.ceil(len(measured) / self.tc.eta)
            if keep <= 1 or self.stopped:
                break  # the fastest of this rung wins
            measured.sort(key=lambda cr: -float(cr[1].tokens_per_sec or 0.0))
            alive = [c for c, _ in measured[:keep]]
            steps, rung = steps * self.tc.eta, rung + 1

    def best(self) -> TrialRecord | None:
        """The fastest ``ok`` trial of the longest rung that measured any."""
        if not self.rungs:
            return None
        return max(self.rungs[-1], key=lambda r: float(r.tokens_per_sec or 0.0))


def tune(config: TuneConfig, runner: TrialRunner | None = None, quiet: bool = False) -> TuneResult:
    """Search ``config``'s space; write ``trials.jsonl``, ``best.yaml``, ``report.md`` and ``report.png`` under
    ``config.out`` (see :mod:`lightning_llmfast.tune`). Says one line per trial on stderr as it ends, under a progress
    bar of the rung's trials when stderr is a terminal.

    Args:
        config: what to search.
        runner: runs one trial; default :class:`~lightning_llmfast.tune.runner.SubprocessRunner` on
            ``config.script_path``.
        quiet: say nothing while searching.

    Raises:
        ConfigError: an unreadable config or space, a setting that does not fit the config, or an ``out`` directory
            holding another search.

    Example::

        result = tune(TuneConfig("tiny.yaml", "tuned/", space={"data.batch_size": [4, 8]}, global_batch=16))
    """
    progress = Progress(None if quiet else sys.stderr, config.time_budget, time.monotonic())
    text = Path(config.config).read_text()
    try:
        base = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{config.config}: not YAML: {err}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{config.config}: not an example-CLI config (a mapping), got {type(base).__name__}")
    world = world_size(base)
    space = load_space(config.space) if config.space is not None else default_space(base, world)
    candidates, global_batch = plan_candidates(config, base, space, world)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_identity(out, _identity(config, text, space, global_batch))
    log = TrialLog(out / "trials.jsonl")
    search = _Search(config, base, runner or SubprocessRunner(config.script_path), log, progress)
    try:
        search.run(candidates)
    finally:
        progress.close()
    best = search.best()
    result = TuneResult(search.records, best, best.steps if best is not None else 0, search.stopped, out)
    if best is not None:
        write_atomic(out / "best.yaml", yaml.safe_dump(apply_settings(base, best.settings), sort_keys=False))
        result.files.append(out / "best.yaml")
    result.files.append(write_report(out / "report.md", search.records, result, world))
    plot = write_plot(out / "report.png", search.records, config.memory_budget)
    if plot is not None:
        result.files.append(plot)
    return result
