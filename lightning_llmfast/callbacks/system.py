"""The tutorial's system metrics: device busy fraction, peak memory, gradient-sync time and offload overlap.

Nothing here synchronises the step: timings are CUDA events (or host stamps on CPU) read at a log point, and only
the ones that have completed by then (the rest count at the next log point); memory peaks are the allocator's host
counters. At a log point every rank reduces its numbers with one all-reduce (the maximum over ranks).

Example::

    trainer = L.Trainer(strategy="llmfast", callbacks=[SystemMetricsMonitor()], devices=8)
"""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_llmfast._checks import check_int
from lightning_llmfast.comm import BusyTimer, EventClock, GradReduction, SpanTimer, clock_for

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["METRICS", "SystemMetricsMonitor", "host_peak_rss_bytes"]

METRICS: tuple[str, ...] = (
    "train/device_busy",
    "train/peak_memory",
    "train/memory_fraction",
    "train/host_peak_rss",
    "train/grad_sync_ms",
    "offload/overlap",
)
"""Every name :class:`SystemMetricsMonitor` can log, in the order of its reduced vector."""

_GIB = float(1 << 30)
_MISSING = -1.0  # a value this rank has not got (every real one is >= 0): the maximum over ranks keeps the others


def host_peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class SystemMetricsMonitor(Callback):
    """Logs device busy fraction, peak memory, gradient-sync time and offload overlap during training.

    Logged every ``log_every_n_steps`` optimizer steps (the maximum over ranks):

    - ``train/device_busy`` (CUDA): the fraction of wall time the device spent inside training steps, from CUDA
      events at each step's start and end (:class:`~lightning_llmfast.comm.BusyTimer`); not logged on CPU, where the
      host itself computes.
    - ``train/peak_memory`` (CUDA, GiB): the allocator's peak allocated bytes since the fit started;
      ``train/memory_fraction``: its peak *reserved* bytes over the device's capacity (what the device sees used).
      Not logged on CPU, which has no device memory; there ``train/host_peak_rss`` is the counterpart.
    - ``train/host_peak_rss`` (GiB): the process's peak resident set size (host memory, pinned buffers included).
    - ``train/grad_sync_ms``: per step, from the launch of the first gradient bucket to the completion of the last,
      under :class:`~lightning_llmfast.LLMFastStrategy` on several processes (CUDA events on GPUs, host time on CPU):
      with DDP its communication hook's buckets (see ``grad_reduce_dtype``), with ``sharding="fsdp"``/``"hsdp"``
      FSDP2's reduce-scatters (through ``FSDPModule.set_custom_reduce_scatter``; HSDP's cross-node all-reduce is not
      included). Not logged with one process (nothing is reduced) or with a user ``ddp_comm_hook``.
    - ``offload/overlap``: the share of the offload copies' time hidden behind compute, when the activation
      offloader reports ``copy_ms`` and ``exposed_copy_ms`` in its stats (this callback turns on its copy timing:
      without it the offloader takes no timestamps for its copies).

    Args:
        log_every_n_steps: optimizer steps between log points; defaults to the trainer's ``log_every_n_steps``.

    Raises:
        ConfigError: ``log_every_n_steps`` is not an int >= 1.

    Example::

        monitor = SystemMetricsMonitor()
        trainer = L.Trainer(strategy=LLMFastStrategy(grad_reduce_dtype="bf16"), callbacks=[monitor], devices=8)
        trainer.fit(module, datamodule=dm)
        print(monitor.last_metrics["train/grad_sync_ms"])
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, low=1)
        self.log_every_n_steps = log_every_n_steps
        self.last_metrics: dict[str, float] = {}
        """What the last log point logged."""
        self._busy: BusyTimer | None = None
        self._sync: SpanTimer | None = None
        self._device = torch.device("cpu")
        self._last_logged_step = -1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Before the strategy's own setup: a DDP hook can only be registered once, when the model is wrapped.
        self._device = trainer.strategy.root_device
        self._busy = BusyTimer(EventClock()) if self._device.type == "cuda" else None
        reduction = getattr(trainer.strategy, "grad_reduction", None)
        self._sync = reduction.time_with(clock_for(self._device)) if isinstance(reduction, GradReduction) else None
        self._last_logged_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)  # the fit's peak, not the process's
        for offloader in _offloaders(trainer):  # made at fit start; copies are timed only when this logs them
            offloader.time_copies = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._busy is not None:
            self._busy.step_start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._busy is not None:
            self._busy.step_end()
        step = trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if step % every == 0 and step != self._last_logged_step:  # once per optimizer step under accumulation
            self._last_logged_step = step
            self._log(trainer, step)

    def _local_values(self, trainer: pl.Trainer) -> dict[str, float | None]:
        """This rank's numbers (``None`` where it has none), read without waiting for the device."""
        cuda = self._device.type == "cuda"
        values: dict[str, float | None] = dict.fromkeys(METRICS)
        if cuda:
            capacity = torch.cuda.get_device_properties(self._device).total_memory
            values["train/peak_memory"] = torch.cuda.max_memory_allocated(self._device) / _GIB
            values["train/memory_fraction"] = torch.cuda.max_memory_reserved(self._device) / capacity
        values["train/host_peak_rss"] = host_peak_rss_bytes() / _GIB
        values["train/device_busy"] = self._busy.read() if self._busy is not None else None
        values["train/grad_sync_ms"] = self._sync.read_ms() if self._sync is not None else None
        values["offload/overlap"] = _offload_overlap(trainer)
        return values

    def _log(self, trainer: pl.Trainer, step: int) -> None:
        local = self._local_values(trainer)
        vector = torch.tensor([_MISSING if local[k] is None else local[k] for k in METRICS], dtype=torch.float64)
        if trainer.world_size > 1:  # one collective at a log point, on every rank alike
            vector = trainer.strategy.reduce(vector.to(self._device), reduce_op="max").cpu()
        metrics = {name: float(v) for name, v in zip(METRICS, vector.tolist()) if v != _MISSING}
        if trainer.is_global_zero and metrics:
            # Lightning's own rows for this optimizer step carry the index step - 1: share them.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step - 1)
        self.last_metrics = metrics


def _offloaders(trainer: pl.Trainer) -> list[Any]:
    """The activation offloaders of the fit: the strategy's and the ``ActivationOffload`` callbacks'."""
    owners = [trainer.strategy, *(cb for cb in trainer.callbacks if hasattr(cb, "offloader"))]
    return [o for o in (getattr(owner, "offloader", None) for owner in owners) if o is not None]


def _offload_overlap(trainer: pl.Trainer) -> float | None:
    """``1 - exposed / copy time`` of the offloader's last step, when its stats carry both (else ``None``)."""
    stats = getattr(trainer.strategy, "offload_stats", None)
    if stats is None:
        stats = next((getattr(cb, "stats", None) for cb in trainer.callbacks if hasattr(cb, "offloader")), None)
    if not stats or "copy_ms" not in stats or "exposed_copy_ms" not in stats:
        return None
    copy_ms = float(stats["copy_ms"])
    return max(0.0, 1.0 - float(stats["exposed_copy_ms"]) / copy_ms) if copy_ms > 0 else None
