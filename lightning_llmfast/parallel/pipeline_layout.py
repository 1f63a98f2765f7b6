"""Data and expert parallelism inside the pipeline stages: FSDP2/HSDP over a stage's ranks, experts split among them.

Under ``pipeline_parallel_size = P`` the ``world / P`` ranks of a stage hold the same layers (:class:`ParallelDims`,
``pp x dp_replicate x dp_shard x cp``). :func:`parallelize_stages` lays this rank's pruned stages out over those
ranks, as :func:`~lightning_llmfast.parallel.parallelize` lays out a whole model without pipelining:

- with ``expert_parallel_size = N`` every MoE block of the stage keeps its share of the experts over the stage's
  ``"ep"`` group (the stage's ranks form the ``("edp", "ep")`` mesh); the balance loss covers the stage's ranks;
- under ``sharding="fsdp"``/``"hsdp"`` every block of a stage is a ``fully_shard`` group over the stage's
  data-parallel mesh (experts over ``"edp"``), and the stage module torch's
  :class:`~torch.distributed.pipelining.PipelineStage` runs is the FSDP root (torch's stage then reduces the
  gradients once, after the schedule's last backward). Parameters stay gathered from a microbatch's forward to the
  schedule's end (torchtitan's default under pipelining: no gather per microbatch).

The runner's loss is a token-loss sum divided by the step's label tokens over all replicas
(:meth:`~lightning_llmfast.parallel.pipeline.PipelineRunner.finish_step`), so FSDP2 reduces by a plain sum (divide
factor 1, no mean) and ``finish_step`` sums over the replicas only the gradients FSDP2 did not reduce: DDP-style
dense ones over the stage's ranks, DDP-style local experts over the ranks holding the same experts.

Example::

    runner = PipelineRunner(module.model, config, dims.pp_group, device=device, dp_group=dims.dp_group)
    parallelize_stages(runner, dims)  # before materialising a meta-device model and building the optimizers
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel import DispatchPayload, expert_parameters, shard_model_experts
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.fsdp import fully_shard_experts
from lightning_llmfast.parallel.pipeline import PipelineRunner
from lightning_llmfast.parallel.pipeline_split import part, tied_parameter

__all__ = ["parallelize_stages", "stage_fsdp_units"]


def parallelize_stages(
    runner: PipelineRunner,
    dims: ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    dispatch: DispatchPayload | None = None,
) -> None:
    """Split the experts of ``runner``'s stages over the stage's ``"ep"`` ranks and shard the stages with FSDP2, in
    place, as ``dims`` says (its mesh built); tells the runner which gradients it still sums over replicas.

    Args:
        runner: the runner that pruned this rank's model to its stages (before any optimizer is built).
        dims: the layout, after :meth:`~lightning_llmfast.parallel.ParallelDims.build_mesh`.
        mp_policy: FSDP2 mixed precision.
        dispatch: the expert-parallel all-to-all payloads (``None``: the activations' dtype).

    Raises:
        ConfigError: FSDP2 with a tied embedding and head on one rank's two stages (``"zbv"``: one parameter
            cannot sit in two FSDP2 groups), or from :func:`~lightning_llmfast.expert_parallel.shard_model_experts`.

    Example::

        parallelize_stages(runner, dims, mp_policy=mixed_precision_policy("bf16-mixed"))
    """
    model = runner.model
    if dims.fsdp_enabled and runner.tied and runner.has_first and runner.has_last:
        raise ConfigError(
            f"pipeline with sharding={dims.sharding!r}: the tied embedding and head sit in two stages of one rank "
            f"(stages {runner.stages}); untie them (MoEGPTConfig(tie_embeddings=False), a "
            "transformers config's tie_word_embeddings=False) or use a schedule that puts the first and the last stage "
            "on different ranks"
        )
    if dims.ep_enabled:
        shard_model_experts(model, dims.ep_mesh, loss_group=dims.dp_group, fsdp=dims.fsdp_enabled, dispatch=dispatch)
    if not dims.fsdp_enabled:
        if dims.ep_enabled:  # DDP-style local experts: summed over the ranks holding the same ones, not the stage
            runner.expert_params = {id(p) for _, p, _ in expert_parameters(model)}
            runner.expert_group = dims.edp_mesh.get_group() if dims.edp > 1 else None
        return
    embed, head = part(runner.adapter, "embed"), part(runner.adapter, "head")
    tied = tied_parameter(runner.adapter)  # None unless this rank holds both
    names = [next((n for n, p in m.named_parameters() if p is tied), None) for m in (embed, head) if m is not None]
    if dims.ep_enabled:
        fully_shard_experts(model, dims, mp_policy=mp_policy, reshard_after_forward=False)
    kwargs = {"mesh": dims.dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "reshard_after_forward": False}
    for stage in runner.modules:
        for layer in stage.layers:
            fully_shard(layer, **kwargs)
        fully_shard(stage, **kwargs)  # the root: embedding, final norm and head; what PipelineStage reduces
    for unit in stage_fsdp_units(runner):
        # The runner divides the token-loss sums by the step's tokens over all replicas: FSDP2 sums (force_sum:
        # a plain sum, also on gloo, which has no pre-multiplied one).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    if tied is not None and not runner.has_first:
        # The last stage's root sharded the head's weight; the embedding registered beside it (for its name) shares
        # the sharded parameter again.
        embed_name, head_name = names
        assert embed is not None and head is not None and embed_name is not None and head_name is not None
        owner, _, name = embed_name.rpartition(".")
        embed.get_submodule(owner).register_parameter(name, head.get_parameter(head_name))


def stage_fsdp_units(runner: PipelineRunner) -> list[FSDPModule]:
    """Every FSDP2 unit of ``runner``'s stages (roots first, in stage order).

    Example::

        for unit in stage_fsdp_units(runner):
            unit.reshard()
    """
    units: list[FSDPModule] = []
    for stage in runner.modules:
        units.extend(m for m in stage.modules() if isinstance(m, FSDPModule) and m not in units)
    return units
