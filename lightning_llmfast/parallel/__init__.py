"""Distributed layouts for the Lightning layer: one device mesh for FSDP2 and expert parallelism.

:class:`ParallelDims` holds the run's layout and builds its one DeviceMesh (``"edp"`` x ``"ep"``, flattened to
``"dp_shard"``); :func:`parallelize` applies it to a model with ``torch.distributed`` primitives (``fully_shard``,
expert sharding); :class:`~lightning_llmfast.LLMFastStrategy` calls them. They own no communication of their own.

- :mod:`~lightning_llmfast.parallel.dims`: the layout and its mesh.
- :mod:`~lightning_llmfast.parallel.fsdp`: per-block ``fully_shard`` (the experts' over ``"edp"`` too), mixed
  precision, start-up broadcast, meta materialisation.

Expert sharding over ``"ep"`` itself is :mod:`lightning_llmfast.expert_parallel`, which this package applies.
- :mod:`~lightning_llmfast.parallel.clip`: gradient clipping by the global norm across both meshes.
- :mod:`~lightning_llmfast.parallel.checkpoint`: DCP save/load with resharding and the single-file export.
- :mod:`~lightning_llmfast.parallel.atomic`: checkpoints written beside their target, flushed, renamed over it.
- :mod:`~lightning_llmfast.parallel.verdict`: every rank's verdict turned into one decision by one collective.
- :mod:`~lightning_llmfast.parallel.pipeline` and :mod:`~lightning_llmfast.parallel.pipeline_split`: pipeline stages
  on ``torch.distributed.pipelining``'s schedules (the cut, the in-place pruning, the runner), reaching a model
  through its stage adapter (:mod:`~lightning_llmfast.parallel.pipeline_stage`: MoEGPT, transformers decoders).

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
from lightning_llmfast.parallel.clip import clip_grad_norm, global_grad_norm
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.fsdp import (
    broadcast_module_states,
    materialize_module,
    mixed_precision_policy,
    shard_module,
)
from lightning_llmfast.parallel.layout import parallelize

__all__ = [
    "ParallelDims",
    "broadcast_module_states",
    "clip_grad_norm",
    "consolidate_checkpoint",
    "global_grad_norm",
    "is_distributed_checkpoint",
    "load_distributed_checkpoint",
    "materialize_module",
    "mixed_precision_policy",
    "parallelize",
    "save_distributed_checkpoint",
    "shard_module",
]
