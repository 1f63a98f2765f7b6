"""A memory plan's prediction against its steps in the loggers (``offload/predicted_peak`` and friends, with a warning
when they part by more than 15%), and the copier's copy timings behind ``offload/overlap``."""

from __future__ import annotations

import csv
import dataclasses
import random
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule, PackedDataModule, SystemMetricsMonitor
from lightning_llmfast.callbacks import ActivationOffload
from lightning_llmfast.callbacks.offload import PLAN_METRICS
from lightning_llmfast.callbacks.system import _offload_overlap
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload import (
    ActivationOffloader,
    CpuCopier,
    LayerProfile,
    MemoryProfile,
    OffloadConfig,
    measure,
)
from lightning_llmfast.offload.copier import Copier

README = (Path(__file__).parents[1] / "README.md").read_text()


def _fit(tmp_path: Path, steps: int = 5) -> tuple[dict[str, list[float]], list[str], ActivationOffload]:
    """A small fit under a memory plan (offload forced on CPU); the CSV file's columns and the warnings raised."""
    config = MoEGPTConfig(vocab_size=258, hidden_size=16, n_layers=6, n_heads=2, n_kv_heads=1, ffn_size=32,
                          num_experts=4, top_k=2)  # fmt: skip
    data = PackedDataModule(corpus="synthetic", synthetic_num_docs=60, synthetic_mean_len=12, seq_len=16,
                            batch_size=2, num_workers=0, pin_memory=False)  # fmt: skip
    # The layers save 6 x 34.6 kB here: 150 kB makes the plan offload some of them (asserted through the stats).
    offload = ActivationOffload(
        OffloadConfig(force=True, min_offload_bytes=0, plan="auto", budget=150_000, profile_steps=1)
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="llmfast", max_steps=steps, log_every_n_steps=1,
                        callbacks=[offload, SystemMetricsMonitor(log_every_n_steps=1)], limit_val_batches=0,
                        logger=CSVLogger(tmp_path, name="", version=""), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(MoEGPTLightningModule(config), datamodule=data)
    columns: dict[str, list[float]] = {}
    with open(tmp_path / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None):
                    columns.setdefault(name, []).append(float(value))
    return columns, [str(w.message) for w in caught], offload


def _plan_warnings(messages: list[str], unit: str) -> list[str]:
    return [m for m in messages if "memory plan predicted" in m and unit in m]


def test_plan_metrics_reach_the_csv_file_and_a_right_plan_does_not_warn(tmp_path: Path) -> None:
    columns, messages, offload = _fit(tmp_path)
    # step 0 warms up, step 1 is profiled (no probe steps with one profiled step): steps 2, 3 and 4 run the plan
    for name in PLAN_METRICS:
        assert len(columns.get(name, [])) == 3, (name, sorted(columns))
        assert f"`{name}`" in README
    predicted, measured = columns["offload/predicted_peak"], columns["offload/measured_peak"]
    assert all(0 < m <= 1.1 * p and m >= 0.9 * p for p, m in zip(predicted, measured))
    assert offload.last_metrics["offload/measured_peak"] == measured[-1] and offload.stats["offloaded_bytes"] > 0
    assert _plan_warnings(messages, "bytes") == []
    # on CPU the host that computes runs every copy: nothing overlaps
    assert columns["offload/overlap"] and set(columns["offload/overlap"]) == {0.0}


def test_a_wrong_plan_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = measure.measure_profile

    def inflated(*args: Any, **kwargs: Any) -> MemoryProfile:  # a profile that claims 1.5x the bytes
        profile = real(*args, **kwargs)
        sizes = [tuple(b * 3 // 2 for b in layer.tensor_bytes) for layer in profile.layers]
        layers = tuple(
            dataclasses.replace(layer, saved_bytes=sum(t), tensor_bytes=t) for layer, t in zip(profile.layers, sizes)
        )
        return dataclasses.replace(profile, layers=layers)

    monkeypatch.setattr(measure, "measure_profile", inflated)
    columns, messages, _ = _fit(tmp_path)
    assert all(m < 0.85 * p for p, m in zip(columns["offload/predicted_peak"], columns["offload/measured_peak"]))
    assert len(_plan_warnings(messages, "bytes")) == 1  # three logged steps, one warning


# ------------------------------------------------------------------------------------------------- copy timings
class _Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_cpu_copier_times_each_copy_as_run_and_as_exposed() -> None:
    copier = CpuCopier(torch.device("cpu"))
    copier.timed = True
    copier.timestamp = _Clock(1.000, 1.003, 2.000, 2.0005)  # type: ignore[method-assign]
    src, dst = torch.arange(10, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8)
    copier.copy([(dst, src)], to_host=True)
    copier.copy([(src, dst)], to_host=False)
    assert copier.copy_times() is None  # the step has not ended
    copier.end_step()
    copy_ms, exposed_ms = copier.copy_times()  # type: ignore[misc]
    assert copy_ms == pytest.approx(3.5) and exposed_ms == pytest.approx(3.5) and torch.equal(dst, src)
    copier.end_step()
    assert copier.copy_times() is None  # a step without copies has no overlap to report


class _CountingCopier(CpuCopier):
    """Synchronous copies that count their batches of copies and their timestamps (a CPU copier's timing events)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.copies = self.stamps = 0

    def copy(self, pairs: Any, to_host: bool, after: Any = ()) -> Any:
        self.copies += 1
        return super().copy(pairs, to_host, after)

    def timestamp(self) -> float:
        self.stamps += 1
        return super().timestamp()


@pytest.mark.parametrize("timed", [False, True], ids=["nothing-logs", "overlap-logged"])
def test_the_offloader_times_its_copies_only_when_asked(timed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.GELU()) for _ in range(3))
    offloader = ActivationOffloader(layers, OffloadConfig(force=True, min_offload_bytes=0))
    copiers: list[_CountingCopier] = []
    make = lambda device: copiers.append(_CountingCopier(device)) or copiers[-1]  # noqa: E731
    monkeypatch.setattr(offloader, "_make_copier", make)
    offloader.time_copies = timed
    x = torch.randn(5, 7, requires_grad=True)
    for _ in range(2):
        with offloader:
            h = x
            for layer in layers:
                h = layer(h)
            h.square().sum().backward()
    (copier,) = copiers
    stats = offloader.stats
    assert stats["offloaded_bytes"] > 0 and copier.copies >= 4  # two steps, two offloading layers, out and back
    if timed:
        assert copier.stamps == 2 * copier.copies and stats["copy_ms"] >= 0 and stats["exposed_copy_ms"] >= 0
    else:
        assert copier.stamps == 0 and "copy_ms" not in stats
    offloader.close()


class _Event:
    def __init__(self, time: float | None = None) -> None:
        self.time = time


class _StreamCopier(Copier):
    """Copies on a fake stream: the test completes events (sets their device time) when it likes."""

    def mark_compute(self) -> None:
        return None

    def copy(self, pairs: Any, to_host: bool, after: Any = ()) -> _Event:
        start, end = _Event(), _Event()
        self._span("copy", start, end)
        return end

    def compute_waits(self, event: Any) -> None:
        self._span("wait", _Event(), _Event())

    def done(self, event: Any) -> bool:
        return event.time is not None

    def wait_host(self, event: Any) -> None:
        raise AssertionError("reading copy timings must never block")

    def timestamp(self) -> _Event:
        return _Event()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        assert start.time is not None and end.time is not None, "read before completion: would block"
        return end.time - start.time

    def allocated(self) -> None:
        return None


def test_copy_times_wait_for_every_span_and_sum_copies_and_waits_apart() -> None:
    copier = _StreamCopier(torch.device("cpu"))
    copier.timed = True
    copier.copy([], to_host=True)
    copier.copy([], to_host=False)
    copier.compute_waits(None)
    copier.end_step()
    (_, c1s, c1e), (_, c2s, c2e), (_, ws, we) = copier._ended
    c1s.time, c1e.time, c2s.time, c2e.time = 0.0, 10.0, 20.0, 26.0
    assert copier.copy_times() is None  # the wait has not completed: read at a later log point
    ws.time, we.time = 24.0, 25.5
    assert copier.copy_times() == pytest.approx((16.0, 1.5))


class _Strategy:
    def __init__(self, stats: dict[str, float] | None) -> None:
        self.offload_stats = stats


class _Trainer:
    def __init__(self, stats: dict[str, float] | None) -> None:
        self.strategy = _Strategy(stats)
        self.callbacks: list[Any] = []


@pytest.mark.parametrize(
    ("stats", "expected"),
    [
        ({"copy_ms": 16.0, "exposed_copy_ms": 1.5}, 1 - 1.5 / 16.0),
        ({"copy_ms": 4.0, "exposed_copy_ms": 4.0}, 0.0),
        ({"copy_ms": 0.0, "exposed_copy_ms": 0.0}, None),
        ({"offloaded_bytes": 5}, None),
        (None, None),
    ],
)
def test_system_monitor_overlap_is_one_minus_exposed_over_copy(stats: Any, expected: float | None) -> None:
    got = _offload_overlap(_Trainer(stats))  # type: ignore[arg-type]
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_layer_profiles_of_a_cpu_copier_cost_their_whole_copy() -> None:
    from lightning_llmfast.offload.memory_plan import mechanism_cost

    layer = LayerProfile(1000, 0, 50.0, 50.0, 1.0)
    overlapping = MemoryProfile((layer, layer), bandwidth_bytes_per_ms=100.0)
    serial = dataclasses.replace(overlapping, copies_overlap=False)
    assert mechanism_cost(overlapping, 0, "offload", margin=0.0) == (1000, 0.0)  # 10 ms hides behind 50 ms
    assert mechanism_cost(serial, 0, "offload", margin=0.0) == (1000, 20.0)  # one copy each way, both exposed


def test_median_profile_is_the_per_layer_median_of_times_and_the_largest_bytes() -> None:
    rng = random.Random(5)
    steps = []
    for _ in range(5):
        layers = []
        for _ in range(7):
            saved = rng.randrange(1, 1000)
            layers.append(LayerProfile(saved, rng.randrange(saved + 1), *(rng.uniform(0, 9) for _ in range(3))))
        steps.append(MemoryProfile(tuple(layers), bandwidth_bytes_per_ms=rng.uniform(1, 9)))
    got = measure.median_profile(steps)
    for i, layer in enumerate(got.layers):
        for name in ("forward_ms", "backward_ms", "recompute_ms"):
            values = sorted(getattr(s.layers[i], name) for s in steps)
            assert getattr(layer, name) == values[2]  # five steps: the third smallest
        assert layer.saved_bytes == max(s.layers[i].saved_bytes for s in steps)
    assert got.bandwidth_bytes_per_ms == sorted(s.bandwidth_bytes_per_ms for s in steps)[2]
    with pytest.raises(OffloadError, match="no profiled steps"):
        measure.median_profile([])


def test_the_memory_plan_alternates_profiled_and_probe_steps_and_plans_from_their_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profiled: list[tuple[bool, MemoryProfile]] = []
    real = measure.measure_profile

    def counted(*args: Any, **kwargs: Any) -> MemoryProfile:
        profiled.append((off.calls.probing, real(*args, **kwargs)))
        return profiled[-1][1]

    monkeypatch.setattr(measure, "measure_profile", counted)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)))
    config = OffloadConfig(force=True, min_offload_bytes=0, plan="auto", budget=1 << 40, profile_steps=3)
    off = ActivationOffloader(list(layers), config)
    offloaded = []
    for step in range(8):
        with off:
            layers(torch.randn(4, 8, requires_grad=True)).sum().backward()
        offloaded.append(off.stats["offloaded_bytes"])
        # step 0 warms up, steps 1-6 alternate keeping and probing (every eligible layer offloads), then the plan
        assert len(profiled) == min(step, 6) and (off.memory_plan is not None) == (step >= 6)
    assert [probe for probe, _ in profiled] == [False, True] * 3
    assert offloaded[1::2][:3] == [0, 0, 0] and all(b > 0 for b in offloaded[2:7:2])
    assert offloaded[7] == 0  # the budget fits everything: the plan keeps all
    kept = [p for probe, p in profiled if not probe]
    plan = off.memory_plan
    assert plan is not None and plan.profile.layers == measure.median_profile(kept).layers
    # the host time per offloaded storage, from the formula: (median over neighbouring pairs of the probe's time less
    # the kept step's before it, less the copies) / storages
    layers_kept = plan.profile.layers[: off.calls.eligible]
    copies = sum(2 * layer.saved_bytes for layer in layers_kept) / plan.profile.bandwidth_bytes_per_ms
    times = [sum(x.forward_ms + x.backward_ms for x in p.layers) for _, p in profiled]
    added = sorted(probe - keep for keep, probe in zip(times[0::2], times[1::2]))[1]
    storages = sum(len(layer.tensor_bytes) for layer in layers_kept)
    expected = max(0.0, (added - copies) / storages)
    assert plan.profile.storage_ms == pytest.approx(expected)
    off.close()
