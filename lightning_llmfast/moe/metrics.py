"""Expert-load metrics fed from the router's one counting pass, without a host sync.

Example::

    metric = ExpertLoadMetric(num_experts=8)
    metric.update(plan.tokens_per_expert, plan.num_dropped, plan.num_tokens * plan.top_k)
    metric.compute()  # {"load_imbalance": ..., "dropped_fraction": ..., "load_entropy": ...}
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_llmfast.errors import ConfigError, RoutingError

__all__ = ["ExpertLoadMetric"]


class ExpertLoadMetric(Metric):
    """Load balance of one MoE layer, accumulated over steps and summed across ranks.

    States (all ``dist_reduce_fx="sum"``, int64 so counts stay exact): ``tokens_per_expert`` ``(E,)``,
    ``num_dropped`` and ``num_pairs`` (0-d). :meth:`update` only adds device tensors, so it never syncs;
    :meth:`compute` returns device tensors too (reading them is the logger's sync).

    ``compute()`` returns:

    - ``load_imbalance``: ``max_e n_e / mean_e n_e`` (1 = perfectly balanced, ``E`` = one expert gets every pair;
      1 when nothing was routed);
    - ``dropped_fraction``: dropped pairs / routed pairs (0 when dropless or nothing was routed);
    - ``load_entropy``: entropy in nats of the kept-pair distribution over experts (``log E`` = balanced).

    Args:
        num_experts: ``E``.
        kwargs: forwarded to ``torchmetrics.Metric``.

    Raises:
        ConfigError: ``num_experts < 1``.

    Example::

        metric = ExpertLoadMetric(4)
        metric.update(torch.tensor([3, 1, 0, 0]))
        metric.compute()["load_imbalance"]  # tensor(3.)
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    tokens_per_expert: Tensor
    num_dropped: Tensor
    num_pairs: Tensor

    def __init__(self, num_experts: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ConfigError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self.num_experts = num_experts
        self.add_state("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_dropped", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_pairs", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(
        self,
        tokens_per_expert: Tensor,
        num_dropped: Tensor | int | None = None,
        num_pairs: Tensor | int | None = None,
    ) -> None:
        """Add one forward's counts (device tensors are added on the device: no sync).

        Args:
            tokens_per_expert: ``(E,)`` integer kept pairs per expert (``RoutingPlan.tokens_per_expert``).
            num_dropped: 0-d dropped pairs (``RoutingPlan.num_dropped``); ``None`` means dropless.
            num_pairs: routed pairs ``T * k`` (kept + dropped); ``None`` means kept + dropped.

        Raises:
            RoutingError: ``tokens_per_expert`` does not have shape ``(E,)``.
        """
        if tuple(tokens_per_expert.shape) != (self.num_experts,):
            raise RoutingError(
                f"tokens_per_expert must have shape ({self.num_experts},) (num_experts), "
                f"got {tuple(tokens_per_expert.shape)}"
            )
        kept = tokens_per_expert.to(self.tokens_per_expert.device, torch.int64)
        dropped = torch.as_tensor(0 if num_dropped is None else num_dropped, device=kept.device).to(torch.int64)
        self.tokens_per_expert += kept
        self.num_dropped += dropped
        self.num_pairs += kept.sum() + dropped if num_pairs is None else torch.as_tensor(num_pairs, device=kept.device)

    def compute(self) -> dict[str, Tensor]:
        """The three load statistics as 0-d float32 tensors (see the class docstring)."""
        counts = self.tokens_per_expert.to(torch.float32)
        total = counts.sum()
        routed = total > 0
        # The where() keeps empty windows finite without a Python branch on a device value.
        imbalance = torch.where(routed, counts.max() / (total / self.num_experts).clamp(min=1e-12), 1.0)
        share = counts / total.clamp(min=1.0)
        entropy = -torch.special.xlogy(share, share).sum()
        dropped_fraction = self.num_dropped.to(torch.float32) / self.num_pairs.clamp(min=1).to(torch.float32)
        return {"load_imbalance": imbalance, "dropped_fraction": dropped_fraction, "load_entropy": entropy}
