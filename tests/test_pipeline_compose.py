"""Pipeline stages composed with data and expert parallelism inside each stage (issue 53): four gloo processes, two
stages of two ranks, equal to one process accumulating the same micro-batches (fp32, gradient clipping active).

- ``sharding="fsdp"``: each stage's blocks FSDP2-sharded over its two ranks (each holds half of its stage), every
  layer's saved activations offloaded (CPU copies); its DCP checkpoint resumes on one process without pipelining.
- ``expert_parallel_size=2``: each stage's experts split over its two ranks (overlapped exchanges, as by default),
  the rest replicated or FSDP2-sharded; the balance loss covers the stage's micro-batch ``k`` of both ranks, so the
  reference joins them.
- ``sharding="hsdp"`` on four one-rank nodes (each stage replicated over two nodes, sharded over one): one step's
  gradients through the runner equal one process's on both replicas' batches.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _distributed import run_distributed
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from pipeline_fit import MICRO, STEPS, batches, launch, module, one_process_fit, one_process_trainer

from lightning_llmfast import ConfigError, LLMFastStrategy
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.pipeline import PipelineConfig, PipelineRunner
from lightning_llmfast.parallel.pipeline_layout import parallelize_stages
from lightning_llmfast.seqmeta import SequenceMetadata

CLIP = 0.5  # pipeline_fit's gradient_clip_val


def _streams(ranks: list[dict[str, Any]], dims: ParallelDims) -> tuple[list[int], list[list[int]]]:
    """Each rank's data-parallel index, and per step the batch of each of the two streams (the sampler split the
    batches between them; a pipeline's stages read the same)."""
    replicas = [dims.data_parallel_rank(r) for r in range(dims.world_size)]
    streams = {replica: ranks[r]["seen"] for r, replica in enumerate(replicas)}
    assert all(ranks[r]["seen"] == streams[replica] for r, replica in enumerate(replicas))
    assert sorted(streams[0] + streams[1]) == list(range(2 * STEPS))
    return replicas, [[streams[0][step], streams[1][step]] for step in range(STEPS)]


def _assert_parameters(ranks: list[dict[str, Any]], single: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's (gathered) parameters within 1e-5 of one process's; returns them by name."""
    reference = dict(single.named_parameters())
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    assert set(held) == set(reference)  # every parameter on some stage, under the model's own name
    for rank in ranks:
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name
    return held


@pytest.mark.slow
def test_fsdp_sharded_offloaded_stages_equal_one_process_and_resume_without_pipelining(tmp_path: Path) -> None:
    # Interleaved: two stages per rank, each its own FSDP2 root (stages 0 and 2 on the first two ranks), whose
    # microbatches' forwards and backwards interleave under the offloader.
    ranks = launch(tmp_path, 4, "--sharding", "fsdp", "--schedule", "interleaved_1f1b", "--offload")
    replicas, order = _streams(ranks, ParallelDims(4, "fsdp", pipeline_parallel_size=2))
    single, losses = one_process_fit(order)
    for r, replica in enumerate(replicas):  # each rank logs its own replica's batch loss
        assert ranks[r]["losses"] == pytest.approx(losses[replica::2], abs=1e-5)
    norms = ranks[0]["grad_norms"]  # one norm over both stages and all shards, clipping every step
    assert min(norms) > CLIP and all(rank["grad_norms"] == pytest.approx(norms, rel=1e-6) for rank in ranks)
    for rank in ranks:  # each rank holds half of its stage's parameters
        assert rank["held"] / sum(p.numel() for p in rank["params"].values()) == pytest.approx(0.5, abs=1e-3)
    for rank in ranks:  # both layers of the rank offloaded, every buffer back in the pool
        stats = rank["offload"]
        assert stats["offload_layers"] == 2 and stats["offloaded_tensors"] > 0 and stats["checked_out"] == 0
    held = _assert_parameters(ranks, single)
    validation = one_process_trainer().validate(single, DataLoader(batches()[:1], batch_size=None), verbose=False)
    assert all(rank["val"] == pytest.approx(validation[0]["val/loss"], abs=1e-5) for rank in ranks)

    torch.set_num_threads(1)
    resumed = module()
    trainer = one_process_trainer(max_steps=STEPS)
    trainer.fit(resumed, DataLoader(batches(), batch_size=None), ckpt_path=str(tmp_path / "run.ckpt"))
    assert trainer.global_step == STEPS
    for name, param in resumed.named_parameters():  # the shards of both stages, by name
        assert torch.equal(param.detach(), held[name]), name
    state = trainer.optimizers[0].state
    assert len(state) == sum(1 for _ in resumed.parameters())  # every parameter's AdamW state came back
    assert all(int(s["step"]) == STEPS for s in state.values())


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_expert_parallel_stages_equal_one_process_on_joined_micro_batches(tmp_path: Path, sharding: str) -> None:
    ranks = launch(tmp_path, 4, "--ep", "2", "--equal", "--sharding", sharding)
    replicas, order = _streams(ranks, ParallelDims(4, sharding, expert_parallel_size=2, pipeline_parallel_size=2))
    single, losses = one_process_fit(order, equal=True, joint=True)
    # A rank's balance term is its share of the stage's balance loss: the two streams' losses average to the step's.
    by_replica = {replica: ranks[r]["losses"] for r, replica in enumerate(replicas)}
    assert [(a + b) / 2 for a, b in zip(by_replica[0], by_replica[1], strict=True)] == pytest.approx(losses, abs=1e-5)
    assert min(ranks[0]["grad_norms"]) > CLIP
    for rank in ranks:
        assert rank["overlap"] and all(chunks is not None for chunks in rank["overlap"])  # overlapped exchanges
        experts = [n for n in rank["params"] if ".experts." in n]
        assert experts  # MoE layers on both stages; each rank holds half of their experts (FSDP2: of everything)
        whole = sum(p.numel() for p in rank["params"].values())
        dense = whole - sum(rank["params"][n].numel() for n in experts)
        assert rank["held"] == (whole // 2 if sharding == "fsdp" else dense + (whole - dense) // 2)
    _assert_parameters(ranks, single)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv"])
def test_offload_with_a_split_backward_schedule_is_refused_at_construction(schedule: str) -> None:
    # Their weight-gradient step reads the saved activations again after the input-gradient step released them.
    with pytest.raises(ConfigError, match="does not compose with pipeline_schedule"):
        LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, pipeline_schedule=schedule, offload=True)
    LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, pipeline_schedule="1f1b", offload=True)


def _hsdp_step(rank: int, world: int, out: str) -> None:
    """One pipelined step of 2 stages x 2 replicas (4 one-rank nodes: HSDP replicates over them, shards over 1)."""
    model = module().model
    dims = ParallelDims(world, "hsdp", num_nodes=world, pipeline_parallel_size=2)
    dims.build_mesh("cpu")
    assert (dims.dp_replicate, dims.dp_shard) == (2, 1)
    config = PipelineConfig(2, MICRO, "1f1b")
    runner = PipelineRunner(model, config, dims.pp_group, device=torch.device("cpu"), dp_group=dims.dp_group)
    parallelize_stages(runner, dims)
    batch = batches()[dims.data_parallel_rank(rank)]
    runner.step(batch.input_ids, batch.labels, batch.position_ids, SequenceMetadata.from_batch(batch))
    runner.finish_step()
    grads = {}
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor) and param.grad.placements[0].is_replicate()  # 2-D: (replicas, shards)
        grads[name] = param.grad.full_tensor()
    torch.save(grads, f"{out}/grads{rank}.pt")


def test_hsdp_stages_give_one_process_gradients_on_both_replicas_batches(tmp_path: Path) -> None:
    run_distributed(_hsdp_step, 4, str(tmp_path))
    model = module().model
    data = batches()[:2]  # the two replicas' batches
    tokens = sum(float((b.labels != -100).sum()) for b in data)
    loss = sum(
        F.cross_entropy(model(b.input_ids, b.position_ids).flatten(0, 1), b.labels.flatten(), reduction="sum")
        for b in data
    )
    (loss / tokens).backward()
    reference = dict(model.named_parameters())
    held: dict[str, torch.Tensor] = {}
    for rank in range(4):
        grads = torch.load(tmp_path / f"grads{rank}.pt", weights_only=True)
        for name, grad in grads.items():  # replicas agree, and each stage's gradients are one process's
            assert torch.equal(grad, held.setdefault(name, grad)), name
            assert float((grad - reference[name].grad).abs().max()) < 1e-5, name
    assert set(held) == set(reference)  # the tied embedding/head summed over both stages


def test_fsdp_refuses_a_tied_embedding_and_head_on_one_ranks_two_stages() -> None:
    # "zbv" puts the first and the last stage on one rank: one tied parameter cannot sit in two FSDP2 groups.
    runner = PipelineRunner(module().model, PipelineConfig(1, 2, "zbv"), None, device=torch.device("cpu"))
    assert runner.stages == [0, 1] and runner.tied
    with pytest.raises(ConfigError, match="untie them"):  # before any mesh is used
        parallelize_stages(runner, ParallelDims(4, "fsdp", pipeline_parallel_size=2))
