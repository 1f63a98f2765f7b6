"""Expert-load torchmetrics metric fed from the router's one counting pass, without a host sync.

Example::

    metric = ExpertLoadMetric(num_experts=8)
    metric.update(plan.tokens_per_expert, plan.num_dropped, plan.num_tokens * plan.top_k)
    metric.compute()  # {"load_imbalance": ..., "dropped_fraction": ..., "load_entropy": ...}
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError

__all__ = ["ExpertLoadMetric"]


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _count(name: str, value: object, device: torch.device) -> Tensor:
    """A scalar count as a 0-d int64 tensor on ``device``: an int ``>= 0`` or a 0-d integer tensor (host checks)."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or not _is_integer(value):
            raise RoutingError(
                f"{name} must be an int or a 0-d integer tensor, got a {value.dtype} tensor of shape "
                f"{tuple(value.shape)}"
            )
        return value.to(device, torch.int64)
    return torch.tensor(check_int(name, value, low=0, error=RoutingError), dtype=torch.int64, device=device)


class ExpertLoadMetric(Metric):
    """Load balance of one MoE layer, accumulated over steps and summed across ranks.

    States (all ``dist_reduce_fx="sum"``, int64 so counts stay exact): ``tokens_per_expert`` ``(E,)``,
    ``num_dropped`` and ``num_pairs`` (0-d). ``update(..., validate=False)`` only adds device tensors, so it never
    syncs (the default ``validate=True`` reads the counts once to check them); :meth:`compute` returns device
    tensors too (reading them is the logger's sync).

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
        check_int("num_experts", num_experts, low=1)
        self.num_experts = num_experts
        self.add_state("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_dropped", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_pairs", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(
        self,
        tokens_per_expert: Tensor,
        num_dropped: Tensor | int | None = None,
        num_pairs: Tensor | int | None = None,
        *,
        validate: bool = True,
    ) -> None:
        """Add one forward's counts (device tensors are added on the device).

        Args:
            tokens_per_expert: ``(E,)`` integer kept pairs per expert (``RoutingPlan.tokens_per_expert``).
            num_dropped: int or 0-d integer tensor, dropped pairs (``RoutingPlan.num_dropped``); ``None`` means
                dropless.
            num_pairs: int or 0-d integer tensor, routed pairs ``T * k`` (kept + dropped); ``None`` means
                kept + dropped.
            validate: check the values (counts ``>= 0``, ``num_pairs >= kept + dropped``): one host sync on an
                accelerator. With ``False`` (the per-step hot path, as in
                :class:`~lightning_llmfast.callbacks.ExpertLoadMonitor`) only shapes and dtypes are checked and
                nothing syncs.

        Raises:
            RoutingError: ``tokens_per_expert`` not an ``(E,)`` integer tensor, ``num_dropped``/``num_pairs`` not
                an int or a 0-d integer tensor, or (``validate=True``) negative counts or ``num_pairs`` below
                kept + dropped. Nothing is added then.
        """
        if not isinstance(tokens_per_expert, Tensor):
            raise RoutingError(f"tokens_per_expert must be a torch.Tensor, got {type(tokens_per_expert).__name__}")
        if tuple(tokens_per_expert.shape) != (self.num_experts,):
            raise RoutingError(
                f"tokens_per_expert must have shape ({self.num_experts},) (num_experts), "
                f"got {tuple(tokens_per_expert.shape)}"
            )
        if not _is_integer(tokens_per_expert):
            raise RoutingError(f"tokens_per_expert must be an integer tensor, got {tokens_per_expert.dtype}")
        device = self.tokens_per_expert.device
        kept = tokens_per_expert.to(device, torch.int64)
        dropped = _count("num_dropped", 0 if num_dropped is None else num_dropped, device)
        pairs = kept.sum() + dropped if num_pairs is None else _count("num_pairs", num_pairs, device)
        if validate:
            # NOTE: host sync (one read of four device values); the per-step caller passes validate=False.
            low, kept_v, dropped_v, pairs_v = torch.stack([kept.min(), kept.sum(), dropped, pairs]).tolist()
            if low < 0:
                raise RoutingError(f"tokens_per_expert must be counts >= 0, got {kept.tolist()}")
            if dropped_v < 0:
                raise RoutingError(f"num_dropped must be >= 0, got {dropped_v}")
            if pairs_v < kept_v + dropped_v:
                raise RoutingError(
                    f"num_pairs must be >= kept + dropped = {kept_v} + {dropped_v} (the routed pairs), got {pairs_v}"
                )
        self.tokens_per_expert += kept
        self.num_dropped += dropped
        self.num_pairs += pairs

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
