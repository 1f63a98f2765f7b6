"""Memory plans against each single mechanism: measured peak activation memory and tokens/s at budgets of the peak.

On CUDA, the H200 offload shape (``offload_steps.SHAPES["full"]``: 12 layers, hidden 1024, 4 x 2048 tokens, AdamW,
bf16 autocast as Lightning's ``"bf16-mixed"`` runs it) trains in these modes, interleaved in one process and timed
with CUDA events (median of repeats):

- ``off``: no offloader (the baseline);
- ``offload``: every layer but the last copies its saved activations to pinned host memory (``offload_layers=None``);
- ``recompute``: every layer under selective recomputation, nothing copied (``offload_layers=0``);
- ``plan_60``, ``plan_50``: ``OffloadConfig(plan="auto", budget=...)`` at 60% and 50% of the bytes the layers save
  without any mechanism (the plan's own profile of an unreachable budget).

Every offloader mode rebuilds norm outputs and weight copies (the default ``rebuild="norms"``), so each mechanism is
compared on the same footing. Per mode: ``step_ms``, ``tokens_per_sec``, ``tps_ratio`` (mode/off), ``peak_act_bytes``
(the device's peak during a step above what is allocated before it, gradients zeroed in place) and ``mem_reduction``
(1 - mode/off); per plan its choices and offloaded storages per layer, predicted against measured peak of live saved
bytes and step time, and against each single mechanism the ratios of tokens/s and of peak activation memory.

``--device cpu --tiny`` runs the same loop on a 12-layer model at hidden 32 with the forced CPU path (wall clock; no
device peak, so the memory columns are ``None``; the plans' own counts of live saved bytes remain): the dry run that
proves the script before a GPU session spends its time on it.

Usage::

    python benchmarks/gpu_memplan.py --device cuda --json out/memplan.json --summary
    python benchmarks/gpu_memplan.py --device cpu --tiny --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from offload_steps import SHAPES, setup, step

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

FRACTIONS = (0.6, 0.5)
SINGLE = {"offload": {"offload_layers": None}, "recompute": {"offload_layers": 0, "recompute": "selective"}}


def _offloaders(model: Any, opt: Any, ids: torch.Tensor, tiny: bool) -> tuple[dict[str, Any], int]:
    """The modes' offloaders over ``model``'s layers (``off``: ``None``), with every plan made; and the saved bytes
    the budgets are fractions of."""
    common: dict[str, Any] = {"min_offload_bytes": 0 if tiny else 1 << 20, "force": tiny}
    probe = ActivationOffloader(model.layers, OffloadConfig(**common, plan="auto", budget=1 << 60, profile_steps=1))
    while probe.memory_plan is None:
        step(model, opt, ids, probe)
    saved = probe.memory_plan.profile.saved_bytes
    probe.close()
    modes: dict[str, Any] = {"off": None}
    modes.update({name: ActivationOffloader(model.layers, OffloadConfig(**common, **s)) for name, s in SINGLE.items()})
    for fraction in FRACTIONS:
        config = OffloadConfig(**common, plan="auto", budget=int(saved * fraction))
        modes[f"plan_{round(fraction * 100)}"] = ActivationOffloader(model.layers, config)
    for off in modes.values():
        for _ in range(2):  # warm-up (Triton compilation, allocator, pool sizing), then the plans' profiled steps
            step(model, opt, ids, off)
        while off is not None and off.config.plan is not None and off.memory_plan is None:
            step(model, opt, ids, off)
    return modes, saved


def _timed(model: Any, opt: Any, ids: torch.Tensor, off: Any, peaks: list[int]) -> Callable[[int], float]:
    """One step of a mode: its milliseconds (CUDA events, or the host clock on CPU), its peak appended to ``peaks``."""
    cuda = ids.device.type == "cuda"

    def run_step(r: int) -> float:
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: the peak above `base` is the step's activations
        if not cuda:
            t0 = time.perf_counter()
            step(model, opt, ids, off, free_grads=False)
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, opt, ids, off, free_grads=False)
        end.record()
        end.synchronize()  # NOTE: host sync: benchmark timing only
        peaks.append(torch.cuda.max_memory_allocated() - base)
        return start.elapsed_time(end)

    return run_step


def _plan_row(off: ActivationOffloader, row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    plan = off.memory_plan
    assert plan is not None
    row.update(
        budget_bytes=plan.budget_bytes,
        choices=list(plan.choices),
        storages=list(plan.storages),
        predicted_peak=plan.predicted_peak,
        predicted_ms=plan.predicted_ms,
        **{f"last_{k}": v for k, v in off.step_metrics().items()},
        vs_single={
            name: {"tps": row["tokens_per_sec"] / rows[name]["tokens_per_sec"],
                   "peak_act": _ratio(row["peak_act_bytes"], rows[name]["peak_act_bytes"])}
            for name in SINGLE
        },
    )  # fmt: skip


def _ratio(a: float | None, b: float | None, minus: bool = False) -> float | None:
    """``a / b`` (``1 - a / b`` with ``minus``), or ``None`` where a peak was not measured (CPU)."""
    if a is None or not b:
        return None
    return 1 - a / b if minus else a / b


def run(device: str = "cuda", tiny: bool = False, repeats: int = 6) -> dict[str, Any]:
    """Measure every mode (see the module docstring); ``tiny``: the 12-layer hidden-32 shape. Returns the report."""
    shape = SHAPES["host" if tiny else "full"]
    if device == "cpu":
        torch.set_num_threads(1)  # a tiny model: more threads only wait on each other on a shared host
    model, opt, ids = setup(shape, device)
    modes, saved = _offloaders(model, opt, ids, tiny)
    peaks: dict[str, list[int]] = {name: [] for name in modes}
    fns = {name: _timed(model, opt, ids, off, peaks[name]) for name, off in modes.items()}
    measured = interleave(fns, max(repeats, 1), warmup=0)
    tokens = ids.numel()
    rows: dict[str, dict[str, Any]] = {}
    for name, m in measured.items():
        ms = statistics.median(m.values)
        peak = max(peaks[name]) if peaks[name] else None  # no device peak on CPU
        rows[name] = {"step_ms": ms, "tokens_per_sec": tokens / (ms / 1e3), "peak_act_bytes": peak}
    for row in rows.values():
        row["tps_ratio"] = row["tokens_per_sec"] / rows["off"]["tokens_per_sec"]
        row["mem_reduction"] = _ratio(row["peak_act_bytes"], rows["off"]["peak_act_bytes"], minus=True)
    for name, off in modes.items():
        if off is not None and off.memory_plan is not None:
            _plan_row(off, rows[name], rows)
        if off is not None:
            rows[name]["stats"] = {k: off.stats[k] for k in ("offloaded_bytes", "recompute_layers", "offload_layers")}
            off.close()
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": name, "shape": shape, "tokens_per_step": tokens, "repeats": repeats, "saved_bytes": saved,
            "fractions": list(FRACTIONS), "modes": rows}  # fmt: skip


def summary(report: dict[str, Any]) -> str:
    """A markdown table: one row per mode; for the plans, their prediction and their ratios to each single mechanism.

    Example::

        print(summary(run(device="cpu", tiny=True, repeats=2)))
    """
    lines = [
        f"memory plans on {report['device']}: {report['shape']['model']}, {report['tokens_per_step']} tokens/step, "
        f"layers save {report['saved_bytes'] / 2**20:.1f} MiB",
        "| mode | step ms | tokens/s | vs off | peak act MiB | act reduction | pred./meas. saved peak MiB "
        "| pred./meas. ms | tps vs offload, recompute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["modes"].items():
        plan = "-", "-", "-"
        if "predicted_peak" in m:
            single = ", ".join(f"{v['tps']:.2f}" for v in m["vs_single"].values())
            peak = m.get("last_measured_peak", float("nan")) / 2**20
            plan = (f"{m['predicted_peak'] / 2**20:.1f} / {peak:.1f}",
                    f"{m['predicted_ms']:.1f} / {m.get('last_measured_ms', float('nan')):.1f}", single)  # fmt: skip
        peak_act = "-" if m["peak_act_bytes"] is None else f"{m['peak_act_bytes'] / 2**20:.1f}"
        reduction = "-" if m["mem_reduction"] is None else f"{m['mem_reduction']:.1%}"
        lines.append(
            f"| {name} | {m['step_ms']:.1f} | {m['tokens_per_sec']:,.0f} | {m['tps_ratio']:.3f} | {peak_act} "
            f"| {reduction} | {plan[0]} | {plan[1]} | {plan[2]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tiny", action="store_true", help="the 12-layer hidden-32 CPU shape (a dry run of the script)"
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--summary", action="store_true", help="print the markdown table instead of the JSON")
    args = parser.parse_args()
    report = run(args.device, args.tiny or args.device != "cuda", args.repeats)
    text = json.dumps(report, indent=1, default=str)
    print(summary(report) if args.summary else text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
