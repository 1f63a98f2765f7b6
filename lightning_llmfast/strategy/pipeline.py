"""The pipeline half of ``strategy="llmfast"``: ``pipeline_parallel_size=P`` runs torch's pipeline schedules inside
Lightning's training step.

:class:`PipelineParallelBase` sits between :class:`~lightning_llmfast.strategy.sharded.ShardedDataParallelBase` and
:class:`~lightning_llmfast.LLMFastStrategy`. With ``pipeline_parallel_size > 1`` its setup cuts the LightningModule's
``model`` (a :class:`~lightning_llmfast.models.MoEGPT`, or the transformers causal LM of
:class:`~lightning_llmfast.HFCausalLMModule`: :mod:`~lightning_llmfast.parallel.pipeline_stage`) into stages and
prunes it in place
(:class:`~lightning_llmfast.parallel.pipeline.PipelineRunner`): the optimizers are then built on this rank's stages
only, under the full model's parameter names. Lightning's loop is unchanged (automatic optimization, accumulation,
clipping, optimizer and scheduler steps, callbacks, loggers):

- the strategy's ``training_step`` runs the batch's forward and backward through the schedule and returns the loss
  as a tensor whose own backward reaches nothing (the gradients are already accumulated), so the closure's
  ``backward`` costs nothing and its hooks still run;
- the ``world / P`` ranks of a stage read their own streams of batches (``distributed_sampler_kwargs``) and hold
  the stage replicated (``sharding="ddp"``) or FSDP2-sharded (``"fsdp"``/``"hsdp"``), its experts split over them
  with ``expert_parallel_size`` (:func:`~lightning_llmfast.parallel.pipeline_layout.parallelize_stages`);
- before the optimizer step (inside the closure, so before clipping) the gradients are divided by the step's label
  tokens over every replica, summed over the ranks of each stage (FSDP2 has summed its shards already) and over the
  tied embedding/head's two copies (:meth:`~lightning_llmfast.parallel.pipeline.PipelineRunner.finish_step`);
  clipping by norm takes the norm over every stage and shard (one all-reduce over the world);
- ``train/loss`` is logged on every rank: the loss of its replica's batch (the last stage's value plus every
  stage's router term, summed over the pipeline), ``train/ce`` (its cross entropy alone), ``pipeline/bubble`` (the
  schedule's idle share) and ``pipeline/stage_ms`` (this rank's schedule time per step: CUDA events, or the wall
  clock on the CPU); ``validate`` and ``test`` run the stages forward and log ``val/loss``/``test/loss``
  (``HFCausalLMModule``'s ``val/ppl`` too, through its ``log_validation_loss``); ``predict`` runs them forward and
  returns on every rank what the LightningModule's ``predict_step`` makes of the last stage's logits;
- with ``context_parallel_size=C`` the ``C`` ranks of a stage's cp group split every microbatch's positions: the
  batch's rows are cut into the microbatches and each into this rank's shard on the host (the step receives the
  list of shards), and the stages gather keys and values over the group (docs/long_context.md);
- checkpoints are DCP directories keyed by the model's names (each rank writes its stages), so they resume under
  another pipeline size, or none.

Example::

    strategy = LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=4, pipeline_schedule="1f1b")
    trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=2)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_llmfast.comm.timing import SpanTimer, clock_for
from lightning_llmfast.data import PackedBatch
from lightning_llmfast.data.packing import IGNORE_INDEX
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.parallel.broadcast import broadcast_tree
from lightning_llmfast.parallel.checkpoint import is_distributed_checkpoint
from lightning_llmfast.parallel.clip import ShardedGrad, clip_grad_norm
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.fsdp import time_reduce_scatters
from lightning_llmfast.parallel.pipeline import PipelineConfig, PipelineRunner
from lightning_llmfast.parallel.pipeline_layout import parallelize_stages, stage_fsdp_units
from lightning_llmfast.seqmeta import SequenceMetadata
from lightning_llmfast.strategy.sharded import ShardedDataParallelBase

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["PipelineParallelBase"]

_SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv")  # schedules whose backward is split into input and weight
_FIELDS = ("input_ids", "labels", "position_ids")


class PipelineParallelBase(ShardedDataParallelBase):
    """ShardedDataParallelBase with pipeline stages (``pipeline_parallel_size > 1``).

    Args:
        *args: passed on.
        pipeline_parallel_size: pipeline stages ``P`` (ranks of one pipeline); ``1``: no pipelining.
        pipeline_microbatches: row microbatches each batch is cut into; must divide the batch size.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"`` or ``"zbv"``.
        pipeline_stages_per_rank: stages per rank (``None``: 1 for ``"gpipe"``/``"1f1b"``, else 2).
        pipeline_layers: transformer layers per stage, by hand (``None``: balanced by parameters and compute).
        **kwargs: passed on.

    Raises:
        ConfigError: at construction, for a layout :class:`~lightning_llmfast.parallel.pipeline.PipelineConfig`
            refuses, or activation offload with a zero-bubble schedule (``"interleaved_zero_bubble"``, ``"zbv"``); at
            setup on every rank before any step, when ``P`` does not divide the world, the model (``module.model``,
            MoEGPT or transformers decoder) cannot be cut, has fewer layers than stages, uses manual
            optimization, or pipelining is combined with ``precision="16-mixed"`` (its
            gradient scaler), or under ``sharding="fsdp"``/``"hsdp"`` a tied
            embedding and head would sit in two stages of one rank (``"zbv"``); when resuming from a checkpoint file
            rather than a distributed checkpoint directory.

    Example::

        strategy = LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=4, pipeline_schedule="zbv")
    """

    def __init__(
        self,
        *args: Any,
        pipeline_parallel_size: int = 1,
        pipeline_microbatches: int = 1,
        pipeline_schedule: str = "1f1b",
        pipeline_stages_per_rank: int | None = None,
        pipeline_layers: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        config = PipelineConfig(
            pipeline_parallel_size, pipeline_microbatches, pipeline_schedule, pipeline_stages_per_rank, pipeline_layers
        )
        if config.size > 1 and config.schedule in _SPLIT_BACKWARD and getattr(self, "offload_config", None) is not None:
            # Their weight-gradient step reads the layers' saved activations again after the input-gradient step
            # has reloaded (and released) them.
            raise ConfigError(
                f"{type(self).__name__}: activation offload does not compose with pipeline_schedule="
                f"{config.schedule!r} (its backward is split into input and weight gradients); use 'gpipe', '1f1b' or "
                "'interleaved_1f1b'"
            )
        super().__init__(*args, pipeline_parallel_size=pipeline_parallel_size, **kwargs)
        self.pipeline_config: PipelineConfig | None = config if config.size > 1 else None
        """The pipeline layout (``None`` without pipelining)."""
        self._runner: PipelineRunner | None = None
        self._pipelined: nn.Module | None = None  # the LightningModule the runner pruned
        self._held_grads: list[tuple[nn.Parameter, Tensor]] = []  # the step's gradients until Lightning's backward
        self._stage_timer: SpanTimer | None = None  # this rank's schedule time per step (pipeline/stage_ms)

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        """The runner of this rank's stages, from setup on (``None`` without pipelining)."""
        return self._runner

    def _check_pipeline_composition(self) -> None:
        config, dims = self.pipeline_config, self.parallel_dims
        assert config is not None
        config.check_world(self.world_size)
        if str(self.precision_plugin.precision) == "16-mixed":
            # A gradient scaler scales the closure's loss, which the schedule's backward never sees.
            raise ConfigError(
                f"{type(self).__name__}: pipeline_parallel_size={config.size} does not compose with "
                'precision="16-mixed" (its gradient scaler never sees the schedule\'s backward): use "bf16-mixed"'
            )
        assert dims is not None and dims.pp_group is not None

    def _setup_pipeline(self, trainer: pl.Trainer) -> None:
        """Cut and prune the model (once per LightningModule), then the base setup without DDP's wrapper."""
        module = self.lightning_module
        assert module is not None and self.pipeline_config is not None
        self._check_pipeline_composition()
        if module is not self._pipelined:
            if not module.automatic_optimization:
                raise ConfigError(
                    f"{type(self).__name__}: pipeline_parallel_size runs the schedule's forward and backward inside "
                    "the training step of automatic optimization; manual optimization is not supported"
                )
            model = getattr(module, "model", None)
            if not isinstance(model, nn.Module):
                raise ConfigError(
                    f"{type(self).__name__}: pipeline_parallel_size cuts the LightningModule's `model` (a MoEGPT or a "
                    f"transformers decoder-only causal LM) into stages; {type(module).__name__} has no such attribute"
                )
            dims = self.parallel_dims
            assert dims is not None
            coef = float(getattr(module, "aux_loss_coef", 0.0))
            config, device = self.pipeline_config, self.root_device
            self._runner = runner = PipelineRunner(
                model, config, dims.pp_group, device=device, aux_loss_coef=coef, dp_group=dims.dp_group,
                cp_group=dims.cp_group,
            )
            # Experts split and FSDP2 groups inside each stage, before materialising (each rank allocates its
            # shards) and before the optimizers are built.
            policy = self._fsdp_mp_policy() if self.sharding != "ddp" else None
            parallelize_stages(runner, dims, mp_policy=policy, dispatch=self._dispatch())
            timer = self._grad_sync_timer()
            if timer is not None and dims.fsdp_enabled:
                for stage in runner.modules:
                    time_reduce_scatters(stage, timer)
            # Pruned first: a model built on the meta device allocates and initialises only this rank's stages.
            self._materialize()
            model.to(device)
            self._pipelined = module
        Strategy.setup(self, trainer)
        self._setup_context_parallel()  # this rank's MoE blocks: balance loss over the cp group's shards
        # Every stage of a pipeline reads its replica's stream of batches (distributed_sampler_kwargs). With one
        # replica that is the whole stream, as on one device: no DistributedSampler, which would reshuffle data the
        # user did not ask to shuffle.
        connector = getattr(trainer, "_accelerator_connector", None)
        dims = self.parallel_dims
        if (
            dims is not None
            and dims.dp == 1
            and connector is not None
            and hasattr(connector, "use_distributed_sampler")
        ):
            connector.use_distributed_sampler = False

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model if self._runner is not None else super()._setup_model(model)

    @property
    @override
    def _distributed_checkpoints(self) -> bool:
        return self.pipeline_config is not None or super()._distributed_checkpoints

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if self.pipeline_config is not None and not is_distributed_checkpoint(checkpoint_path):
            # A file's optimizer state is keyed by the whole model's parameter order, which a stage does not have.
            raise ConfigError(
                f"{type(self).__name__}: pipeline_parallel_size={self.pipeline_config.size} resumes from distributed "
                f"checkpoint directories (keyed by parameter name); {checkpoint_path} is a file: load its weights "
                "with LightningModule.load_from_checkpoint before fit (the strategy then cuts the loaded model)"
            )
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def _context_shard(self, batch: Any, dims: ParallelDims) -> Any:
        """Under pipelining, this rank's shard of every microbatch: the batch's rows cut into the microbatches, each
        cut into its context-parallel shard with its metadata planned on the host (a list, one per microbatch)."""
        if self.pipeline_config is None or not isinstance(batch, PackedBatch):
            return super()._context_shard(batch, dims)
        m = self.pipeline_config.microbatches
        self.pipeline_config.check_batch(batch.batch_size)
        rows, shard = batch.batch_size // m, super()._context_shard
        return [shard(batch.rows(k * rows, (k + 1) * rows), dims) for k in range(m)]

    def _batch_inputs(
        self, batch: Any
    ) -> tuple[Tensor, Tensor, Tensor | None, SequenceMetadata | list[SequenceMetadata] | None]:
        if isinstance(batch, list) and batch and all(isinstance(b, PackedBatch) for b in batch):
            # The microbatches' context-parallel shards (one row each), each with its own metadata.
            ids, labels, positions = (torch.cat([getattr(b, name) for b in batch]) for name in _FIELDS)
            return ids, labels, positions, [SequenceMetadata.from_batch(b) for b in batch]
        if isinstance(batch, PackedBatch):
            return batch.input_ids, batch.labels, batch.position_ids, SequenceMetadata.from_batch(batch)
        if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
            return batch["input_ids"], batch["labels"], batch.get("position_ids"), None
        raise ConfigError(
            f"{type(self).__name__}: pipelined steps take PackedBatch batches (or dicts with input_ids and labels), "
            f"got {type(batch).__name__}"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        runner, module = self._runner, self.lightning_module
        if runner is None or module is None:
            return super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        input_ids, labels, position_ids, metadata = self._batch_inputs(batch)
        # Lightning zeroes the gradients between the training step and its backward (at the start of an
        # accumulation window): this batch's gradients are computed apart, wait aside, and are added in `backward`
        # to what Lightning kept.
        params = [p for p in module.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        for param in params:
            param.grad = None
        timer = self._stage_timer
        if timer is None:
            timer = self._stage_timer = SpanTimer(clock_for(self.root_device))
        span = timer.begin(last=True)
        loss = runner.step(input_ids, labels, position_ids, metadata)
        timer.end(span)
        self._held_grads = [(p, p.grad) for p in params if p.grad is not None]
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad
        rows = int(input_ids.shape[0])
        module.log("train/loss", loss, prog_bar=True, batch_size=rows, sync_dist=False)
        if runner.last_ce is not None:  # the cross entropy alone, as the modules log it without pipelining
            module.log("train/ce", runner.last_ce, batch_size=rows, sync_dist=False)
        bubble = runner.bubble
        if bubble is not None:
            module.log("pipeline/bubble", bubble, on_step=True, on_epoch=False, batch_size=rows)
        stage_ms = timer.read_ms()  # this rank's stages, over the steps whose stamps completed (never waits)
        if stage_ms is not None:
            module.log("pipeline/stage_ms", stage_ms, on_step=True, on_epoch=False, batch_size=rows)
        # The closure's backward runs on a leaf of its own and reaches nothing: the gradients are computed already.
        return loss + torch.zeros((), device=loss.device, requires_grad=True)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        for param, grad in self._held_grads:
            param.grad = grad if param.grad is None else param.grad + grad
        self._held_grads = []
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _pipeline_eval(self, batch: Any, name: str) -> Tensor:
        runner, module = self._runner, self.lightning_module
        assert runner is not None and module is not None
        input_ids, labels, position_ids, metadata = self._batch_inputs(batch)
        try:
            loss = runner.evaluate(input_ids, labels, position_ids, metadata)
        finally:
            # FSDP2 keeps a stage's parameters gathered from forward to the schedule's end (no per-microbatch
            # gather); a forward-only schedule has no end that frees them, and the next update would leave them stale.
            for unit in stage_fsdp_units(runner):
                unit.reshard()
        metric = getattr(module, "val_ce" if name == "val/loss" else "test_ce", None)
        log_validation = getattr(module, "log_validation_loss", None) if name == "val/loss" else None
        if metric is not None:  # MoEGPTLightningModule's token-weighted mean over the split
            metric.update(loss, (labels != IGNORE_INDEX).sum())
            module.log(name, metric, prog_bar=True, batch_size=int(input_ids.shape[0]))
        elif callable(log_validation):  # HFCausalLMModule's val/loss, kept for its epoch's val/ppl
            log_validation(loss, int(input_ids.shape[0]))
        else:
            module.log(name, loss, prog_bar=True, batch_size=int(input_ids.shape[0]))
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._runner is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval(args[0] if args else kwargs["batch"], "val/loss")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._runner is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval(args[0] if args else kwargs["batch"], "test/loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipelining: the stages forward, then on the last stage the LightningModule's own ``predict_step``
        with its ``forward`` answering the pipeline's logits; its result is broadcast over the pipeline, so every
        rank returns what one process would."""
        runner, module = self._runner, self.lightning_module
        if runner is None or module is None:
            return super().predict_step(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        if isinstance(batch, list):  # the microbatches' context-parallel shards
            raise ConfigError(
                f"{type(self).__name__}: predict under pipeline_parallel_size with context_parallel_size="
                f"{self.context_parallel_size} is not supported (the per-sequence results would be split over the cp "
                "ranks): predict with context_parallel_size=1"
            )
        input_ids, _, position_ids, metadata = self._batch_inputs(batch)
        with self.precision_plugin.predict_step_context():
            logits = runner.forward(input_ids, position_ids, metadata)
        result = None
        if logits is not None:
            with _forward_answers(module, batch, logits):
                result = super().predict_step(*args, **kwargs)
        assert runner.group is not None
        return broadcast_tree(result, runner.last_rank, runner.group, self.root_device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        runner = self._runner
        if runner is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        timer = self._grad_sync_timer() if self.sharding != "ddp" else None

        def closure_then_finish() -> Any:
            # After the step's last backward, before clipping and the update: the gradients divided by the step's
            # label tokens, summed over the replicas and over the tied weight's two copies.
            result = closure()
            if timer is not None:
                timer.close()  # FSDP2's reduce-scatters launched at each schedule's end
            runner.finish_step()
            return result

        # DDPStrategy's step: the runner reduces every gradient itself (the base's expert averaging would again).
        return super(ShardedDataParallelBase, self).optimizer_step(optimizer, closure_then_finish, model, **kwargs)

    @override
    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        runner, module = self._runner, self.lightning_module
        if runner is None or module is None:
            super()._clip_grad_norm(optimizer, max_norm)
            return
        dims = self.parallel_dims
        assert dims is not None
        tied = runner.tied_weight() if runner.tied_holders == 2 else None
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # Every rank's squares go into one all-reduce over the world, each divided by the ranks holding the
                # same elements: an FSDP2 shard by its replicas (HSDP), a local expert by the stage's holders of
                # it, a replicated gradient by the stage's ranks; the tied weight's two equal copies count once.
                if isinstance(p.grad, DTensor):
                    mesh, local = p.grad.device_mesh, p.grad.to_local()
                    replicas = math.prod(mesh.size(i) for i, pl in enumerate(p.grad.placements) if pl.is_replicate())
                    replicas *= dims.stage_size // mesh.size()
                else:
                    local = p.grad
                    replicas = dims.edp if id(p) in runner.expert_params else dims.stage_size
                grads.append(ShardedGrad(local, replicas * (2 if p is tied else 1)))
        norm = clip_grad_norm(grads, max_norm)  # the default group: the world
        module.log("train/grad_norm", norm, on_step=True, on_epoch=False)


@contextmanager
def _forward_answers(module: nn.Module, batch: Any, logits: Tensor) -> Iterator[None]:
    """``module(batch)`` returns ``logits`` (once, for this very batch) inside the block: the LightningModule's own
    ``predict_step`` then runs on the pipeline's logits; its model is cut into stages and cannot run whole."""
    calls = []

    def forward(*args: Any, **kwargs: Any) -> Tensor:
        given = args[0] if args else next(iter(kwargs.values()), None)
        if given is not batch or len(args) + len(kwargs) != 1 or calls:
            raise ConfigError(
                f"pipelined predict: {type(module).__name__}.predict_step may call the module's forward once, on the "
                "batch it was given (the pipeline computes that batch's logits); it called it otherwise"
            )
        calls.append(1)
        return logits

    module.forward = forward  # type: ignore[method-assign]  # an instance attribute over the class's method
    try:
        yield
    finally:
        del module.forward
