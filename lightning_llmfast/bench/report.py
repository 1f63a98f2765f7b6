"""Reporting a benchmark result: a Markdown table (for the terminal and ``benchmarks/RESULTS.md``) and a PNG plot.

Every end-to-end variant is reported with the median, min and max of its timed repeats. When the repeats spread so
widely that a ratio cannot be trusted, :func:`spread_warnings` says so, and the report and the plot show it:

- a variant whose fastest repeat is more than :data:`MAX_SPREAD` times its slowest one (a busy machine, a too-short
  run), or
- a ratio whose range over the repeats (``min(a) / max(b)`` to ``max(a) / min(b)``) contains 1: the run cannot tell
  which of the two is faster.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["MAX_SPREAD", "RATIOS", "markdown_report", "plot_result", "ratio_range", "spread_warnings"]

MAX_SPREAD = 1.25
"""Largest accepted ``max / min`` of one variant's tokens/sec over its repeats. The repeats are interleaved, so a
variant that spreads more than this was slowed by something other than its code (other jobs on the machine, clock
changes, a too-short segment) and the ratios it enters are flagged."""

RATIOS: dict[str, tuple[str, str]] = {
    "llmfast_vs_before": ("llmfast", "before"),
    "llmfast_vs_peer": ("llmfast", "peer"),
}
"""The reported tokens/sec ratios: name -> (numerator variant, denominator variant)."""

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tokens_per_sec", "tokens/s (median)"),
    ("tokens_per_sec_range", "min - max"),
    ("vs_before", "vs before"),
    ("host_syncs_per_step", "host syncs/step"),
    ("kernels_per_step", "kernels/step"),
    ("metadata_builds_per_step", "metadata builds/step"),
    ("aten_ops_per_step", "ATen ops/step"),
    ("peak_mem_bytes", "peak mem"),
    ("final_loss", "final loss"),
)

_CELL_CHARS = 30  # a list in a table cell (per-layer sizes) is cut here


def _fmt(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if key == "tokens_per_sec":
        return f"{value:,.0f}"
    if key == "tokens_per_sec_range":
        return f"{value[0]:,.0f} - {value[1]:,.0f}"
    if key == "vs_before":
        return f"{value:.2f}x"
    if key == "peak_mem_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "final_loss":
        return f"{value:.4f}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _spread(row: dict[str, Any]) -> tuple[float, float] | None:
    """``(min, max)`` tokens/sec of a variant's repeats, or ``None`` (skipped, failed, or a result without them)."""
    low, high = row.get("tokens_per_sec_min"), row.get("tokens_per_sec_max")
    return None if low is None or high is None else (float(low), float(high))


def ratio_range(e2e: dict[str, dict[str, Any]], num: str, den: str) -> tuple[float, float] | None:
    """The range of the tokens/sec ratio ``num / den`` over the repeats: ``(min(num) / max(den), max(num) / min(den))``.

    Returns:
        ``None`` when either variant did not run or has no per-repeat spread.

    Example::

        ratio_range({"a": {"tokens_per_sec_min": 90, "tokens_per_sec_max": 110},
                     "b": {"tokens_per_sec_min": 50, "tokens_per_sec_max": 60}}, "a", "b")  # (1.5, 2.2)
    """
    a, b = _spread(e2e.get(num, {})), _spread(e2e.get(den, {}))
    if a is None or b is None or b[0] <= 0:
        return None
    return a[0] / b[1], a[1] / b[0]


def spread_warnings(e2e: dict[str, dict[str, Any]]) -> list[str]:
    """Warnings for the variants and ratios whose repeats spread too widely to be trusted (see the module docstring).

    Example::

        spread_warnings(result["e2e"])  # ["llmfast: repeats range from 243 to 5,636 tokens/s (23.19x ...", ...]
    """
    warnings = []
    for variant, row in e2e.items():
        spread = _spread(row)
        if spread is not None and spread[1] > MAX_SPREAD * spread[0]:
            warnings.append(
                f"{variant}: repeats range from {spread[0]:,.0f} to {spread[1]:,.0f} tokens/s "
                f"({spread[1] / max(spread[0], 1e-12):.2f}x, above the {MAX_SPREAD}x limit): the machine's load, not "
                f"the code, sets ratios with {variant}; rerun on an idle machine or with more --repeats/--steps"
            )
    for name, (num, den) in RATIOS.items():
        interval = ratio_range(e2e, num, den)
        if interval is not None and interval[0] <= 1.0 <= interval[1]:
            warnings.append(
                f"{name}: between {interval[0]:.2f}x and {interval[1]:.2f}x over the repeats: the run cannot tell "
                f"whether {num} or {den} is faster"
            )
    return warnings


def markdown_report(result: dict[str, Any]) -> str:
    """The end-to-end table (median, min and max per variant), the ratios with their ranges, the spread warnings,
    the micro-benchmarks as tables and the notes, as Markdown.

    Args:
        result: a dictionary from :func:`~lightning_llmfast.bench.suite.run_benchmark` (older results without
            the per-repeat spread print ``n/a`` in its column).

    Returns:
        Markdown text (no trailing newline).

    Example::

        print(markdown_report(run_benchmark("quick")))
    """
    e2e: dict[str, dict[str, Any]] = result["e2e"]
    base = e2e.get("before", {}).get("tokens_per_sec")
    lines = [
        f"**{result['profile']}** profile on **{result['device']}**, commit `{result['commit']}`, "
        f"{result.get('date', '')}; {result.get('machine', '')}",
        "",
        "| variant | " + " | ".join(title for _, title in _COLUMNS) + " |",
        "|---" * (len(_COLUMNS) + 1) + "|",
    ]
    for variant, row in e2e.items():
        if "skipped" in row or "error" in row:
            reason = row.get("skipped") or row.get("error")
            lines.append(f"| {variant} | {reason} |" + " |" * (len(_COLUMNS) - 1))
            continue
        values = dict(row, vs_before=row["tokens_per_sec"] / base if base else None, tokens_per_sec_range=_spread(row))
        lines.append(f"| {variant} | " + " | ".join(_fmt(key, values.get(key)) for key, _ in _COLUMNS) + " |")
    ratios = result.get("ratios", {})
    lines += ["", "Ratios (tokens/s of the medians; in brackets their range over the repeats):"]
    for name, value in ratios.items():
        interval = ratio_range(e2e, *RATIOS[name]) if name in RATIOS else None
        within = "" if interval is None else f" [{interval[0]:.2f}x - {interval[1]:.2f}x]"
        lines.append(f"- {name} = {_fmt('vs_before', value)}{within}")
    warnings = spread_warnings(e2e)
    if warnings:
        lines += ["", "**Warning: the spread of the repeats is too wide to trust these ratios.**"]
        lines += [f"- {warning}" for warning in warnings]
    for name, entry in result.get("micro", {}).items():
        section = _micro_section(entry)
        lines += ["", f"Micro-benchmark **{name}**:" + ("" if section.startswith("\n") else " ") + section]
    notes = result.get("notes", [])
    if notes:
        lines += ["", "Notes:"]
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def _micro_section(entry: dict[str, Any]) -> str:
    """A micro-benchmark's (nested) dict as Markdown tables: its scalars as one ``key | value`` table, dicts of dicts
    and lists of dicts as a table each, and dicts of scalars with the same keys (``step_ms``/``tokens_per_sec`` per
    mode) together in one table."""
    if "skipped" in entry or "error" in entry:
        return str(entry.get("skipped") or entry.get("error"))
    if isinstance(entry.get("table"), str):
        return "\n\n" + entry["table"]
    tables: list[tuple[str, dict[str, dict[str, Any]]]] = []
    scalars = {k: v for k, v in entry.items() if not _nested(v)}
    if scalars:
        tables.append(("", {"value": scalars}))
    by_keys: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}
    for key, value in entry.items():
        if isinstance(value, list) and _nested(value):
            tables.append((key, {f"#{i + 1}": dict(_flatten(v)) for i, v in enumerate(value)}))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            tables.append((key, {str(k): dict(_flatten(v)) for k, v in value.items()}))
        elif isinstance(value, dict):
            flat = dict(_flatten(value))
            by_keys.setdefault(tuple(flat), {})[key] = flat
    tables += [(", ".join(group) if len(group) > 1 else next(iter(group)), group) for group in by_keys.values()]
    return "".join(f"\n\n{title}:\n\n" * bool(title) + "\n\n" * (not title) + _table(rows) for title, rows in tables)


def _nested(value: Any) -> bool:
    """A dict, or a list holding a dict: rendered as a table of its own rather than as one cell."""
    return isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value))


def _table(rows: dict[str, dict[str, Any]]) -> str:
    """``rows`` (row name -> column -> value) as a Markdown table, turned so that the longer axis runs down the page
    (a dozen metrics of three modes become twelve rows of three columns, not one wide line)."""
    columns = list(dict.fromkeys(c for r in rows.values() for c in r))
    if len(columns) > len(rows):
        rows, columns = {c: {name: r.get(c, "") for name, r in rows.items()} for c in columns}, list(rows)
    out = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(_num(r.get(c, "")) for c in columns) + " |" for name, r in rows.items()]
    return "\n".join(out)


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= _CELL_CHARS else text[: _CELL_CHARS - 3] + "..."


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), value)]


def plot_result(result: dict[str, Any], path: str | Path) -> None:
    """Write a PNG comparing the end-to-end variants: tokens/s (median, error bars from min to max; hatched bars
    spread more than :data:`MAX_SPREAD`), host syncs, ATen ops and peak memory per step.

    Args:
        result: a dictionary from :func:`~lightning_llmfast.bench.suite.run_benchmark`.
        path: where to write the PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install lightning-llmfast[plot]``).

    Example::

        plot_result(result, "bench.png")
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    rows = {v: r for v, r in result["e2e"].items() if "tokens_per_sec" in r}
    panels = (
        ("tokens_per_sec", "tokens/s (median, min-max; higher is better)", 1.0),
        ("host_syncs_per_step", "host syncs / step", 1.0),
        ("aten_ops_per_step", "ATen ops / step", 1.0),
        ("peak_mem_bytes", "peak memory (MiB)", 2.0**-20),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    colors = {"before": "#9e9e9e", "peer": "#ff9800", "llmfast": "#7b1fa2"}
    names = list(rows)
    for ax, (key, title, scale) in zip(axes, panels):
        values = [rows[v][key] * scale for v in names]
        bars = ax.bar(names, values, color=[colors.get(v, "#607d8b") for v in names])
        if key == "tokens_per_sec":
            _error_bars(ax, bars, [rows[v] for v in names])
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
    title = f"lightning_llmfast: {result['profile']} profile on {result['device']} ({result['commit']})"
    if spread_warnings(result["e2e"]):
        title += "\nWARNING: repeats spread too widely to trust the ratios (see the report)"
    fig.suptitle(title, color="black" if "\n" not in title else "#b71c1c")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _error_bars(ax: Any, bars: Any, rows: list[dict[str, Any]]) -> None:
    """Min-max error bars on the tokens/s bars; bars whose repeats spread more than MAX_SPREAD are hatched."""
    for bar, row in zip(bars, rows):
        spread = _spread(row)
        if spread is None:
            continue
        median = row["tokens_per_sec"]
        x = bar.get_x() + bar.get_width() / 2
        ax.errorbar(x, median, yerr=[[median - spread[0]], [spread[1] - median]], color="black", capsize=4, lw=1)
        if spread[1] > MAX_SPREAD * spread[0]:
            bar.set_hatch("//")
