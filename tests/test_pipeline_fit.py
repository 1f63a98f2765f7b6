"""Pipeline parallelism inside Lightning (issue 53): a two-stage fit equals one process accumulating the microbatches,
and its DCP checkpoint resumes on one process by parameter name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.parallel import consolidate_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[1]
sys.path.insert(0, str(SCRIPTS))
from pipeline_fit import MICRO, STEPS, Record, batches, micro_batches, module  # noqa: E402

from lightning_llmfast.parallel.dims import ParallelDims  # noqa: E402


def _trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy="llmfast", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5, **kwargs,
    )  # fmt: skip


def _fit(tmp: Path, devices: int, *args: str, out: str = "run") -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "pipeline_fit.py"), "--out", out, "--schedule", "1f1b", "--devices",
         str(devices), *args], cwd=tmp, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"{out}.rank{r}.pt", weights_only=True) for r in range(devices)]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pipeline_fit")
    return tmp, _fit(tmp, 2)


def _reference(order: list[list[int]], awkward: bool = False) -> tuple[L.LightningModule, list[float]]:
    """One process accumulating the micro-batches of the batches each optimizer step's replicas trained on
    (``order``: per step, the batches of every replica, in turn); returns the module and each batch's loss."""
    torch.set_num_threads(1)
    single, record = module(), Record()
    micro = micro_batches(awkward)
    chosen = [micro[MICRO * b + k] for step in order for b in step for k in range(MICRO)]
    trainer = _trainer(max_steps=len(order), accumulate_grad_batches=MICRO * len(order[0]), callbacks=[record])
    trainer.fit(single, train_dataloaders=DataLoader(chosen, batch_size=None))
    counts = [float((b.labels != -100).sum()) for b in chosen]
    # A replica's loss of a batch is its microbatches' losses weighted by their label tokens.
    batch_losses = [
        sum(record.losses[i] * counts[i] for i in range(s, s + MICRO)) / sum(counts[s : s + MICRO])
        for s in range(0, len(chosen), MICRO)
    ]
    return single, batch_losses


def test_two_stage_fit_equals_one_process_accumulating_the_microbatches(
    pipelined: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = pipelined
    assert ranks[0]["seen"] == ranks[1]["seen"] == list(range(STEPS))  # one pipeline: the stream, in order
    start = {name: p.detach().clone() for name, p in module().named_parameters()}
    single, expected = _reference([[step] for step in range(STEPS)])
    for rank in ranks:  # train/loss logged on every rank, the same value
        assert rank["losses"] == pytest.approx(expected, abs=1e-5)
        assert rank["bubbles"] == pytest.approx([1 / 3] * STEPS)  # 1F1B, 2 stages, 2 microbatches
        assert len(rank["stage_ms"]) == STEPS and min(rank["stage_ms"]) > 0  # the wall clock: complete at once
    reference = dict(single.named_parameters())
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    assert set(held) == set(reference)  # every parameter on some stage, under the model's own name
    assert not set(ranks[0]["params"]) & set(ranks[1]["params"]) - {"model.embed.weight"}  # tied: on both ends
    for name, value in held.items():
        assert float((value - reference[name].detach()).abs().max()) < 1e-5, name
    assert max(float((start[n] - p.detach()).abs().max()) for n, p in reference.items()) > 1e-3
    validation = _trainer().validate(single, DataLoader(batches()[:1], batch_size=None), verbose=False)
    assert ranks[0]["val"] == ranks[1]["val"] == pytest.approx(validation[0]["val/loss"], abs=1e-5)


def test_two_stage_checkpoint_resumes_on_one_process(pipelined: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = pipelined
    torch.set_num_threads(1)
    resumed = module()
    trainer = _trainer(max_steps=STEPS)
    trainer.fit(resumed, train_dataloaders=DataLoader(batches(), batch_size=None), ckpt_path=str(tmp / "run.ckpt"))
    assert trainer.global_step == STEPS
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    for name, param in resumed.named_parameters():
        assert torch.equal(param.detach(), held[name]), name
    state = trainer.optimizers[0].state
    assert len(state) == sum(1 for _ in resumed.parameters())  # every parameter's AdamW state came back
    assert all(int(s["step"]) == STEPS for s in state.values())
    consolidate_checkpoint(tmp / "run.ckpt", tmp / "whole.ckpt")  # one file holding the whole model
    whole = torch.load(tmp / "whole.ckpt", weights_only=True)["state_dict"]
    assert set(whole) == set(held) | {"model.lm_head.weight"}  # the tied head, as the model's state dict has it
    assert all(torch.equal(whole[name], value) for name, value in held.items())


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_pipeline_equal_one_process_on_both_streams(tmp_path: Path) -> None:
    ranks = _fit(tmp_path, 4)
    dims = ParallelDims(4, pipeline_parallel_size=2)
    replicas = [dims.data_parallel_rank(r) for r in range(4)]  # ranks 0 and 2 read one stream, 1 and 3 the other
    streams = {replica: ranks[r]["seen"] for r, replica in enumerate(replicas)}
    assert all(ranks[r]["seen"] == streams[replica] for r, replica in enumerate(replicas))  # a pipeline's stages
    assert sorted(streams[0] + streams[1]) == list(range(2 * STEPS))  # the sampler split the batches between them
    order = [[streams[0][step], streams[1][step]] for step in range(STEPS)]
    single, losses = _reference(order)
    for r, replica in enumerate(replicas):  # each rank logs its own replica's batch loss
        assert ranks[r]["losses"] == pytest.approx(losses[replica::2], abs=1e-5)
    reference = dict(single.named_parameters())
    for rank in ranks:
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name


@pytest.mark.slow
def test_two_stage_checkpoint_resumes_on_four_stages(pipelined: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = pipelined
    resumed = _fit(tmp, 4, "--pp", "4", "--resume", str(tmp / "run.ckpt"), out="pp4")
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    assert all(rank["step"] == STEPS for rank in resumed)
    # Every stage's AdamW state came back from the other layout, by parameter name.
    assert all(rank["adam"] == [STEPS] * len(rank["params"]) for rank in resumed)
    assert [len({n for n in r["params"] if ".layers." in n}) // 7 for r in resumed] == [1, 1, 1, 1]  # a layer each
    assert set().union(*(r["params"] for r in resumed)) == set(held)
    for rank in resumed:
        for name, value in rank["params"].items():
            assert torch.equal(value, held[name]), name


@pytest.mark.slow
def test_accumulating_two_pipelined_batches_equals_one_process_on_both(tmp_path: Path) -> None:
    # Lightning zeroes gradients between a training step and its backward at the start of every window: the
    # pipelined step's gradients must survive that, and the step's tokens span both batches.
    ranks = _fit(tmp_path, 2, "--accumulate", "2")
    single, losses = _reference([[0, 1]])  # one optimizer step on batches 0 and 1
    for rank in ranks:
        assert rank["seen"] == [0, 1] and rank["losses"] == pytest.approx(losses, abs=1e-5)
    reference = dict(single.named_parameters())
    for rank in ranks:
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name


def test_strategy_refuses_bad_pipeline_settings(tmp_path: Path) -> None:
    strategy = LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(ConfigError, match="must divide the world size 1"):  # at setup, before any step
        trainer.fit(module(), train_dataloaders=DataLoader(batches(), batch_size=None))
    with pytest.raises(ConfigError, match="schedule must be one of"):
        LLMFastStrategy(pipeline_parallel_size=2, pipeline_schedule="dualpipe")
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        LLMFastStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_stages_per_rank=1)
    strategy = LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, pipeline_schedule="gpipe")
    assert strategy.pipeline_config is not None and strategy.pipeline_config.num_stages == 2
    assert LLMFastStrategy().pipeline_config is None
    with pytest.raises(ConfigError, match="is a file: load its weights"):
        strategy.load_checkpoint(tmp_path / "single.ckpt")


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow)])
def test_pipeline_stages_split_over_context_parallel_ranks_equal_one_process(tmp_path: Path, schedule: str) -> None:
    # pp=2 x cp=2: each microbatch cut into its cp shards on the host; a row-long document split over both cp ranks,
    # length-1 documents, a document longer than a row, padding tails. Losses, val/loss and weights after three
    # clipped AdamW steps equal one process accumulating the microbatches (ZBV: the zero-bubble split backward).
    ranks = _fit(tmp_path, 4, "--cp", "2", "--schedule", schedule)
    single, expected = _reference([[step] for step in range(STEPS)], awkward=True)
    for rank in ranks:  # train/loss on every rank: the replica's whole batch, over both cp shards and both stages
        assert rank["losses"] == pytest.approx(expected, abs=1e-5)
    reference = dict(single.named_parameters())
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    assert set(held) == set(reference)
    for rank in ranks:  # the cp ranks of a stage hold the same stage, trained to the same values
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name
    validation = _trainer().validate(single, DataLoader(batches(awkward=True)[:1], batch_size=None), verbose=False)
    assert [rank["val"] for rank in ranks] == pytest.approx([validation[0]["val/loss"]] * 4, abs=1e-5)
