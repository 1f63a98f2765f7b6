"""Expert parallelism: MoE experts split over the ranks of a process group, tokens exchanged by all-to-all.

Plain PyTorch on top of :mod:`lightning_llmfast.moe` (no Lightning, no :mod:`lightning_llmfast.parallel`):

- :mod:`~lightning_llmfast.expert_parallel.sharding`: :func:`shard_experts` (one block) and
  :func:`shard_model_experts` (every block of a model, over a DeviceMesh dimension);
- :mod:`~lightning_llmfast.expert_parallel.dispatchers`: the all-to-all token dispatchers (dropless, capacity),
  their byte counts inside and across nodes (:class:`NodeTraffic`) and the batch-wide balance loss
  :func:`global_aux_loss`;
- :mod:`~lightning_llmfast.expert_parallel.hierarchical`: the hierarchical dispatch across nodes (a token crosses the
  node boundary once per destination node) and the node sub-groups it runs on;
- :mod:`~lightning_llmfast.expert_parallel.payload`: what travels on the wire (:class:`DispatchPayload`: bf16, fp8)
  and the differentiable exchange, whole or in two halves;
- :mod:`~lightning_llmfast.expert_parallel.overlap`: the chunked exchange whose chunks travel while the experts run
  (:func:`set_ep_overlap`);
- :mod:`~lightning_llmfast.expert_parallel.exchange`: the masked gathers around the exchange and the staging of its
  host-side handshakes, and the asynchronous all-to-all (a communication stream on CUDA);
- :mod:`~lightning_llmfast.expert_parallel.state`: the sharded expert tensors of a model: gradient reduction, their
  states as DTensor views for distributed checkpoints, full states sliced to a rank's experts.

The whole-run mesh (``ParallelDims``) and FSDP2 live in :mod:`lightning_llmfast.parallel`, which builds on this.

Example::

    from lightning_llmfast.expert_parallel import shard_experts

    shard_experts(block, dist.group.WORLD, dispatch_dtype="bf16")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

# public name -> submodule; resolved lazily so that importing the payload does not import the MoE block.
_LAZY: dict[str, str] = {
    "AllToAllCapacityDispatcher": "lightning_llmfast.expert_parallel.dispatchers",
    "AllToAllDispatcher": "lightning_llmfast.expert_parallel.dispatchers",
    "AllToAllDroplessDispatcher": "lightning_llmfast.expert_parallel.dispatchers",
    "NodeTraffic": "lightning_llmfast.expert_parallel.dispatchers",
    "SharedBatchDispatcher": "lightning_llmfast.expert_parallel.dispatchers",
    "share_batch": "lightning_llmfast.expert_parallel.sharding",
    "global_aux_loss": "lightning_llmfast.expert_parallel.dispatchers",
    "HierarchicalDispatcher": "lightning_llmfast.expert_parallel.hierarchical",
    "NodeGroups": "lightning_llmfast.expert_parallel.hierarchical",
    "node_groups": "lightning_llmfast.expert_parallel.hierarchical",
    "DispatchPayload": "lightning_llmfast.expert_parallel.payload",
    "set_ep_dispatch": "lightning_llmfast.expert_parallel.sharding",
    "set_ep_overlap": "lightning_llmfast.expert_parallel.sharding",
    "shard_experts": "lightning_llmfast.expert_parallel.sharding",
    "shard_model_experts": "lightning_llmfast.expert_parallel.sharding",
    "expert_parameters": "lightning_llmfast.expert_parallel.state",
    "expert_dtensor": "lightning_llmfast.expert_parallel.state",
    "expert_dtensor_optimizer_state": "lightning_llmfast.expert_parallel.state",
    "expert_dtensor_state_dict": "lightning_llmfast.expert_parallel.state",
    "grouped_moe_blocks": "lightning_llmfast.expert_parallel.state",
    "reduce_expert_gradients": "lightning_llmfast.expert_parallel.state",
    "sharded_moe_blocks": "lightning_llmfast.expert_parallel.state",
    "slice_expert_optimizer_state": "lightning_llmfast.expert_parallel.state",
    "slice_expert_state_dict": "lightning_llmfast.expert_parallel.state",
}

__all__ = [
    "AllToAllCapacityDispatcher",
    "AllToAllDispatcher",
    "AllToAllDroplessDispatcher",
    "DispatchPayload",
    "HierarchicalDispatcher",
    "NodeGroups",
    "NodeTraffic",
    "SharedBatchDispatcher",
    "expert_dtensor",
    "expert_dtensor_optimizer_state",
    "expert_dtensor_state_dict",
    "expert_parameters",
    "global_aux_loss",
    "grouped_moe_blocks",
    "node_groups",
    "reduce_expert_gradients",
    "set_ep_dispatch",
    "set_ep_overlap",
    "share_batch",
    "shard_experts",
    "shard_model_experts",
    "sharded_moe_blocks",
    "slice_expert_optimizer_state",
    "slice_expert_state_dict",
]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.expert_parallel.dispatchers import (
        AllToAllCapacityDispatcher,
        AllToAllDispatcher,
        AllToAllDroplessDispatcher,
        NodeTraffic,
        SharedBatchDispatcher,
        global_aux_loss,
    )
    from lightning_llmfast.expert_parallel.hierarchical import HierarchicalDispatcher, NodeGroups, node_groups
    from lightning_llmfast.expert_parallel.payload import DispatchPayload
    from lightning_llmfast.expert_parallel.sharding import (
        set_ep_dispatch,
        set_ep_overlap,
        shard_experts,
        shard_model_experts,
        share_batch,
    )
    from lightning_llmfast.expert_parallel.state import (
        expert_dtensor,
        expert_dtensor_optimizer_state,
        expert_dtensor_state_dict,
        expert_parameters,
        grouped_moe_blocks,
        reduce_expert_gradients,
        sharded_moe_blocks,
        slice_expert_optimizer_state,
        slice_expert_state_dict,
    )
