"""``strategy="llmfast"``: DDP or FSDP2 that skips itself on one device and owns the activation offloader.

Importing this module registers four names in Lightning's ``StrategyRegistry``: ``"llmfast"`` (DDP, offload off),
``"llmfast_offload"`` (DDP, offload on), ``"llmfast_fsdp"`` (FSDP2) and ``"llmfast_fsdp_offload"`` (FSDP2, offload
on). ``import lightning_llmfast`` imports it.

Example::

    import lightning as L
    import lightning_llmfast  # registers the strategies

    trainer = L.Trainer(strategy="llmfast_offload", accelerator="cuda", devices=8)
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_llmfast.callbacks.offload import ActivationOffload
from lightning_llmfast.comm.grad import GradReduction, PowerSGDConfig, check_ddp_arguments
from lightning_llmfast.comm.timing import ExchangeTimer, clock_for
from lightning_llmfast.errors import ConfigError, OffloadError
from lightning_llmfast.expert_parallel import (
    DispatchPayload,
    NodeGroups,
    set_ep_dispatch,
    set_ep_overlap,
    sharded_moe_blocks,
)
from lightning_llmfast.expert_parallel.overlap import check_chunks
from lightning_llmfast.expert_parallel.sharding import EP_DISPATCHES
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig
from lightning_llmfast.parallel.pretrained import loads_every_weight
from lightning_llmfast.strategy.checkpoint_io import VerifiedCheckpointIO
from lightning_llmfast.strategy.pipeline import PipelineParallelBase
from lightning_llmfast.strategy.recovery import InProcessLauncher, with_recovery

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.strategies.registry import _StrategyRegistry
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

    from lightning_llmfast.comm.timing import SpanTimer
    from lightning_llmfast.parallel.dims import ParallelDims

__all__ = ["LLMFastStrategy"]

# Offload settings the strategy once took as keywords: refused by name (DDP would take them, and ignore them on one
# process) with the OffloadConfig spelling.
_REMOVED_OFFLOAD_KEYWORDS = frozenset(
    {
        "offload_activations",
        "force_offload",
        "min_offload_bytes",
        "keep_last_layers",
        "prefetch_layers",
        "pool_headroom",
        "offload_layers",
        "recompute",
        "rebuild",
        "rebuild_gemms",
        "rebuild_gemm_layers",
    }
)


class LLMFastStrategy(PipelineParallelBase):
    """DDP or FSDP2 for LLM training with optional double-buffered activation offload.

    With one process on one device it neither wraps the model in ``DistributedDataParallel`` nor creates a
    process group, so no all-reduce is paid for; with several processes (gloo on CPU, NCCL on CUDA, any number of
    nodes through Lightning's launchers) it is plain DDP. With ``offload`` set it creates an
    :class:`~lightning_llmfast.offload.ActivationOffloader` (copy streams, pinned pool, device buffer sets) in
    :meth:`setup`, runs ``training_step`` inside its pack hooks and the backward inside the same step, and
    releases everything in :meth:`teardown`, also after an exception: the machinery of the
    :class:`~lightning_llmfast.callbacks.ActivationOffload` callback, which does the same under any strategy.
    The model needs no change.

    With ``sharding="fsdp"`` and several processes it builds a device mesh (:attr:`device_mesh`) and shards the
    model with FSDP2 instead of wrapping it in DDP: every block of ``layers`` and every top-level child holding other
    parameters is a ``fully_shard`` group, so parameters, gradients and optimizer state are split over the ranks
    (:class:`~lightning_llmfast.strategy.sharded.ShardedDataParallelBase`, :mod:`~lightning_llmfast.parallel.fsdp`).
    ``precision="bf16-mixed"`` computes in bf16 and reduces and keeps master weights in fp32. A model built in
    ``configure_model`` on the meta device is sharded first and then materialised shard by shard through its
    modules' ``reset_parameters()``. Checkpoints are DCP directories that every rank writes its shards into and
    that load into any world size (:mod:`~lightning_llmfast.parallel.checkpoint`; ``consolidate_checkpoint``
    exports one file for inference). One process shards nothing, as with DDP, but reads and writes the same
    checkpoints. A save that fails on any rank raises the same ``CheckpointError`` on every rank, and before every
    ``fit``, ``validate``, ``test`` or ``predict`` the strategy's launcher puts back a checkpoint that a kill inside
    a save left aside (:mod:`~lightning_llmfast.strategy.recovery`), so ``ckpt_path="last"`` finds it.

    Args:
        sharding: ``"ddp"`` (replicated model), ``"fsdp"`` (FSDP2 sharded data parallel) or ``"hsdp"`` (FSDP2 sharded
            within each node, replicated across the Trainer's ``num_nodes``; docs/multinode.md).
        offload: offload saved activations of ``layers`` to pinned host memory with these settings
            (:class:`~lightning_llmfast.offload.OffloadConfig`; ``True``: its defaults; ``None``/``False``: off).
            The layers' saved RMSNorm outputs (and, under ``precision="bf16-mixed"``, their saved bf16 weight copies)
            are then rebuilt in backward instead of kept, in every layer (``offload_layers=0`` does only that).
        layers: the layer stack (offloaded, and sharded block by block under ``"fsdp"``): ``None`` (the largest
            ``nn.ModuleList`` of identical blocks in the LightningModule), an attribute path such as
            ``"model.layers"``, or the modules.
        expert_parallel_size: ``N > 1`` splits the routed experts of every MoE block over groups of ``N`` ranks (the
            ``("edp", "ep")`` mesh of :class:`~lightning_llmfast.parallel.ParallelDims`;
            :mod:`~lightning_llmfast.expert_parallel`): tokens travel by all-to-all. Under ``"ddp"`` expert
            gradients are averaged over the ranks holding the same experts, dense ones by DDP over all, and
            checkpoints are DCP directories into which every rank writes its own experts and their optimizer state
            (nothing gathered), with the keys and shapes of a one-process checkpoint: they resume on any world size
            and export with ``python -m lightning_llmfast.export``; under ``"fsdp"`` the experts are also
            ``fully_shard`` ed over ``"edp"`` (each rank holds ``1 / world`` of every parameter). ``N`` must divide
            the world size and every block's experts. Gradient clipping by norm (``Trainer(gradient_clip_val=...)``)
            takes the global norm over both meshes under every layout, on the device, and logs it as
            ``train/grad_norm``.
        context_parallel_size: ``N > 1`` splits the positions of every packed batch over groups of ``N`` ranks
            (context parallelism, docs/long_context.md): the ranks of a group read the same batch, each keeps the
            share :func:`~lightning_llmfast.seqmeta.context_split` gives it (balanced by causal attention work, no
            per-document padding), and attention gathers the group's keys and values every layer. Dense parameters
            are sharded (FSDP) or replicated over data-parallel x cp ranks, expert-parallel groups are drawn from
            them (``expert_parallel_size`` divides ``dp_shard x cp``); losses, router statistics and token counts
            cover the whole group's batch, equal to one rank holding it. ``N`` must divide the world (under
            ``"hsdp"``: the processes of a node) and the tokens of every batch; batches must be ``PackedBatch`` es.
        pipeline_parallel_size: ``P > 1`` cuts the model's layers into pipeline stages run by torch's schedules
            inside the training step, with ``pipeline_microbatches``, ``pipeline_schedule``,
            ``pipeline_stages_per_rank`` and ``pipeline_layers``
            (:class:`~lightning_llmfast.strategy.pipeline.PipelineParallelBase`, docs/pipeline.md). With
            ``context_parallel_size`` the cp ranks of each stage split every microbatch's positions.
        dispatch_dtype: with ``expert_parallel_size > 1``, the tokens' payload on the all-to-all: ``None`` (the
            activations' dtype), ``"bf16"``, or ``"fp8"`` (e4m3 with one fp32 scale per row, ``H + 4`` bytes: half of
            bf16 plus the scales); the expert outputs and gradients then come back in bf16. A
            :class:`~lightning_llmfast.expert_parallel.DispatchPayload` chooses both (``combine="fp32"``). The error
            bound is in :mod:`~lightning_llmfast.expert_parallel.sharding`.
        ep_dispatch: with ``expert_parallel_size > 1``, how tokens cross nodes: ``"flat"`` (every (token, expert)
            pair to its expert's rank) or ``"hierarchical"`` (a token crosses the node boundary once per destination
            node and is fanned out to its experts inside it;
            :mod:`~lightning_llmfast.expert_parallel.hierarchical`). The nodes are Lightning's: ``len(devices)``
            processes on each of ``num_nodes``. Group-limited routing (``num_groups``, ``topk_groups``) must then
            have its groups inside the nodes (``num_groups`` a multiple of the nodes the expert-parallel group spans),
            so that each token reaches at most ``topk_groups`` nodes. Either way every training step logs this
            rank's forward all-to-all bytes as ``comm/inter_node_bytes`` (to other nodes) and
            ``comm/intra_node_bytes`` (to other ranks of its node), counted on the host from the split sizes.
        ep_overlap: with ``expert_parallel_size > 1``, hide the dispatchers' exchanges under compute: the
            routed rows travel in ``ep_overlap_chunks`` chunks (hierarchical: chunks of destination nodes, at most
            one per node, one with ``capacity_factor``), the experts of one chunk run while the next travels
            (forward and backward), and the shared experts and the balance loss run while the exchanges are in
            flight (:mod:`~lightning_llmfast.expert_parallel.overlap`; same bytes, same host reads, the same losses
            and gradients up to the order of floating-point sums). ``False``: exchange, then compute. Either way
            every training step logs ``comm/a2a_ms`` (the time the exchanges of the previous step were in flight)
            and ``comm/a2a_exposed_ms`` (the time that step waited for them): CUDA events, or the wall clock on the
            CPU (docs/distributed.md).
        ep_overlap_chunks: chunks per exchange: an int ``>= 1`` or ``"auto"`` (up to 4, each of at least 256 rows
            received per rank on average).
        grad_reduce_dtype: ``"bf16"`` reduces gradients in bf16 (half the bytes): DDP through torch's
            ``bf16_compress_hook``, FSDP2 through ``MixedPrecisionPolicy.reduce_dtype`` (experts included), the DDP
            experts of ``expert_parallel_size > 1`` in their all-reduce; ``None`` keeps their dtype
            (:mod:`~lightning_llmfast.comm.grad`).
        grad_compression: ``"powersgd"`` (or a :class:`~lightning_llmfast.comm.PowerSGDConfig`) reduces DDP
            gradients through torch's PowerSGD hook; its per-rank state is saved in checkpoints and resumed.
        *args: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and on to DDP).

    Raises:
        OffloadError: at construction for an ``offload`` that is neither an ``OffloadConfig``, a bool nor ``None``;
            at :meth:`setup`, before any step, when ``layers`` matches nothing.
        ConfigError: ``expert_parallel_size`` not an int ``>= 1``, a ``dispatch_dtype`` other than ``None``,
            ``"bf16"``, ``"fp8"`` or a ``DispatchPayload``, or one without expert parallelism; an ``ep_dispatch``
            other than ``"flat"`` or ``"hierarchical"``, or ``"hierarchical"`` without expert parallelism; before any
            step, when ``expert_parallel_size`` does not divide the world size or a block's experts, the model has
            no grouped MoE block, or (hierarchical) the expert-parallel group does not fill whole nodes equally or
            group-limited routing has groups that straddle nodes; an ``ep_overlap`` that is not a bool or an
            ``ep_overlap_chunks`` that is not an int ``>= 1`` or ``"auto"``.
        ConfigError: at construction for a keyword that neither this strategy, DDPStrategy nor
            ``DistributedDataParallel`` takes, under every ``sharding`` (named, with its closest accepted spelling).
        ConfigError: at construction for a ``grad_reduce_dtype`` other than ``None``/``"bf16"``, a
            ``grad_compression`` other than ``None``/``"powersgd"``/a ``PowerSGDConfig``, both together, PowerSGD
            with ``sharding="fsdp"``, or either with a ``ddp_comm_hook``.
        ConfigError: at construction for a ``sharding`` other than ``"ddp"`` or ``"fsdp"``; under ``"fsdp"``, at
            :meth:`setup` before any step,
            when ``layers`` matches nothing, the precision has no FSDP2 policy (``"16-mixed"``), or meta-device
            modules have no ``reset_parameters()``; when resuming from a file that is not a distributed checkpoint.

    Example::

        strategy = LLMFastStrategy(offload=OffloadConfig(offload_layers="auto"), layers="model.layers")
        trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=1, precision="bf16-mixed")
        trainer.fit(MoEGPTLightningModule(MoEGPTConfig(n_layers=12)), datamodule=dm)
        print(strategy.offload_stats)  # the last step's offload stats, also after fit

        trainer = L.Trainer(strategy="llmfast_fsdp", accelerator="cuda", devices=8, precision="bf16-mixed")
        trainer.fit(module, datamodule=dm, ckpt_path="ckpts/last.ckpt")  # a DCP directory, any world size

        strategy = LLMFastStrategy(sharding="fsdp", expert_parallel_size=4)  # FSDP2 x EP on one mesh
        strategy = LLMFastStrategy(expert_parallel_size=8, dispatch_dtype="fp8")  # e4m3 tokens, bf16 outputs
        strategy = LLMFastStrategy(sharding="fsdp", context_parallel_size=4)  # long rows split over 4 ranks
        trainer = L.Trainer(strategy=strategy, devices=8, precision="bf16-mixed", gradient_clip_val=1.0)
    """

    strategy_name = "llmfast"

    def __init__(
        self,
        *args: Any,
        sharding: str = "ddp",
        offload: OffloadConfig | bool | None = None,
        layers: Sequence[nn.Module] | nn.Module | str | None = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        dispatch_dtype: str | DispatchPayload | None = None,
        ep_dispatch: str = "flat",
        ep_overlap: bool = True,
        ep_overlap_chunks: int | str = "auto",
        grad_reduce_dtype: str | None = None,
        grad_compression: str | PowerSGDConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.grad_reduction = GradReduction.from_args(grad_reduce_dtype, grad_compression, owner=type(self).__name__)
        """The gradient reduction (dtype or PowerSGD; bytes per step in ``wire_bytes``)."""
        check_ddp_arguments(self.grad_reduction, sharding, kwargs, owner=type(self).__name__)
        self._user_comm_hook = kwargs.get("ddp_comm_hook") is not None
        self._user_init_sync = "init_sync" in kwargs
        self.dispatch_payload = DispatchPayload.of(dispatch_dtype)
        """The expert-parallel all-to-all payloads (``DispatchPayload()``: the activations' dtype both ways)."""
        if self.dispatch_payload != DispatchPayload() and expert_parallel_size == 1:
            raise ConfigError(
                f"{type(self).__name__}: dispatch_dtype={dispatch_dtype!r} needs expert_parallel_size > 1 "
                "(without expert parallelism no token is sent)"
            )
        if ep_dispatch not in EP_DISPATCHES:
            raise ConfigError(f"{type(self).__name__}: ep_dispatch must be one of {EP_DISPATCHES}, got {ep_dispatch!r}")
        if ep_dispatch != "flat" and expert_parallel_size == 1:
            raise ConfigError(f"{type(self).__name__}: ep_dispatch={ep_dispatch!r} needs expert_parallel_size > 1")
        self.ep_dispatch = ep_dispatch
        """How expert-parallel tokens cross nodes: ``"flat"`` or ``"hierarchical"``."""
        if not isinstance(ep_overlap, bool):
            raise ConfigError(f"{type(self).__name__}: ep_overlap must be a bool, got {ep_overlap!r}")
        check_chunks(ep_overlap_chunks, owner=f"{type(self).__name__}: ep_overlap_chunks")
        self.ep_overlap_chunks: int | str | None = ep_overlap_chunks if ep_overlap else None
        """Chunks of the overlapped expert-parallel exchanges (``None``: ``ep_overlap=False``)."""
        self._a2a_timer: ExchangeTimer | None = None
        removed = sorted(set(kwargs) & _REMOVED_OFFLOAD_KEYWORDS)
        if removed:
            raise OffloadError(
                f"{type(self).__name__}: {', '.join(removed)} removed; pass offload=OffloadConfig(...) or "
                "offload=True (force_offload is OffloadConfig(force=...), rebuild_gemms=True is rebuild='norms+gemms')"
            )
        self.offload_config = self._offload_config(offload)
        kwargs.setdefault("checkpoint_io", VerifiedCheckpointIO())  # digests of every tensor, verified on load
        super().__init__(
            *args,
            sharding=sharding,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            **kwargs,
        )
        self._layers_spec = layers
        # The hierarchical dispatch's node sub-groups and the mesh they were built on: built once, reused by every
        # later setup (fit, validate, test) of this strategy.
        self._node_layout: tuple[ParallelDims, NodeGroups] | None = None
        config = self.offload_config
        self._offload = ActivationOffload(config, layers=layers) if config is not None else None
        if config is None and layers is not None and sharding == "ddp":
            # FSDP shards `layers` block by block: there the argument is used without offload too.
            rank_zero_warn("LLMFastStrategy: layers= does nothing without offload (or strategy='llmfast_offload')")

    @classmethod
    def _offload_config(cls, offload: OffloadConfig | bool | None) -> OffloadConfig | None:
        # A string must not pass: bool("no") is True.
        if offload is None or offload is False:
            return None
        if offload is True:
            return OffloadConfig()
        if not isinstance(offload, OffloadConfig):
            raise OffloadError(
                f"{cls.__name__}: offload must be an OffloadConfig, a bool or None, got {type(offload).__name__}"
            )
        return offload

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The activation offloader while fitting with offload on, else ``None``."""
        return self._offload.offloader if self._offload is not None else None

    @property
    def offload_stats(self) -> dict[str, int | bool] | None:
        """:attr:`ActivationOffloader.stats <lightning_llmfast.offload.ActivationOffloader.stats>` of the last step:
        while fitting, and after :meth:`teardown` released the offloader (``None`` before any offloading fit)."""
        return self._offload.stats if self._offload is not None else None

    @property
    def single_process(self) -> bool:
        """One process on one node: no process group, no DDP wrapper, no all-reduce."""
        return self.num_nodes * self.num_processes <= 1

    # ------------------------------------------------------------------ distributed plumbing
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.single_process and not self.cluster_environment.creates_processes_externally:
            self._launcher = InProcessLauncher()  # nothing to launch; also works in notebooks
        else:
            super()._configure_launcher()
        if self._launcher is not None:  # checkpoints a kill left aside put back before Lightning looks for them
            self._launcher = with_recovery(self._launcher)

    @override
    def setup_distributed(self) -> None:
        if not self.single_process:
            super().setup_distributed()
            _destroy_process_group_at_exit()
            return
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_clipping()
        if self.pipeline_config is not None:
            self._setup_pipeline(trainer)  # its own setup: stages cut and pruned, no DDP wrapper
            self._setup_node_dispatch()  # expert parallelism inside the stages: dispatch and overlap as asked
            if self._offload is not None and trainer.state.fn == TrainerFn.FITTING:
                assert self.lightning_module is not None
                self._offload.on_fit_start(trainer, self.lightning_module)
            return
        if self.sharding == "ddp" and not self.single_process:
            self._read_locally()
        if self.sharding == "ddp" and self.expert_parallel_size > 1:
            self._setup_expert_parallel()  # before DDP wraps the model and the optimizers are built
            self._setup_node_dispatch()
        elif self.sharding == "ddp" and not self.single_process:
            self._materialize()  # a meta-device model, before DDP broadcasts it
        if self.sharding != "ddp":
            self._check_fsdp_config(self._layers_spec)  # on every world size, before any step
        if self.sharding != "ddp" and not self.single_process:
            self._setup_sharded(trainer, self._layers_spec)
            self._setup_node_dispatch()
        elif self.single_process:
            self._materialize()  # configure_model (or a pretrained directory) on the meta device
            # The base setup (device, precision, optimizers) without DDP's wrapper and module-state broadcast.
            Strategy.setup(self, trainer)
            # One replica needs no DistributedSampler; Lightning would inject one (it sees a DDPStrategy) and it
            # would reshuffle training data the user did not ask to shuffle, unlike a single-device run.
            connector = getattr(trainer, "_accelerator_connector", None)
            if connector is not None and hasattr(connector, "use_distributed_sampler"):
                connector.use_distributed_sampler = False
        else:
            super().setup(trainer)
        self._setup_context_parallel()
        if self._offload is not None and trainer.state.fn == TrainerFn.FITTING:
            assert self.lightning_module is not None
            self._offload.on_fit_start(trainer, self.lightning_module)

    def _read_locally(self) -> None:
        """Under DDP a model whose every weight comes from a pretrained directory is read by each rank from the same
        files (rank-local reads, :mod:`~lightning_llmfast.parallel.pretrained`); DDP's start-up broadcast of rank 0's
        copy would then move every byte a second time, so it is turned off (``init_sync=False``) unless the user
        set ``init_sync``. A model initialised at random keeps the broadcast."""
        if self._user_init_sync:
            return
        assert self.lightning_module is not None
        if loads_every_weight(self.lightning_module):
            self._ddp_kwargs["init_sync"] = False
        else:
            self._ddp_kwargs.pop("init_sync", None)

    def _setup_node_dispatch(self) -> None:
        """Expert parallelism across Lightning's nodes (``len(devices)`` processes each): ``ep_dispatch``'s
        dispatchers, counting their bytes inside and across nodes, overlapped as ``ep_overlap`` says and timed."""
        if self.expert_parallel_size == 1:
            return
        assert self.lightning_module is not None and self.parallel_devices is not None
        ranks_per_node, dims, cached = len(self.parallel_devices), self.parallel_dims, self._node_layout
        layout = cached[1] if cached is not None and cached[0] is dims else None
        module, dispatch, timeout = self.lightning_module, self.ep_dispatch, self._timeout
        layout = set_ep_dispatch(module, dispatch, ranks_per_node, timeout=timeout, node_layout=layout)
        self._node_layout = (dims, layout) if layout is not None and dims is not None else None
        self._a2a_timer = ExchangeTimer(clock_for(self.root_device))
        set_ep_overlap(module, self.ep_overlap_chunks, self._a2a_timer)

    def _node_traffic(self) -> tuple[int, int]:
        """This rank's expert-parallel all-to-all bytes so far: ``(to other nodes, to other ranks of its node)``."""
        module = self.lightning_module
        if self.expert_parallel_size == 1 or module is None:
            return 0, 0
        traffic = [dispatcher.traffic for _, _, dispatcher in sharded_moe_blocks(module)]
        return sum(t.inter for t in traffic), sum(t.intra for t in traffic)

    def _log_node_traffic(self, before: tuple[int, int]) -> None:
        """Log the bytes of the training step's forward since ``before`` (:meth:`_node_traffic`)."""
        module = self.lightning_module
        if self.expert_parallel_size == 1 or module is None:
            return
        inter, intra = (now - then for now, then in zip(self._node_traffic(), before, strict=True))
        module.log("comm/inter_node_bytes", float(inter), on_step=True, on_epoch=False, batch_size=1)
        module.log("comm/intra_node_bytes", float(intra), on_step=True, on_epoch=False, batch_size=1)

    def _log_exchange_times(self) -> None:
        """Log ``comm/a2a_ms`` and ``comm/a2a_exposed_ms`` of the steps closed so far whose stamps completed (the
        previous step's forward and backward: reading them never waits for the device)."""
        module, timer = self.lightning_module, self._a2a_timer
        if timer is None or module is None:
            return
        times = timer.read_ms()
        if times is not None:
            module.log("comm/a2a_ms", times[0], on_step=True, on_epoch=False, batch_size=1)
            module.log("comm/a2a_exposed_ms", times[1], on_step=True, on_epoch=False, batch_size=1)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model if self.single_process else super()._setup_model(model)

    # ------------------------------------------------------------------ offload wiring
    # ------------------------------------------------------------------ gradient reduction
    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if not self._user_comm_hook:  # DDP takes one hook: the user's own (Lightning registers it) wins
            self.grad_reduction.register(self.model)

    @override
    def _dispatch(self) -> DispatchPayload:
        return self.dispatch_payload

    @override
    def _grad_sync_timer(self) -> SpanTimer | None:
        return self.grad_reduction.timer

    @override
    def _grad_reduce_dtype(self) -> torch.dtype | None:
        return self.grad_reduction.reduce_dtype  # FSDP2's reduce dtype, and the DDP experts' all-reduce

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        states = self.grad_reduction.gather_states()  # a collective: every rank saves through here
        super().save_checkpoint({**checkpoint, **states}, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self.grad_reduction.load_gathered_states(checkpoint, self.global_rank, self.world_size)
        return checkpoint

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        offload, trainer = self._offload, self.lightning_module.trainer if self.lightning_module else None
        before = self._node_traffic()
        if self._a2a_timer is not None:
            self._a2a_timer.close()  # the previous step: its forward and its backward
        if offload is None or offload.offloader is None or trainer is None:
            output = super().training_step(*args, **kwargs)
            self._log_node_traffic(before)
            self._log_exchange_times()
            return output
        assert self.lightning_module is not None
        offload.on_train_batch_start(trainer, self.lightning_module, None, 0)
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            offload.on_before_backward(trainer, self.lightning_module, None)
        self._log_node_traffic(before)
        self._log_exchange_times()
        # Automatic optimization runs backward next (see `backward`); manual optimization already did it inside
        # training_step, and a `None` output means Lightning skips backward.
        if output is None or not self.lightning_module.automatic_optimization:
            offload.on_train_batch_end(trainer, self.lightning_module, output, None, 0)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._untimed_exchanges():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._untimed_exchanges():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._untimed_exchanges():
            return super().predict_step(*args, **kwargs)

    @contextlib.contextmanager
    def _untimed_exchanges(self) -> Iterator[None]:
        """An evaluation step: the training step before it is closed (its forward and backward are whole), and the
        evaluation's own exchanges are dropped, so the timer holds nothing between training steps and no evaluation
        exchange is charged to a training step."""
        timer = self._a2a_timer
        if timer is not None:
            timer.close()
        try:
            yield
        finally:
            if timer is not None:
                timer.discard()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        offload = self._offload
        module = self.lightning_module
        assert module is not None
        if offload is None or offload.offloader is None or not module.automatic_optimization:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        try:
            result = super().backward(closure_loss, optimizer, *args, **kwargs)
        except BaseException as err:
            offload.on_exception(module.trainer, module, err)
            raise
        offload.on_after_backward(module.trainer, module)
        return result

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._offload is not None and self.lightning_module is not None:
            self._offload.on_exception(self.lightning_module.trainer, self.lightning_module, exception)

    @override
    def teardown(self) -> None:
        if self._offload is not None and self.lightning_module is not None:
            self._offload.teardown(self.lightning_module.trainer, self.lightning_module, "fit")
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (
            ("llmfast", "ddp", False, "LLMFastStrategy: DDP without the wrapper on one device"),
            ("llmfast_offload", "ddp", True, "LLMFastStrategy with double-buffered activation offload"),
            ("llmfast_fsdp", "fsdp", False, "LLMFastStrategy: FSDP2 sharded data parallel"),
            ("llmfast_fsdp_offload", "fsdp", True, "LLMFastStrategy: FSDP2 with activation offload"),
        )
        for name, sharding, offload, description in entries:
            # Guard: importing twice (or reloading) must not raise "already registered".
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, sharding=sharding, offload=offload)


LLMFastStrategy.register_strategies(StrategyRegistry)


# The process that registered the exit handler: a child forked from it inherits the handler but not the backends'
# threads, and must leave the parent's groups alone.
_EXIT_HANDLER_PID: int | None = None


def _destroy_default_process_group() -> None:
    """Shut every process group down while the interpreter is still whole; a no-op once the user destroyed it, and in
    a forked child."""
    if os.getpid() == _EXIT_HANDLER_PID and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _destroy_process_group_at_exit() -> None:
    """Register :func:`_destroy_default_process_group` with ``atexit``, once per process.

    Lightning keeps the process group after ``fit`` (a later ``test`` reuses it) and never destroys it. NCCL asks for
    ``destroy_process_group`` before exit, and a gloo group left to the interpreter's teardown can abort it
    ("terminate called without an active exception": worker threads that free tensors when Python can no longer take
    the GIL, pytorch/pytorch#179291). The handler shuts the backends down while Python is still whole.
    """
    global _EXIT_HANDLER_PID
    _EXIT_HANDLER_PID = os.getpid()
    atexit.unregister(_destroy_default_process_group)  # registered once, however many fits the process runs
    atexit.register(_destroy_default_process_group)
