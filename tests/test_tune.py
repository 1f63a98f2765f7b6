"""``python -m lightning_llmfast.tune`` (issues 49, 54): settings, memory prediction, successive halving, pruning,
failing and timed-out trials, the time budget, resume after kill -9, the files it writes, the processes it leaves
(none: a trial's group ends with it, everything ends with the tuner, Ctrl-C exits 130), what it says while it
searches, memory sizes with units, and one real search of the example CLI whose ``best.yaml`` trains.

Most searches run :mod:`tests.scripts.fake_trial` (the example CLI's stand-in: no torch, milliseconds) or an
in-process runner; ``test_real_search_of_the_example_cli`` runs the example CLI itself.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.tune import (
    RECORD_FIELDS,
    Measurement,
    SubprocessRunner,
    Trial,
    TrialLog,
    TrialRecord,
    TuneConfig,
    apply_settings,
    default_space,
    main,
    parse_bytes,
    predict_memory,
    tune,
    write_plot,
)
from lightning_llmfast.tune.memory import measure_probe
from lightning_llmfast.tune.space import (
    CONTEXT_PARALLEL,
    PIPELINE_MICROBATCHES,
    PIPELINE_PARALLEL,
    PIPELINE_SCHEDULE,
    accumulation,
)

ROOT = Path(__file__).parents[1]
FAKE = ROOT / "tests" / "scripts" / "fake_trial.py"
MODEL = {"hidden_size": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_size": 64, "num_experts": 4, "top_k": 2}


def _config(tmp_path: Path, **data: Any) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "llmfast", "max_steps": 50, "logger": False,
                    "enable_checkpointing": False},
        "model": {"config": dict(MODEL), "lr": 0.003},
        "data": {"corpus": "synthetic", "synthetic_num_docs": 64, "seq_len": 32, "batch_size": 4, "num_workers": 0,
                 **data},
    }  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class FakeRunner:
    """In-process trials: a rate per batch size (or a crash for a negative lr); remembers every trial it ran."""

    def __init__(self, rates: dict[int, float]) -> None:
        self.rates, self.trials = rates, []

    def __call__(self, trial: Trial) -> Measurement:
        self.trials.append(trial)
        if trial.config["model"]["lr"] < 0:
            return Measurement("failed", reason="exit status 1: ValueError: Invalid learning rate")
        return Measurement("ok", self.rates[trial.config["data"]["batch_size"]], 1 << 20)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_settings_go_into_the_config_sections() -> None:
    config = {"trainer": {"strategy": "llmfast"}, "data": {"class_path": "x.Data", "init_args": {"seq_len": 8}}}
    out = apply_settings(config, {"trainer.strategy.init_args.sharding": "fsdp", "data.batch_size": 2, "model.lr": 1})
    assert out["trainer"]["strategy"] == {"class_path": "lightning_llmfast.LLMFastStrategy",
                                          "init_args": {"sharding": "fsdp"}}  # fmt: skip
    assert out["data"]["init_args"] == {"seq_len": 8, "batch_size": 2} and out["model"] == {"lr": 1}
    assert config["trainer"]["strategy"] == "llmfast"  # the input is not changed
    with pytest.raises(ConfigError, match=r"trainer.strategy.init_args.x: strategy is 'ddp'"):
        apply_settings({"trainer": {"strategy": "ddp"}}, {"trainer.strategy.init_args.x": 1})


def test_default_space_follows_the_config_and_the_world(tmp_path: Path) -> None:
    config = yaml.safe_load(_config(tmp_path).read_text())
    assert default_space(config, world=1, cuda=False) == {"data.batch_size": [1, 2, 4, 8]}
    space = default_space(config, world=4, cuda=True)
    assert space["trainer.strategy.init_args.sharding"] == ["ddp", "fsdp"]
    assert space["trainer.strategy.init_args.expert_parallel_size"] == [1, 2, 4]  # divide the world and 4 experts
    assert space["model.config.router_backend"] == ["triton", "torch"] and space["model.compile"] == [False, True]
    assert len(space["trainer.strategy.init_args.offload"]) == 3
    config["model"]["config"]["num_experts"] = 3
    assert "trainer.strategy.init_args.expert_parallel_size" not in default_space(config, world=4, cuda=False)


def test_predicted_memory_adds_the_sharding_plan_and_activations_linear_in_the_micro_batch(tmp_path: Path) -> None:
    config = yaml.safe_load(_config(tmp_path).read_text())
    predicted = {b: predict_memory(apply_settings(config, {"data.batch_size": b}), world=1) for b in (1, 2, 5)}
    per_sequence = predicted[2] - predicted[1]
    assert per_sequence > 0 and predicted[5] - predicted[1] == 4 * per_sequence  # one probe, scaled
    # The model states, independently: every parameter in fp32, its gradient and two AdamW moments.
    model = MoEGPT(MoEGPTConfig(**MODEL, vocab_size=258))
    states = 4 * 4 * sum(p.numel() for p in model.parameters())
    assert predicted[1] - per_sequence == pytest.approx(states, rel=0.35)  # what no sequence needs: states + const
    assert predicted[1] > states
    fsdp = {"trainer.strategy.init_args.sharding": "fsdp", "data.batch_size": 1}
    assert predict_memory(apply_settings(config, fsdp), world=4) < predicted[1]  # the states are sharded
    deep = {"model.config.n_layers": 6, "data.batch_size": 5}
    kept = predict_memory(apply_settings(config, deep), world=1)
    offload = {"force": True, "keep_last_layers": 1, "min_offload_bytes": 0}
    assert predict_memory(apply_settings(config, {**deep, "trainer.strategy.init_args.offload": offload}), 1) < kept
    recompute = {"force": True, "offload_layers": 0, "recompute": "selective"}
    assert predict_memory(apply_settings(config, {**deep, "trainer.strategy.init_args.offload": recompute}), 1) < kept
    quiet = {**deep, "trainer.strategy.init_args.offload": True}  # no device, no force: the offloader idles
    assert predict_memory(apply_settings(config, quiet), world=1) == kept
    triton = {"model.config.router_backend": "triton", "data.batch_size": 5}  # probed with its PyTorch reference
    assert predict_memory(apply_settings(config, triton), world=1) == predicted[5]
    assert predict_memory({**config, "model": {"class_path": "lightning_llmfast.HFCausalLMModule"}}, 1) is None


def test_context_parallel_sizes_share_batches_and_divide_activations(tmp_path: Path) -> None:
    config = yaml.safe_load(_config(tmp_path).read_text())  # micro-batch 4 of 32 tokens
    assert default_space(config, world=4, cuda=False)[CONTEXT_PARALLEL] == [1, 2, 4]
    odd = {**config, "data": {**config["data"], "seq_len": 33}}  # micro-batch 1 of 33 tokens: no split of 2 or 4
    assert CONTEXT_PARALLEL not in default_space(odd, world=4, cuda=False)
    settings: dict[str, Any] = {"data.batch_size": 2, CONTEXT_PARALLEL: 2}
    assert accumulation(settings, config, global_batch=8, world=4) == ""
    assert settings["trainer.accumulate_grad_batches"] == 2  # 2 streams of micro-batch 2, twice
    settings = {"data.batch_size": 4, CONTEXT_PARALLEL: 4}
    assert "1 groups of 4 context-parallel ranks" in accumulation(settings, config, global_batch=6, world=4)
    long = {"data.seq_len": 512, "data.batch_size": 2}
    one = predict_memory(apply_settings(config, long), world=2)
    two = predict_memory(apply_settings(config, {**long, CONTEXT_PARALLEL: 2}), world=2)
    assert one is not None and two is not None
    # cp=2 halves the sequence's activations and adds the gathered keys and values: fp32, 1 kv head of 16, 2 layers.
    states = predict_memory(apply_settings(config, {**long, "data.batch_size": 1}), world=2)
    assert states is not None
    activations = 2 * (one - states)  # two sequences' worth, from the scaling by the micro-batch
    gathered = 2 * (1024 + 256) * 2 * 16 * 4  # 1024 tokens, 1 + 1/(2 cp) of them kept by the busiest rank
    assert two == pytest.approx(one - activations + -(-activations // 2) + gathered, abs=2 * 4096)


def test_successive_halving_prunes_and_keeps_the_optimizer_batch(tmp_path: Path) -> None:
    space = {"data.batch_size": [1, 2, 3, 4, 8, 16], "model.lr": [0.003, -1.0]}
    runner = FakeRunner({1: 100.0, 2: 300.0, 4: 250.0, 8: 200.0})
    small = predict_memory(apply_settings(yaml.safe_load(_config(tmp_path).read_text()), {"data.batch_size": 8}), 1)
    config = TuneConfig(_config(tmp_path), tmp_path / "out", space=space, global_batch=8, memory_budget=small, eta=2)
    result = tune(config, runner)
    lines = _lines(tmp_path / "out/trials.jsonl")
    assert all(tuple(line) == RECORD_FIELDS for line in lines)
    by = {(r["settings"]["data.batch_size"], r["settings"]["model.lr"], r["status"]): r for r in lines}
    assert "not a multiple of micro-batch 3" in by[3, 0.003, "pruned"]["reason"]
    assert "not a multiple of micro-batch 16" in by[16, 0.003, "pruned"]["reason"]  # 16 > 8 sequences a step
    assert by[8, 0.003, "ok"]["predicted_memory"] == small
    assert "Invalid learning rate" in by[1, -1.0, "failed"]["reason"]  # the search went on
    assert {r["settings"]["trainer.accumulate_grad_batches"] for r in lines if r["status"] == "ok"} == {1, 2, 4, 8}
    run = [r for r in lines if r["status"] != "pruned"]  # each row: its rung and the steps it measured
    assert [(r["rung"], r["steps"]) for r in run] == [(0, 4)] * 8 + [(1, 8)] * 2
    assert all((r["rung"], r["steps"]) == (0, 0) for r in lines if r["status"] == "pruned")
    for trial in runner.trials:  # every trial's optimizer batch is 8 sequences
        assert trial.config["data"]["batch_size"] * trial.config["trainer"]["accumulate_grad_batches"] == 8
    # rung 0: the 4 runnable lr=0.003 candidates and 4 crashing ones, 4 steps; rung 1: the best 2 of 4, 8 steps
    assert [(t.config["data"]["batch_size"], t.steps) for t in runner.trials[8:]] == [(2, 8), (4, 8)]
    assert result.best is not None and result.best.settings["data.batch_size"] == 2 and result.best_steps == 8
    assert yaml.safe_load((tmp_path / "out/best.yaml").read_text())["data"]["batch_size"] == 2
    report = (tmp_path / "out/report.md").read_text()
    assert report.index("data.batch_size=2, model.lr=0.003") < report.index("data.batch_size=1, model.lr=0.003")


def test_memory_budget_prunes_before_running(tmp_path: Path) -> None:
    base = yaml.safe_load(_config(tmp_path).read_text())
    budget = predict_memory(apply_settings(base, {"data.batch_size": 2}), 1)
    runner = FakeRunner({1: 1.0, 2: 2.0, 4: 4.0})
    result = tune(TuneConfig(_config(tmp_path), tmp_path / "out", space={"data.batch_size": [1, 2, 4]},
                             global_batch=4, memory_budget=budget), runner)  # fmt: skip
    pruned = [r for r in result.records if r.status == "pruned"]
    assert [r.settings["data.batch_size"] for r in pruned] == [4] and "> memory budget" in pruned[0].reason
    assert pruned[0].predicted_memory > budget
    assert sorted(t.config["data"]["batch_size"] for t in runner.trials) == [1, 2]
    assert result.best is not None and result.best.settings["data.batch_size"] == 2


def test_pipeline_settings_are_searched_with_invalid_layouts_pruned_and_memory_per_stage(tmp_path: Path) -> None:
    base = yaml.safe_load(_config(tmp_path).read_text())  # 2 layers, micro-batch 4 of 32 tokens
    base["trainer"]["devices"] = 4
    (tmp_path / "four.yaml").write_text(yaml.safe_dump(base))
    space = default_space(base, world=4, cuda=False)
    assert space[PIPELINE_PARALLEL] == [1, 2]  # no more stages than layers
    assert space[PIPELINE_MICROBATCHES] == [2, 4, 8] and "zbv" in space[PIPELINE_SCHEDULE]
    sharding = "trainer.strategy.init_args.sharding"
    space = {"data.batch_size": [4], sharding: ["ddp", "fsdp"], PIPELINE_PARALLEL: [1, 2, 4],
             PIPELINE_MICROBATCHES: [1, 2, 3, 4], PIPELINE_SCHEDULE: ["1f1b", "gpipe", "zbv"]}  # fmt: skip
    runner = FakeRunner({4: 1.0})
    result = tune(TuneConfig(tmp_path / "four.yaml", tmp_path / "out", space=space, global_batch=16, eta=10), runner)
    keys = (sharding, PIPELINE_PARALLEL, PIPELINE_MICROBATCHES, PIPELINE_SCHEDULE)
    records = {tuple(r.settings.get(k, 1 if k == PIPELINE_MICROBATCHES else "1f1b") for k in keys): r
               for r in result.records}  # fmt: skip
    assert len(records) == 2 + 2 * 2 * 4 * 3  # pp=1: one candidate, its pipeline knobs idle
    assert len(result.records) == len(records) + sum(r.rung == 1 for r in result.records)  # promoted: run again
    ran = {key for key, r in records.items() if r.status == "ok"}
    staged = {(2, 2, "1f1b"), (2, 4, "1f1b"), (2, 1, "gpipe"), (2, 2, "gpipe"), (2, 4, "gpipe")}
    assert ran == {("ddp", 1, 1, "1f1b"), ("fsdp", 1, 1, "1f1b")} | {(s, *k) for s in ("ddp", "fsdp") for k in staged}
    assert len(runner.trials) == len(ran) + sum(r.rung == 1 for r in result.records)  # the pruned never ran
    reasons = {
        ("ddp", 2, 1, "1f1b"): "needs microbatches >= pipeline size 2",
        ("ddp", 2, 3, "gpipe"): "must divide the batch size 4",
        ("ddp", 2, 2, "zbv"): "4 stages (size 2 x stages_per_rank 2) but the model has only 2 layers",
        ("ddp", 4, 4, "gpipe"): "the model has only 2 layers",
        ("fsdp", 2, 2, "zbv"): "but the model has only 2 layers",
    }
    for key, reason in reasons.items():
        assert records[key].status == "pruned" and reason in records[key].reason, key
    # The stages of a pipeline share their micro-batches: 16 sequences a step are 2 pipelines x 4 x 2 accumulated.
    assert {
        t.config["trainer"]["accumulate_grad_batches"] for t in runner.trials if t.settings[PIPELINE_PARALLEL] == 2
    } == {2}
    # Memory per stage, by hand: each stage one layer; rank 0 the embedding, rank 1 the final norm and the tied head;
    # parameters, gradients, two AdamW moments in fp32; the microbatches in flight of what one sequence saves.
    model = MoEGPT(MoEGPTConfig(**MODEL, vocab_size=258))
    probe, kinds = measure_probe(model.config, 32)
    embed, norm = model.embed.weight.numel(), model.norm.weight.numel()
    states = [
        16 * (sum(p.numel() for p in model.layers[i].parameters()) + extra)
        for i, extra in ((0, embed), (1, embed + norm))
    ]
    saved = [sum(probe.storages[kinds[0]]), sum(probe.storages[kinds[1]]) + probe.outside]
    for m, schedule, in_flight in ((2, "gpipe", (2, 2)), (4, "1f1b", (2, 1)), (2, "1f1b", (2, 1))):
        rows = 4 // m
        expected = max(states[r] + in_flight[r] * rows * saved[r] for r in range(2))
        assert records["ddp", 2, m, schedule].predicted_memory == expected, (m, schedule)
        # sharding="fsdp": a stage's states over its world / pp = 2 ranks
        sharded = max(-(-states[r] // 2) + in_flight[r] * rows * saved[r] for r in range(2))
        assert records["fsdp", 2, m, schedule].predicted_memory == sharded, (m, schedule)


def test_trial_log_drops_a_cut_line_and_refuses_a_damaged_one(tmp_path: Path) -> None:
    log = TrialLog(tmp_path / "trials.jsonl")
    record = TrialRecord({"data.batch_size": 2}, "ok", 10.0, 5, 6, "")
    log.append(record)
    with open(log.path, "a") as f:
        f.write('{"settings": {"data.batch_size": 4}, "sta')  # a kill mid-write
    assert log.read() == [record]
    assert log.path.read_text().count("\n") == 1 and log.path.read_text().endswith("}\n")  # the cut line is gone
    log.append(record)
    assert log.read() == [record, record]
    log.path.write_text('{"not": "a record"}\n' + log.path.read_text())
    with pytest.raises(ConfigError, match="line 1 is not a trial record"):
        log.read()


@pytest.fixture(scope="module")
def trial_server() -> None:
    """The trial server started (it imports torch and Lightning once per process) before the timed tests."""
    SubprocessRunner(FAKE)


def _fake(tmp_path: Path, space: dict[str, list[Any]], **kwargs: Any) -> TuneConfig:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    return TuneConfig(_config(tmp_path), tmp_path / "out", space=tmp_path / "space.yaml", script=FAKE,
                      warmup_steps=1, steps=2, **kwargs)  # fmt: skip


def test_a_trial_past_its_timeout_is_stopped_and_the_search_goes_on(tmp_path: Path, monkeypatch, trial_server) -> None:
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "30")
    start = time.monotonic()
    result = tune(_fake(tmp_path, {"data.batch_size": [2, 4]}, trial_timeout=1.0))
    assert time.monotonic() - start < 20
    assert [r.status for r in result.records] == ["timeout", "timeout"] and result.best is None
    assert "no result within 1s" in result.records[0].reason and not result.stopped_by_budget
    assert "No trial measured a rate" in (tmp_path / "out/report.md").read_text()


def test_the_time_budget_stops_the_search_and_a_rerun_continues_it(tmp_path: Path, monkeypatch, trial_server) -> None:
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "1")
    monkeypatch.setenv("FAKE_TRIAL_CALLS", str(tmp_path / "calls.jsonl"))
    space = {"data.batch_size": [1, 2, 4, 8], "model.lr": [0.003, 0.002]}
    start = time.monotonic()
    result = tune(_fake(tmp_path, space, time_budget=7.0, global_batch=8))  # rung 0 alone takes 8 x 1 s and more
    assert time.monotonic() - start < 7.0 + 4.0  # the budget, then the kill of the running trial and the report
    assert result.stopped_by_budget and 1 <= len(result.records) < 8  # the trial cut by the budget is not recorded
    assert len(_lines(tmp_path / "calls.jsonl")) - len(result.records) in (0, 1)  # the cut one, if it had started
    assert "time budget stopped the search" in (tmp_path / "out/report.md").read_text()
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "0")
    again = tune(_fake(tmp_path, space, global_batch=8))
    assert not again.stopped_by_budget and again.best is not None and again.best.settings["data.batch_size"] == 8
    calls = _lines(tmp_path / "calls.jsonl")
    assert all(c["preloaded"] for c in calls)  # forked from the server, which saw the environment change
    for record in result.records:  # measured before the budget ran out: not run again
        batch, lr = record.settings["data.batch_size"], record.settings["model.lr"]
        assert sum((c["batch"], c["lr"], c["steps"]) == (batch, lr, 3) for c in calls) == 1


def test_resume_after_kill_9_repeats_no_finished_trial(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"data.batch_size": [1, 2, 4, 8], "model.lr": [0.003, -1.0]}))
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "FAKE_TRIAL_SLEEP": "0.2", "FAKE_TRIAL_CALLS": str(calls),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    command = [sys.executable, "-m", "lightning_llmfast.tune", "--config", str(_config(tmp_path)), "--out",
               str(tmp_path / "out"), "--space", str(space), "--global-batch", "8", "--steps", "1",
               "--warmup-steps", "1", "--eta", "2", "--script", str(FAKE)]  # fmt: skip
    log = tmp_path / "out" / "trials.jsonl"
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    with open(log, "a") as f:
        f.write('{"settings": {"data.batch_si')  # and the kill cut a line
    before = [json.loads(line) for line in log.read_text().splitlines()[:-1]]
    assert 3 <= len(before) < 10  # rung 0: 8 trials, rung 1: the best 2 of the 4 that ran
    time.sleep(0.5)  # the orphaned trial ends
    ran_before = len(_lines(calls))
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr
    after = _lines(log)
    assert after[: len(before)] == before  # kept as they were
    ran = _lines(calls)[ran_before:]
    # the rerun ran exactly the trials the log lacked; only the one the kill cut ran twice, if any
    assert len(ran) == len(after) - len(before) and len(_lines(calls)) - len(after) in (0, 1)
    keys = [(r["settings"]["data.batch_size"], r["settings"]["model.lr"]) for r in after]
    assert len(after) == 10 and len(set(keys[:8])) == 8  # rung 0: each candidate once
    assert yaml.safe_load((tmp_path / "out/best.yaml").read_text())["data"]["batch_size"] == 8


def _stat(pid: int) -> tuple[int, int, int] | None:
    """``(ppid, pgid, start time)`` of a running process, from ``/proc``; ``None`` if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[2]), int(fields[19]))


def _processes() -> dict[int, tuple[int, int, int]]:
    running = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    return {pid: stat for pid, stat in running.items() if stat is not None}


def _descendants(root: int) -> dict[int, tuple[int, int, int]]:
    table, found, todo = _processes(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, stat in table.items():
            if stat[0] == parent and pid not in found:
                found[pid] = stat
                todo.append(pid)
    return found


def _survivors(processes: dict[int, tuple[int, int, int]], within: float) -> list[int]:
    """Which of ``processes`` (as :func:`_stat` saw them: a reused pid is another process) still run after
    ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid, stat in processes.items() if (_stat(pid) or (0, 0, -1))[2] == stat[2]]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while _stat(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _stat(pid) is None


def _group(pgid: int) -> dict[int, tuple[int, int, int]]:
    return {pid: stat for pid, stat in _processes().items() if stat[1] == pgid}


def _wait_for_lines(path: Path, count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not path.exists() or path.read_text().count("\n") < count):
        time.sleep(0.05)
    return _lines(path)


@pytest.mark.parametrize("end", ["exit", "sigkill", "timeout"])
def test_a_trial_s_process_group_ends_with_it(tmp_path: Path, monkeypatch, trial_server, end: str) -> None:
    """A child the trial left running (a DDP rank, a tracker) ends with it: on a clean exit, when rank 0 is killed
    (the OOM killer's SIGKILL), at its timeout."""
    monkeypatch.setenv("FAKE_TRIAL_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_TRIAL_CHILD", "1")
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "30" if end == "timeout" else "0")
    if end == "sigkill":
        monkeypatch.setenv("FAKE_TRIAL_KILL", "1")
    config = yaml.safe_load(_config(tmp_path).read_text())
    trial = Trial({}, config, 2, 1, 1.0 if end == "timeout" else 60.0, tmp_path / "trial")
    measured = SubprocessRunner(FAKE)(trial)
    expected = {"exit": ("ok", ""), "sigkill": ("failed", "killed by SIGKILL"), "timeout": ("timeout", "no result")}
    assert measured.status == expected[end][0] and measured.reason.startswith(expected[end][1])
    (call,) = _lines(tmp_path / "calls.jsonl")
    assert call["pgid"] == call["pid"] == call["child_pgid"]  # the trial leads a group of its own, its child in it
    assert _gone(call["child"], 2.0) and _survivors(_group(call["pid"]), 2.0) == []  # the watchdog went too


def test_kill_9_of_the_tuner_ends_every_process_it_started(tmp_path: Path) -> None:
    """The trial server, its resource tracker, the running trial, the trial's child and its watchdog end within
    seconds of a ``kill -9`` of the tuner (the trials are the server's children, not the tuner's)."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"data.batch_size": [2]}))
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "FAKE_TRIAL_SLEEP": "60", "FAKE_TRIAL_CHILD": "1", "FAKE_TRIAL_CALLS": str(calls),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    command = [sys.executable, "-m", "lightning_llmfast.tune", "--config", str(_config(tmp_path)), "--out",
               str(tmp_path / "out"), "--space", str(space), "--steps", "1", "--warmup-steps", "1", "--script",
               str(FAKE)]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (call,) = _wait_for_lines(calls, 1)
        started = _descendants(process.pid)
        assert {call["pid"], call["child"]} <= set(started) and len(started) >= 5  # + server, tracker, watchdog
        assert {pid for pid, stat in started.items() if stat[1] == call["pid"]} >= {call["pid"], call["child"]}
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert _survivors(started, 5.0) == []
    finally:
        process.kill()


def test_ctrl_c_stops_the_running_trial_and_exits_130(tmp_path: Path, monkeypatch, capsys, trial_server) -> None:
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "60")
    monkeypatch.setenv("FAKE_TRIAL_CHILD", "1")
    monkeypatch.setenv("FAKE_TRIAL_CALLS", str(tmp_path / "calls.jsonl"))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"data.batch_size": [2, 4]}))
    argv = ["--config", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--space", str(tmp_path / "space.yaml"),
            "--steps", "1", "--warmup-steps", "1", "--script", str(FAKE)]  # fmt: skip
    running: list[dict[str, Any]] = []

    def interrupt() -> None:  # Ctrl-C once the first trial runs (the tuner then waits on it)
        running.extend(_wait_for_lines(tmp_path / "calls.jsonl", 1, timeout=60))
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt)
    try:
        thread.start()
        start = time.monotonic()
        assert main(argv) == 130
        assert time.monotonic() - start < 30
    finally:
        thread.join()
        signal.signal(signal.SIGINT, previous)
    assert "interrupted" in capsys.readouterr().err
    (call,) = running
    assert _gone(call["child"], 2.0) and _survivors(_group(call["pid"]), 2.0) == []
    assert not (tmp_path / "out/trials.jsonl").exists() or _lines(tmp_path / "out/trials.jsonl") == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_the_search_says_a_line_per_trial(tmp_path: Path, monkeypatch, terminal: bool) -> None:
    """One line per record as it is made, with its settings, status, rate, memory and time of the budget; a bar of
    the rung's trials on a terminal only; a rerun says which lines it read back."""
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    base = yaml.safe_load(_config(tmp_path).read_text())
    budget = predict_memory(apply_settings(base, {"data.batch_size": 4}), 1)
    space = {"data.batch_size": [1, 2, 4, 8], "model.lr": [0.003, -1.0]}
    config = TuneConfig(_config(tmp_path), tmp_path / "out", space=space, global_batch=8, memory_budget=budget,
                        time_budget=600.0, eta=2)  # fmt: skip
    result = tune(config, FakeRunner({1: 1500.0, 2: 2500.0, 4: 2000.0}))
    said = stream.getvalue().replace("\r", "\n").splitlines()
    lines = [line for line in said if re.match(r"tune: (ok|failed|pruned|timeout)\b", line)]
    assert len(lines) == len(result.records) == 10  # 2 pruned by memory; rung 0: 6 (3 crash); rung 1: the best 2
    for line, record in zip(lines, result.records):
        assert record.status in line and f"data.batch_size={record.settings['data.batch_size']}" in line
        assert f"predicted {record.predicted_memory / (1 << 20):,.1f} MiB" in line and "s of 600s" in line
    ok = [line for line in lines if line.startswith("tune: ok")]
    assert ok[0].startswith("tune: ok, rung 0, 4 steps: 1,500 tokens/s,") and "peak 1.0 MiB" in ok[0]
    assert ok[-1].startswith("tune: ok, rung 1, 8 steps: 2,000 tokens/s,")
    assert "Invalid learning rate" in next(line for line in lines if line.startswith("tune: failed, rung 0"))
    assert "> memory budget" in next(line for line in lines if line.startswith("tune: pruned: predicted"))
    assert ("tune rung 0 (4 steps)" in stream.getvalue()) == terminal  # the bar, on a terminal only
    again = io.StringIO()
    monkeypatch.setattr(sys, "stderr", again)
    tune(config, FakeRunner({}))  # everything is in trials.jsonl: nothing runs
    assert again.getvalue().count("[trials.jsonl]") == 10
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    tune(config, FakeRunner({}), quiet=True)
    assert "[trials.jsonl]" not in quiet.getvalue()


def test_memory_sizes_take_units(tmp_path: Path, capsys, trial_server) -> None:
    assert parse_bytes("80GiB") == 80 * 1024**3 and parse_bytes("500MB") == 500 * 1000**2
    assert parse_bytes("1.5 kib") == 1536 and parse_bytes("81604378624") == 81604378624 and parse_bytes("2TB") == 2e12
    for garbage in ("", "GiB", "80 GiB x", "-1", "80G", "0.4B", "1e9"):
        with pytest.raises(ConfigError, match=r"memory size"):
            parse_bytes(garbage)
    argv = ["--config", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--space", str(tmp_path / "s.yaml")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--memory-budget", "lots"])
    assert exit_.value.code == 2
    assert "argument --memory-budget: not a memory size: 'lots'" in capsys.readouterr().err
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"data.batch_size": [1, 2]}))
    assert main([*argv, "--memory-budget", "1KiB", "--script", str(FAKE)]) == 0  # everything pruned: nothing runs
    reasons = [line["reason"] for line in _lines(tmp_path / "out/trials.jsonl")]
    assert len(reasons) == 2 and all(r.endswith("> memory budget 1,024") for r in reasons)


def test_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert main(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "error: TuneConfig.config: no such file" in capsys.readouterr().err
    config = _config(tmp_path)
    runner = FakeRunner({2: 1.0, 4: 2.0})
    tune(TuneConfig(config, tmp_path / "out", space={"data.batch_size": [2, 4]}), runner)
    with pytest.raises(ConfigError, match=r"holds another search .*space"):
        tune(TuneConfig(config, tmp_path / "out", space={"data.batch_size": [2]}), runner)
    with pytest.raises(ConfigError, match=r"space: model.lr must list at least one value"):
        tune(TuneConfig(config, tmp_path / "o2", space={"model.lr": []}), runner)
    with pytest.raises(ConfigError, match="--global-batch sets per candidate"):
        tune(TuneConfig(config, tmp_path / "o3", space={"trainer.accumulate_grad_batches": [1]}, global_batch=8))
    with pytest.raises(ConfigError, match=r"TuneConfig.warmup_steps must be an int >= 1"):
        TuneConfig(config, tmp_path / "o4", warmup_steps=0)


def test_without_matplotlib_the_plot_is_skipped_with_a_message(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_plot(tmp_path / "report.png", [TrialRecord({}, "ok", 1.0, 1, 1)]) is None
    assert "matplotlib is missing" in capsys.readouterr().err and not (tmp_path / "report.png").exists()


def test_real_search_of_the_example_cli(tmp_path: Path, monkeypatch) -> None:
    """Two trials of the example CLI (one crashes), then ``best.yaml`` trains as it is."""
    monkeypatch.chdir(tmp_path)
    config = TuneConfig(_config(tmp_path), tmp_path / "out", space={"model.lr": [0.003, -1.0]}, steps=2,
                        warmup_steps=1, trial_timeout=300)  # fmt: skip
    result = tune(config)
    ok, failed = result.records
    assert (ok.status, failed.status) == ("ok", "failed") and "Invalid learning rate" in failed.reason
    assert ok.tokens_per_sec > 0 and ok.peak_memory > ok.predicted_memory > 0  # RSS holds the interpreter too
    assert ok.settings == {"model.lr": 0.003, "trainer.accumulate_grad_batches": 1}
    plotted = (tmp_path / "out/report.png").exists() and (tmp_path / "out/report.png").stat().st_size > 0
    assert plotted == (importlib.util.find_spec("matplotlib") is not None)  # the plot extra is optional
    spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples" / "train_moe.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cli = example.main(["fit", "--config", str(tmp_path / "out/best.yaml"), "--trainer.max_steps", "1"])
    assert cli.trainer.global_step == 1 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
