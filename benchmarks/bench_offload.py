"""Activation offload: peak activation memory and tokens/sec with and without offload, copy/compute overlap.

On CUDA the reference ``MoEGPT`` (12 layers or more) trains with AdamW under bf16 autocast in three modes, interleaved
in one process and timed with CUDA events (median of repeats): ``off``, ``on`` (every layer but the last offloads,
reported at the top level) and ``auto`` (``offload_layers="auto"``: as many leading layers as the copies can hide
behind compute, reported under ``"auto"`` with its plan: measured per-layer compute, bytes and bandwidth). Reported:

- ``peak_act_bytes``: peak allocated memory during a step minus what is allocated before it (weights, gradients,
  optimizer state), i.e. the activations (plus transient buffers), per mode; ``mem_reduction`` = 1 - on/off.
- ``tokens_per_sec`` per mode and ``tps_ratio`` = on/off (the issue's target: >= 40% less peak activation memory at
  no more than 5% fewer tokens/sec).
- ``overlap``: ``1 - exposed / copy_ms`` where ``copy_ms`` is the device-to-host plus host-to-device time of the
  offloaded bytes alone (CUDA events, pinned buffers) and ``exposed`` = step time with offload minus without.

On CPU there are no copy streams: it runs the forced path on a tiny model for the offloader's stats and a
bit-identity check only, and says that timings need CUDA.

Usage::

    python benchmarks/bench_offload.py --device cuda            # 12 layers, hidden 1024, 4 x 2048 tokens
    python benchmarks/bench_offload.py --quick --device cpu     # forced CPU path, stats only
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader

MEM_TARGET = 0.40  # at least 40% lower peak activation memory
TPS_TARGET = 0.95  # at no more than 5% lower tokens/sec

FULL = {
    "model": {"hidden_size": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "ffn_size": 1408},
    "batch": 4,
    "seq_len": 2048,
}
QUICK = {
    "model": {"hidden_size": 512, "n_layers": 12, "n_heads": 8, "n_kv_heads": 4, "ffn_size": 704},
    "batch": 2,
    "seq_len": 1024,
}
CPU = {
    "model": {"hidden_size": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 64},
    "batch": 2,
    "seq_len": 33,
}
# A small vocabulary keeps the (B, T, V) logits, which no layer offload can touch, from dominating the peak.
VOCAB = 4096


def _setup(shape: dict[str, Any], device: str) -> tuple[MoEGPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=VOCAB, num_experts=8, top_k=2, **shape["model"])
    model = MoEGPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, VOCAB, (shape["batch"], shape["seq_len"]), device=device)
    return model, opt, ids


def _step(model: MoEGPT, opt: torch.optim.Optimizer, ids: torch.Tensor, off: ActivationOffloader | None) -> None:
    opt.zero_grad(set_to_none=True)
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda")
    with off if off is not None else torch.enable_grad(), autocast:
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        loss.backward()
    opt.step()


def _cpu(quick: bool) -> dict[str, Any]:
    model, opt, ids = _setup(CPU, "cpu")
    ref, ref_opt, _ = _setup(CPU, "cpu")
    auto_model, auto_opt, _ = _setup(CPU, "cpu")
    off = ActivationOffloader(model.layers, min_offload_bytes=0, keep_last_layers=1, force=True)
    auto = ActivationOffloader(
        auto_model.layers, min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto"
    )
    identical = {"on": True, "auto": True}
    for _ in range(2 if quick else 3):
        _step(ref, ref_opt, ids, None)
        for name, (m, o, offloader) in {"on": (model, opt, off), "auto": (auto_model, auto_opt, auto)}.items():
            _step(m, o, ids, offloader)
            identical[name] &= all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    report = {
        "device": "cpu",
        "note": "timings, peak memory and overlap need CUDA (copy streams); CPU runs the forced path for stats only",
        "shape": CPU,
        "bit_identical_params": identical["on"],
        "stats": off.stats,
        "auto": {"bit_identical_params": identical["auto"], "stats": auto.stats, "plan": auto.auto_plan},
    }
    off.close()
    auto.close()
    return report


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


def _cuda(quick: bool, repeats: int) -> dict[str, Any]:
    shape = QUICK if quick else FULL
    device = "cuda"
    model, opt, ids = _setup(shape, device)
    kwargs: dict[str, Any] = {"min_offload_bytes": 1 << 20, "keep_last_layers": 1, "prefetch_layers": 1}
    off = ActivationOffloader(model.layers, **kwargs)
    auto = ActivationOffloader(model.layers, offload_layers="auto", **kwargs)
    modes = {"off": None, "on": off, "auto": auto}
    # Warm-up: Triton compilation (in "off", first, so that "auto" measures warm kernels), allocator, pool sizing
    # (first offload step; for "auto" the second, after its measuring step).
    for mode in modes.values():
        for _ in range(3):
            _step(model, opt, ids, mode)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in modes}
    peaks: dict[str, int] = dict.fromkeys(modes, 0)
    for _ in range(repeats):
        for name, mode in modes.items():  # interleaved: the machine's noise hits every mode alike
            if mode is not None:
                mode.synchronize()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(model, opt, ids, mode)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - base)
    tokens = ids.numel()
    ms = {name: statistics.median(t) for name, t in times.items()}
    compared = {}
    for name in ("on", "auto"):
        offloader = modes[name]
        assert offloader is not None
        stats = offloader.stats
        # The device buffer sets persist between steps, so `base` already holds them: charge them to offload.
        peaks[name] += int(stats["device_set_bytes"])
        copy_ms = _copy_ms(max(int(stats["offloaded_bytes"]), 1), device)
        exposed = max(ms[name] - ms["off"], 0.0)
        mem_reduction = 1 - peaks[name] / peaks["off"]
        tps_ratio = ms["off"] / ms[name]
        compared[name] = {
            "offload_layers": stats["offload_layers"],
            "mem_reduction": mem_reduction,
            "tps_ratio": tps_ratio,
            "copy_ms": copy_ms,
            "exposed_copy_ms": exposed,
            "overlap": max(0.0, min(1.0, 1 - exposed / copy_ms)) if copy_ms > 0 else None,
            "meets_target": mem_reduction >= MEM_TARGET and tps_ratio >= TPS_TARGET,
            "stats": stats,
        }
        offloader.close()
    return {
        "device": torch.cuda.get_device_name(0),
        "shape": shape,
        "tokens_per_step": tokens,
        "repeats": repeats,
        "step_ms": ms,
        "tokens_per_sec": {name: tokens / (t / 1e3) for name, t in ms.items()},
        "peak_act_bytes": peaks,
        "targets": {"mem_reduction": MEM_TARGET, "tps_ratio": TPS_TARGET},
        **compared["on"],  # "all": every layer but the last (the previous report's top-level numbers)
        "auto": {**compared["auto"], "plan": auto.auto_plan},
    }


def run(quick: bool = False, device: str = "cpu", repeats: int | None = None) -> dict[str, Any]:
    """Run the offload benchmark.

    Args:
        quick: a smaller model (still 12 layers) and fewer repeats.
        device: ``"cuda"`` for timings and memory; ``"cpu"`` runs the forced path for stats only.
        repeats: interleaved timed steps per mode (default 5 quick, 10 full).

    Returns:
        On CUDA ``{"step_ms", "tokens_per_sec", "peak_act_bytes", "mem_reduction", "tps_ratio", "overlap",
        "meets_target", "stats", "offload_layers", "auto": {the same for "auto", "plan"}, ...}``; on CPU
        ``{"note", "bit_identical_params", "stats", "auto": {"bit_identical_params", "stats", "plan"}}``.

    Example::

        report = run(quick=True, device="cpu")
    """
    if device == "cuda" and torch.cuda.is_available():
        return _cuda(quick, repeats or (5 if quick else 10))
    return _cpu(quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick, device=args.device, repeats=args.repeats), indent=1, default=str))


if __name__ == "__main__":
    main()
