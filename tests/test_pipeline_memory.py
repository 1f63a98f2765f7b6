"""The per-stage memory plan of a pipelined MoEGPT (issue 53): parameter bytes equal to what the strategy's runner
really keeps on each rank after pruning, and activations of the microbatches in flight by the schedules' hand
formulas (GPipe ``M``, 1F1B ``min(P - r, M)``, interleaved 1F1B's warm-up ``(v - 1) P + 2 (P - 1 - r)`` plus one)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel.pipeline import PipelineConfig, PipelineRunner
from lightning_llmfast.parallel.pipeline_memory import in_flight_peak, schedule_actions, stage_memory
from lightning_llmfast.plan import PipelinePlan, main
from lightning_llmfast.tune.memory import measure_probe


def _model(tie: bool) -> MoEGPT:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=37, hidden_size=24, n_layers=6, n_heads=4, n_kv_heads=2, ffn_size=10,
                          num_experts=3, top_k=2, dense_layers=[1], tie_embeddings=tie)  # fmt: skip
    return MoEGPT(config)


def _pruned_bytes(config: PipelineConfig, tie: bool) -> list[int]:
    """Parameter bytes each pipeline rank keeps once PipelineRunner has cut and pruned a real model."""
    out = []
    for rank in range(config.size):
        model = _model(tie)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config.size)
        try:
            PipelineRunner(model, config, dist.group.WORLD, device=torch.device("cpu"))
        finally:
            dist.destroy_process_group()
        out.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return out


LAYOUTS = [
    PipelineConfig(2, 2, "1f1b"),
    PipelineConfig(3, 3, "gpipe"),
    PipelineConfig(2, 4, "interleaved_1f1b"),
    PipelineConfig(2, 2, "zbv"),
    PipelineConfig(2, 2, "1f1b", layers=[5, 1]),
]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("config", LAYOUTS, ids=lambda c: f"{c.schedule}-pp{c.size}-{c.layers}")
def test_parameter_bytes_are_what_the_pruned_stages_hold(config: PipelineConfig, tie: bool) -> None:
    with torch.device("meta"):
        model = _model(tie)
    rows = stage_memory(model, config, [0] * 6)
    assert [r.params for r in rows] == _pruned_bytes(config, tie)
    assert all(r.grads == r.params and r.optimizer == 2 * r.params for r in rows)  # fp32 grads, two AdamW moments
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    # every parameter on one rank; a tied embedding and head on the first and the last stage's ranks (zbv: both 0)
    twice = model.embed.weight.nbytes if tie and config.schedule != "zbv" else 0
    assert sum(r.params for r in rows) == whole + twice


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activations_are_the_microbatches_in_flight_by_hand(schedule: str) -> None:
    pp, m = 4, 6
    rng = random.Random(7)
    layer = [rng.randrange(1, 10**6) for _ in range(6)]
    head = rng.randrange(1, 10**7)
    with torch.device("meta"):
        model = _model(True)
    rows = stage_memory(model, PipelineConfig(pp, m, schedule, layers=[1, 2, 2, 1]), layer, head_activations=head)
    stage_bytes = [layer[0], layer[1] + layer[2], layer[3] + layer[4], layer[5] + head]
    for r, row in enumerate(rows):
        in_flight = m if schedule == "gpipe" else min(pp - r, m)
        assert (row.in_flight, row.activations) == (in_flight, in_flight * stage_bytes[r])
        assert row.total == 4 * row.params + row.activations


def test_interleaved_in_flight_follows_its_warmup() -> None:
    for pp, v, m in ((2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4)):
        table = schedule_actions(PipelineConfig(pp, m, "interleaved_1f1b", stages_per_rank=v))
        for r in range(pp):
            peak, _ = in_flight_peak(table[r], dict.fromkeys(range(pp * v), 1))
            assert peak == min((v - 1) * pp + 2 * (pp - 1 - r) + 1, v * m), (pp, v, m, r)


def test_zero_bubble_frees_at_the_weight_gradient_and_a_bad_layout_is_refused() -> None:
    with torch.device("meta"):
        model = _model(True)
    rows = stage_memory(model, PipelineConfig(2, 4, "zbv"), [100] * 6, head_activations=7)
    assert all(1 <= r.in_flight <= 2 * 4 for r in rows) and rows[0].stages == (0, 3)
    with pytest.raises(ConfigError, match="each stage needs a layer"):
        stage_memory(model, PipelineConfig(4, 4, "interleaved_1f1b"), [100] * 6)
    with pytest.raises(ConfigError, match="5 layer activation sizes for 6 layers"):
        stage_memory(model, PipelineConfig(2, 4), [100] * 5)


def test_plan_cli_predicts_each_stage_of_the_reference_model(capsys: pytest.CaptureFixture[str]) -> None:
    plan = main(["reference", "--pp", "4", "--microbatches", "6", "--batch", "12", "--seq-len", "24"])
    assert isinstance(plan, PipelinePlan) and "in_flight" in capsys.readouterr().out
    probe, kinds = measure_probe(MoEGPTConfig(), 24)
    per_layer = [2 * sum(probe.storages[k]) for k in kinds]  # a microbatch: 12 / 6 = 2 rows
    for r, row in enumerate(plan.ranks):  # 1F1B: min(P - r, M) microbatches in flight; one layer a stage
        saved = per_layer[r] + (2 * probe.outside if r == 3 else 0)
        assert row.layers == (r,) and row.activations == min(4 - r, 6) * saved
    with pytest.raises(SystemExit):
        main(["deepseek-v3", "--pp", "2"])  # only MoEGPT splits into stages: an argparse error, no traceback
    assert "only the 'reference' MoEGPT" in capsys.readouterr().err
