"""Distributed layouts for the Lightning layer: sharded data parallel (FSDP2) and expert parallelism.

These helpers build DeviceMeshes and apply ``torch.distributed`` primitives (``fully_shard``, expert sharding) to a
model; :class:`~lightning_llmfast.LLMFastStrategy` calls them. They own no communication of their own.

- :mod:`~lightning_llmfast.parallel.fsdp`: meshes, per-block ``fully_shard``, mixed precision, meta materialisation.
- :mod:`~lightning_llmfast.parallel.checkpoint`: DCP save/load with resharding and the single-file export.

Example::

    from lightning_llmfast.parallel import consolidate_checkpoint

    consolidate_checkpoint("ckpts/last.ckpt", "export/model.ckpt")
"""

from lightning_llmfast.parallel.checkpoint import (
    consolidate_checkpoint,
    is_distributed_checkpoint,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from lightning_llmfast.parallel.fsdp import (
    build_device_mesh,
    materialize_module,
    mesh_shape,
    mixed_precision_policy,
    shard_module,
)

__all__ = [
    "build_device_mesh",
    "consolidate_checkpoint",
    "is_distributed_checkpoint",
    "load_distributed_checkpoint",
    "materialize_module",
    "mesh_shape",
    "mixed_precision_policy",
    "save_distributed_checkpoint",
    "shard_module",
]
