"""Real-token throughput: tokens/sec that excludes padding, summed over ranks, logged through Lightning."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl

__all__ = ["PEAK_FLOPS", "TokenThroughputMonitor", "peak_flops"]

# Dense peak FLOP/s (no 2:4 sparsity) per chip and dtype; "tfloat32" is float32 matmuls with TF32 allowed.
# Sources: NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns) and NVIDIA H100 Tensor Core GPU datasheet
# (SXM, PCIe and NVL columns). Their tensor-core figures are quoted "with sparsity": the dense peak is half.
# float32 is the non-tensor FP32 figure.
PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "h200 sxm": {torch.float32: 67e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
    "h200 nvl": {torch.float32: 60e12, "tfloat32": 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "h100 sxm": {torch.float32: 67e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
    "h100 nvl": {torch.float32: 60e12, "tfloat32": 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "h100 pcie": {torch.float32: 51e12, "tfloat32": 378e12, torch.bfloat16: 756e12, torch.float16: 756e12},
}
"""Our peak table for the Hopper families, used where Lightning's ``get_available_flops`` finds nothing."""


def _hopper_chip(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` key of a CUDA device name (``"NVIDIA H200"``, ``"NVIDIA H100 80GB HBM3"``...)."""
    name = device_name.lower()
    for family in ("h200", "h100"):  # GH200 superchips carry a Hopper GPU with the SXM figures
        if family in name:
            if "nvl" in name:
                return f"{family} nvl"
            return f"{family} pcie" if "pcie" in name else f"{family} sxm"
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of ``device`` for ``dtype`` matmuls: Lightning's table, else :data:`PEAK_FLOPS`, else ``None``.

    Example::

        peak_flops(torch.device("cuda"), torch.bfloat16)  # 989.4e12 on an "NVIDIA H200"
    """
    if device.type != "cuda":
        return None
    found = get_available_flops(device, dtype)
    if found is not None:
        return float(found)
    chip = _hopper_chip(torch.cuda.get_device_name(device))
    if chip is None:
        return None
    key: torch.dtype | str = dtype
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        key = "tfloat32"
    return PEAK_FLOPS[chip].get(key)


def _batch_tokens(batch: Any) -> tuple[int, int, int]:
    """``(real_tokens, padded_tokens, sequences)`` of a batch, read from host-side fields only."""
    real = getattr(batch, "num_tokens", None)
    input_ids = getattr(batch, "input_ids", None)
    if not isinstance(real, int) or input_ids is None:
        raise ConfigError(
            "TokenThroughputMonitor needs batches with an int `num_tokens` and `input_ids` (a PackedBatch), "
            f"got {type(batch).__name__}; pass num_tokens_fn= for other batch types"
        )
    return real, input_ids.numel(), input_ids.shape[0]


class TokenThroughputMonitor(Callback):
    """Logs real (non-padding) tokens/sec, padding fraction and MFU of training.

    Counting is host-side (``batch.num_tokens`` is computed by the collator), so steps between two log points
    never synchronise the device; at a log point it synchronises once so the timer is honest and, under DDP,
    sums every rank's token count (not rank 0's times world size). Windowing is Lightning's
    :class:`~lightning.fabric.utilities.throughput.Throughput`.

    Logged: ``train/tokens_per_sec`` (all ranks), ``train/device/tokens_per_sec``, ``train/tokens`` (cumulative real
    tokens, all ranks), ``train/padding_fraction`` (since the last log) and, when the module has
    ``flops_per_batch(batch)`` and the device's peak is known, ``train/mfu``. Tokens/sec also shows in the
    progress bar.

    Args:
        log_every_n_steps: optimizer steps between log points; defaults to the trainer's ``log_every_n_steps``.
        window_size: number of log points the rates are computed over (at least 2; 2 = the rate since the
            previous log point, which leaves the warm-up before the first log point out).
        num_tokens_fn: maps a batch to ``(real_tokens, padded_tokens, sequences)`` for batches that are not a
            :class:`~lightning_llmfast.data.PackedBatch`.
        peak_flops: the device's peak FLOP/s for MFU; by default looked up from the device and precision
            (:func:`peak_flops`: Lightning's table, then ours for the H100/H200 families).

    Raises:
        ConfigError: ``log_every_n_steps`` is not an int >= 1, ``window_size`` not an int >= 2, ``peak_flops``
            not a finite number > 0, or ``num_tokens_fn`` not callable.

    Example::

        trainer = L.Trainer(callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor()])
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        window_size: int = 2,
        num_tokens_fn: Callable[[Any], tuple[int, int, int]] | None = None,
        peak_flops: float | None = None,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, low=1)
        check_int("window_size", window_size, low=2)  # a rate needs two points
        if num_tokens_fn is not None and not callable(num_tokens_fn):
            raise ConfigError(f"num_tokens_fn must be callable or None, got {num_tokens_fn!r}")
        if peak_flops is not None:
            check_number("peak_flops", peak_flops, low=0, low_open=True)
        self.log_every_n_steps = log_every_n_steps
        self.window_size = window_size
        self.num_tokens_fn = num_tokens_fn or _batch_tokens
        self.peak_flops = peak_flops
        self.total_tokens = 0
        """Real tokens counted on this rank so far (host int)."""
        self.last_metrics: dict[str, float] = {}
        """What the last log point logged."""
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._t0: float | None = None
        self._batches = self._samples = 0
        self._flops_since_log = 0
        self._padded_since_log = self._real_since_log = 0
        self._last_logged_step = -1
        self._global_tokens = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_counters()
        self.total_tokens = 0
        peak = self.peak_flops
        if peak is None:
            peak = peak_flops(pl_module.device, _compute_dtype(trainer))
        # Both instances see world_size=1: the global one is fed all-reduced counts, so its "device" rate is the
        # true sum over ranks rather than rank 0's rate times world size.
        self._local = Throughput(available_flops=peak, world_size=1, window_size=self.window_size)
        self._global = Throughput(world_size=1, window_size=self.window_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        real, padded, sequences = self.num_tokens_fn(batch)
        self.total_tokens += real
        self._real_since_log += real
        self._padded_since_log += padded
        self._batches += 1
        self._samples += sequences
        flops_fn = getattr(pl_module, "flops_per_batch", None)
        if callable(flops_fn):
            self._flops_since_log += int(flops_fn(batch))
        step = trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        # global_step only advances on optimizer steps, so under gradient accumulation we log once per step.
        if step % every == 0 and step != self._last_logged_step:
            self._last_logged_step = step
            self._log(trainer, pl_module, step)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        assert self._t0 is not None
        if pl_module.device.type == "cuda":
            # NOTE: host sync, once per log point: without it the timer measures kernel launches, not kernels.
            torch.cuda.synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._t0
        interval_tokens = torch.tensor(
            [self._real_since_log, self._padded_since_log], dtype=torch.int64, device=pl_module.device
        )
        interval_tokens = trainer.strategy.reduce(interval_tokens, reduce_op="sum")
        global_real, global_padded = (int(v) for v in interval_tokens.tolist())
        self._global_tokens += global_real
        self._local.update(
            time=elapsed,
            batches=self._batches,
            samples=self._samples,
            lengths=self.total_tokens,
            flops=self._flops_since_log or None,
        )
        self._global.update(time=elapsed, batches=self._batches, samples=self._samples, lengths=self._global_tokens)
        metrics: dict[str, float] = {
            "train/tokens": float(self._global_tokens),
            "train/padding_fraction": 1.0 - global_real / global_padded if global_padded else 0.0,
        }
        local, glob = self._local.compute(), self._global.compute()
        if "device/items_per_sec" in local:
            metrics["train/device/tokens_per_sec"] = local["device/items_per_sec"]
            metrics["train/tokens_per_sec"] = glob["device/items_per_sec"]
        if "device/mfu" in local:
            metrics["train/mfu"] = local["device/mfu"]
        self._real_since_log = self._padded_since_log = self._flops_since_log = 0
        if trainer.is_global_zero:
            # Lightning's own rows for this optimizer step carry the index step - 1 (batches stepped before it);
            # use the same so our metrics share their rows.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step - 1)
        if "train/tokens_per_sec" in metrics:
            pl_module.log("tokens_per_sec", metrics["train/tokens_per_sec"], prog_bar=True, logger=False)
        self.last_metrics = metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        # The global count is what train/tokens shows: saved so that it continues after ckpt_path= resumes.
        return {"total_tokens": self.total_tokens, "global_tokens": self._global_tokens}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_tokens = state_dict["total_tokens"]
        # Checkpoints written before the global count was saved hold only this rank's count.
        self._global_tokens = state_dict.get("global_tokens", 0)


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    precision = str(trainer.precision)
    if "bf16" in precision:
        return torch.bfloat16
    if "16" in precision:
        return torch.float16
    return torch.float32
