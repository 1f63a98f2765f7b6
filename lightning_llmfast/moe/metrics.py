"""Import path kept for :class:`~lightning_llmfast.callbacks.ExpertLoadMetric`, which lives in the Lightning layer
(it needs torchmetrics; the rest of :mod:`lightning_llmfast.moe` does not)."""

from lightning_llmfast.callbacks.expert_metric import ExpertLoadMetric

__all__ = ["ExpertLoadMetric"]
