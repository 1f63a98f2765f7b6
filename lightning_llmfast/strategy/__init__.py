"""The strategy room: ``strategy="llmfast"``, its sharding base and its checkpoint IO (Lightning layer).

Importing this package registers ``"llmfast"``, ``"llmfast_offload"``, ``"llmfast_fsdp"`` and
``"llmfast_fsdp_offload"`` in Lightning's ``StrategyRegistry`` (:mod:`.llmfast`); ``import lightning_llmfast`` does.

Example::

    from lightning_llmfast.strategy import LLMFastStrategy

    trainer = L.Trainer(strategy=LLMFastStrategy(sharding="fsdp"), devices=8)
"""

from __future__ import annotations

from lightning_llmfast.strategy.checkpoint_io import VerifiedCheckpointIO
from lightning_llmfast.strategy.llmfast import LLMFastStrategy

__all__ = ["LLMFastStrategy", "VerifiedCheckpointIO"]
