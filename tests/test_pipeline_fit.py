"""Pipeline parallelism inside Lightning (issue 53): a two-stage fit equals one process accumulating the microbatches,
and its DCP checkpoint resumes on one process by parameter name."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.export import main as export_main
from lightning_llmfast.parallel import consolidate_checkpoint

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from pipeline_fit import PREDICT, STEPS, batches, launch, module, one_process_fit, one_process_trainer

from lightning_llmfast.parallel.dims import ParallelDims


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pipeline_fit")
    return tmp, launch(tmp, 2, "--predict")


def test_two_stage_fit_equals_one_process_accumulating_the_microbatches(
    pipelined: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = pipelined
    assert ranks[0]["seen"] == ranks[1]["seen"] == list(range(STEPS))  # one pipeline: the stream, in order
    start = {name: p.detach().clone() for name, p in module().named_parameters()}
    single, expected = one_process_fit([[step] for step in range(STEPS)])
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
    validation = one_process_trainer().validate(single, DataLoader(batches()[:1], batch_size=None), verbose=False)
    assert ranks[0]["val"] == ranks[1]["val"] == pytest.approx(validation[0]["val/loss"], abs=1e-5)
    # trainer.predict after the fit and alone (a fresh trainer, an untrained model): on every rank what
    # MoEGPTLightningModule.predict_step returns in one process (rank 0 receives it from the last stage)
    data = DataLoader(batches()[:PREDICT], batch_size=None)
    for key, reference_module in (("predicted", single), ("predicted_alone", module())):
        expected_batches = one_process_trainer().predict(reference_module, data)
        assert expected_batches is not None and len(expected_batches) == PREDICT
        for rank in ranks:
            for got, want in zip(rank[key], expected_batches, strict=True):
                assert got["documents"] == want["documents"] and torch.equal(got["tokens"], want["tokens"])
                assert float((got["loss"] - want["loss"]).abs().max()) < 1e-5, key


def test_two_stage_checkpoint_resumes_on_one_process(pipelined: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = pipelined
    torch.set_num_threads(1)
    resumed = module()
    trainer = one_process_trainer(max_steps=STEPS)
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


def test_two_stage_checkpoint_exports_as_the_one_process_model(
    pipelined: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    tmp, ranks = pipelined
    torch.set_num_threads(1)
    single = module()  # the one-process model holding the pipeline's trained weights, saved as one .ckpt file
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    single.load_state_dict(held | {"model.lm_head.weight": held["model.embed.weight"]})
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(single)
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    shard = ["--max-shard-size", "20KB"]
    assert export_main([str(tmp / "run.ckpt"), str(tmp_path / "pp"), *shard]) == 0  # the pp=2 DCP directory
    assert export_main([str(tmp_path / "single.ckpt"), str(tmp_path / "one"), *shard]) == 0
    files = sorted(f.name for f in (tmp_path / "pp").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "one").iterdir()) and len(files) > 4  # sharded
    for name in files:
        assert (tmp_path / "pp" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    # transformers loads it as the Mixtral a MoEGPT is: the same logits
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "pp").eval()
    ids = batches()[0].input_ids[:, :13]
    with torch.no_grad():
        expected, got = single.model(ids), hf(input_ids=ids).logits
    assert float((got - expected).abs().max()) < 1e-5


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_pipeline_equal_one_process_on_both_streams(tmp_path: Path) -> None:
    ranks = launch(tmp_path, 4)
    dims = ParallelDims(4, pipeline_parallel_size=2)
    replicas = [dims.data_parallel_rank(r) for r in range(4)]  # ranks 0 and 2 read one stream, 1 and 3 the other
    streams = {replica: ranks[r]["seen"] for r, replica in enumerate(replicas)}
    assert all(ranks[r]["seen"] == streams[replica] for r, replica in enumerate(replicas))  # a pipeline's stages
    assert sorted(streams[0] + streams[1]) == list(range(2 * STEPS))  # the sampler split the batches between them
    order = [[streams[0][step], streams[1][step]] for step in range(STEPS)]
    single, losses = one_process_fit(order)
    for r, replica in enumerate(replicas):  # each rank logs its own replica's batch loss
        assert ranks[r]["losses"] == pytest.approx(losses[replica::2], abs=1e-5)
    reference = dict(single.named_parameters())
    for rank in ranks:
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name


@pytest.mark.slow
def test_two_stage_checkpoint_resumes_on_four_stages(pipelined: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = pipelined
    resumed = launch(tmp, 4, "--pp", "4", "--resume", str(tmp / "run.ckpt"), out="pp4")
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
    ranks = launch(tmp_path, 2, "--accumulate", "2")
    single, losses = one_process_fit([[0, 1]])  # one optimizer step on batches 0 and 1
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


@pytest.mark.parametrize(("schedule", "pp"), [("zbv", 2), pytest.param("1f1b", 4, marks=pytest.mark.slow)])
def test_predict_alone_equals_one_process_when_the_last_stage_is_elsewhere(
    schedule: str, pp: int, tmp_path: Path
) -> None:
    # zbv: the last stage on rank 0 (its V); on 4 ranks: on rank 3, two ranks in between
    ranks = launch(tmp_path, pp, "--pp", str(pp), "--predict-only", "--schedule", schedule)
    expected = one_process_trainer().predict(module(), DataLoader(batches()[:PREDICT], batch_size=None))
    assert expected is not None
    for rank in ranks:
        for got, want in zip(rank["predicted_alone"], expected, strict=True):
            assert got["documents"] == want["documents"] and torch.equal(got["tokens"], want["tokens"])
            assert float((got["loss"] - want["loss"]).abs().max()) < 1e-5


def test_pipelined_predict_refuses_a_predict_step_that_runs_forward_otherwise() -> None:
    from lightning_llmfast.strategy.pipeline import _forward_answers

    model, (batch, other) = module(), batches()[:2]
    logits = torch.randn(*batch.input_ids.shape, 64)
    with _forward_answers(model, batch, logits):
        assert model(batch) is logits  # the pipeline's logits, for this very batch
        with pytest.raises(ConfigError, match="once, on the batch it was given"):
            model(batch)
    with _forward_answers(model, batch, logits), pytest.raises(ConfigError, match="once, on the batch"):
        model(other)
    assert "forward" not in vars(model)  # the class's forward again
    assert model(batch).shape == logits.shape


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow)])
def test_pipeline_stages_split_over_context_parallel_ranks_equal_one_process(tmp_path: Path, schedule: str) -> None:
    # pp=2 x cp=2: each microbatch cut into its cp shards on the host; a row-long document split over both cp ranks,
    # length-1 documents, a document longer than a row, padding tails. Losses, val/loss and weights after three
    # clipped AdamW steps equal one process accumulating the microbatches (ZBV: the zero-bubble split backward).
    ranks = launch(tmp_path, 4, "--cp", "2", "--schedule", schedule)
    single, expected = one_process_fit([[step] for step in range(STEPS)], awkward=True)
    for rank in ranks:  # train/loss on every rank: the replica's whole batch, over both cp shards and both stages
        assert rank["losses"] == pytest.approx(expected, abs=1e-5)
    reference = dict(single.named_parameters())
    held = {name: p for rank in ranks for name, p in rank["params"].items()}
    assert set(held) == set(reference)
    for rank in ranks:  # the cp ranks of a stage hold the same stage, trained to the same values
        for name, value in rank["params"].items():
            assert float((value - reference[name].detach()).abs().max()) < 1e-5, name
    data = DataLoader(batches(awkward=True)[:1], batch_size=None)
    validation = one_process_trainer().validate(single, data, verbose=False)
    assert [rank["val"] for rank in ranks] == pytest.approx([validation[0]["val/loss"]] * 4, abs=1e-5)


def test_pipelined_predict_refuses_context_parallel_shards() -> None:
    strategy = LLMFastStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, context_parallel_size=2)
    strategy._runner, strategy._lightning_module = object(), module()  # as after setup: the step sees the shards
    with pytest.raises(ConfigError, match="predict with context_parallel_size=1"):
        strategy.predict_step(batches()[:2], 0)
