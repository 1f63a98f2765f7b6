"""The benchmark suite: end-to-end variants and micro-benchmarks in one process, one JSON result.

Claims about speed in this project come only from here. The result dictionary (``--json``) is::

    {"profile", "device", "commit", "machine",
     "e2e": {variant: {"tokens_per_sec" (median), "tokens_per_sec_min", "tokens_per_sec_max",
                       "tokens_per_sec_repeats", "host_syncs_per_step", "metadata_builds_per_step",
                       "aten_ops_per_step", "kernels_per_step" (the CUDA code path: bench/cuda_path.py),
                       "kernels_by_op_per_step", "peak_mem_bytes", "final_loss",
                       "kernels_per_step_cpu_path" (on a CPU, where the CPU's path differs)}
              or {"skipped"|"error": reason}},
     "ratios": {"llmfast_vs_before", "llmfast_vs_peer"},   # tokens/sec ratios of the medians; None: a variant missing
     "ratio_ranges": {same names: [low, high] over the repeats, or None},
     "warnings": [str, ...],                                # spreads too wide to trust the ratios (report.py)
               # profile "hf" (bench/hf.py): variants "hf_eager", "hf_grouped_mm", "llmfast";
               # ratios {"llmfast_vs_best_hf", "llmfast_vs_best_hf_cpu_time"},
               # ratio_ranges {"llmfast_vs_hf_eager", "llmfast_vs_hf_grouped_mm"}
     "micro": {name: dict returned by benchmarks/bench_<name>.py's run(), or {"skipped"|"error": reason}},
     "notes": [str, ...]}

Micro-benchmarks are the scripts ``benchmarks/bench_metadata.py``, ``bench_moe.py`` and ``bench_offload.py`` of the
repository, each exposing ``run(quick: bool, ...) -> dict``. ``benchmarks/`` is not a package, so they are loaded
by path; where the directory or a script is absent (an installed wheel) the entry says so.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_llmfast.bench.e2e import VARIANTS, E2ESettings, run_e2e
from lightning_llmfast.bench.report import RATIOS, ratio_range, spread_warnings
from lightning_llmfast.errors import ConfigError

__all__ = ["MICRO_BENCHMARKS", "PROFILES", "BenchProfile", "git_commit", "machine", "run_benchmark", "run_micro"]

MICRO_BENCHMARKS: tuple[str, ...] = ("metadata", "moe", "offload")
"""Micro-benchmark names: ``benchmarks/bench_<name>.py``."""

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BenchProfile:
    """A named benchmark size.

    Args:
        name: profile name.
        e2e: end-to-end settings.
        micro_quick: the ``quick`` argument passed to every micro-benchmark's ``run``.

    Example::

        profile = PROFILES["quick"]
        profile.e2e.seq_len  # 1024
    """

    name: str
    e2e: E2ESettings
    micro_quick: bool


PROFILES: dict[str, BenchProfile] = {
    # Seconds on a laptop core: for the test suite and smoke checks of the machinery.
    "tiny": BenchProfile(
        "tiny",
        E2ESettings(
            model={"hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 64, "num_experts": 4},
            seq_len=64,
            batch_size=2,
            mean_doc_len=16,
            warmup_steps=1,
            measured_steps=2,
            repeats=2,
            count_steps=1,
        ),
        micro_quick=True,
    ),
    # Under 2 minutes on 2 idle CPU cores, micro-benchmarks included: the default model on rows of 1024 tokens packed
    # with ~10 documents each. The gains grow with the row length (attention over a dense row mask is O(T^2)):
    # see benchmarks/RESULTS.md for T = 512 and 2048. Under TRITON_INTERPRET=1 llmfast's kernels/step of the CUDA
    # path are counted too, a few minutes more (Triton's interpreter; bench/cuda_path.py).
    "quick": BenchProfile(
        "quick",
        E2ESettings(
            model={},
            seq_len=1024,
            batch_size=2,
            mean_doc_len=96,
            warmup_steps=1,
            measured_steps=3,
            repeats=5,
            count_steps=2,
        ),
        micro_quick=True,
    ),
    # transformers Qwen3-MoE trained by HFCausalLMModule vs the transformers way (bench/hf.py); ~1 minute on 2 cores.
    "hf": BenchProfile(
        "hf",
        E2ESettings(
            model={
                "vocab_size": 258,
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            },
            seq_len=256,
            batch_size=4,
            mean_doc_len=48,
            warmup_steps=1,
            measured_steps=2,
            repeats=3,
            count_steps=1,
        ),
        micro_quick=True,
    ),
    # About 3-4 minutes on one H200 in bf16: a 12-layer, 1024-wide MoE at 4096 tokens per row.
    "full": BenchProfile(
        "full",
        E2ESettings(
            model={
                "hidden_size": 1024,
                "n_layers": 12,
                "n_heads": 16,
                "n_kv_heads": 4,
                "ffn_size": 1024,
                "num_experts": 8,
                "top_k": 2,
            },
            seq_len=4096,
            batch_size=4,
            mean_doc_len=512,
            warmup_steps=2,
            measured_steps=8,
            repeats=5,
            count_steps=2,
            precision="bf16-mixed",
        ),
        micro_quick=False,
    ),
}


def git_commit(path: Path = _REPO_ROOT) -> str:
    """Short commit hash of the repository at ``path`` (``+dirty`` with uncommitted changes), or ``"unknown"``.

    ``$LLMFAST_COMMIT``, when set, wins: a tree copied to a lent GPU machine has no ``.git`` or a stale one, so the
    caller names what it copied.

    Example::

        git_commit()  # "b3f7d21+dirty"
    """
    named = os.environ.get("LLMFAST_COMMIT")
    if named:
        return named
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=path,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def machine(device: torch.device) -> str:
    """One line naming the hardware and the versions that produced a result.

    Example::

        machine(torch.device("cpu"))  # "Intel(R) Xeon(R) Processor, 2 cores, torch threads 2; python 3.11.7, ..."
    """
    import lightning

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{_cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    return (
        f"{hardware}; python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}"
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def run_micro(
    quick: bool,
    device: str,
    names: tuple[str, ...] = MICRO_BENCHMARKS,
    benchmarks_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the micro-benchmark scripts ``benchmarks/bench_<name>.py`` in this process.

    Each script is loaded by path and its ``run`` is called with ``quick`` and, when it accepts one, ``device``.
    A missing script, or one that raises, does not stop the others.

    Args:
        quick: passed to every ``run``.
        device: ``"cpu"`` or ``"cuda"``.
        names: which micro-benchmarks.
        benchmarks_dir: where the scripts live (default: the repository's ``benchmarks/``).
        log: progress messages.

    Returns:
        ``{name: result}`` where ``result`` is the dict the script returned plus ``"seconds"``, or
        ``{"skipped": reason}`` / ``{"error": message}``.

    Example::

        micro = run_micro(quick=True, device="cpu", names=("metadata",))
    """
    directory = benchmarks_dir if benchmarks_dir is not None else _REPO_ROOT / "benchmarks"
    out: dict[str, Any] = {}
    for name in names:
        path = directory / f"bench_{name}.py"
        if not path.is_file():
            out[name] = {"skipped": f"{path} not found (benchmarks/ ships with the repository, not the wheel)"}
            log(f"[micro] {name}: skipped ({path} not found)")
            continue
        start = time.perf_counter()
        try:
            spec = importlib.util.spec_from_file_location(f"_llmfast_bench_{name}", path)
            assert spec is not None and spec.loader is not None
            script = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(script)
            kwargs: dict[str, Any] = {"quick": quick}
            if "device" in inspect.signature(script.run).parameters:
                kwargs["device"] = device
            result = dict(script.run(**kwargs))
        except Exception as err:  # a broken micro-benchmark must not lose the end-to-end numbers
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"[micro] {name}: error {type(err).__name__}: {err}")
            continue
        result["seconds"] = round(time.perf_counter() - start, 2)
        out[name] = result
        log(f"[micro] {name}: done in {result['seconds']} s")
    return out


def run_benchmark(
    profile: str | BenchProfile = "quick",
    device: str = "cpu",
    *,
    variants: tuple[str, ...] = VARIANTS,
    micro: tuple[str, ...] = MICRO_BENCHMARKS,
    repeats: int | None = None,
    measured_steps: int | None = None,
    max_seconds: float | None = None,
    benchmarks_dir: Path | None = None,
    log: Callable[[str], None] = print,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the end-to-end variants and the micro-benchmarks of a profile and return the result dictionary.

    Args:
        profile: a name from :data:`PROFILES` or a :class:`BenchProfile`.
        device: ``"cpu"`` or ``"cuda"``.
        variants: end-to-end variants to run (the ``hf`` profile always runs ``bench.hf.HF_VARIANTS``).
        micro: micro-benchmarks to run (empty: none).
        repeats, measured_steps: overrides of the profile's timed repeats and measured steps per segment.
        max_seconds: a soft time budget: timed repeats stop starting after 60% of it, micro-benchmarks after all of
            it (those not started are marked skipped).
        benchmarks_dir: where the micro-benchmark scripts live.
        log: progress messages.
        on_update: called with the result so far after the end-to-end part and after every micro-benchmark.

    Returns:
        The dictionary described in this module's docstring (JSON-serialisable). Example::

        result = run_benchmark("quick", "cpu")
        result["ratios"]["llmfast_vs_before"]
    """
    profile = _profile(profile, device)
    settings = profile.e2e.with_overrides(repeats=repeats, measured_steps=measured_steps)
    start = time.perf_counter()
    budget = math.inf if max_seconds is None else max_seconds
    e2e, notes, ratios, ranges = _end_to_end(profile.name, settings, device, variants, log, start + 0.6 * budget)
    result = _header(profile.name, device) | {"e2e": e2e, "ratios": ratios, "ratio_ranges": ranges}
    result |= {"warnings": spread_warnings(e2e), "micro": {}, "notes": notes}
    result["seconds"] = round(time.perf_counter() - start, 1)
    if on_update is not None:
        on_update(result)
    for name in micro:
        if time.perf_counter() - start > budget:
            result["micro"][name] = {"skipped": f"time budget of {max_seconds} s used up"}
            continue
        result["micro"].update(run_micro(profile.micro_quick, device, (name,), benchmarks_dir, log))
        result["seconds"] = round(time.perf_counter() - start, 1)
        if on_update is not None:
            on_update(result)
    return result


def _header(profile: str, device: str) -> dict[str, Any]:
    """What produced a result: profile, device, commit, machine and date."""
    return {
        "profile": profile,
        "device": device,
        "commit": git_commit(),
        "machine": machine(torch.device(device)),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _profile(profile: str | BenchProfile, device: str) -> BenchProfile:
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ConfigError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
        profile = PROFILES[profile]
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return profile


def _end_to_end(
    profile: str,
    settings: E2ESettings,
    device: str,
    variants: tuple[str, ...],
    log: Callable[[str], None],
    deadline: float,
) -> tuple[dict[str, Any], list[str], dict[str, float | None], dict[str, Any]]:
    """The end-to-end part of a profile: ``(results, notes, ratios, ratio ranges)``."""
    if profile == "hf":
        from lightning_llmfast.bench.hf import HF_VARIANTS, run_hf

        e2e, notes = run_hf(settings, device, HF_VARIANTS, log=log, deadline=deadline)
        # against the fastest transformers setting: the smallest of the ratios
        peers = [_ratio(e2e, "llmfast", v) for v in HF_VARIANTS if v != "llmfast"]
        ranges = {f"llmfast_vs_{v}": ratio_range(e2e, "llmfast", v) for v in HF_VARIANTS if v != "llmfast"}
        ratios = {"llmfast_vs_best_hf": min((r for r in peers if r is not None), default=None)}
        cpu = [e2e[v].get("tokens_per_cpu_sec") for v in HF_VARIANTS]
        if all(cpu):
            ratios["llmfast_vs_best_hf_cpu_time"] = cpu[-1] / max(cpu[:-1])
        return e2e, notes, ratios, ranges
    e2e, notes = run_e2e(settings, device, variants, log=log, deadline=deadline)
    ratios = {name: _ratio(e2e, num, den) for name, (num, den) in RATIOS.items()}
    ranges = {name: ratio_range(e2e, num, den) for name, (num, den) in RATIOS.items()}
    return e2e, notes, ratios, ranges  # type: ignore[return-value]


def _ratio(e2e: dict[str, dict[str, Any]], num: str, den: str) -> float | None:
    a, b = e2e.get(num, {}).get("tokens_per_sec"), e2e.get(den, {}).get("tokens_per_sec")
    return a / b if a is not None and b else None
