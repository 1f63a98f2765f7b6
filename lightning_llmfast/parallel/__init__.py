"""Distributed layouts for the Lightning layer: sharded data parallel (FSDP2) and expert parallelism.

These helpers build DeviceMeshes and apply ``torch.distributed`` primitives (``fully_shard``, expert sharding) to a
model; :class:`~lightning_llmfast.LLMFastStrategy` calls them. They own no communication of their own.
"""
