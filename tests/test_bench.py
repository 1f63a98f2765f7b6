"""The benchmark harness and its counters: sync detection, the variants' equivalence, the JSON schema, the CLI."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast import ConfigError
from lightning_llmfast.bench import OpCounter, SyncCounter, e2e, steps
from lightning_llmfast.bench.__main__ import main
from lightning_llmfast.bench.e2e import E2ESettings, build_variants, make_batches
from lightning_llmfast.bench.report import markdown_report
from lightning_llmfast.bench.suite import PROFILES, git_commit, run_benchmark, run_micro
from lightning_llmfast.data import VOCAB_SIZE
from lightning_llmfast.offload import ActivationOffloader

TINY = PROFILES["tiny"].e2e


# ------------------------------------------------------------------------------------------------------ counters
def _bool_mask_setitem(x: torch.Tensor) -> None:
    y = x.clone()
    y[x > 0] = torch.zeros_like(x)[: int((x > 0).sum())]


# (name, workload, expected number of syncs): each workload forces exactly that many host syncs on an accelerator.
SYNC_CASES: list[tuple[str, Any, int]] = [
    ("item", lambda x: x.sum().item(), 1),
    ("float()", lambda x: float(x[0]), 1),
    ("python if", lambda x: bool(x.max() > 0), 1),
    ("nonzero", lambda x: torch.nonzero(x > 0), 1),
    ("one-arg where", lambda x: torch.where(x > 0), 1),
    ("bincount", lambda x: torch.bincount((x > 0).long()), 1),
    ("bincount with minlength", lambda x: torch.bincount((x > 0).long(), minlength=4), 1),
    ("boolean-mask getitem", lambda x: x[x > 0], 1),
    ("boolean-mask setitem", _bool_mask_setitem, 2),  # the .sum() read, then the masked write
    ("unique", lambda x: torch.unique((x * 3).long()), 1),
    ("masked_select", lambda x: torch.masked_select(x, x > 0), 1),
    ("repeat_interleave without output_size", lambda x: torch.repeat_interleave((x > 0).long()), 1),
]


@pytest.mark.parametrize(("name", "workload", "expected"), SYNC_CASES, ids=[c[0] for c in SYNC_CASES])
def test_sync_counter_catches_each_sync(name: str, workload: Any, expected: int) -> None:
    x = torch.randn(37)
    with SyncCounter() as sc:
        workload(x)
    assert sc.num_syncs == expected, (name, dict(sc.syncs))


def test_sync_counter_is_zero_on_sync_free_code_and_counts_every_op() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(101, 8, generator=g, requires_grad=True)
    with SyncCounter() as sc:
        # a sync-free router: top-k, counts without bincount, a stable sort, scans, gathers and a backward
        weights, experts = logits.softmax(-1).topk(2, dim=-1)
        counts = torch.zeros(8, dtype=torch.long).scatter_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
        offsets = torch.cumsum(counts, 0)
        order = torch.sort(experts.flatten(), stable=True).indices
        gathered = weights.flatten()[order] * offsets[experts.flatten()[order]].float()
        torch.where(gathered > 0, gathered, 0.0).sum().backward()
    assert sc.num_syncs == 0, dict(sc.syncs)
    assert sc.total > 20 and sc.counts["topk"] == 1 and sc.counts["sort"] == 1

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with OpCounter() as ops:
        torch.mm(a, b).relu()
        a + 1
    assert dict(ops.counts) == {"mm": 1, "relu": 1, "add": 1}
    assert ops.total == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device-to-host copies need a CUDA device")
def test_sync_counter_catches_device_to_host_copies_on_cuda() -> None:
    x = torch.randn(16, device="cuda")
    with SyncCounter(device="cuda") as sc:
        x.cpu()
        y = x * 2  # stays on the device: no sync
        torch.empty(16).copy_(y)
        torch.randn(16).to("cuda", non_blocking=True)  # from pageable memory: staged synchronously
        torch.tensor([1, 2], device="cuda")
    assert dict(sc.syncs) == {"cpu": 1, "device_to_host_copy": 1, "host_to_device_copy": 2}, dict(sc.syncs)
    with SyncCounter(device="cuda") as sc:
        torch.randn(16).pin_memory().to("cuda", non_blocking=True)  # pinned and non_blocking: no sync
        y.to("cpu", non_blocking=True)
    assert sc.num_syncs == 0, dict(sc.syncs)


# -------------------------------------------------------------------------------------------------- the variants
def test_make_batches_are_full_deterministic_and_mixed() -> None:
    batches = make_batches(TINY, 6, vocab_size=VOCAB_SIZE)
    again = make_batches(TINY, 6, vocab_size=VOCAB_SIZE)
    assert len(batches) == 6
    for b, c in zip(batches, again):
        assert b.input_ids.shape == (TINY.batch_size, TINY.seq_len)
        assert torch.equal(b.input_ids, c.input_ids) and torch.equal(b.cu_seqlens, c.cu_seqlens)
        assert int(b.input_ids.max()) < VOCAB_SIZE
    # the shuffle mixes in rows of several short documents, not only whole-row chunks of long ones
    assert max(b.cu_seqlens.numel() - 1 for b in batches) > 2 * TINY.batch_size


def _loss_and_grads(module: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad()
    logits = module(batch)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_variants_start_from_the_same_function() -> None:
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    settings = E2ESettings(
        model={"hidden_size": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 48, "num_experts": 5},
        seq_len=37,
        batch_size=3,
        mean_doc_len=9,
    )
    modules = build_variants(settings)
    batch = make_batches(settings, 1, vocab_size=settings.config("before").vocab_size)[0]
    before, peer, llmfast = (modules[v] for v in ("before", "peer", "llmfast"))
    assert not isinstance(peer, str) and not isinstance(before, str) and not isinstance(llmfast, str)
    for layer in peer.model.layers:  # the peer is transformers' own block, in its grouped_mm mode
        assert isinstance(layer.ffn.moe, MixtralSparseMoeBlock)
        assert layer.ffn.moe.experts.config._experts_implementation == "grouped_mm"

    ref_loss, ref_grads = _loss_and_grads(before, batch)
    for module in (peer, llmfast):
        loss, grads = _loss_and_grads(module, batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        # parameters are renamed in the peer; compare the shared ones (embeddings, attention, norms)
        shared = [n for n in ref_grads if n in grads]
        assert len(shared) >= 1 + 4 * settings.config("before").n_layers
        for name in shared:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for i, layer in enumerate(peer.model.layers):  # the peer's expert gradients are ours, transposed
        mine = ref_grads[f"model.layers.{i}.ffn.experts.gate_up_proj"]
        torch.testing.assert_close(layer.ffn.moe.experts.gate_up_proj.grad, mine.transpose(1, 2), rtol=1e-4, atol=1e-6)


def test_peer_is_skipped_with_the_reason_when_transformers_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ModuleNotFoundError
    modules = build_variants(TINY, ("before", "peer"))
    assert modules["peer"] == "skipped: transformers not installed"
    assert not isinstance(modules["before"], str)


@pytest.mark.parametrize(
    "kwargs",
    [{"measured_steps": 0}, {"repeats": 0}, {"warmup_steps": -1}, {"model": {"attention_metadata": "cached"}}],
)
def test_settings_reject_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        E2ESettings(**kwargs)


def test_unknown_variant_and_profile_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown variants"):
        build_variants(TINY, ("before", "fastest"))
    with pytest.raises(SystemExit):
        main(["--profile", "huge"])


# ------------------------------------------------------------------------------------------------ harness and CLI
E2E_KEYS = {
    "tokens_per_sec",
    "tokens_per_sec_min",
    "tokens_per_sec_max",
    "tokens_per_sec_repeats",
    "host_syncs_per_step",
    "metadata_builds_per_step",
    "aten_ops_per_step",
    "kernels_per_step",
    "kernels_by_op_per_step",
    "peak_mem_bytes",
    "final_loss",
}
# Where the CPU path differs from CUDA's and Triton's interpreter can count the CUDA one (bench/cuda_path.py).
CPU_PATH_KEY = "kernels_per_step_cpu_path"


def test_cli_writes_the_json_schema_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["--profile", "tiny", "--device", "cpu", "--json", str(out), "--plot", str(png), "--micro", ""]) == 0
    result = json.loads(out.read_text())

    assert {"profile", "device", "commit", "e2e", "ratios", "micro"} <= set(result)
    assert result["profile"] == "tiny" and result["device"] == "cpu" and result["micro"] == {}
    assert set(result["e2e"]) == {"before", "peer", "llmfast"}
    for variant, row in result["e2e"].items():
        assert set(row) - {CPU_PATH_KEY} == E2E_KEYS, variant
        assert sum(row["kernels_by_op_per_step"].values()) == pytest.approx(row["kernels_per_step"])
        assert row["tokens_per_sec"] > 0 and row["aten_ops_per_step"] > 0 and row["peak_mem_bytes"] > 0
        assert math.isfinite(row["final_loss"])
        repeats = row["tokens_per_sec_repeats"]
        assert len(repeats) == PROFILES["tiny"].e2e.repeats
        assert (row["tokens_per_sec_min"], row["tokens_per_sec_max"]) == (min(repeats), max(repeats))
        assert row["tokens_per_sec_min"] <= row["tokens_per_sec"] <= row["tokens_per_sec_max"]
    e2e = result["e2e"]
    low, high = result["ratio_ranges"]["llmfast_vs_before"]
    assert low <= result["ratios"]["llmfast_vs_before"] <= high and isinstance(result["warnings"], list)
    ratios = result["ratios"]
    assert set(ratios) == {"llmfast_vs_before", "llmfast_vs_peer"}
    assert ratios["llmfast_vs_before"] == pytest.approx(
        e2e["llmfast"]["tokens_per_sec"] / e2e["before"]["tokens_per_sec"]
    )
    assert ratios["llmfast_vs_peer"] == pytest.approx(e2e["llmfast"]["tokens_per_sec"] / e2e["peer"]["tokens_per_sec"])

    # counters against what each variant does by construction
    n_layers = PROFILES["tiny"].e2e.config("before").n_layers
    assert e2e["before"]["metadata_builds_per_step"] == n_layers  # one dense mask per layer
    assert e2e["before"]["host_syncs_per_step"] >= n_layers  # at least the per-layer boundary read
    assert e2e["peer"]["metadata_builds_per_step"] == 1  # one dense mask per forward
    assert e2e["llmfast"]["metadata_builds_per_step"] == 1
    assert e2e["llmfast"]["host_syncs_per_step"] == 0
    assert e2e["llmfast"]["aten_ops_per_step"] < e2e["before"]["aten_ops_per_step"]
    for row in e2e.values():  # views and allocations are ops but launch no kernel
        assert 0 < row["kernels_per_step"] < row["aten_ops_per_step"]
    # same batches, same initial weights, fp32: the losses after training agree
    losses = [row["final_loss"] for row in e2e.values()]
    assert max(losses) - min(losses) <= 1e-3 * min(losses), losses

    table = capsys.readouterr().out
    assert "| variant |" in table and "| llmfast |" in table and "llmfast_vs_before" in table
    if png.exists():  # matplotlib installed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_micro_loads_scripts_by_path_and_isolates_failures(tmp_path: Path) -> None:
    (tmp_path / "bench_good.py").write_text(
        "def run(quick: bool, device: str = 'cpu') -> dict:\n    return {'quick': quick, 'device': device, 'x': 2.5}\n"
    )
    (tmp_path / "bench_nodevice.py").write_text("def run(quick):\n    return {'quick': quick}\n")
    (tmp_path / "bench_broken.py").write_text("def run(quick):\n    raise RuntimeError('boom')\n")
    micro = run_micro(False, "cpu", ("good", "nodevice", "broken", "absent"), tmp_path, log=lambda _: None)
    assert micro["good"]["quick"] is False and micro["good"]["device"] == "cpu" and micro["good"]["x"] == 2.5
    assert micro["good"]["seconds"] >= 0
    assert micro["nodevice"]["quick"] is False
    assert micro["broken"] == {"error": "RuntimeError: boom"}
    assert "not found" in micro["absent"]["skipped"]


def test_metadata_and_moe_micro_benchmarks_run_on_cpu_without_error() -> None:
    """``run_micro`` reports a failing script instead of raising: here the real scripts must not fail."""
    micro = run_micro(True, "cpu", ("metadata", "moe"), Path(__file__).parents[1] / "benchmarks", log=lambda _: None)
    assert all("error" not in result and "skipped" not in result for result in micro.values()), micro
    assert micro["metadata"]["rows"] and micro["moe"]["results"]
    for result in micro["moe"]["results"]:  # the paired ratios: each round over the same round's limit
        quartiles = result["paired_ratio_quartiles"]
        assert set(quartiles) == set(result["median_ms"])
        assert all(q1 <= q2 <= q3 for q1, q2, q3 in quartiles.values())
        # the limit is the faster of the two in each round: neither is ever below it, and one of them is it
        assert quartiles["expert_only"][0] >= 1.0 and quartiles["expert_loop"][0] >= 1.0
        assert min(quartiles["expert_only"][0], quartiles["expert_loop"][0]) == 1.0


def test_moe_bench_paired_quartiles_pair_rounds_and_take_inclusive_quartiles() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import bench_moe
    finally:
        sys.path.pop(0)
    # round r's time over round r's reference, not medians over medians: 2/1, 6/2, 6/3, 20/4, 10/5
    assert bench_moe._paired_quartiles([2.0, 6.0, 6.0, 20.0, 10.0], [1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 2.0, 3.0]
    assert bench_moe._paired_quartiles([3.0], [2.0]) == [1.5, 1.5, 1.5]


def test_markdown_report_shows_skipped_variants_and_ratios() -> None:
    row = dict.fromkeys(E2E_KEYS - {"tokens_per_sec_repeats", "kernels_by_op_per_step"}, 1.0)
    result = {
        "profile": "quick",
        "device": "cpu",
        "commit": "abc",
        "e2e": {
            "before": dict(row, tokens_per_sec=100.0, tokens_per_sec_min=100.0, tokens_per_sec_max=100.0),
            "peer": {"skipped": "transformers not installed"},
            "llmfast": dict(row, tokens_per_sec=150.0, tokens_per_sec_min=150.0, tokens_per_sec_max=150.0),
        },
        "ratios": {"llmfast_vs_before": 1.5, "llmfast_vs_peer": None},
        "micro": {"moe": {"skipped": "absent"}},
    }
    text = markdown_report(result)
    assert "| peer | transformers not installed |" in text
    assert "| llmfast | 150 | 150 - 150 | 1.50x |" in text
    assert "llmfast_vs_before = 1.50x" in text and "llmfast_vs_peer = n/a" in text
    assert "Micro-benchmark **moe**: absent" in text


def test_a_failing_variant_is_reported_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    fit = steps.fit_segment

    def fit_or_fail(variant: str, *args: Any) -> None:
        if variant == "before":
            raise RuntimeError("CUDA out of memory\nTried to allocate ...")
        fit(variant, *args)

    monkeypatch.setattr(steps, "fit_segment", fit_or_fail)
    settings = TINY.with_overrides(repeats=1, measured_steps=1)
    results, notes = e2e.run_e2e(settings, "cpu", ("before", "llmfast"), log=lambda _: None)
    assert results["before"] == {"error": "RuntimeError: CUDA out of memory"}
    assert set(results["llmfast"]) - {CPU_PATH_KEY} == E2E_KEYS
    assert any(note.startswith("before: failed") for note in notes)


def test_time_budget_cuts_repeats_and_skips_micro_benchmarks(tmp_path: Path) -> None:
    (tmp_path / "bench_never.py").write_text("raise AssertionError('must not be loaded')\n")
    result = run_benchmark(
        "tiny", "cpu", variants=("before",), micro=("never",), max_seconds=1e-6, benchmarks_dir=tmp_path, log=print
    )
    assert f"time budget reached: 1 of {TINY.repeats} timed repeats ran" in result["notes"]
    assert result["micro"] == {"never": {"skipped": "time budget of 1e-06 s used up"}}
    assert set(result["e2e"]["before"]) == E2E_KEYS and result["ratios"]["llmfast_vs_before"] is None


def test_peak_memory_on_cpu_counts_live_tensor_bytes_once() -> None:
    kept = torch.zeros(4)  # exists before the block: not counted
    with steps.PeakMemory(torch.device("cpu")) as mem:
        a = torch.empty(1 << 18)  # 1 MiB of float32
        a.view(-1, 2).add_(1)  # a view and an in-place op: the same storage
        b = torch.empty(1 << 19)  # 2 MiB
        del b
        c = torch.empty(1 << 17)  # 0.5 MiB, allocated after b was freed
    assert mem.peak_bytes == (1 << 20) + (2 << 20), mem.peak_bytes
    assert a.numel() + c.numel() + kept.numel() > 0


def test_offload_micro_benchmark_on_cpu_runs_every_mode_bit_identical() -> None:
    """The offload script's CPU path: every mode's forced offload/recompute keeps the reference parameters."""
    out = run_micro(True, "cpu", ("offload",), Path(__file__).parents[1] / "benchmarks", log=lambda _: None)
    modes = out["offload"]["modes"]
    assert set(modes) == {
        "rebuild",
        "rebuild_gemms",
        "rebuild_gemms_6",
        "all",
        "auto",
        "auto_gemms",
        "recompute",
        "auto_recompute",
    }
    assert all(m["bit_identical_params"] for m in modes.values())
    # bf16 autocast without its cache, as Lightning runs it: four layers' five weight copies are rebuilt, not copied
    assert modes["rebuild"]["stats"]["recast_casts"] == 20 and modes["rebuild"]["stats"]["offloaded_bytes"] == 0
    # and the norms' bf16 outputs (attention input; MoE input shared by router and experts): 3 per layer, 2 storages
    assert modes["rebuild"]["stats"]["rebuilt_tensors"] == 12
    # measured on CPU: rebuilding lowers the peak of live tensor bytes, by at most what it did not keep
    peaks = out["offload"]["peak_live_bytes"]
    stats = modes["rebuild"]["stats"]
    assert 0 < peaks["off"] - peaks["rebuild"] <= stats["recast_bytes"] + stats["rebuilt_bytes"]
    # rebuilding the experts' gate/up outputs too (one per layer) lowers it further, by at most those bytes
    gemms = modes["rebuild_gemms"]["stats"]
    assert gemms["rebuilt_tensors"] == stats["rebuilt_tensors"] + 4
    assert 0 < peaks["rebuild"] - peaks["rebuild_gemms"] <= gemms["rebuilt_bytes"] - stats["rebuilt_bytes"]
    assert modes["all"]["stats"]["offloaded_bytes"] > 0 and modes["recompute"]["stats"]["offloaded_bytes"] == 0
    assert modes["recompute"]["stats"]["recompute_layers"] == 4
    # host time of the modes that copy nothing, on a model whose step is host time (reported, not asserted on)
    host = out["offload"]["host_ms"]
    assert host["shape"]["model"]["n_layers"] == 12
    for kind in ("forward", "backward"):
        assert set(host[f"{kind}_ms"]) == {"off", "rebuild", "rebuild_gemms"}
        assert all(ms > 0 for ms in host[f"{kind}_ms"].values()) and host[f"{kind}_ratio"]["off"] == 1.0
    # rebuilding dispatches more per step (casts, norms), and rebuilding GEMMs more again (the grouped GEMMs)
    assert host["step_ops"]["off"] < host["step_ops"]["rebuild"] < host["step_ops"]["rebuild_gemms"]
    # the saved-tensor inventory of layer 0: largest first, weight casts among them, every storage counted once
    inv = out["offload"]["layer0_saved"]
    sizes = [e["bytes"] for e in inv["top"]]
    assert sizes == sorted(sizes, reverse=True) and 0 < sum(sizes) <= inv["total_bytes"]
    assert any(e["op"] == "ToCopyBackward0" and e["dtype"] == "torch.bfloat16" for e in inv["top"])


class _FakeEvent:
    """A CUDA timing event that reads the host clock (the CUDA measurement loop, run on CPU)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1e3


def test_offload_cuda_measurement_loop_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU-only path of bench_offload.py (the loop, both peak kinds, the report and its summary) with CUDA's
    events and memory counters faked on CPU, so that a GPU session never loses its run to a bug in the script."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import bench_offload
    finally:
        sys.path.pop(0)
    allocated = iter(range(1 << 20, 1 << 30, 1 << 10))  # growing: every step "adds" memory above its base
    setup = bench_offload._setup
    monkeypatch.setattr(bench_offload, "_setup", lambda shape, device: setup(bench_offload.SHAPES["cpu"], "cpu"))
    monkeypatch.setattr(bench_offload, "_copy_ms", lambda nbytes, device: 1.0)
    monkeypatch.setattr(
        bench_offload,
        "ActivationOffloader",
        lambda layers, config: ActivationOffloader(layers, replace(config, force=True)),
    )
    for name, fake in {
        "Event": _FakeEvent,
        "synchronize": lambda: None,
        "memory_allocated": lambda: next(allocated),
        "reset_peak_memory_stats": lambda: None,
        "max_memory_allocated": lambda: next(allocated),
        "get_device_name": lambda index=0: "fake",
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    report = bench_offload._cuda("full", repeats=2)
    assert set(report["modes"]) == set(bench_offload.MODES)
    for row in report["modes"].values():
        assert row["peak_act_bytes"] > 0 and row["peak_step_bytes"] > 0 and row["forward_ms"] > 0
        assert row["held_after_forward_bytes"] > 0  # read between `base` and backward
        assert row["meets_target"] == (row["mem_reduction"] >= 0.4 and row["tps_ratio"] >= 0.95)
    assert report["modes"]["all"]["offload_layers"] == 3  # every layer but the last (its tensors are under 1 MiB)
    text = bench_offload.summary(report)
    assert text.count("\n| ") == 1 + len(report["modes"])  # the separator and one row per mode
    assert "auto plan:" in text and "layer 0 saves" in text and "(rebuild_gemms mode)" in text
    # every layer of the 4 counted, each saving about what layer 0 does
    assert 3.5 < report["layers_saved_bytes"] / report["layer0_saved"]["total_bytes"] < 4.5
    # --modes: a subset, with the baseline; an unknown name fails before any model is built
    assert list(bench_offload._cuda("full", repeats=2, names=["rebuild_gemms"])["modes"]) == ["off", "rebuild_gemms"]
    with pytest.raises(ConfigError, match="unknown"):
        bench_offload.run(device="cuda", modes=["rebuild", "gemms"])


def test_git_commit_prefers_the_named_commit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LLMFAST_COMMIT", raising=False)
    assert git_commit(tmp_path) == "unknown"  # not a repository
    monkeypatch.setenv("LLMFAST_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"
    assert git_commit() == "abc1234"  # also over this repository's own .git
