"""The typed MoE layer contract: one :class:`MoEStats` record per forward, and the :class:`MoELayer` protocol.

Losses, metrics and callbacks read an MoE layer through this contract only: ``isinstance(module, MoELayer)``, then
``module.stats`` (the last forward's record) and ``module.finish_step()`` (once per optimizer step).

Example::

    for module in model.modules():
        if isinstance(module, MoELayer) and module.stats is not None:
            loss = loss + 0.01 * module.stats.aux_loss
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["MoELayer", "MoEStats"]


class MoEStats(NamedTuple):
    """What one MoE forward counted and computed, from the router's one counting pass.

    Attributes:
        tokens_per_expert: ``(E,)`` int32 kept pairs per expert, or ``None`` for a layer that does not count (a
            third-party block wrapped only for its loss).
        aux_loss: 0-d differentiable load-balancing loss (of the layer's kind: micro-batch, sequence, global).
        z_loss: 0-d differentiable router z-loss, or ``None`` where the layer has none.
        num_dropped: 0-d int64, valid pairs dropped by a capacity limit (a tensor: reading it is the caller's sync).
        num_pairs: routed pairs ``T * k`` when every token is valid (a host int), else ``None`` (then kept plus
            dropped pairs are all the routed ones).
        nonfinite: 0-d bool, whether the router logits had NaN/inf, when the forward checked; ``None``: not checked
            in the hot path (:meth:`nonfinite_flag` checks on demand).
        router_logits: ``(T, E)`` router logits.
        plan: the :class:`~lightning_llmfast.moe.RoutingPlan`, or ``None`` (the naive baseline has none).

    Example::

        stats = block.stats
        loss = loss + 0.01 * stats.aux_loss + 1e-3 * stats.z_loss
    """

    tokens_per_expert: Tensor | None
    aux_loss: Tensor
    z_loss: Tensor | None
    num_dropped: Tensor | None
    num_pairs: int | None
    nonfinite: Tensor | None
    router_logits: Tensor | None
    plan: RoutingPlan | None

    def nonfinite_flag(self) -> Tensor | None:
        """0-d bool: whether the router logits had NaN/inf (masked tokens left out), on the device, without a sync.

        ``nonfinite`` when the forward checked, else computed now from ``router_logits`` (a few 0-d ops: what a
        monitor pays, not every forward); ``None`` without logits.

        Example::

            bad = block.stats.nonfinite_flag()  # read it where the host reads device values anyway
        """
        if self.nonfinite is not None or self.router_logits is None:
            return self.nonfinite
        from lightning_llmfast.moe.routing import nonfinite_flag

        logits = self.router_logits.detach().float()
        mask = None if self.plan is None else self.plan.token_mask
        if mask is not None:
            logits = logits.masked_fill(~mask.unsqueeze(1), 0.0)
        return nonfinite_flag(logits)


@runtime_checkable
class MoELayer(Protocol):
    """An MoE layer: this package's blocks, the adapted transformers blocks, the naive baseline.

    Attributes:
        stats: the last forward's :class:`MoEStats` (``None`` before the first forward).

    Example::

        blocks = [m for m in model.modules() if isinstance(m, MoELayer)]
    """

    stats: MoEStats | None

    def finish_step(self, group: dist.ProcessGroup | None = None) -> None:
        """Close an optimizer step (expert-bias update from the step's counts, reset of step sums)."""
        ...
