"""Token-weighted losses over the optimizer step, exact under data parallelism and gradient accumulation.

A per-rank, per-micro-batch mean gives every micro-batch the same weight, whatever its number of label tokens, so
``N`` ranks with ``accumulate_grad_batches=A`` do not compute the gradient one process would compute on the union
of their data. :func:`causal_lm_loss` and :func:`scale_by_token_share` weight every label token equally over the
whole optimizer step: the step's gradient is the sum of all token-loss gradients divided by the global number of
label tokens (all ranks, all accumulated micro-batches).

How: during training (several ranks or accumulation) the returned tensor's *value* is the plain mean of this
micro-batch (what you log) while its *gradient* is that of the unnormalised token-loss sum. A callback, added to
the trainer on first use, counts the label tokens of each micro-batch on the device and, in
``on_before_optimizer_step`` (before Lightning clips gradients), all-reduces the step's count once over the
data-parallel group and rescales the accumulated gradients by ``dp_size * accumulate_grad_batches / count``: this
undoes DDP's (or FSDP2's) mean over the data-parallel ranks and Lightning's division by ``accumulate_grad_batches``.
Under :class:`~lightning_llmfast.LLMFastStrategy` the group is the ``"dp_shard"`` group of its
:class:`~lightning_llmfast.parallel.ParallelDims` (the ranks that see different data; expert-parallel ranks are among
them); under another strategy, its world. No host sync is added.

Every term of a loss that goes through this weighting must use one of the two functions: a term added
unweighted would be rescaled by the step's token count as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_llmfast.errors import DataError
from lightning_llmfast.parallel.dims import ParallelDims

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["causal_lm_loss", "scale_by_token_share", "shared_batch_losses"]


def causal_lm_loss(
    logits: Tensor, labels: Tensor, *, module: pl.LightningModule | None = None, ignore_index: int = -100
) -> Tensor:
    """Cross entropy of ``logits`` against already shifted ``labels``, token-weighted over the optimizer step.

    Without ``module`` (or outside ``trainer.fit``'s training, with one process and no accumulation, or under
    manual optimization) this is the plain mean over label tokens (``0`` when there is none). Inside training with
    several ranks or ``accumulate_grad_batches > 1`` the value is still this micro-batch's mean, and the gradient
    the optimizer sees is ``sum of token-loss gradients / global label tokens of the step``.

    Args:
        logits: ``(..., V)`` floating logits (computed in float32).
        labels: integer labels of shape ``logits.shape[:-1]``; ``ignore_index`` marks positions without a target.
        module: the LightningModule whose ``training_step`` calls this.
        ignore_index: label value that is not a target.

    Returns:
        A 0-d float32 tensor.

    Raises:
        DataError: ``labels`` is not an integer tensor of shape ``logits.shape[:-1]``, or ``logits`` is not floating.

    Example::

        def training_step(self, batch, batch_idx):
            logits = self(batch.input_ids)
            return causal_lm_loss(logits, batch.labels, module=self)
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise DataError(f"causal_lm_loss: logits must be a floating (..., V) tensor, got {_describe(logits)}")
    _check_labels(labels, logits.shape[:-1], "causal_lm_loss")
    token_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    count = (labels != ignore_index).sum()
    mean = token_sum / count.clamp_min(1)
    weighting = _weighting(module)
    if weighting is None:
        return mean
    weighting.count_micro_batch(count)
    return _value_with_grad_of(mean, token_sum)


def scale_by_token_share(
    loss: Tensor, labels: Tensor, *, module: pl.LightningModule | None = None, ignore_index: int = -100
) -> Tensor:
    """Weight a per-micro-batch loss (router aux or z loss) by its micro-batch's share of the step's label tokens.

    The value is ``loss`` unchanged; inside training with several ranks or accumulation, the optimizer sees
    ``sum over micro-batches and ranks of (label tokens of the micro-batch / global label tokens) * grad(loss)``,
    the same weighting as :func:`causal_lm_loss`. Pass the labels of the micro-batch ``loss`` was computed on
    (the same labels as this step's :func:`causal_lm_loss` call; the micro-batch's tokens are counted once).

    Args:
        loss: a 0-d loss of this micro-batch.
        labels: the micro-batch's labels (any shape).
        module: the LightningModule whose ``training_step`` calls this.
        ignore_index: label value that is not a target.

    Returns:
        A tensor with ``loss``'s value.

    Raises:
        DataError: ``loss`` is not 0-d, or ``labels`` is not an integer tensor.

    Example::

        loss = causal_lm_loss(logits, batch.labels, module=self)
        loss = loss + 0.01 * scale_by_token_share(model.aux_loss(), batch.labels, module=self)
    """
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise DataError(f"scale_by_token_share: loss must be a 0-d tensor, got {_describe(loss)}")
    _check_labels(labels, None, "scale_by_token_share")
    weighting = _weighting(module)
    if weighting is None:
        return loss
    count = (labels != ignore_index).sum()
    group = _context_group(module)
    if group is not None:
        # The ranks of a context-parallel group share one micro-batch, and a batch-wide loss (the balance loss over
        # the group) is the mean of their values: each weighs its share of the micro-batch's tokens equally.
        count = count.to(torch.float64)
        dist.all_reduce(count, group=group, async_op=True).wait()
        count = count / dist.get_world_size(group)
    weighting.count_micro_batch(count)
    return _value_with_grad_of(loss, loss * count.to(loss.dtype))


def shared_batch_losses(
    ce: Tensor, loss: Tensor, labels: Tensor, *, module: pl.LightningModule | None = None, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """The values to log for a micro-batch that a context-parallel group shares: its token-mean cross entropy over
    every rank's share, and the total loss (that plus the mean over the ranks of the batch-wide terms ``loss - ce``),
    the same on every rank of the group and equal to one rank holding the whole batch. Without context parallelism
    ``(ce, loss)`` unchanged. Detached: for logging only (one all-reduce of three numbers over the group).

    Args:
        ce: this rank's :func:`causal_lm_loss`.
        loss: ``ce`` plus this rank's weighted batch-wide losses (router aux, z).
        labels: this rank's labels.
        module: the LightningModule whose ``training_step`` calls this.
        ignore_index: label value that is not a target.

    Example::

        ce_log, loss_log = shared_batch_losses(ce, loss, batch.labels, module=self)
        self.log("train/loss", loss_log)
    """
    group = _context_group(module)
    if group is None:
        return ce, loss
    count = (labels != ignore_index).sum().to(torch.float64)
    ce64 = ce.detach().to(torch.float64)
    sums = torch.stack([ce64 * count, count, loss.detach().to(torch.float64) - ce64])
    dist.all_reduce(sums, group=group, async_op=True).wait()
    batch_ce = sums[0] / sums[1].clamp_min(1)
    return batch_ce.to(ce.dtype), (batch_ce + sums[2] / dist.get_world_size(group)).to(loss.dtype)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _check_labels(labels: object, shape: torch.Size | None, owner: str) -> None:
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dtype.is_floating_point
        or labels.dtype.is_complex
        or labels.dtype == torch.bool
    ):
        raise DataError(f"{owner}: labels must be an integer tensor, got {_describe(labels)}")
    if shape is not None and labels.shape != shape:
        raise DataError(f"{owner}: labels have shape {tuple(labels.shape)}, expected {tuple(shape)} (logits[..., 0])")


def _value_with_grad_of(value: Tensor, target: Tensor) -> Tensor:
    """``value``'s value with ``target``'s gradient (``target - target.detach()`` is exactly zero)."""
    return value.detach() + (target - target.detach())


def _weighting(module: pl.LightningModule | None) -> _StepTokenWeighting | None:
    """The trainer's weighting callback when the step weighting differs from a plain mean, else ``None``."""
    if module is None:
        return None
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
    if (
        trainer is None
        or not trainer.training
        or not module.automatic_optimization
        or not torch.is_grad_enabled()
        or _data_parallel(trainer)[1] * trainer.accumulate_grad_batches == 1
    ):
        return None
    for callback in trainer.callbacks:
        if isinstance(callback, _StepTokenWeighting):
            return callback
    callback = _StepTokenWeighting()
    trainer.callbacks.append(callback)
    return callback


def _context_group(module: pl.LightningModule | None) -> dist.ProcessGroup | None:
    """The context-parallel group of the module's strategy (the ranks sharing a batch), or ``None``."""
    trainer = getattr(module, "_trainer", None)
    dims = getattr(getattr(trainer, "strategy", None), "parallel_dims", None)
    return dims.cp_group if isinstance(dims, ParallelDims) else None


def _data_parallel(trainer: pl.Trainer) -> tuple[dist.ProcessGroup | None, int]:
    """The data-parallel group and size: the strategy's ``ParallelDims`` group of every data-parallel rank when it has
    one, else ``(None, world_size)`` (the strategy's own reduce over its world)."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if isinstance(dims, ParallelDims) and dims.dp_group is not None:
        return dims.dp_group, dims.stage_size
    return None, trainer.world_size


class _StepTokenWeighting(Callback):
    """Counts label tokens per micro-batch and rescales the step's gradients by the global count."""

    def __init__(self) -> None:
        self._count: Tensor | None = None  # label tokens of the step so far, on this rank (device tensor)
        self._counted_batch = False  # this micro-batch's tokens are in _count

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._counted_batch = False

    def count_micro_batch(self, count: Tensor) -> None:
        if self._counted_batch:
            return
        self._counted_batch = True
        count = count.detach().to(torch.float64)
        self._count = count if self._count is None else self._count + count

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._count is None:
            return
        # One all-reduce of a count per step over the data-parallel ranks; the division stays on the device.
        group, dp_size = _data_parallel(trainer)
        if group is None:
            total = trainer.strategy.reduce(self._count, reduce_op="sum")
        else:
            total = self._count.clone()
            dist.all_reduce(total, group=group)
        factor = (dp_size * trainer.accumulate_grad_batches) / total.clamp_min(1)
        factors: dict[torch.dtype, Tensor] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    if param.grad.dtype not in factors:
                        factors[param.grad.dtype] = factor.to(param.grad.dtype)
                    param.grad.mul_(factors[param.grad.dtype])
        self._count = None
