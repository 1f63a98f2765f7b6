"""Apply a :class:`~lightning_llmfast.parallel.ParallelDims` layout to a model, in the order NCCL requires.

:func:`parallelize` is what :class:`~lightning_llmfast.LLMFastStrategy` runs at setup, and what
:mod:`lightning_llmfast.plan` runs on a fake process group:

1. a model built eagerly is moved to the device first, then its states are broadcast from rank 0 in buckets (a
   process group on NCCL takes device tensors only; one broadcast per bucket, not per tensor);
2. with ``expert_parallel_size > 1`` every MoE block keeps its share of the experts (``"ep"``);
3. under FSDP2 the experts are ``fully_shard`` ed over ``"edp"``, the layer stack and the remaining top-level
   children over ``"dp_shard"`` (under HSDP, both 2-D with ``"dp_replicate"`` first: replicated across nodes);
4. a model built on the meta device is materialised shard by shard, or read from its pretrained checkpoint, each rank
   reading only what it holds (unless ``device`` is the meta device itself: a sharding plan,
   :mod:`lightning_llmfast.plan`).

Example::

    dims = ParallelDims(world, "fsdp", expert_parallel_size=2)
    dims.build_mesh("cuda")
    parallelize(module, dims, module.model.layers, device=torch.device("cuda", local_rank))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_llmfast.expert_parallel import DispatchPayload, shard_model_experts
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.fsdp import (
    broadcast_module_states,
    fully_shard_experts,
    materialize_module,
    shard_module,
)

__all__ = ["parallelize"]


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    layers: Sequence[nn.Module] = (),
    *,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    dispatch: DispatchPayload | None = None,
) -> list[nn.Module]:
    """Shard ``module`` in place as ``dims`` says (its mesh built); under DDP only the experts (DDP wraps later).

    Args:
        module: the model (LightningModule), built eagerly (any device) or on the meta device.
        dims: the layout, after :meth:`~lightning_llmfast.parallel.ParallelDims.build_mesh`.
        layers: the layer stack, sharded block by block under FSDP2 (unused under DDP).
        device: this rank's device (the one its process group serves).
        mp_policy: FSDP2 mixed precision.
        reshard_after_forward: FSDP2's ZeRO-3 (``True``) or ZeRO-2 behaviour.
        dispatch: the expert-parallel all-to-all payloads (``None``: the activations' dtype).

    Returns:
        The FSDP2 root modules (empty under DDP).

    Raises:
        ConfigError: from :func:`~lightning_llmfast.expert_parallel.shard_model_experts`,
            :func:`~lightning_llmfast.parallel.fsdp.shard_module` or
            :func:`~lightning_llmfast.parallel.fsdp.materialize_module`.

    Example::

        roots = parallelize(module, dims, module.model.layers, device=torch.device("cpu"))
    """
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        broadcast_module_states(module, device)
    if dims.ep_enabled:
        shard_model_experts(
            module, dims.ep_mesh, loss_group=dims.dp_group, fsdp=dims.sharding != "ddp", dispatch=dispatch
        )
    roots: list[nn.Module] = []
    if dims.fsdp_enabled:
        if dims.ep_enabled:
            fully_shard_experts(module, dims, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        roots = shard_module(
            module, dims.dp_mesh, layers, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    if device.type == "meta":
        return roots  # a sharding plan: nothing to allocate
    if not materialize_module(module, device) and dims.fsdp_enabled:
        module.to(device)  # buffers FSDP does not manage
    return roots
