"""Grouped MoE routing, sync-free permutation, grouped experts, MoE blocks and adapters (plain PyTorch).

Example::

    from lightning_llmfast.moe import MoEBlock

    block = MoEBlock(hidden_size=64, ffn_size=128, num_experts=8, top_k=2)
    y = block(torch.randn(2, 16, 64))  # (2, 16, 64); block.last_aux_loss, block.last_tokens_per_expert
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

# Imported eagerly: the function shares its name with its submodule, and once any code imports the submodule
# ``lightning_llmfast.moe.permute`` the import system binds that name on this package to the module, which a lazy
# lookup would never override.
from lightning_llmfast.moe.permute import permute, unpermute

# public name -> submodule; resolved lazily so that importing one part does not import the others.
_LAZY: dict[str, str] = {
    "route": "lightning_llmfast.moe.routing",
    "RoutingPlan": "lightning_llmfast.moe.routing",
    "update_expert_bias": "lightning_llmfast.moe.routing",
    "SwiGLUExperts": "lightning_llmfast.moe.naive",
    "NaiveMoEBlock": "lightning_llmfast.moe.naive",
    "GroupedExperts": "lightning_llmfast.moe.experts",
    "routed_swiglu": "lightning_llmfast.moe.dispatch",
    "MoEBlock": "lightning_llmfast.moe.block",
    "SharedExperts": "lightning_llmfast.moe.block",
    "register_moe_adapter": "lightning_llmfast.moe.adapters",
    "get_moe_adapter": "lightning_llmfast.moe.adapters",
    "ExpertLoadMetric": "lightning_llmfast.moe.metrics",
    "ExpertParallelDispatch": "lightning_llmfast.moe.expert_parallel",
    "shard_experts": "lightning_llmfast.moe.expert_parallel",
}

__all__ = [
    "ExpertLoadMetric",
    "ExpertParallelDispatch",
    "GroupedExperts",
    "MoEBlock",
    "NaiveMoEBlock",
    "RoutingPlan",
    "SharedExperts",
    "SwiGLUExperts",
    "get_moe_adapter",
    "permute",
    "register_moe_adapter",
    "route",
    "routed_swiglu",
    "shard_experts",
    "unpermute",
    "update_expert_bias",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.moe.adapters import get_moe_adapter, register_moe_adapter
    from lightning_llmfast.moe.block import MoEBlock, SharedExperts
    from lightning_llmfast.moe.dispatch import routed_swiglu
    from lightning_llmfast.moe.expert_parallel import ExpertParallelDispatch, shard_experts
    from lightning_llmfast.moe.experts import GroupedExperts
    from lightning_llmfast.moe.metrics import ExpertLoadMetric
    from lightning_llmfast.moe.naive import NaiveMoEBlock, SwiGLUExperts
    from lightning_llmfast.moe.routing import RoutingPlan, route, update_expert_bias
