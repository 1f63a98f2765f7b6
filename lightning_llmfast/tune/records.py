"""What a search records: a trial's settings and outcome (:class:`TrialRecord`, one line of ``trials.jsonl``, kept by
:class:`TrialLog`), what a trial runner is given and reports (:class:`Trial`, :class:`Measurement`) and the search's
outcome (:class:`TuneResult`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError

__all__ = [
    "RECORD_FIELDS",
    "STATUSES",
    "Measurement",
    "Trial",
    "TrialLog",
    "TrialRecord",
    "TrialRunner",
    "TuneResult",
    "settings_key",
    "write_atomic",
]

STATUSES: tuple[str, ...] = ("ok", "failed", "pruned", "timeout")
"""A trial's outcome: measured, crashed (non-zero exit or no rate logged), pruned without running, timed out."""

RECORD_FIELDS: tuple[str, ...] = (
    "settings", "status", "tokens_per_sec", "predicted_memory", "peak_memory", "reason", "steps", "rung",
)  # fmt: skip
"""The keys of every line of ``trials.jsonl``."""


@dataclass(frozen=True)
class TrialRecord:
    """One line of ``trials.jsonl`` (:data:`RECORD_FIELDS`); memory in bytes per device, ``None`` where unknown;
    ``steps``: the optimizer steps the trial measured (its rung's, the warm-up left out; 0 for a pruned candidate);
    ``rung``: the successive-halving rung it ran in (0 the shortest)."""

    settings: dict[str, Any]
    status: str
    tokens_per_sec: float | None = None
    predicted_memory: int | None = None
    peak_memory: int | None = None
    reason: str = ""
    steps: int = 0
    rung: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"TrialRecord.status must be one of {STATUSES}, got {self.status!r}")
        check_int("TrialRecord.steps", self.steps, low=0)
        check_int("TrialRecord.rung", self.rung, low=0)


@dataclass(frozen=True)
class Trial:
    """What a trial runner runs: ``config`` (the candidate's example-CLI config, a dict) for ``warmup_steps +
    steps`` optimizer steps within ``timeout`` seconds, writing its files under ``directory``."""

    settings: dict[str, Any]
    config: dict[str, Any]
    steps: int
    warmup_steps: int
    timeout: float
    directory: Path


@dataclass(frozen=True)
class Measurement:
    """What a trial runner reports: a status of :data:`STATUSES` but ``pruned``, the median rate, the peak memory."""

    status: str
    tokens_per_sec: float | None = None
    peak_memory: int | None = None
    reason: str = ""


TrialRunner = Callable[[Trial], Measurement]
"""Runs one trial (:class:`~lightning_llmfast.tune.runner.SubprocessRunner`, or a stand-in in tests)."""


@dataclass
class TuneResult:
    """The search's outcome: every record in log order, the best ``ok`` one of the longest rung, its rung's steps,
    whether the time budget stopped the search, and the files written."""

    records: list[TrialRecord]
    best: TrialRecord | None
    best_steps: int
    stopped_by_budget: bool
    out: Path
    files: list[Path] = field(default_factory=list)


def settings_key(settings: Mapping[str, Any]) -> str:
    """The settings as one string: the same for the same settings, whatever their order."""
    return json.dumps(settings, sort_keys=True, default=str)


class TrialLog:
    """``trials.jsonl``: one :class:`TrialRecord` a line, appended, flushed and fsynced one by one.

    A line cut short by a kill (the last one, without its newline or unparsable) is dropped from the file when it
    is read; a damaged line before it is an error.

    Example::

        log = TrialLog(Path("tuned/trials.jsonl"))
        log.append(TrialRecord({"data.batch_size": 4}, "ok", 1234.0, 1 << 30, 1 << 30))
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[TrialRecord]:
        """Every complete record, in the order written.

        Raises:
            ConfigError: a line other than the last is not a trial record.
        """
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        complete = lines[:-1]  # the part after the last newline is cut short (or empty)
        records = []
        for number, line in enumerate(complete, 1):
            try:
                records.append(TrialRecord(**json.loads(line)))
            except (ValueError, TypeError) as err:
                if number < len(complete):
                    raise ConfigError(f"{self.path}: line {number} is not a trial record ({err})") from None
                complete = complete[:-1]  # the last line, written in part
        good = sum(len(line) + 1 for line in complete)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return records

    def append(self, record: TrialRecord) -> None:
        """Write ``record`` as one line and fsync it."""
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(record), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
