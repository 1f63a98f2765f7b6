"""Expert-load monitoring (log MoE load balance from the router's counts, surface non-finite router logits) and
the once-per-optimizer-step expert balancing of the MoE blocks.

Example::

    trainer = L.Trainer(callbacks=[ExpertLoadMonitor(log_every_n_steps=50), ExpertBalanceCallback()])
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llmfast._checks import check_int
from lightning_llmfast.callbacks.expert_metric import ExpertLoadMetric
from lightning_llmfast.errors import RoutingError

__all__ = ["ExpertBalanceCallback", "ExpertLoadMonitor"]


class ExpertLoadMonitor(Callback):
    """Logs ``moe/load_imbalance``, ``moe/dropped_fraction`` and ``moe/load_entropy`` during training.

    Every module with a ``last_tokens_per_expert`` attribute counts as an MoE block (this package's blocks and the
    adapted transformers blocks). After each training batch its counts are added to one
    :class:`~lightning_llmfast.callbacks.ExpertLoadMetric` per block, on the device, without a host sync. Every
    ``log_every_n_steps`` batches the metrics are computed, averaged over the blocks, logged and reset. At that
    point, where the host reads device values anyway, a non-finite router-logit flag recorded since the last log
    (``last_nonfinite``, set by routing with ``validate=False``) raises :class:`~lightning_llmfast.RoutingError`
    naming the blocks.

    Args:
        log_every_n_steps: logging period in training batches; ``None`` uses the trainer's ``log_every_n_steps``.

    Raises:
        ConfigError: ``log_every_n_steps`` not ``None`` or an int >= 1.

    Example::

        trainer = L.Trainer(callbacks=[ExpertLoadMonitor()], log_every_n_steps=10)
        trainer.fit(MyMoEModule())  # logs moe/load_imbalance etc. every 10 batches
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, low=1)
        self.log_every_n_steps = log_every_n_steps
        self._blocks: dict[str, nn.Module] = {}
        self._metrics: dict[str, ExpertLoadMetric] = {}
        self._nonfinite: dict[str, Tensor] = {}
        self._batches = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here rather than in setup(): configure_model (and GroupedRouterMixin's block swap) runs after setup.
        self._blocks = {name: m for name, m in pl_module.named_modules() if hasattr(m, "last_tokens_per_expert")}
        if not self._blocks:
            rank_zero_warn(
                f"ExpertLoadMonitor: {type(pl_module).__name__} holds no MoE block to monitor (GroupedRouterMixin "
                "recognised none to swap); no expert-load metric will be logged"
            )
        self._metrics = {}
        self._nonfinite = {}
        self._batches = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for name, block in self._blocks.items():
            counts = block.last_tokens_per_expert
            if counts is None:
                continue
            metric = self._metrics.get(name)
            if metric is None:
                metric = self._metrics[name] = ExpertLoadMetric(counts.numel()).to(counts.device)
            plan = getattr(block, "last_plan", None)
            # validate=False: no host sync per batch (the counts come from the router).
            if plan is None:
                metric.update(counts, validate=False)
            else:
                # Masked tokens are no routed pairs: the valid pairs are then exactly the kept plus the dropped ones.
                num_pairs = plan.num_tokens * plan.top_k if getattr(plan, "token_mask", None) is None else None
                metric.update(counts, plan.num_dropped, num_pairs, validate=False)
            flag = getattr(block, "last_nonfinite", None)
            if flag is not None:
                # OR-ed on the device: a NaN in any batch of the window is reported, not only in the last one.
                seen = self._nonfinite.get(name)
                self._nonfinite[name] = flag if seen is None else seen | flag
        self._batches += 1
        period = self.log_every_n_steps or trainer.log_every_n_steps
        if self._batches % period == 0 and self._metrics:
            self._check_finite()
            self._log(pl_module)

    def _check_finite(self) -> None:
        if not self._nonfinite:
            return
        names = list(self._nonfinite)
        # NOTE: host sync, once per logging period, where the logger reads device values anyway.
        flags = torch.stack([self._nonfinite[n] for n in names]).tolist()
        bad = [n for n, f in zip(names, flags) if f]
        self._nonfinite = {}
        if bad:
            raise RoutingError(f"router logits contained NaN or infinite values in MoE block(s) {bad}")

    def _log(self, pl_module: pl.LightningModule) -> None:
        results = [metric.compute() for metric in self._metrics.values()]
        for key in ("load_imbalance", "dropped_fraction", "load_entropy"):
            value = torch.stack([r[key] for r in results]).mean()
            pl_module.log(f"moe/{key}", value, on_step=True, on_epoch=False)
        for metric in self._metrics.values():
            metric.reset()


class ExpertBalanceCallback(Callback):
    """Calls ``finish_step()`` of every MoE block once per optimizer step (after all its micro-batches' backward).

    That is where :class:`~lightning_llmfast.moe.MoEBlock` applies its ``bias_update="step"`` expert-bias update
    from the counts of the step's micro-batches, summed over the data-parallel ranks (one all-reduce of ``E``
    integers per block, no host sync), and resets the step sums of ``aux_loss="global"``. It runs in
    ``on_before_optimizer_step``, which Lightning calls once per optimizer step whatever
    ``accumulate_grad_batches`` is; a second optimizer stepping in the same training step does not repeat it.

    Args:
        process_group: the data-parallel group to sum over; ``None``: each block's ``dp_group`` (by default the
            default group, which is the data-parallel group under plain DDP/FSDP).

    Example::

        trainer = L.Trainer(strategy="llmfast", accumulate_grad_batches=4, callbacks=[ExpertBalanceCallback()])
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self._done_step: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._done_step = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._done_step == trainer.global_step:
            return
        self._done_step = trainer.global_step
        for module in pl_module.modules():
            finish = getattr(module, "finish_step", None)
            if callable(finish) and getattr(module, "_llmfast_grouped", False):
                finish(self.process_group)
