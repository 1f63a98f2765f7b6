"""Grouped MoE routing, sync-free dispatch, grouped experts, MoE blocks and adapters (plain PyTorch).

One path: :func:`route` (its ``backend`` picks the fused Triton kernels or the PyTorch reference) -> a
:class:`TokenDispatcher` (:class:`LocalDispatcher`, or an all-to-all one from
:mod:`lightning_llmfast.expert_parallel`) -> :func:`expert_swiglu` -> the dispatcher's combine. Expert parallelism
lives in :mod:`lightning_llmfast.expert_parallel`; its names here (``shard_experts``, ``AllToAll*Dispatcher``) are
deprecated aliases.

Example::

    from lightning_llmfast.moe import MoEBlock, MoEConfig

    block = MoEBlock(MoEConfig.build(hidden_size=64, ffn_size=128, num_experts=8, top_k=2))
    y = block(torch.randn(2, 16, 64))  # (2, 16, 64); block.stats.aux_loss, block.stats.tokens_per_expert
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

# public name -> submodule; resolved lazily so that importing one part does not import the others.
_LAZY: dict[str, str] = {
    "route": "lightning_llmfast.moe.routing",
    "RoutingPlan": "lightning_llmfast.moe.routing",
    "update_expert_bias": "lightning_llmfast.moe.routing",
    "MoEConfig": "lightning_llmfast.moe.config",
    "RoutingConfig": "lightning_llmfast.moe.config",
    "MoEStats": "lightning_llmfast.moe.stats",
    "MoELayer": "lightning_llmfast.moe.stats",
    "SequenceBoundaries": "lightning_llmfast.moe.losses",
    "SwiGLUExperts": "lightning_llmfast.moe.naive",
    "NaiveMoEBlock": "lightning_llmfast.moe.naive",
    "GroupedExperts": "lightning_llmfast.moe.experts",
    "TokenDispatcher": "lightning_llmfast.moe.dispatcher",
    "ExpertRows": "lightning_llmfast.moe.dispatcher",
    "LocalDispatcher": "lightning_llmfast.moe.dispatcher",
    "expert_swiglu": "lightning_llmfast.moe.experts",
    "routed_swiglu": "lightning_llmfast.moe.experts",
    "permute": "lightning_llmfast.moe.token_rows",
    "unpermute": "lightning_llmfast.moe.token_rows",
    "GroupedMoE": "lightning_llmfast.moe.block",
    "MoEBlock": "lightning_llmfast.moe.block",
    "SharedExperts": "lightning_llmfast.moe.block",
    "register_moe_adapter": "lightning_llmfast.moe.adapters",
    "get_moe_adapter": "lightning_llmfast.moe.adapters",
}

# Deprecated names that moved to lightning_llmfast.expert_parallel (they resolve with a DeprecationWarning).
_MOVED: dict[str, str] = {
    "AllToAllCapacityDispatcher": "lightning_llmfast.expert_parallel",
    "AllToAllDispatcher": "lightning_llmfast.expert_parallel",
    "AllToAllDroplessDispatcher": "lightning_llmfast.expert_parallel",
    "shard_experts": "lightning_llmfast.expert_parallel",
}

__all__ = [
    "ExpertRows",
    "GroupedExperts",
    "GroupedMoE",
    "LocalDispatcher",
    "MoEBlock",
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "NaiveMoEBlock",
    "RoutingConfig",
    "RoutingPlan",
    "SequenceBoundaries",
    "SharedExperts",
    "SwiGLUExperts",
    "TokenDispatcher",
    "expert_swiglu",
    "get_moe_adapter",
    "permute",
    "register_moe_adapter",
    "route",
    "routed_swiglu",
    "unpermute",
    "update_expert_bias",
]


__getattr__ = lazy_getattr(__name__, _LAZY, moved=_MOVED)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.moe.adapters import get_moe_adapter, register_moe_adapter
    from lightning_llmfast.moe.block import GroupedMoE, MoEBlock, SharedExperts
    from lightning_llmfast.moe.config import MoEConfig, RoutingConfig
    from lightning_llmfast.moe.dispatcher import ExpertRows, LocalDispatcher, TokenDispatcher
    from lightning_llmfast.moe.experts import GroupedExperts, expert_swiglu, routed_swiglu
    from lightning_llmfast.moe.losses import SequenceBoundaries
    from lightning_llmfast.moe.naive import NaiveMoEBlock, SwiGLUExperts
    from lightning_llmfast.moe.routing import RoutingPlan, route, update_expert_bias
    from lightning_llmfast.moe.stats import MoELayer, MoEStats
    from lightning_llmfast.moe.token_rows import permute, unpermute
