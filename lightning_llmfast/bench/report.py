"""Reporting a benchmark result: a Markdown table (for the terminal and ``benchmarks/RESULTS.md``) and a PNG plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["markdown_report", "plot_result"]

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tokens_per_sec", "tokens/s"),
    ("vs_before", "vs before"),
    ("host_syncs_per_step", "host syncs/step"),
    ("metadata_builds_per_step", "metadata builds/step"),
    ("aten_ops_per_step", "ATen ops/step"),
    ("peak_mem_bytes", "peak mem"),
    ("final_loss", "final loss"),
)


def _fmt(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if key == "tokens_per_sec":
        return f"{value:,.0f}"
    if key == "vs_before":
        return f"{value:.2f}x"
    if key == "peak_mem_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "final_loss":
        return f"{value:.4f}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown_report(result: dict[str, Any]) -> str:
    """The end-to-end table, the ratios, the micro-benchmark summaries and the notes, as Markdown.

    Args:
        result: a dictionary from :func:`~lightning_llmfast.bench.harness.run_benchmark`.

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
        values = dict(row, vs_before=row["tokens_per_sec"] / base if base else None)
        lines.append(f"| {variant} | " + " | ".join(_fmt(key, values.get(key)) for key, _ in _COLUMNS) + " |")
    ratios = result.get("ratios", {})
    lines += ["", "Ratios (tokens/s): " + ", ".join(f"{k} = {_fmt('vs_before', v)}" for k, v in ratios.items())]
    for name, entry in result.get("micro", {}).items():
        lines += ["", f"Micro-benchmark **{name}**: " + _micro_section(entry)]
    notes = result.get("notes", [])
    if notes:
        lines += ["", "Notes:"]
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def _micro_section(entry: dict[str, Any]) -> str:
    """A micro-benchmark's dict as Markdown: its scalars on one line, then one table per list of row dicts."""
    if "skipped" in entry or "error" in entry:
        return str(entry.get("skipped") or entry.get("error"))
    if isinstance(entry.get("table"), str):
        return "\n\n" + entry["table"]
    scalars = [(k, v) for k, v in _flatten(entry) if not isinstance(v, list)]
    out = ", ".join(f"{k}={_num(v)}" for k, v in scalars)
    for key, rows in entry.items():
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            flat = [dict(_flatten(r)) for r in rows]
            columns = list(dict.fromkeys(c for r in flat for c in r))
            out += f"\n\n{key}:\n\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"
            out += "".join("\n| " + " | ".join(_num(r.get(c, "")) for c in columns) + " |" for r in flat)
    return out


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), value)]


def plot_result(result: dict[str, Any], path: str | Path) -> None:
    """Write a PNG comparing the end-to-end variants: tokens/s, host syncs, ATen ops and peak memory per step.

    Args:
        result: a dictionary from :func:`~lightning_llmfast.bench.harness.run_benchmark`.
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
        ("tokens_per_sec", "tokens/s (higher is better)", 1.0),
        ("host_syncs_per_step", "host syncs / step", 1.0),
        ("aten_ops_per_step", "ATen ops / step", 1.0),
        ("peak_mem_bytes", "peak memory (MiB)", 2.0**-20),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    colors = {"before": "#9e9e9e", "peer": "#ff9800", "llmfast": "#7b1fa2"}
    for ax, (key, title, scale) in zip(axes, panels):
        names = list(rows)
        values = [rows[v][key] * scale for v in names]
        bars = ax.bar(names, values, color=[colors.get(v, "#607d8b") for v in names])
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(f"lightning_llmfast: {result['profile']} profile on {result['device']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
