"""Activation offload and selective recomputation: peak activation memory and tokens/sec, copy/compute overlap.

On CUDA the reference ``MoEGPT`` (12 layers or more) trains with AdamW under bf16 autocast as Lightning's
``"bf16-mixed"`` runs it (no autocast weight cache; backward outside autocast) in these modes, interleaved in one
process and timed with CUDA events (median of repeats):

- ``off``: nothing (the baseline);
- ``rebuild``: the offloader copies nothing (``offload_layers=0``) and only drops the layers' saved bf16 weight copies
  and RMSNorm outputs (and their bf16 copies), rebuilt in backward;
- ``rebuild_gemms``: as ``rebuild``, and the experts' gate/up GEMM output is rebuilt too (``rebuild="norms+gemms"``: one
  more gather and grouped GEMM per layer in backward); ``rebuild_gemms_6``: in the first 6 layers only (half the
  GEMMs, half their share of the memory);
- ``all``: every layer but the last offloads (``offload_layers=None``);
- ``auto``: ``offload_layers="auto"``: as many leading layers as the copies can hide behind compute (with its plan:
  measured per-layer compute, bytes and bandwidth);
- ``auto_gemms``: ``"auto"`` with ``rebuild="norms+gemms"`` (fewer bytes per offloaded layer);
- ``recompute``: no offload, every layer under selective recomputation (``offload_layers=0, recompute="selective"``);
- ``auto_recompute``: ``"auto"`` offload plus selective recomputation of the layers that do not offload.

Every offloader mode rebuilds the weight copies and the norms' outputs as ``rebuild`` does. ``--modes`` runs a subset
(``off`` always runs: it is the baseline).

Reported per mode:

- ``peak_act_bytes``: peak allocated memory during a step minus what is allocated before it, measured in the steps
  whose gradients stay allocated (zeroed in place, as ``zero_grad(set_to_none=False)``): activations and backward's
  transient buffers only; ``mem_reduction`` = 1 - mode/off. This is the target's "peak activation memory".
- ``peak_step_bytes``: the same in the steps that free the gradients first (Lightning's default ``zero_grad()``), so
  it also counts the gradients as backward creates them; ``step_mem_reduction`` = 1 - mode/off. When a layer's
  weight gradients outweigh what it saves (``large``: 0.97 GB of fp32 gradients per layer), the peak moves to the
  end of backward and this reduction is capped whatever the offloader does.
  Timed repeats alternate the two kinds.
- ``tokens_per_sec`` and ``tps_ratio`` = mode/off (the issue's target: >= 40% less peak activation memory at no more
  than 5% fewer tokens/sec: ``meets_target``).
- ``overlap`` (offloading modes): ``1 - exposed / copy_ms`` where ``copy_ms`` is the device-to-host plus
  host-to-device time of the offloaded bytes alone (CUDA events, pinned buffers) and ``exposed`` = step time of the
  mode minus ``off``.

On CPU there are no copy streams: :mod:`offload_cpu` runs the forced path on a tiny model (under the same bf16
autocast) for the offloader's stats and a bit-identity check of every mode, the peak of live tensor bytes of the modes
that copy nothing, and ``host_ms``: forward and backward time of those modes on a 12-layer model whose step is host
time, as a launch-bound GPU forward is (what the hooks and rebuild bookkeeping cost; copy timings need CUDA), with the
ATen operations a step dispatches in each mode. Shapes, modes and the step are in :mod:`offload_steps`.

Usage::

    python benchmarks/bench_offload.py --device cuda                # 12 layers, hidden 1024, 4 x 2048 tokens
    python benchmarks/bench_offload.py --device cuda --shape wide   # 12 layers, hidden 2048
    python benchmarks/bench_offload.py --device cuda --shape large  # 12 layers, hidden 4096, 4 experts
    python benchmarks/bench_offload.py --device cuda --modes rebuild,rebuild_gemms,auto_gemms
    python benchmarks/bench_offload.py --quick --device cpu         # forced CPU path, stats only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

# Its sibling modules, also when the suite loads this script from its path (lightning_llmfast.bench.suite).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_cpu import cpu_report
from offload_steps import MODES, SHAPES, saved_inventory, selected
from offload_steps import copy_ms as _copy_ms
from offload_steps import setup as _setup
from offload_steps import step as _step

MEM_TARGET = 0.40  # at least 40% lower peak activation memory
TPS_TARGET = 0.95  # at no more than 5% lower tokens/sec


def _cuda(shape_name: str, repeats: int, names: Sequence[str] | None = None) -> dict[str, Any]:
    shape, device = SHAPES[shape_name], "cuda"
    model, opt, ids = _setup(shape, device)
    inventory = saved_inventory(model, ids)  # before any offloader hooks the layers
    # With the head and loss, what forward holds at its end; the rest of a peak is backward's transients.
    layers_saved = saved_inventory(model, ids, layer=None, top=0)["total_bytes"]
    common: dict[str, Any] = {"min_offload_bytes": 1 << 20, "keep_last_layers": 1, "prefetch_layers": 1}
    modes = {
        name: None if settings is None else ActivationOffloader(model.layers, OffloadConfig(**common, **settings))
        for name, settings in selected(names).items()
    }
    # Warm-up: Triton compilation (in "off", first, so that "auto" measures warm kernels), allocator, pool sizing
    # (first offload step; for "auto" the second, after its measuring step).
    for mode in modes.values():
        for _ in range(3):
            _step(model, opt, ids, mode)
    torch.cuda.synchronize()
    phases: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    peaks: dict[bool, dict[str, int]] = {free: dict.fromkeys(modes, 0) for free in (False, True)}
    held_after_forward = dict.fromkeys(modes, 0)

    def timed(name: str, mode: ActivationOffloader | None) -> Callable[[int], float]:
        def step(r: int) -> float:
            free_grads = r % 2 == 1  # alternate: activation-only peaks, then peaks with the gradients as they appear
            if mode is not None:
                mode.synchronize()
            # Zero (or free) the previous gradients before `base`: then it is weights, optimizer state and, when they
            # stay allocated, the gradients, and the peak above it is what the step adds.
            opt.zero_grad(set_to_none=free_grads)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, fwd_end, bwd_end, end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            held: list[int] = []
            start.record()
            _step(model, opt, ids, mode, marks=(fwd_end, bwd_end), free_grads=free_grads, held=held)
            end.record()
            end.synchronize()  # NOTE: host sync: benchmark timing only
            phases[name].append((start.elapsed_time(fwd_end), fwd_end.elapsed_time(bwd_end)))
            peaks[free_grads][name] = max(peaks[free_grads][name], torch.cuda.max_memory_allocated() - base)
            if not free_grads:
                held_after_forward[name] = max(held_after_forward[name], held[0] - base)
            return start.elapsed_time(end)

        return step

    # at least one repeat of each peak kind; the warm-up steps ran above
    measured = interleave({name: timed(name, mode) for name, mode in modes.items()}, max(repeats, 2), warmup=0)
    times = {name: m.values for name, m in measured.items()}
    tokens = ids.numel()
    ms = {name: statistics.median(t) for name, t in times.items()}
    results = {name: _row(name, off, ms, phases[name], tokens, device) for name, off in modes.items()}
    for name, row in results.items():
        act, full = peaks[False], peaks[True]
        row.update(peak_act_bytes=act[name], held_after_forward_bytes=held_after_forward[name],
                   peak_step_bytes=full[name], mem_reduction=1 - act[name] / act["off"],
                   step_mem_reduction=1 - full[name] / full["off"])  # fmt: skip
        row["meets_target"] = row["mem_reduction"] >= MEM_TARGET and row["tps_ratio"] >= TPS_TARGET
    return {
        "device": torch.cuda.get_device_name(0),
        "shape_name": shape_name,
        "shape": shape,
        "tokens_per_step": tokens,
        "repeats": repeats,
        "targets": {"mem_reduction": MEM_TARGET, "tps_ratio": TPS_TARGET},
        "modes": results,
        "meeting_target": [name for name, row in results.items() if row["meets_target"]],
        "layer0_saved": inventory,
        "layers_saved_bytes": layers_saved,
    }


def _row(
    name: str,
    offloader: ActivationOffloader | None,
    ms: dict[str, float],
    phases: list[tuple[float, float]],
    tokens: int,
    device: str,
) -> dict[str, Any]:
    """A mode's times, tokens/s and (with an offloader) its layers, copy overlap, stats and plan; closes the
    offloader."""
    row: dict[str, Any] = {
        "step_ms": ms[name],
        "tokens_per_sec": tokens / (ms[name] / 1e3),
        "tps_ratio": ms["off"] / ms[name],
        # Where the time goes: forward and loss, and backward (the rest of a step is the optimizer).
        "forward_ms": statistics.median(f for f, _ in phases),
        "backward_ms": statistics.median(b for _, b in phases),
    }
    if offloader is None:
        return row
    stats = offloader.stats
    row["offload_layers"] = stats["offload_layers"]
    row["recompute_layers"] = stats["recompute_layers"]
    if stats["offloaded_bytes"]:
        copy_ms = _copy_ms(int(stats["offloaded_bytes"]), device)
        exposed = max(ms[name] - ms["off"], 0.0)
        row["copy_ms"] = copy_ms
        row["exposed_ms"] = exposed
        row["overlap"] = max(0.0, min(1.0, 1 - exposed / copy_ms))
    row["stats"] = stats
    row["plan"] = offloader.auto_plan
    offloader.close()
    return row


def run(
    quick: bool = False,
    device: str = "cpu",
    repeats: int | None = None,
    shape: str | None = None,
    modes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the offload benchmark.

    Args:
        quick: the ``"quick"`` shape (the harness's switch); otherwise ``shape``.
        device: ``"cuda"`` for timings and memory; ``"cpu"`` runs the forced path on a tiny model, stats only.
        repeats: interleaved timed steps per mode (default 5 quick, 8 otherwise).
        shape: ``"full"`` (hidden 1024, the default), ``"wide"`` (hidden 2048), ``"large"`` (hidden 4096, 4
            experts) or ``"quick"`` (hidden 512); 12 layers each.
        modes: names from ``MODES`` to run (``off`` runs always); ``None``: all.

    Returns:
        On CUDA ``{"modes": {mode: {"step_ms", "tokens_per_sec", "tps_ratio", "peak_act_bytes",
        "held_after_forward_bytes", "mem_reduction", "peak_step_bytes", "step_mem_reduction", "meets_target",
        "offload_layers", "recompute_layers", "overlap", "stats", "plan", ...}}, "meeting_target", "layer0_saved",
        "layers_saved_bytes", ...}``; on CPU ``{"note", "modes": {mode: {"bit_identical_params",
        "stats", "plan"}}}``.

    Example::

        report = run(quick=True, device="cpu")
    """
    shape = shape or ("quick" if quick else "full")
    if shape not in SHAPES or shape in ("cpu", "host"):
        raise ConfigError(f"shape must be one of full, wide, large, quick; got {shape!r}")
    selected(modes)  # unknown names fail before any model is built
    if device == "cuda" and torch.cuda.is_available():
        return _cuda(shape, repeats or (5 if shape == "quick" else 8), modes)
    return cpu_report(shape == "quick", modes)


def summary(report: dict[str, Any]) -> str:
    """Markdown summary of a CUDA report: one row per mode, the "auto" plans, and layer 0's saved-tensor inventory.

    Example::

        print(summary(run(device="cuda", shape="large")))
    """
    lines = [
        f"offload {report['shape_name']}: {report['shape']['model']}, {report['tokens_per_step']} tokens/step, "
        f"{report['device']}",
        "| mode | step ms | fwd ms | bwd ms | tokens/s | vs off | peak act GiB | act reduction | held after fwd GiB "
        "| peak step GiB | step reduction | offload layers | recompute layers | overlap | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["modes"].items():
        overlap = m.get("overlap")
        lines.append(
            f"| {name} | {m['step_ms']:.1f} | {m['forward_ms']:.1f} | {m['backward_ms']:.1f} "
            f"| {m['tokens_per_sec']:,.0f} | {m['tps_ratio']:.3f} | {m['peak_act_bytes'] / 2**30:.2f} "
            f"| {m['mem_reduction']:.1%} | {m['held_after_forward_bytes'] / 2**30:.2f} "
            f"| {m['peak_step_bytes'] / 2**30:.2f} | {m['step_mem_reduction']:.1%} "
            f"| {m.get('offload_layers', 0)} | {m.get('recompute_layers', 0)} "
            f"| {'-' if overlap is None else f'{overlap:.2f}'} | {'met' if m['meets_target'] else 'missed'} |"
        )
    for name, m in report["modes"].items():
        plan = m.get("plan")
        if plan:
            forward, backward = ([round(c, 2) for c in plan.get(key) or []] for key in ("compute_ms", "backward_ms"))
            per_layer = [b >> 20 for b in plan.get("bytes_per_layer", [])]
            lines.append(
                f"{name} plan: {plan['offload_layers']} layers + {plan['partial_bytes'] >> 20} MiB, prefetch depth "
                f"{plan['prefetch_layers']}, bandwidth {plan['bandwidth_bytes_per_ms'] / 1e6:.1f} GB/s, forward ms "
                f"{forward}, backward ms {backward}, MiB {per_layer}"
            )
    for name in ("rebuild", "rebuild_gemms"):
        stats = report["modes"].get(name, {}).get("stats")
        if stats:
            lines.append(
                f"rebuilt in backward per step ({name} mode): weight copies {stats['recast_bytes'] / 1e6:.1f} MB "
                f"({stats['recast_casts']}), outputs (norms and copies; gate/up with rebuild_gemms) "
                f"{stats['rebuilt_bytes'] / 1e6:.1f} MB ({stats['rebuilt_tensors']})"
            )
    lines.append(f"meeting target: {report['meeting_target']}")
    lines.append(
        f"the layers save {report['layers_saved_bytes'] / 2**30:.2f} GiB for backward without an offloader; in the off "
        "row 'held after fwd' minus that is the head and loss, and in every row 'peak act' minus 'held after fwd' is "
        "what backward adds at its peak"
    )
    inv = report["layer0_saved"]
    lines.append(f"layer 0 saves {inv['total_bytes'] / 1e6:.1f} MB in {inv['tensors']} storages; largest:")
    lines += [f"  {e['bytes'] / 1e6:8.1f} MB  x{e['count']}  {e['op']}  {e['shape']}  {e['dtype']}" for e in inv["top"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="full", choices=["full", "wide", "large", "quick"])
    parser.add_argument("--quick", action="store_true", help="same as --shape quick")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--summary", action="store_true", help="print a markdown summary (CUDA) instead of the JSON")
    parser.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (off always runs)")
    args = parser.parse_args()
    modes = args.modes.split(",") if args.modes else None
    result = run(
        quick=args.quick,
        device=args.device,
        repeats=args.repeats,
        shape=None if args.quick else args.shape,
        modes=modes,
    )
    text = json.dumps(result, indent=1, default=str)
    print(summary(result) if args.summary and "shape_name" in result else text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
