"""What a search says: one line per trial as it ends and, on a terminal, a progress bar (:class:`Progress`); at the end
``report.md`` (:func:`write_report`) and ``report.png`` (:func:`write_plot`)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from lightning_llmfast.tune.records import TrialRecord, TuneResult, write_atomic

__all__ = ["Progress", "trial_line", "write_plot", "write_report"]


def _mib(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / (1 << 20):,.1f}"


def _order(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Best first: measured trials by their steps (the longest first), then rate; then timed out, failed, pruned."""
    rank = {"ok": 0, "timeout": 1, "failed": 2, "pruned": 3}
    return sorted(records, key=lambda r: (rank[r.status], -r.steps, -(r.tokens_per_sec or 0.0)))


def _settings(record: TrialRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in record.settings.items())


def write_report(path: Path, records: Sequence[TrialRecord], result: TuneResult, world: int) -> Path:
    """``report.md``: every trial, best first, with the prediction error of memory ``(predicted - peak) / peak``.

    Example::

        write_report(Path("tuned/report.md"), result.records, result, world=1)
    """
    lines = ["# tune report", ""]
    if result.best is not None:
        lines += [f"Best: {result.best.tokens_per_sec:,.0f} tokens/s over {result.best_steps} measured steps with "
                  f"`{json.dumps(result.best.settings)}` (`best.yaml`).", ""]  # fmt: skip
    else:
        lines += ["No trial measured a rate.", ""]
    if result.stopped_by_budget:
        lines += ["The time budget stopped the search; rerun the same command to continue it.", ""]
    errors = [(r.predicted_memory - r.peak_memory) / r.peak_memory for r in records
              if r.status == "ok" and r.predicted_memory and r.peak_memory]  # fmt: skip
    memory = "peak RSS of the trial process" if not torch.cuda.is_available() else "max_memory_allocated"
    if errors:
        lines += [f"Memory prediction error (predicted - measured) / measured over {len(errors)} measured trials: "
                  f"median {statistics.median(errors):+.1%}, range {min(errors):+.1%} to {max(errors):+.1%} "
                  f"(measured: {memory}; world {world}).", ""]  # fmt: skip
    lines += ["| # | status | steps | tokens/s | predicted MiB | peak MiB | error | settings | reason |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(_order(records), 1):
        error = ""
        if r.predicted_memory and r.peak_memory:
            error = f"{(r.predicted_memory - r.peak_memory) / r.peak_memory:+.1%}"
        rate = "" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}"
        lines.append(f"| {i} | {r.status} | {r.steps or ''} | {rate} | {_mib(r.predicted_memory)} | "
                     f"{_mib(r.peak_memory)} | {error} | {_settings(r)} | {r.reason.replace('|', '/')} |")  # fmt: skip
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def write_plot(path: Path, records: Sequence[TrialRecord], memory_budget: int | None = None) -> Path | None:
    """``report.png``: tokens/s against measured peak memory of the measured trials; the pruned apart, below, at
    their predicted memory. Returns ``None`` (and says so on stderr) without matplotlib (the ``plot`` extra).

    Example::

        write_plot(Path("tuned/report.png"), result.records, memory_budget=8 << 30)
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tune: report.png not written: matplotlib is missing (pip install 'lightning-llmfast[plot]')",
              file=sys.stderr)  # fmt: skip
        return None
    ok = [r for r in records if r.status == "ok" and r.peak_memory and r.tokens_per_sec]
    pruned = [r for r in records if r.status == "pruned" and r.predicted_memory]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[4, 1])
    top.scatter([r.peak_memory / (1 << 20) for r in ok], [r.tokens_per_sec for r in ok], label="measured")
    top.set_ylabel("tokens/s")
    top.set_title("tune: tokens/s against peak memory")
    bottom.scatter([r.predicted_memory / (1 << 20) for r in pruned], [0] * len(pruned), marker="x", color="C3",
                   label="pruned (predicted memory)")  # fmt: skip
    bottom.set_yticks([])
    bottom.set_xlabel("peak memory per device, MiB (pruned: predicted)")
    for axis in (top, bottom):
        if memory_budget is not None:
            axis.axvline(memory_budget / (1 << 20), color="grey", linestyle="--", label="memory budget")
        axis.legend(loc="best", fontsize="small")
    figure.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)
    return path


def trial_line(record: TrialRecord, elapsed: float, budget: float | None) -> str:
    """One line on a trial that ended: its status, rung and measured steps, rate, predicted and peak memory (MiB), the
    time the search has used (of its budget), its settings and, for one not measured, why.

    Example::

        trial_line(TrialRecord({"data.batch_size": 4}, "ok", 2500.0, 60 << 20, 512 << 20, "", 4, 0), 12, 600)
        # tune: ok, rung 0, 4 steps: 2,500 tokens/s, predicted 60.0 MiB, peak 512.0 MiB; 12s of 600s; data.batch_size=4
    """
    where = "" if record.status == "pruned" else f", rung {record.rung}, {record.steps} steps"
    rate = "" if record.tokens_per_sec is None else f"{record.tokens_per_sec:,.0f} tokens/s, "
    memory = f"predicted {_mib(record.predicted_memory) or '?'} MiB"
    if record.peak_memory is not None:
        memory += f", peak {_mib(record.peak_memory)} MiB"
    used = f"{elapsed:,.0f}s" + (f" of {budget:,.0f}s" if budget is not None else "")
    reason = f" ({record.reason})" if record.reason else ""
    return f"tune: {record.status}{where}: {rate}{memory}; {used}; {_settings(record)}{reason}"


class Progress:
    """What a search says while it runs, on ``stream`` (``None``: nothing): one :func:`trial_line` per trial as it
    ends, and where ``stream`` is a terminal a progress bar of the current rung's trials (tqdm, Lightning's own).

    Args:
        stream: where to write (the search's stderr), or ``None``.
        budget: the search's time budget in seconds, or ``None``.
        start: when the search started (``time.monotonic()``).

    Example::

        progress = Progress(sys.stderr, budget=600.0, start=time.monotonic())
        progress.rung(0, total=8, steps=4)
        progress.record(record)
        progress.close()
    """

    def __init__(self, stream: TextIO | None, budget: float | None, start: float) -> None:
        self.stream, self.budget, self.start = stream, budget, start
        self._bar: Any = None

    def rung(self, rung: int, total: int, steps: int) -> None:
        """A rung of ``total`` trials of ``steps`` measured steps begins: a new bar (on a terminal)."""
        self.close()
        if self.stream is not None and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"tune rung {rung} ({steps} steps)", unit="trial", file=self.stream,
                             dynamic_ncols=True, leave=False)  # fmt: skip

    def record(self, record: TrialRecord, resumed: bool = False) -> None:
        """A trial ended (``resumed``: read back from ``trials.jsonl``): its line, and a step of the bar."""
        if self.stream is None:
            return
        line = trial_line(record, time.monotonic() - self.start, self.budget) + (" [trials.jsonl]" if resumed else "")
        if self._bar is None:
            print(line, file=self.stream, flush=True)
            return
        self._bar.write(line, file=self.stream)
        self._bar.update()

    def close(self) -> None:
        """Take the bar down (the lines stay)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
