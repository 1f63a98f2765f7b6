"""FSDP2 for the Lightning layer: per-block ``fully_shard``, mixed precision, start-up broadcast, meta materialisation.

Everything here applies ``torch.distributed`` primitives (``fully_shard``, ``MixedPrecisionPolicy``, ``broadcast``)
on the meshes of :class:`~lightning_llmfast.parallel.ParallelDims`; nothing shards or communicates by itself. The
layout follows torchtitan: every block of the layer stack is its own FSDP2 group (its parameters are gathered just
before it runs and freed after), and every top-level child of the LightningModule that still holds parameters
(embeddings, final norm, head) is a root group.

Example::

    dims = ParallelDims(8, "fsdp")
    dims.build_mesh("cuda")
    roots = shard_module(lightning_module, dims.dp_mesh, layers=lightning_module.model.layers,
                         mp_policy=mixed_precision_policy("bf16-mixed"))
    materialize_module(lightning_module, torch.device("cuda"))  # only if built on the meta device
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_llmfast.comm.timing import SpanTimer
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.state import sharded_moe_blocks
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.pretrained import PRETRAINED_ATTRIBUTE, pretrained_targets

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "broadcast_module_states",
    "expert_shard_dim",
    "fully_shard_experts",
    "materialize_module",
    "mixed_precision_policy",
    "shard_module",
    "time_reduce_scatters",
]

BROADCAST_BUCKET_BYTES = 25 << 20
"""Largest flat buffer of :func:`broadcast_module_states` (DDP's default bucket size)."""

# Lightning precision -> FSDP2 policy: parameters gathered for compute in `param_dtype`, gradients reduced in
# `reduce_dtype`, sharded master weights and optimizer state stay in the module's dtype (fp32 under "-mixed").
_POLICIES: dict[str, tuple[torch.dtype, torch.dtype] | None] = {
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "32-true": None,
    "64-true": None,
    "bf16-true": None,
    "16-true": None,
}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy for a Lightning ``precision`` setting.

    ``"bf16-mixed"``: bf16 parameters for compute, fp32 gradient reduction, fp32 sharded master weights and
    optimizer state. ``"*-true"`` settings need none (Lightning already converted the module's dtype).

    Raises:
        ConfigError: for a setting FSDP2 cannot honour here, e.g. ``"16-mixed"`` (its gradient scaler does not
            support sharded gradients; use ``"bf16-mixed"``).

    Example::

        policy = mixed_precision_policy("bf16-mixed")
        policy.param_dtype  # torch.bfloat16
    """
    if precision not in _POLICIES:
        raise ConfigError(
            f"sharding='fsdp' supports precision in {sorted(_POLICIES)}, got {precision!r} (fp16 loss scaling is "
            "not supported with sharded gradients; use 'bf16-mixed')"
        )
    dtypes = _POLICIES[precision]
    return None if dtypes is None else MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    layers: Sequence[nn.Module],
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> list[nn.Module]:
    """Shard ``module`` in place with ``fully_shard``: each of ``layers``, then each top-level child left over.

    ``module`` itself (the LightningModule) is not wrapped: Lightning calls ``training_step``, not ``forward``, so
    the roots are its children, whose ``forward`` the step calls. The last layer keeps its parameters gathered
    after forward (its backward runs next, as in torchtitan). Calling it again on a sharded module does nothing.

    Args:
        module: the model (a LightningModule or any module whose children are called through ``forward``).
        mesh: the data-parallel mesh (:attr:`ParallelDims.dp_mesh`: 1-D shards FSDP-style, 2-D
            ``("dp_replicate", "dp_shard")`` HSDP-style); checked only by ``fully_shard``, after the arguments above.
        layers: the blocks of the layer stack, in execution order, all inside ``module``.
        mp_policy: FSDP2 mixed precision (:func:`mixed_precision_policy`); ``None`` computes in the stored dtype.
        reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3); ``False`` keeps them
            until backward (ZeRO-2: more memory, one all-gather fewer per block).

    Returns:
        The root modules sharded (top-level children of ``module``).

    Raises:
        ConfigError: ``layers`` is empty or not inside ``module``, or ``module`` holds parameters of its own (they
            would be neither sharded nor reduced).

    Example::

        roots = shard_module(lightning_module, mesh, lightning_module.model.layers)
    """
    if layers and all(isinstance(layer, FSDPModule) for layer in layers):
        return [child for child in module.children() if isinstance(child, FSDPModule)]
    inside = {id(m) for m in module.modules()}
    if not layers or any(id(layer) not in inside or layer is module for layer in layers):
        raise ConfigError(
            f"sharding='fsdp': the layer stack must be non-empty blocks inside {type(module).__name__}, got "
            f"{len(layers)} layer(s)"
        )
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ConfigError(
            f"sharding='fsdp': {type(module).__name__} holds parameters directly ({own}); move them into a child "
            "module so they can be sharded"
        )
    kwargs = {"mesh": mesh, "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy()}
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        fully_shard(layer, reshard_after_forward=reshard_after_forward and not last, **kwargs)
    in_blocks = {id(p) for layer in layers for p in layer.parameters()}
    roots = []
    for child in module.children():
        # A child whose every parameter already sits in a block group (the layer stack itself) needs no group.
        if any(id(p) not in in_blocks for p in child.parameters()):
            fully_shard(child, reshard_after_forward=reshard_after_forward, **kwargs)
            roots.append(child)
    return roots


def broadcast_module_states(
    module: nn.Module, device: torch.device, *, src: int = 0, bucket_bytes: int = BROADCAST_BUCKET_BYTES
) -> int:
    """Move ``module`` to ``device``, then broadcast its parameters and buffers from rank ``src`` in buckets.

    Used before sharding a model that every rank built eagerly, so that the shards come from one model even when
    the ranks' seeds differ (DDP does the same at construction). The move comes first: a process group on NCCL
    takes device tensors only. Tensors are packed by dtype into flat buckets of at most ``bucket_bytes`` (one larger
    tensor is a bucket alone), so a model costs a few broadcasts, not one per tensor. Already sharded parameters
    (DTensors) are left alone. Without an initialised process group only the move happens.

    Returns:
        The number of broadcasts issued.

    Example::

        broadcast_module_states(model, torch.device("cuda", local_rank))  # every rank now holds rank 0's weights
    """
    module.to(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    tensors = [t for t in [*module.parameters(), *module.buffers()] if not isinstance(t, DTensor)]
    buckets: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (bucket index, bytes in it)
    for tensor in tensors:
        index, used = sizes.get(tensor.dtype, (0, 0))
        size = tensor.numel() * tensor.element_size()
        if used and used + size > bucket_bytes:
            index, used = index + 1, 0
        sizes[tensor.dtype] = (index, used + size)
        buckets.setdefault((tensor.dtype, index), []).append(tensor)
    with torch.no_grad():
        for bucket in buckets.values():
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src)
            for tensor, chunk in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(chunk.view_as(tensor))
    return len(buckets)


def _shared_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """``(module, name, first module, its name)`` for every parameter also registered earlier (tied weights)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in first:
                ties.append((m, name, *first[id(p)]))
            else:
                first[id(p)] = (m, name)
    return ties


def materialize_module(module: nn.Module, device: torch.device) -> bool:
    """Allocate parameters and buffers left on the meta device on ``device`` and initialise them.

    Call after :func:`shard_module`: each rank allocates only its shards. Every module that holds meta tensors is
    re-initialised through its ``reset_parameters()`` (the convention of ``torch.nn`` layers, Lightning and FSDP),
    except inside a transformers model, where ``torch.nn`` layers and modules without it (RMSNorm, rotary tables) go
    through that model's ``_init_weights``, as transformers initialises them. Tied parameters stay tied. A submodule
    carrying a :class:`~lightning_llmfast.parallel.pretrained.PretrainedCheckpoint` in its ``pretrained_checkpoint``
    attribute is not initialised but read from it, each rank reading only what it holds (only its non-persistent
    buffers, such as rotary tables, are computed); the attribute is then cleared.

    Returns:
        Whether anything was on the meta device.

    Raises:
        ConfigError: a module with meta parameters or buffers has no ``reset_parameters()`` and no transformers
            model around it (checked before anything is allocated).
        CheckpointError: a pretrained checkpoint that does not match the model or cannot be read.

    Example::

        with torch.device("meta"):
            model = MoEGPT(config)
        shard_module(model, mesh, model.layers)
        materialize_module(model, torch.device("cuda"))
    """
    meta = [
        (name, m)
        for name, m in module.named_modules()
        if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    ]
    if not meta:
        return False
    targets = pretrained_targets(module)
    prefixes = [prefix for prefix, _, _ in targets]

    def from_checkpoint(name: str) -> bool:
        return any(not p or name == p or name.startswith(p + ".") for p in prefixes)

    # Inside a model read from a pretrained checkpoint only the tables it does not store are computed (rotary
    # `inv_freq`: non-persistent buffers); everything else is read from the checkpoint after allocation.
    inits = {
        name: _initializer(module, name, m)
        for name, m in meta
        if not from_checkpoint(name) or len(m._non_persistent_buffers_set) > 0
    }
    kinds = dict(meta)
    missing = [f"{name or '<root>'} ({type(kinds[name]).__name__})" for name, init in inits.items() if init is None]
    if missing:
        raise ConfigError(
            f"sharding='fsdp': modules built on the meta device need reset_parameters() to be initialised; "
            f"missing on {', '.join(missing)}"
        )
    ties = _shared_parameters(module)
    module.to_empty(device=device)
    for owner, name, source, source_name in ties:  # plain `to_empty` gives each module a parameter of its own
        if getattr(owner, name) is not getattr(source, source_name):
            setattr(owner, name, getattr(source, source_name))
    with torch.no_grad():
        for init in inits.values():
            init()  # type: ignore[misc]
    for _, target, checkpoint in targets:
        checkpoint.load_into(target)
        setattr(target, PRETRAINED_ATTRIBUTE, None)  # read once
    return True


def _initializer(root: nn.Module, name: str, m: nn.Module) -> Callable[[], None] | None:
    """How ``m`` is initialised: as the innermost transformers model holding it would, for ``torch.nn`` layers and
    modules without ``reset_parameters()`` (a Linear there gets ``normal(0, initializer_range)``, not torch's
    Kaiming default); otherwise ``m.reset_parameters`` (our grouped experts inside a swapped model)."""
    resettable = callable(getattr(m, "reset_parameters", None))
    if resettable and not type(m).__module__.startswith("torch.nn"):
        return m.reset_parameters
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):  # innermost first; transformers models define `_init_weights(module)`
        owner = root.get_submodule(".".join(parts[:depth]))
        if callable(getattr(owner, "_init_weights", None)) and hasattr(owner, "config"):
            return partial(owner._init_weights, m)
    return m.reset_parameters if resettable else None


def expert_shard_dim(shape: Sequence[int], shards: int) -> int:
    """The dimension FSDP2 shards a rank's expert tensor of ``shape`` (local experts first) on over ``shards`` ranks.

    The experts (dim 0) when they split evenly; else the first other dimension that does (with fewer local experts
    than ranks dim 0 would leave some ranks nothing: torchtitan shards on dim 1 then); else dim 0 (FSDP2 pads uneven
    shards on dim 0 only).

    Example::

        expert_shard_dim((1, 64, 32), 2)  # 1: each of 2 ranks holds half of every row of the one local expert
    """
    return next((dim for dim, size in enumerate(shape) if size % shards == 0), 0)


def fully_shard_experts(
    module: nn.Module,
    dims: ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` every MoE block sharded by :func:`~lightning_llmfast.expert_parallel.shard_model_experts`: its
    experts over ``"edp"``.

    FSDP2 gathers a group's parameters when its module's ``forward`` runs; the block reads its experts' weights in its
    own ``forward``, so the block is the experts' group (over ``"edp"``), and its other children with parameters
    (router, shared experts, their gates) are groups of their own over ``"dp_shard"``, sharded like every dense
    parameter. Each rank then holds ``1 / world`` of every expert tensor. Under ``"hsdp"`` the experts' mesh is
    ``("dp_replicate", "edp")`` and the other children's ``("dp_replicate", "dp_shard")``: sharded inside a node,
    replicated across nodes (:attr:`ParallelDims.expert_mesh`, :attr:`ParallelDims.dp_mesh`), each rank holding
    ``1 / ranks_per_node``. Expert tensors are sharded on :func:`expert_shard_dim` (the experts, or another dimension
    that splits evenly when there are fewer local experts than ``"edp"`` ranks). Expert gradients are summed over
    every rank holding the same experts and divided by the world size: each local expert's gradient already sums the
    losses of its ``"ep"`` group's ranks (the all-to-all's backward brings them home), so this makes it the gradient
    of the mean of all ranks' losses, as for the dense parameters.

    Raises:
        ConfigError: a block holds parameters of its own outside its children.

    Example::

        fully_shard_experts(model, dims)  # before the layers are sharded over "dp_shard"
    """
    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "reshard_after_forward": reshard_after_forward}
    for name, block, _ in list(sharded_moe_blocks(module)):
        own = [n for n, _ in block.named_parameters(recurse=False)]
        if own:
            raise ConfigError(f"expert parallelism under FSDP: MoE block {name!r} holds parameters directly ({own})")
        for child_name, child in block.named_children():
            if child_name != "experts" and any(True for _ in child.parameters()):
                fully_shard(child, mesh=dims.dp_mesh, **kwargs)
        fully_shard(block, mesh=dims.expert_mesh, shard_placement_fn=_expert_placement(dims.edp_mesh.size()), **kwargs)
        block.set_gradient_divide_factor(float(dims.world_size))
        # gloo has no pre-multiplied sum: a plain sum, then the division (NCCL fuses it). Not with one "edp" rank
        # (per node under "hsdp"): there FSDP2 reduce-scatters nothing and divides once itself, before the replicas'
        # all-reduce (a forced sum would divide a second time after it).
        gloo = dist.get_backend(dims.edp_mesh.get_group()) == "gloo"
        block.set_force_sum_reduction_for_comms(gloo and dims.edp_mesh.size() > 1)


def _expert_placement(shards: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP2's ``shard_placement_fn`` of an expert group: :func:`expert_shard_dim` of each rank's experts."""

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(local.shape, shards))

    return placement


class _TimedReduceScatter:
    """FSDP2's reduce-scatter (``dist.reduce_scatter_tensor`` into a fresh buffer, as its default) with each call
    stamped by a :class:`~lightning_llmfast.comm.timing.SpanTimer`: the ``allocate``/``__call__`` protocol of
    ``FSDPModule.set_custom_reduce_scatter``. FSDP2 calls it inside its reduce-scatter stream, so a CUDA clock's
    events land in that stream's order."""

    def __init__(self, timer: SpanTimer) -> None:
        self.timer = timer

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        span = self.timer.begin()
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if work is None:
            self.timer.end(span)
        else:
            work.get_future().then(lambda _: self.timer.end(span))
        return work


def time_reduce_scatters(module: nn.Module, timer: SpanTimer) -> int:
    """Stamp every reduce-scatter of ``module``'s FSDP2 units with ``timer`` (the step is closed by the caller with
    ``timer.close()`` once backward is over); returns the number of units timed.

    Example::

        timer = SpanTimer(clock_for(device))
        time_reduce_scatters(model, timer)
        loss.backward(); timer.close(); optimizer.step()
        timer.read_ms()  # the step's reduce-scatters: first launch to last completion
    """
    comm = _TimedReduceScatter(timer)
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]  # the protocol, not torch's private base class
    return len(units)
