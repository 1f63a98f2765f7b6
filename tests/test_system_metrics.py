"""System metrics without host syncs: busy fraction and sync spans from fake events, and the README's metric table."""

from __future__ import annotations

import csv
import re
import threading
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_llmfast import (
    ConfigError,
    ExpertLoadMonitor,
    MoEGPTConfig,
    MoEGPTLightningModule,
    PackedDataModule,
    SequenceMetadataCallback,
    SystemMetricsMonitor,
    TokenThroughputMonitor,
)
from lightning_llmfast.callbacks.system import METRICS, host_peak_rss_bytes
from lightning_llmfast.comm import BusyTimer, HostClock, SpanTimer

README = (Path(__file__).parents[1] / "README.md").read_text()


class _Event:
    """A fake CUDA event: a device time set when the fake device reaches it; ``ready`` once it has."""

    def __init__(self) -> None:
        self.time: float | None = None


class _FakeDevice:
    """Hands out events; the test decides when (in device milliseconds) each one completes."""

    def __init__(self) -> None:
        self.events: list[_Event] = []

    def stamp(self) -> _Event:
        self.events.append(_Event())
        return self.events[-1]

    def ready(self, stamp: _Event) -> bool:
        return stamp.time is not None

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        assert start.time is not None and end.time is not None, "read before both completed: would block"
        return end.time - start.time

    def run(self, *times: float) -> None:
        """Complete the oldest pending events at these device times."""
        pending = [e for e in self.events if e.time is None]
        for event, t in zip(pending, times, strict=False):
            event.time = t


def test_device_busy_is_step_time_over_wall_time_from_completed_events_only() -> None:
    device = _FakeDevice()
    timer = BusyTimer(device)
    # step 0: 0..8 then idle until 10; step 1: 10..13, idle until 20; step 2 started (its events pending)
    timer.step_start(), timer.step_end(), timer.step_start(), timer.step_end(), timer.step_start()
    device.run(0.0, 8.0, 10.0, 13.0)  # step 2's start has not been reached: step 1's wall time is unknown
    assert timer.read() == pytest.approx(8.0 / 10.0)  # step 0 only; step 1 waits without blocking
    device.run(20.0)
    assert timer.read() == pytest.approx(3.0 / 10.0)  # step 0 was forgotten
    assert timer.read() is None  # nothing new complete
    timer.step_end(), timer.step_start()
    device.run(21.0, 21.0)  # back-to-back steps: no gap at all
    assert timer.read() == pytest.approx(1.0)


def test_device_busy_time_weights_steps_of_different_length() -> None:
    device = _FakeDevice()
    timer = BusyTimer(device)
    for _ in range(3):
        timer.step_start(), timer.step_end()
    timer.step_start()
    device.run(0.0, 1.0, 2.0, 30.0, 32.0, 33.0, 40.0)  # busy 1, 28, 1 of wall 2, 30, 8
    assert timer.read() == pytest.approx((1 + 28 + 1) / (2 + 30 + 8))


def test_sync_span_runs_from_first_launch_to_last_completion_in_any_order() -> None:
    device = _FakeDevice()
    timer = SpanTimer(device)
    first, second = timer.begin(), timer.begin()
    last = timer.begin(last=True)
    device.run(0.0)  # the step's start stamp
    for span, t in ((last, 5.0), (first, 7.0), (second, 6.0)):  # the last bucket does not finish last
        timer.end(span)
        device.run(t)
    assert first is second is last  # one step
    assert timer.read_ms() == pytest.approx(7.0)
    assert timer.read_ms() is None


def test_sync_span_waits_for_pending_events_and_buckets_without_blocking() -> None:
    device = _FakeDevice()
    timer = SpanTimer(device)
    a, b = timer.begin(), timer.begin(last=True)
    timer.end(b)
    device.run(0.0, 4.0)
    assert timer.read_ms() is None  # bucket a has not completed: the step is open
    timer.end(a)
    assert timer.read_ms() is None  # its end event is not reached yet
    device.run(9.0)
    c = timer.begin(last=True)  # the next step
    timer.end(c)
    device.run(20.0, 22.0)
    assert timer.read_ms() == pytest.approx((9.0 + 2.0) / 2)


def test_sync_span_closed_by_the_caller_waits_for_the_buckets_it_launched() -> None:
    """FSDP2's reduce-scatters cannot tell their last one: the strategy closes the step after backward."""
    device = _FakeDevice()
    timer = SpanTimer(device)
    timer.close()  # nothing launched: no step
    a, b = timer.begin(), timer.begin()
    timer.end(a)
    timer.close()
    device.run(1.0, 4.0)
    assert timer.read_ms() is None  # b has not completed
    c = timer.begin()  # the next step opens its own span
    assert c is not a
    timer.end(b)
    device.run(10.0, 12.0)  # c's start, b's end
    assert timer.read_ms() == pytest.approx(11.0)  # launch of a to completion of b
    timer.end(c)
    timer.close()  # closing after every bucket ended closes at once
    device.run(25.0)
    assert timer.read_ms() == pytest.approx(15.0)


def test_sync_span_is_thread_safe_with_host_stamps() -> None:
    timer = SpanTimer(HostClock())
    for _ in range(20):
        spans = [timer.begin(last=i == 7) for i in range(8)]
        threads = [threading.Thread(target=timer.end, args=(s,)) for s in spans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert timer.read_ms() >= 0.0
    assert timer.read_ms() is None


def test_host_peak_rss_grows_with_memory_the_process_touches() -> None:
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * 4096
    before = host_peak_rss_bytes()
    assert before > 0
    block = torch.ones(max(before - current, 0) + (64 << 20), dtype=torch.uint8)  # touched: resident
    assert host_peak_rss_bytes() >= before + (32 << 20)
    del block


def test_bad_log_interval_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="log_every_n_steps"):
        SystemMetricsMonitor(log_every_n_steps=0)


def _readme_metric_names() -> set[str]:
    section = README.split("## Logged metrics", 1)[1].split("\n## ", 1)[0]
    rows = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


# Logged only on a GPU (device events and memory), with the offloader's copy timings or memory plan
# (tests/test_offload_plan_metrics.py reads them from a fit's CSV file), or with several processes
# (gradient sync: tests/test_grad_compression.py reads it from a 2-process fit's CSV file).
_NOT_IN_ONE_CPU_PROCESS = {
    "train/device_busy",
    "train/peak_memory",
    "train/memory_fraction",
    "offload/overlap",
    "train/grad_sync_ms",
    "offload/predicted_peak",
    "offload/measured_peak",
    "offload/predicted_ms",
    "offload/measured_ms",
}


def test_the_readme_metric_table_is_every_name_the_callbacks_and_modules_log(tmp_path: Path) -> None:
    config = MoEGPTConfig(vocab_size=258, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_size=16,
                          num_experts=4, top_k=2)  # fmt: skip
    data = PackedDataModule(corpus="synthetic", synthetic_num_docs=40, synthetic_mean_len=12, seq_len=16,
                            batch_size=2, num_workers=0, pin_memory=False, val_fraction=0.1, test_fraction=0.1,
                            limit_val_batches=1, limit_test_batches=1)  # fmt: skip
    callbacks = [SequenceMetadataCallback(), TokenThroughputMonitor(log_every_n_steps=1, peak_flops=1e12),
                 ExpertLoadMonitor(), SystemMetricsMonitor(log_every_n_steps=1)]  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="llmfast", max_steps=2, callbacks=callbacks,
                        logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    module = MoEGPTLightningModule(config)
    trainer.fit(module, datamodule=data)
    tester = L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path / "test", name="", version=""),
                       enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    tester.validate(module, datamodule=data, verbose=False)
    tester.test(module, datamodule=data, verbose=False)
    logged: set[str] = set()
    for path in (tmp_path / "metrics.csv", tmp_path / "test" / "metrics.csv"):
        with open(path) as f:
            logged |= {name for name in next(csv.reader(f)) if name not in ("step", "epoch")}
    listed = _readme_metric_names()
    assert logged - listed == set(), f"logged but not in the README's metric table: {sorted(logged - listed)}"
    assert listed - logged == _NOT_IN_ONE_CPU_PROCESS, f"in the README but not logged on CPU: {sorted(listed - logged)}"
    assert set(METRICS) <= listed
