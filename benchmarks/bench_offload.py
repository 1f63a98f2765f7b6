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

On CPU there are no copy streams: it runs the forced path on a tiny model (under the same bf16 autocast) for the
offloader's stats and a bit-identity check of every mode, the peak of live tensor bytes of the modes that copy
nothing, and ``host_ms``: forward and backward time of those modes on a 12-layer model whose step is host time, as a
launch-bound GPU forward is (what the hooks and rebuild bookkeeping cost; copy timings need CUDA), with the ATen
operations a step dispatches in each mode (on a launch-bound GPU each one costs host time).

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
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.bench.steps import PeakMemory
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

MEM_TARGET = 0.40  # at least 40% lower peak activation memory
TPS_TARGET = 0.95  # at no more than 5% lower tokens/sec

SHAPES: dict[str, dict[str, Any]] = {
    "full": {
        "model": {"hidden_size": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "ffn_size": 1408},
        "batch": 4,
        "seq_len": 2048,
    },
    # A width closer to production MoE layers: per token, compute grows with H^2 and saved bytes with H.
    "wide": {
        "model": {"hidden_size": 2048, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "ffn_size": 2816},
        "batch": 4,
        "seq_len": 2048,
    },
    # Production-like width (4 experts keep AdamW state for 2.9B parameters near 47 GB). The expert weights are large
    # next to 8192 tokens: their bf16 copies are 37% of what a layer saves, 47% with the norms' outputs (all rebuilt,
    # not copied, by the offloader).
    "large": {
        "model": {
            "hidden_size": 4096,
            "n_layers": 12,
            "n_heads": 32,
            "n_kv_heads": 8,
            "ffn_size": 4096,
            "num_experts": 4,
        },
        "batch": 4,
        "seq_len": 2048,
    },
    "quick": {
        "model": {"hidden_size": 512, "n_layers": 12, "n_heads": 8, "n_kv_heads": 4, "ffn_size": 704},
        "batch": 2,
        "seq_len": 1024,
    },
    "cpu": {
        "model": {"hidden_size": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 64},
        "batch": 2,
        "seq_len": 33,
    },
    # Kernels so small that a step is host time (as a launch-bound GPU forward is): the offloader's hooks and
    # rebuild bookkeeping show as step time.
    "host": {
        "model": {"hidden_size": 32, "n_layers": 12, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 64},
        "batch": 2,
        "seq_len": 32,
    },
}
# Offloader settings per mode (None: no offloader).
MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    # Nothing is copied: only the layers' saved bf16 weight copies are dropped and rebuilt in backward.
    "rebuild": {"offload_layers": 0},
    "rebuild_gemms": {"offload_layers": 0, "rebuild": "norms+gemms"},
    "rebuild_gemms_6": {"offload_layers": 0, "rebuild": "norms+gemms", "rebuild_gemm_layers": 6},
    "all": {"offload_layers": None},
    "auto": {"offload_layers": "auto"},
    "auto_gemms": {"offload_layers": "auto", "rebuild": "norms+gemms"},
    "recompute": {"offload_layers": 0, "recompute": "selective"},
    "auto_recompute": {"offload_layers": "auto", "recompute": "selective"},
}
# The modes CPU measurements compare: the baseline and the two that copy nothing.
COPY_FREE_MODES = ("off", "rebuild", "rebuild_gemms")
# A small vocabulary keeps the (B, T, V) logits, which no layer offload can touch, from dominating the peak.
VOCAB = 4096


def _setup(shape: dict[str, Any], device: str) -> tuple[MoEGPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    config = MoEGPTConfig(**{"vocab_size": VOCAB, "num_experts": 8, "top_k": 2, **shape["model"]})
    with torch.device(device):  # built in place: initialising the "large" shape's 2.9B parameters on the host is slow
        model = MoEGPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, VOCAB, (shape["batch"], shape["seq_len"]), device=device)
    return model, opt, ids


def _step(
    model: MoEGPT,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    off: ActivationOffloader | None,
    marks: tuple[Any, Any] | None = None,
    free_grads: bool = True,
    held: list[int] | None = None,
) -> None:
    """One training step; ``marks``: two CUDA events recorded when the loss exists and when backward has ended;
    ``free_grads``: ``zero_grad(set_to_none=...)``; ``held``: see :func:`_forward_backward`."""
    opt.zero_grad(set_to_none=free_grads)
    _forward_backward(model, ids, off, marks, held)
    opt.step()


def _forward_backward(
    model: MoEGPT,
    ids: torch.Tensor,
    off: ActivationOffloader | None,
    marks: tuple[Any, Any] | None = None,
    held: list[int] | None = None,
) -> None:
    """``held``: gets ``torch.cuda.memory_allocated()`` once the loss exists (the allocator's count: no sync)."""
    # As Lightning's "bf16-mixed" runs a step: autocast without its weight cache around forward and loss only.
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False)
    with off if off is not None else torch.enable_grad():
        with autocast:
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        if marks is not None:
            marks[0].record()
        if held is not None:
            held.append(torch.cuda.memory_allocated())
        loss.backward()
        if marks is not None:
            marks[1].record()


def saved_inventory(model: MoEGPT, ids: torch.Tensor, layer: int | None = 0, top: int = 12) -> dict[str, Any]:
    """What one layer (``layer=None``: every layer) saves for backward, as the offloader would see it (one forward, no
    offloader).

    Storages are counted once (views and shared storages deduplicated), parameters not at all; each entry is the
    autograd node that made the saved tensor (``grad_fn`` of its base; ``leaf`` for none), its shape and dtype.

    Returns:
        ``{"total_bytes", "tensors", "top": [{"op", "shape", "dtype", "bytes", "count"}, ...]}``, largest first.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    seen: set[int] = set()
    groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr and ptr not in params and ptr not in seen:  # ptr 0: an empty storage
            seen.add(ptr)
            base = t if t._base is None else t._base
            key = (base.grad_fn.name() if base.grad_fn is not None else "leaf", tuple(t.shape), str(t.dtype))
            entry = groups.setdefault(key, [0, 0])
            entry[0] += t.untyped_storage().nbytes()
            entry[1] += 1
        return t

    blocks = list(model.layers) if layer is None else [model.layers[layer]]
    handles = [
        hook
        for block in blocks
        for hook in (
            block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
            block.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
        )
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False):
                model(ids)
    finally:
        for handle in handles:
            handle.remove()
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "total_bytes": sum(v[0] for v in groups.values()),
        "tensors": sum(v[1] for v in groups.values()),
        "top": [
            {"op": op, "shape": list(shape), "dtype": dtype, "bytes": nbytes, "count": count}
            for (op, shape, dtype), (nbytes, count) in rows[:top]
        ],
    }


def _cpu(quick: bool, names: Sequence[str] | None = None) -> dict[str, Any]:
    ref, ref_opt, ids = _setup(SHAPES["cpu"], "cpu")
    inventory = saved_inventory(ref, ids)
    runs = {}
    for name, settings in _selected(names).items():
        if settings is not None:
            model, opt, _ = _setup(SHAPES["cpu"], "cpu")
            runs[name] = (model, opt, _cpu_offloader(model, settings))
    identical = dict.fromkeys(runs, True)
    for _ in range(2 if quick else 3):
        _step(ref, ref_opt, ids, None)
        for name, (model, opt, off) in runs.items():
            _step(model, opt, ids, off)
            identical[name] &= all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    report: dict[str, Any] = {
        "device": "cpu",
        "note": "timings and overlap need CUDA (copy streams); CPU runs the forced path for stats, bit-identity and "
        "the peak of live tensor bytes of forward + backward without the offloader, rebuilding weight copies and norm "
        "outputs, and rebuilding the gate/up outputs too",
        "shape": SHAPES["cpu"],
        "modes": {},
        "layer0_saved": inventory,
        "peak_live_bytes": _cpu_peaks(),
        "host_ms": _cpu_host_ms(5 if quick else 20),
    }
    for name, (_, _, off) in runs.items():
        report["modes"][name] = {"bit_identical_params": identical[name], "stats": off.stats, "plan": off.auto_plan}
        off.close()
    return report


def _cpu_offloader(model: MoEGPT, settings: dict[str, Any]) -> ActivationOffloader:
    # Every tensor counts on the tiny CPU model (no 1 MiB floor); the forced path runs without streams.
    return ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, **settings)
    )


def _copy_free_offloaders(model: MoEGPT) -> dict[str, ActivationOffloader | None]:
    """``off`` (``None``) and the CPU offloaders of the two modes that copy nothing and only rebuild (weight copies
    and norm outputs; and the experts' gate/up output): what CPU measurements compare, as offloading to host memory
    frees nothing when the host is the device."""
    return {name: None if MODES[name] is None else _cpu_offloader(model, MODES[name]) for name in COPY_FREE_MODES}


def _close(offloaders: dict[str, ActivationOffloader | None]) -> None:
    for off in offloaders.values():
        if off is not None:
            off.close()


def _cpu_peaks() -> dict[str, int]:
    """Peak live tensor bytes of one forward + backward on CPU in the :func:`_copy_free_offloaders` modes."""
    model, _, ids = _setup(SHAPES["cpu"], "cpu")
    offloaders = _copy_free_offloaders(model)
    peaks = {}
    for name, off in offloaders.items():
        model.zero_grad(set_to_none=True)
        with PeakMemory(torch.device("cpu")) as mem:
            _forward_backward(model, ids, off)
        peaks[name] = mem.peak_bytes
    _close(offloaders)
    return peaks


def _cpu_host_ms(repeats: int) -> dict[str, Any]:
    """Forward and backward milliseconds of a step that is host time (``SHAPES["host"]``) in the
    :func:`_copy_free_offloaders` modes, interleaved, medians; each mode's forward and backward over ``off``'s; and
    the ATen operations a step dispatches in each mode (``step_ops``: counted in the untimed warm-up round).

    What the offloader's pack and unpack hooks and rebuilds cost the host per step: on a GPU whose forward is
    launch-bound that is step time.
    """
    model, _, ids = _setup(SHAPES["host"], "cpu")
    offloaders = _copy_free_offloaders(model)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in offloaders}

    def timed(name: str, off: ActivationOffloader | None) -> Callable[[int], None]:
        def step(r: int) -> None:
            model.zero_grad(set_to_none=True)
            marks: list[float] = []
            start = time.perf_counter()
            _forward_backward(model, ids, off, marks=(_HostMark(marks), _HostMark(marks)))
            if r >= 0:
                times[name].append((marks[0] - start, marks[1] - marks[0]))

        return step

    # The counted call (after the warm-up) gives the ATen operations a step dispatches in each mode.
    measured = interleave({name: timed(name, off) for name, off in offloaders.items()}, repeats, count=True)
    ops = {name: m.ops for name, m in measured.items()}
    _close(offloaders)
    forward = {name: statistics.median(f for f, _ in t) * 1e3 for name, t in times.items()}
    backward = {name: statistics.median(b for _, b in t) * 1e3 for name, t in times.items()}
    return {
        "shape": SHAPES["host"],
        "repeats": repeats,
        "forward_ms": forward,
        "backward_ms": backward,
        "forward_ratio": {name: ms / forward["off"] for name, ms in forward.items()},
        "backward_ratio": {name: ms / backward["off"] for name, ms in backward.items()},
        "step_ops": ops,
    }


class _HostMark:
    """A stand-in for a CUDA event in ``_forward_backward``'s ``marks``: ``record`` appends the host clock."""

    def __init__(self, marks: list[float]) -> None:
        self.marks = marks

    def record(self) -> None:
        self.marks.append(time.perf_counter())


def _copy_ms(nbytes: int, device: str) -> float:
    """Device-to-host plus host-to-device time of ``nbytes`` through pinned memory, alone (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host.copy_(src, non_blocking=True)  # warm-up
    start.record()
    host.copy_(src, non_blocking=True)
    src.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()  # NOTE: host sync: benchmark timing only
    return start.elapsed_time(end)


def _selected(names: Sequence[str] | None) -> dict[str, dict[str, Any] | None]:
    """The modes to run, in ``MODES`` order, ``off`` (the baseline) always among them."""
    unknown = sorted(set(names or ()) - set(MODES))
    if unknown:
        raise ConfigError(f"modes: unknown {unknown}; choose from {sorted(MODES)}")
    return {name: settings for name, settings in MODES.items() if names is None or name == "off" or name in names}


def _cuda(shape_name: str, repeats: int, names: Sequence[str] | None = None) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    device = "cuda"
    model, opt, ids = _setup(shape, device)
    inventory = saved_inventory(model, ids)  # before any offloader hooks the layers
    # With the head and loss, what forward holds at its end; the rest of a peak is backward's transients.
    layers_saved = saved_inventory(model, ids, layer=None, top=0)["total_bytes"]
    common: dict[str, Any] = {"min_offload_bytes": 1 << 20, "keep_last_layers": 1, "prefetch_layers": 1}
    modes = {
        name: None if settings is None else ActivationOffloader(model.layers, OffloadConfig(**common, **settings))
        for name, settings in _selected(names).items()
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
    results: dict[str, Any] = {}
    for name, offloader in modes.items():
        row: dict[str, Any] = {
            "step_ms": ms[name],
            "tokens_per_sec": tokens / (ms[name] / 1e3),
            "tps_ratio": ms["off"] / ms[name],
            # Where the time goes: forward and loss, and backward (the rest of a step is the optimizer).
            "forward_ms": statistics.median(f for f, _ in phases[name]),
            "backward_ms": statistics.median(b for _, b in phases[name]),
        }
        if offloader is not None:
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
        row["peak_act_bytes"] = peaks[False][name]
        row["held_after_forward_bytes"] = held_after_forward[name]
        row["mem_reduction"] = 1 - peaks[False][name] / peaks[False]["off"]
        row["peak_step_bytes"] = peaks[True][name]
        row["step_mem_reduction"] = 1 - peaks[True][name] / peaks[True]["off"]
        row["meets_target"] = row["mem_reduction"] >= MEM_TARGET and row["tps_ratio"] >= TPS_TARGET
        results[name] = row
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
    _selected(modes)  # unknown names fail before any model is built
    if device == "cuda" and torch.cuda.is_available():
        return _cuda(shape, repeats or (5 if shape == "quick" else 8), modes)
    return _cpu(shape == "quick", modes)


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
