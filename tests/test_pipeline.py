"""Pipeline parallelism (issue 53): torch's schedules over gloo ranks equal one process, by parameter name."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llmfast.errors import ConfigError, MetadataError
from lightning_llmfast.models.model import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel.dims import ParallelDims
from lightning_llmfast.parallel.pipeline import (
    SCHEDULES,
    PipelineConfig,
    PipelineRunner,
    bubble_share,
    single_stage_actions,
)
from lightning_llmfast.parallel.pipeline_split import balanced_cut, rank_stages, split_metadata
from lightning_llmfast.seqmeta import SequenceMetadata
from tests._distributed import run_distributed

STEPS, ROWS, SEQ, COEF, LR = 2, 8, 12, 0.05, 0.5


def _config(n_layers: int = 4, tie: bool = True) -> MoEGPTConfig:
    return MoEGPTConfig(
        vocab_size=61, hidden_size=32, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_size=24, num_experts=4,
        top_k=2, router_backend="torch", tie_embeddings=tie,
    )  # fmt: skip


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Packed rows with documents of random lengths (never crossing a row) and some ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 61, (ROWS, SEQ), generator=gen)
        positions = torch.zeros(ROWS, SEQ, dtype=torch.long)
        for row in range(ROWS):
            start = 0
            while start < SEQ:
                length = int(torch.randint(1, SEQ + 1, (1,), generator=gen))
                positions[row, start : start + length] = torch.arange(min(length, SEQ - start))
                start += length
        labels = torch.randint(0, 61, (ROWS, SEQ), generator=gen)
        labels[torch.rand(ROWS, SEQ, generator=gen) < 0.3] = -100
        out.append((ids, labels, positions))
    return out


def _reference(
    microbatches: int, n_layers: int, replicas: int, tie: bool = True
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process on every replica's batches: each microbatch's summed token losses plus its router loss times its
    label tokens, divided by the label tokens of all replicas' batches of the step (gradient accumulation over the
    microbatches), SGD after every step. Returns each replica's batch losses (and, last, the trained model's cross
    entropy on replica 0's first batch) and the parameters."""
    torch.manual_seed(0)
    model = MoEGPT(_config(n_layers, tie))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    streams = [_batches(1 + replica) for replica in range(replicas)]
    losses: list[list[float]] = [[] for _ in range(replicas)]
    for step in range(STEPS):
        total = sum((labels != -100).sum() for _, labels, _ in (stream[step] for stream in streams))
        for replica, stream in enumerate(streams):
            ids, labels, positions = stream[step]
            value = 0.0
            for mb in range(microbatches):
                rows = slice(mb * ROWS // microbatches, (mb + 1) * ROWS // microbatches)
                logits = model(ids[rows], positions[rows])
                ce = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), ignore_index=-100, reduction="sum")
                token_sum = ce + COEF * model.aux_loss() * (labels[rows] != -100).sum()
                (token_sum / total).backward()
                value += float(token_sum.detach())
            losses[replica].append(value / float((labels != -100).sum()))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # the trained model's token-mean cross entropy on replica 0's first batch
        ids, labels, positions = streams[0][0]
        logits = model(ids, positions)
        evaluated = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    losses.append([evaluated])
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _pipelined(
    rank: int, world: int, schedule: str, microbatches: int, n_layers: int, pp: int, tie: bool = True,
    cut: list[int] | None = None,
) -> None:  # fmt: skip
    torch.manual_seed(0)
    model = MoEGPT(_config(n_layers, tie))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    dims = ParallelDims(world, pipeline_parallel_size=pp)
    dims.build_mesh("cpu")
    runner = PipelineRunner(
        model, PipelineConfig(pp, microbatches, schedule, layers=cut), dims.pp_group, device=torch.device("cpu"),
        aux_loss_coef=COEF, dp_group=dims.dp_group,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    replica = dims.data_parallel_rank(rank)
    losses = []
    for ids, labels, positions in _batches(1 + replica):
        loss = runner.step(ids, labels, positions, SequenceMetadata.from_position_ids(positions))
        runner.finish_step()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    bubble = runner.bubble
    assert bubble is not None and 0 <= bubble < 1
    one_f_one_b = (pp - 1) / (microbatches + pp - 1)
    if schedule in ("interleaved_zero_bubble", "zbv"):
        assert bubble < one_f_one_b, (schedule, bubble, one_f_one_b)
    if cut is not None:
        assert runner.layer_counts == cut
        assert len(runner.model.layers) == cut[rank]  # pruned to the hand cut
    ref_losses, ref_params = _reference(microbatches, n_layers, dims.dp, tie)
    # Each rank reports its own replica's batch loss.
    assert losses == pytest.approx(ref_losses[replica], abs=1e-5, rel=1e-5), (schedule, rank, losses, ref_losses)
    ids, labels, positions = _batches(1)[0]
    evaluated = float(runner.evaluate(ids, labels, positions))  # the stages forward only, every rank the same
    assert evaluated == pytest.approx(ref_losses[-1][0], abs=1e-5), (schedule, rank, evaluated, ref_losses[-1])
    params = dict(model.named_parameters())
    assert params, "every rank holds a stage"
    for name, param in params.items():
        diff = float((param.detach() - ref_params[name]).abs().max())
        assert diff < 1e-5, (schedule, rank, name, diff)
    moved = max(float((initial[name] - p.detach()).abs().max()) for name, p in params.items())
    assert moved > 1e-3  # the parameters did train (the comparison is not vacuous)
    held = sum(p.numel() * p.element_size() for p in params.values())
    if pp == 2 and cut is None:
        assert held <= 0.6 * full_bytes, (rank, held / full_bytes)
    others: list[list[str] | None] = [None] * world
    dist.all_gather_object(others, sorted(params))
    assert set().union(*(set(o or ()) for o in others)) == set(ref_params)  # every parameter held, by its name


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_stage_pipeline_equals_one_process(schedule: str) -> None:
    run_distributed(_pipelined, 2, schedule, 4, 4, 2, timeout=180)


def test_four_stage_gpipe_equals_one_process() -> None:
    run_distributed(_pipelined, 4, "gpipe", 2, 4, 4, timeout=180)


def test_untied_head_and_a_cut_by_hand_equal_one_process() -> None:
    run_distributed(_pipelined, 2, "1f1b", 2, 4, 2, False, [1, 3], timeout=180)


def test_two_replicas_of_a_two_stage_pipeline_equal_one_process_on_both_batch_streams() -> None:
    run_distributed(_pipelined, 4, "1f1b", 2, 4, 2, timeout=180)


def test_config_refuses_bad_layouts() -> None:
    with pytest.raises(ConfigError, match="schedule must be one of"):
        PipelineConfig(2, 4, "looped_bfs")
    with pytest.raises(ConfigError, match="takes 1 stage per rank"):
        PipelineConfig(2, 4, "1f1b", stages_per_rank=2)
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        PipelineConfig(2, 4, "zbv", stages_per_rank=3)
    with pytest.raises(ConfigError, match="microbatches >= pipeline size"):
        PipelineConfig(4, 2, "1f1b")
    with pytest.raises(ConfigError, match="gives 3 stages"):
        PipelineConfig(2, 4, "1f1b", layers=[1, 1, 2])
    assert PipelineConfig(2, 4, "interleaved_1f1b").stages_per_rank == 2
    config = PipelineConfig(2, 4, "gpipe")
    with pytest.raises(ConfigError, match="must divide the world size 3"):
        config.check_world(3)
    with pytest.raises(ConfigError, match="must divide the batch size 6"):
        config.check_batch(6)
    with pytest.raises(ConfigError, match="only 3 layers"):
        PipelineConfig(2, 4, "interleaved_1f1b").check_layers(3)
    with pytest.raises(ConfigError, match="cannot split a Linear"):
        PipelineRunner(torch.nn.Linear(2, 2), PipelineConfig(1, 1, "gpipe"), None, device=torch.device("cpu"))  # type: ignore[arg-type]
    dense = MoEGPT(MoEGPTConfig(**{**vars(_config()), "attention_metadata": "dense"}))
    group: Any = object()  # refused before any collective on it: a dense mask would attend the shard's own keys only
    with pytest.raises(ConfigError, match=r"context parallelism.*attention_metadata='cached'"):
        PipelineRunner(dense, PipelineConfig(1, 1, "gpipe"), None, device=torch.device("cpu"), cp_group=group)


def _brute_force_cut(costs: list[float], stages: int, first: float, last: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def test_balanced_cut_is_optimal_against_brute_force() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        stages = int(torch.randint(1, n + 1, (1,), generator=gen))
        costs = (torch.rand(n, generator=gen) * 10).tolist()
        first, last = float(torch.rand(1, generator=gen) * 15), float(torch.rand(1, generator=gen) * 15)
        counts = balanced_cut(costs, stages, first=first, last=last)
        assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
        bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        assert max(loads) == pytest.approx(_brute_force_cut(costs, stages, first, last))
    with pytest.raises(ConfigError, match="cannot cut 2 layers into 3 stages"):
        balanced_cut([1.0, 1.0], 3)


def test_stage_placement_and_metadata_split() -> None:
    assert rank_stages(2, 2, 0, "loop") == [0, 2] and rank_stages(2, 2, 1, "v") == [1, 2]
    meta = SequenceMetadata.from_lengths([3, 3, 2, 4])  # rows of 6: [3, 3], [2, 4]
    first, second = split_metadata(meta, 2)
    assert first.cu_seqlens.tolist() == [0, 3, 6] and second.cu_seqlens.tolist() == [0, 2, 6]
    with pytest.raises(MetadataError, match="crosses the boundary"):
        split_metadata(SequenceMetadata.from_lengths([4, 8]), 2)


def test_bubble_share_of_single_stage_schedules_matches_the_closed_form() -> None:
    # GPipe and 1F1B on p ranks with m microbatches idle (p - 1) / (m + p - 1) of the time.
    for schedule in ("gpipe", "1f1b"):
        for p, m in ((2, 4), (4, 4), (3, 7)):
            table = single_stage_actions(schedule, p, m)
            assert all(
                sorted(a.microbatch_index for a in t if a.computation_type == "F") == list(range(m))
                for t in table.values()
            )
            assert bubble_share(table) == pytest.approx((p - 1) / (m + p - 1))
