"""``ActivationOffload``: activation offload as a callback, usable under any Lightning strategy.

It owns the :class:`~lightning_llmfast.offload.ActivationOffloader`'s lifecycle only: created at ``on_fit_start``
(after the strategy has wrapped or sharded the model), its pack hooks active from ``on_train_batch_start`` until
``on_before_backward`` (the forward), its step ended at ``on_after_backward`` (or at the batch's end when no backward
ran), released at ``teardown``, also after an exception. ``strategy="llmfast_offload"`` uses it too.

With a memory plan (``OffloadConfig(plan="auto")``) it logs, after each step whose index Lightning logs, the plan's
prediction against that step: ``offload/predicted_peak`` and ``offload/measured_peak`` (bytes of live saved
activations), ``offload/predicted_ms`` and ``offload/measured_ms`` (the layers' forward and backward; on a GPU once
the step's events have completed, else at a later log point), and warns once per quantity (rank zero) when measured
and predicted differ by more than :data:`PLAN_TOLERANCE`. Nothing is synchronised: the numbers are the offloader's
own counts and completed timestamps (:meth:`~lightning_llmfast.offload.ActivationOffloader.step_metrics`).

Example::

    trainer = L.Trainer(strategy="fsdp", callbacks=[ActivationOffload(OffloadConfig(offload_layers="auto"))])
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_llmfast._layers import LayersSpec, resolve_layers
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

__all__ = ["PLAN_METRICS", "PLAN_TOLERANCE", "ActivationOffload"]

PLAN_METRICS = ("offload/predicted_peak", "offload/measured_peak", "offload/predicted_ms", "offload/measured_ms")
"""The names a memory plan's steps are logged under."""
PLAN_TOLERANCE = 0.15
"""Relative difference between measured and predicted peak (or time) above which the callback warns."""


class ActivationOffload(L.Callback):
    """Offload saved activations of the model's layer stack to pinned host memory while fitting.

    Works under ``DDPStrategy``, ``FSDPStrategy``, ``ModelParallelStrategy`` (FSDP2: the unsharded parameters are
    never offloaded) and :class:`~lightning_llmfast.LLMFastStrategy`; the model needs no change.

    Args:
        config: the settings (:class:`~lightning_llmfast.offload.OffloadConfig`; ``None``: its defaults).
        layers: the layer stack: ``None`` (the largest ``nn.ModuleList`` of identical blocks in the LightningModule),
            an attribute path such as ``"model.layers"``, or the modules.

    Raises:
        OffloadError: at construction when ``config`` is not an ``OffloadConfig``; at ``on_fit_start``, before any
            step, when ``layers`` matches nothing.

    Example::

        offload = ActivationOffload(OffloadConfig(offload_layers="auto", rebuild="norms+gemms"))
        trainer = L.Trainer(strategy="ddp", callbacks=[offload])
        trainer.fit(module)
        print(offload.stats)
    """

    def __init__(self, config: OffloadConfig | None = None, *, layers: LayersSpec = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise OffloadError(f"{type(self).__name__}: config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        self.layers = layers
        self._offloader: ActivationOffloader | None = None
        self._forward: contextlib.ExitStack | None = None
        self._last_stats: dict[str, int | bool | float] | None = None
        self._step = self._logged_step = -1
        self._warned: set[str] = set()
        self.last_metrics: dict[str, float] = {}
        """What the last log point logged (:data:`PLAN_METRICS`)."""

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The offloader while fitting (``None`` when offload is off on this device)."""
        return self._offloader

    @property
    def stats(self) -> dict[str, int | bool | float] | None:
        """:attr:`ActivationOffloader.stats <lightning_llmfast.offload.ActivationOffloader.stats>` of the last step,
        while fitting and after it (``None`` before any offloading fit)."""
        return self._offloader.stats if self._offloader is not None else self._last_stats

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hint = "ActivationOffload(layers=...)"  # raises before any step runs
        layers = resolve_layers(pl_module, self.layers, error=OffloadError, hint=hint, single=True)
        device = trainer.strategy.root_device
        if device.type != "cuda" and not self.config.force:
            rank_zero_warn(
                f"{type(self).__name__}: activation offload needs a CUDA device; it is off on {device.type} "
                "(force=True runs the mechanism anyway)"
            )
            return
        self._offloader = ActivationOffloader(layers, self.config)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._offloader is None:
            return
        self._step = trainer.global_step
        self._offloader.begin_step()
        self._forward = contextlib.ExitStack()
        self._forward.enter_context(self._offloader.forward_context())

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._end_forward()

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._offloader is not None and pl_module.automatic_optimization:
            self._offloader.end_step()
            self._log_plan(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Manual optimization runs its backward(s) inside training_step; a None output skips backward.
        self._end_forward()
        if self._offloader is not None and self._offloader.in_step:
            self._offloader.end_step()
            self._log_plan(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._end_forward()
        if self._offloader is not None:
            self._offloader.end_step(failed=True)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end_forward()
        if self._offloader is not None:
            self._last_stats = self._offloader.stats  # kept for `stats`: the offloader is released
            self._offloader.close()
            self._offloader = None

    def _log_plan(self, trainer: L.Trainer) -> None:
        """Log the memory plan's prediction against the step that just ended, on the steps Lightning logs (once per
        optimizer step), and warn once per quantity that is off by more than :data:`PLAN_TOLERANCE`."""
        assert self._offloader is not None
        step, every = self._step, trainer.log_every_n_steps
        if not every or step == self._logged_step or (step + 1) % every:
            return  # log_every_n_steps=0: Lightning logs no steps
        metrics = self._offloader.step_metrics()
        if not metrics:
            return  # no plan yet (its measuring steps), or it copied and kept nothing
        self._logged_step = step
        self.last_metrics = {f"offload/{name}": value for name, value in metrics.items()}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=step)
        for what, unit in (("peak", "bytes of live saved activations"), ("ms", "ms of forward and backward")):
            predicted, measured = metrics.get(f"predicted_{what}"), metrics.get(f"measured_{what}")
            if predicted is None or measured is None or what in self._warned:
                continue
            if abs(measured - predicted) > PLAN_TOLERANCE * predicted:
                self._warned.add(what)
                rank_zero_warn(
                    f"{type(self).__name__}: the memory plan predicted {predicted:.6g} {unit} and step {step} "
                    f"measured {measured:.6g} ({measured / predicted - 1:+.1%}, more than {PLAN_TOLERANCE:.0%}); "
                    "the profiled steps it was made from may not represent the run (warned once)"
                )

    def _end_forward(self) -> None:
        if self._forward is not None:
            forward, self._forward = self._forward, None
            forward.close()
