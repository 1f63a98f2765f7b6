"""The sharding half of ``strategy="llmfast"``: ``sharding="ddp" | "fsdp" | "hsdp"`` on top of Lightning's DDPStrategy.

:class:`ShardedDataParallelBase` is the base of :class:`~lightning_llmfast.LLMFastStrategy`. With several processes
it builds the run's one layout, :class:`~lightning_llmfast.parallel.ParallelDims` and its device mesh, in
:meth:`~ShardedDataParallelBase.setup_environment` (from the world size and the Trainer's ``num_nodes``); under
``"fsdp"`` and ``"hsdp"`` its ``_setup_sharded`` replaces DDP's wrapper with
:func:`~lightning_llmfast.parallel.parallelize` (FSDP2 over the world, or within each node and replicated across
nodes, and expert parallelism when asked); with either on any world size, and with ``"ddp"`` under expert
parallelism, checkpoints are DCP directories (:mod:`lightning_llmfast.parallel.checkpoint`) that every rank writes its
own shards and experts into, restored after setup, optimizer state included, so they reshard (an ``"hsdp"``
checkpoint resumes under ``"fsdp"`` or another number of nodes, and back; a DDP x EP one on one process). Otherwise,
with ``"ddp"``, checkpoints are DDPStrategy's files, and a DCP directory given to resume is read as above.

Example::

    trainer = L.Trainer(strategy="llmfast_fsdp", accelerator="cuda", devices=8, precision="bf16-mixed")
    trainer = L.Trainer(strategy=LLMFastStrategy(sharding="hsdp"), num_nodes=4, devices=8)  # shards of 1/8
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_llmfast import expert_parallel
from lightning_llmfast._checks import check_int
from lightning_llmfast._layers import LayersSpec, resolve_layers
from lightning_llmfast.comm.grad import with_reduce_dtype
from lightning_llmfast.data import PackedBatch
from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.expert_parallel import expert_parameters
from lightning_llmfast.parallel import checkpoint as dcp_io
from lightning_llmfast.parallel.clip import clip_grad_norm, sharded_grads
from lightning_llmfast.parallel.dims import CP, SHARDINGS, ParallelDims
from lightning_llmfast.parallel.fsdp import materialize_module, mixed_precision_policy, time_reduce_scatters
from lightning_llmfast.parallel.layout import parallelize
from lightning_llmfast.parallel.verdict import agree

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.utilities.types import _PATH
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.optim import Optimizer

    from lightning_llmfast.comm.timing import SpanTimer
    from lightning_llmfast.expert_parallel import DispatchPayload

__all__ = ["ShardedDataParallelBase", "check_strategy_keywords"]


@functools.cache
def _passed_keywords() -> frozenset[str]:
    """The keywords DDPStrategy takes itself, and those it hands on to ``DistributedDataParallel`` (all but the
    module), read from their signatures so that a newer Lightning or torch brings its own."""
    names: set[str] = set()
    for function, skip in ((DDPStrategy.__init__, {"self"}), (DistributedDataParallel.__init__, {"self", "module"})):
        names.update(
            name
            for name, parameter in inspect.signature(function).parameters.items()
            if name not in skip and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        )
    return frozenset(names)


def check_strategy_keywords(kwargs: Mapping[str, Any], owner: str, own: Sequence[str] = ()) -> None:
    """Refuse the keywords of ``kwargs`` that neither DDPStrategy nor ``DistributedDataParallel`` takes, naming each
    with its closest accepted spelling: under FSDP2 they would be dropped in silence, under DDP fail only at setup.

    Args:
        kwargs: the keywords a strategy passes on to DDPStrategy.
        owner: the strategy's name, for the message.
        own: the strategy's own keywords (offered as spellings too).

    Raises:
        ConfigError: naming every unknown keyword.

    Example::

        check_strategy_keywords({"find_unused_parameter": True}, "LLMFastStrategy")  # ConfigError: did you mean ...
    """
    known = _passed_keywords()
    unknown = sorted(set(kwargs) - known)
    if not unknown:
        return
    spellings = sorted(known | set(own))
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, spellings, n=1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise ConfigError(
        f"{owner}: unknown keyword(s) {', '.join(hints)}; it takes its own settings and those of DDPStrategy and "
        "DistributedDataParallel"
    )


class ShardedDataParallelBase(DDPStrategy):
    """DDPStrategy with ``sharding="fsdp"`` or ``"hsdp"``: FSDP2 in place of the DDP wrapper and DCP checkpoints.

    Args:
        *args: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
        sharding: ``"ddp"`` (replicated model, DDPStrategy unchanged), ``"fsdp"`` (FSDP2 sharded data parallel) or
            ``"hsdp"`` (FSDP2 sharded within each node, replicated across the Trainer's ``num_nodes``).
        expert_parallel_size: ranks that split every MoE block's routed experts (``1``: none).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ConfigError: at construction for a ``sharding`` outside :data:`~lightning_llmfast.parallel.dims.SHARDINGS`,
            an ``expert_parallel_size`` that is not an int ``>= 1``, or a keyword that neither DDPStrategy nor
            ``DistributedDataParallel`` takes (:func:`check_strategy_keywords`, under every ``sharding``); in
            :meth:`setup_environment` when it does not divide the world size (under ``"hsdp"``: the processes of a
            node).

    Example::

        class MyStrategy(ShardedDataParallelBase):  # LLMFastStrategy is one
            ...
    """

    def __init__(
        self,
        *args: Any,
        sharding: str = "ddp",
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if not isinstance(sharding, str) or sharding not in SHARDINGS:
            raise ConfigError(f"{type(self).__name__}: sharding must be one of {SHARDINGS}, got {sharding!r}")
        check_int(f"{type(self).__name__}: expert_parallel_size", expert_parallel_size, low=1)
        check_int(f"{type(self).__name__}: context_parallel_size", context_parallel_size, low=1)
        own = [inspect.signature(c.__init__).parameters for c in type(self).__mro__ if "__init__" in vars(c)]
        check_strategy_keywords(kwargs, type(self).__name__, tuple(name for names in own for name in names))
        super().__init__(*args, **kwargs)
        self.sharding = sharding
        self.expert_parallel_size = expert_parallel_size
        self.context_parallel_size = context_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self._parallel_dims: ParallelDims | None = None
        self._mesh_world: dist.ProcessGroup | None = None  # the default group the mesh was built over
        self._parallelized: nn.Module | None = None  # the module parallelize() sharded over that mesh
        self._restored_distributed = False  # the last load_checkpoint read a DCP directory (weights, optimizers)

    def _materialize(self) -> None:
        """Where nothing is sharded (one process, or DDP without expert parallelism), a model built on the meta
        device still needs its weights: initialised, or read from its pretrained checkpoint."""
        assert self.lightning_module is not None
        materialize_module(self.lightning_module, self.root_device)

    @property
    def parallel_dims(self) -> ParallelDims | None:
        """The run's layout (from :meth:`setup_environment` on), else ``None``."""
        return self._parallel_dims

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``("edp", "ep")`` device mesh with several processes (``"dp_shard"`` its flattened world;
        ``("dp_replicate", "edp", "ep")`` under ``"hsdp"``), else ``None``."""
        dims = self._parallel_dims
        return dims.mesh if dims is not None and dims.world_size > 1 else None

    @property
    def mesh_device_type(self) -> str:
        """The device type the process group's backend serves (``"cpu"`` for gloo)."""
        return "cpu" if self._get_process_group_backend() == "gloo" else self.root_device.type

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded states load into the sharded model and the optimizers built on it.
        return self._distributed_checkpoints or self._resumes_from_dcp() or super().restore_checkpoint_after_setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self.sharding == "ddp" and not self._restored_distributed  # else load_checkpoint restored them

    @property
    def _distributed_checkpoints(self) -> bool:
        """Whether checkpoints are written as DCP directories: sharded states (FSDP2, or DDP's local experts)."""
        return self.sharding != "ddp" or self._ddp_experts

    def _resumes_from_dcp(self) -> bool:
        """Whether the Trainer resumes from a DCP directory (read into the model and optimizers after setup)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        path = getattr(trainer, "ckpt_path", None)
        return path is not None and dcp_io.is_distributed_checkpoint(path)

    @property
    def _expert_state_mesh(self) -> DeviceMesh | None:
        """The mesh DDP's local experts are saved and loaded over as DTensors (``None``: no such experts)."""
        return self._parallel_dims.ep_mesh if self._ddp_experts and self._parallel_dims is not None else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        dims = ParallelDims(
            self.world_size,
            self.sharding,
            self.expert_parallel_size,
            num_nodes=self.num_nodes,
            context_parallel_size=self.context_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
        world = dist.group.WORLD if dims.world_size > 1 else None
        if dims == self._parallel_dims and world is self._mesh_world:
            return  # a later fit, validate or test: the mesh's process groups are this strategy's, built once
        if world is not None:
            dims.build_mesh(self.mesh_device_type)
        self._parallel_dims, self._mesh_world = dims, world
        self._parallelized = None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One stream of batches per data-parallel index: the ranks of a context-parallel group (and the stages of a
        pipeline) read the same batches (``num_replicas = world / (pp * cp)``)."""
        dims = self._parallel_dims
        if dims is None or dims.dp == dims.world_size:
            return super().distributed_sampler_kwargs
        return {"num_replicas": dims.dp, "rank": dims.data_parallel_rank(self.global_rank)}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        dims = self._parallel_dims
        if dims is not None and dims.cp > 1:
            batch = self._context_shard(batch, dims)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _context_shard(self, batch: Any, dims: ParallelDims) -> PackedBatch:
        """This rank's share of ``batch``'s positions (:func:`~lightning_llmfast.seqmeta.context_split`), cut on the
        host before the copy: the ranks of a context-parallel group read the same batch and keep their own shares."""
        if not isinstance(batch, PackedBatch):
            raise ConfigError(
                f"context_parallel_size={dims.cp} splits the positions of packed batches and needs their document "
                f"boundaries: the dataloader yields {type(batch).__name__}, not a PackedBatch (use PackedDataModule, "
                "PreparedDataModule or pack_documents, or set context_parallel_size=1)"
            )
        return batch.context_shard(dims.coordinates(self.global_rank)[CP], dims.cp, dims.cp_group)

    def _setup_context_parallel(self) -> None:
        """Under context parallelism every MoE block's balance loss and step sums cover the whole shared batch."""
        dims, module = self._parallel_dims, self.lightning_module
        if dims is None or dims.cp == 1 or module is None:
            return
        assert dims.cp_group is not None
        expert_parallel.share_batch(module, dims.cp_group, dims.dp_group)

    def _parallelize(self, layers: Sequence[nn.Module] = (), mp_policy: MixedPrecisionPolicy | None = None) -> None:
        """:func:`~lightning_llmfast.parallel.parallelize` the LightningModule, once: a later setup of the same module
        on the same mesh (validate or test after fit) finds it sharded already."""
        module = self.lightning_module
        assert module is not None and self._parallel_dims is not None
        if module is self._parallelized:
            return
        dims, device = self._parallel_dims, self.root_device
        parallelize(module, dims, layers, device=device, mp_policy=mp_policy, dispatch=self._dispatch())
        self._parallelized = module

    def _setup_expert_parallel(self) -> None:
        """DDP with expert parallelism: each rank keeps its experts, which DDP's wrapper then leaves alone."""
        self._parallelize()

    @property
    def _ddp_experts(self) -> bool:
        dims = self._parallel_dims
        return dims is not None and dims.ep_enabled and dims.sharding == "ddp"

    def _setup_clipping(self) -> None:
        """Clipping by norm takes the global norm of every layout (and logs it): installed on the precision plugin."""
        self.precision_plugin = _with_global_norm_clipping(self.precision_plugin, self._clip_grad_norm)

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        module = self.lightning_module
        dims = self._parallel_dims
        assert module is not None
        experts = {id(p) for _, p, _ in expert_parameters(module)} if self._ddp_experts else set()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = sharded_grads(params, experts, dims.edp if dims is not None else 1)
        norm = clip_grad_norm(grads, max_norm, dims.dp_group if dims is not None else None)
        module.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        timer = self._grad_sync_timer() if self.sharding != "ddp" else None
        if timer is not None:

            def closure_then_close() -> Any:
                # FSDP2's reduce-scatters launch during backward; the step's last one has launched when it ends.
                result = closure()
                timer.close()
                return result

            return super().optimizer_step(optimizer, closure_then_close, model, **kwargs)
        if not self._ddp_experts:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        dims = self._parallel_dims
        assert dims is not None

        def closure_then_reduce() -> Any:
            # Inside the closure: after the step's last backward, before clipping and the optimizer update.
            result = closure()
            holders = dims.edp_mesh.get_group() if dims.edp > 1 else None
            expert_parallel.reduce_expert_gradients(self.lightning_module, holders, self._grad_reduce_dtype())
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def _check_fsdp_config(self, layers: LayersSpec) -> list[nn.Module]:
        """Everything ``sharding="fsdp"`` (or ``"hsdp"``) needs, checked on every world size before any step; returns
        the layers."""
        assert self.lightning_module is not None
        mixed_precision_policy(self.precision_plugin.precision)
        try:
            return resolve_layers(self.lightning_module, layers, hint="LLMFastStrategy(layers=...)", single=True)
        except ConfigError as err:
            raise ConfigError(f"sharding={self.sharding!r} shards the layer stack block by block: {err}") from err

    def _grad_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``None``: their own); a subclass may choose one."""
        return None

    def _dispatch(self) -> DispatchPayload | None:
        """The expert-parallel all-to-all payloads (``None``: the activations' dtype); a subclass may choose them."""
        return None

    def _grad_sync_timer(self) -> SpanTimer | None:
        """The timer of each step's gradient reduction, if one was asked for (``train/grad_sync_ms``)."""
        return None

    def _fsdp_mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed-precision policy for the precision setting, reducing in :meth:`_grad_reduce_dtype`."""
        return with_reduce_dtype(mixed_precision_policy(self.precision_plugin.precision), self._grad_reduce_dtype())

    def _setup_sharded(self, trainer: pl.Trainer, layers: LayersSpec) -> None:
        """Strategy setup with FSDP2 in place of the DDP wrapper: shard, materialise, then build the optimizers."""
        assert self.accelerator is not None and self.model is not None and self._parallel_dims is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        assert module is not None
        policy = self._fsdp_mp_policy()
        layers = self._check_fsdp_config(layers)
        self._parallelize(layers, policy)
        timer = self._grad_sync_timer()
        if timer is not None and self._parallel_dims.world_size > 1:
            time_reduce_scatters(module, timer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def teardown(self) -> None:
        # A setup that failed before materialising leaves meta tensors, which the base teardown's `.cpu()` cannot
        # move; give them (uninitialised) host storage so the error that stopped setup is the one the user sees.
        module = self.lightning_module
        if self.sharding != "ddp" and module is not None:
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                module.to_empty(device="cpu")
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if not self._distributed_checkpoints:
            return super().lightning_module_state_dict()
        # DDP's local experts as DTensor views: the keys and shapes of a one-process checkpoint, nothing gathered.
        return dcp_io.model_state(self.lightning_module, self._expert_state_mesh)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if not self._distributed_checkpoints:
            return super().optimizer_state(optimizer)
        return dcp_io.optimizer_state(self.lightning_module, optimizer, self._expert_state_mesh)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self._distributed_checkpoints:
            # Rank 0 writes the file; the others learn here whether it did (Lightning's barrier after the save would
            # leave them waiting for a rank that raised), and any failure raises on every rank alike.
            error: Exception | None = None
            try:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            except Exception as err:
                error = err
            agree(error, f"saving {filepath}")
            return
        if storage_options is not None:
            raise ConfigError(
                f"{type(self).__name__}(sharding={self.sharding!r}): save_checkpoint takes no storage_options"
            )
        path = Path(self.broadcast(str(filepath)))  # rank 0's path: every rank writes into the same directory
        dcp_io.save_distributed_checkpoint(checkpoint, path, rank=self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._restored_distributed = False
        if self.sharding == "ddp" and not dcp_io.is_distributed_checkpoint(checkpoint_path):
            return self._load_file_together(checkpoint_path, weights_only)  # a file (under EP: sliced on load)
        path = Path(self.broadcast(str(checkpoint_path)))
        error = None
        if not dcp_io.is_distributed_checkpoint(path):
            error = ConfigError(
                f"{type(self).__name__}(sharding={self.sharding!r}) resumes from distributed checkpoint directories; "
                f"{path} is not one (load a single-file checkpoint's weights with LightningModule.load_from_checkpoint)"
            )
        agree(error, f"resuming from {path}")  # every rank refuses, or none
        module = self.lightning_module
        assert module is not None
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            # Lightning restores before setup when it cannot see the path yet (Trainer.ckpt_path is set by this very
            # restore, so restore_checkpoint_after_setup said no): a model still on the meta device (configure_model,
            # a pretrained directory) has nothing to read into. Only the non-tensor entries now; Lightning restores
            # again after setup, knowing the path, and the tensors are read into the materialized model then.
            self._restored_distributed = True  # nothing for load_model_state_dict to load
            return dcp_io.load_checkpoint_meta(path, weights_only=weights_only)
        meta = dcp_io.load_distributed_checkpoint(
            path,
            self.lightning_module,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            ep_mesh=self._expert_state_mesh,
        )
        self._restored_distributed = True
        return meta

    def _load_file_together(self, checkpoint_path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        """Every rank reads and verifies the file (DDPStrategy's load); one collective makes every rank go on with
        it, or every rank raise (the ranks without an error raise :class:`CheckpointError` naming the others)."""
        checkpoint: dict[str, Any] = {}
        error: Exception | None = None
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        except (CheckpointError, OSError) as err:
            error = err
        agree(error, f"resuming from {checkpoint_path}")
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharding != "ddp" or self._restored_distributed:
            return  # load_checkpoint already loaded the shards
        if self._ddp_experts:
            state = expert_parallel.slice_expert_state_dict(self.lightning_module, checkpoint["state_dict"])
            checkpoint = {**checkpoint, "state_dict": state}
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.sharding != "ddp":
            return
        if self._ddp_experts:
            states = [
                expert_parallel.slice_expert_optimizer_state(self.lightning_module, optimizer, state)
                for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False)
            ]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)


class _GlobalNormClipping(Precision):
    """Mixed into the Trainer's precision plugin: clipping by norm calls the strategy's global-norm clipping."""

    _clip_by_norm: Callable[[Optimizer, float], None]

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self._clip_by_norm(optimizer, float(clip_val))


@functools.cache
def _global_norm_class(base: type[Precision]) -> type[Precision]:
    return type(base.__name__, (_GlobalNormClipping, base), {"__module__": base.__module__})


def _with_global_norm_clipping(plugin: Precision, clip: Callable[[Optimizer, float], None]) -> Precision:
    """``plugin`` itself, its class extended by :class:`_GlobalNormClipping` (every other behaviour unchanged)."""
    if not isinstance(plugin, _GlobalNormClipping):
        plugin.__class__ = _global_norm_class(type(plugin))
    plugin._clip_by_norm = clip  # type: ignore[attr-defined]
    return plugin
