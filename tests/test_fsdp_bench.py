"""``python -m lightning_llmfast.bench --profile fsdp``: counted per-rank bytes, same training, CLI wiring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_llmfast import ConfigError
from lightning_llmfast.bench import fsdp as bench_fsdp
from lightning_llmfast.bench.__main__ import main
from lightning_llmfast.bench.e2e import E2ESettings
from lightning_llmfast.models import MoEGPT, MoEGPTConfig

TINY = E2ESettings(
    model={"hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 32, "num_experts": 4},
    seq_len=32,
    batch_size=1,
    mean_doc_len=12,
    warmup_steps=1,
    measured_steps=1,
    repeats=1,
)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return bench_fsdp.run_fsdp_benchmark(2, expert_parallel_size=2, settings=TINY, timeout=300, log=lambda _: None)


def test_bytes_per_rank_are_counted_and_fsdp_holds_half_of_ddp(result: dict[str, Any]) -> None:
    model = MoEGPT(MoEGPTConfig(**TINY.model, router_backend="torch"))
    params = list(model.parameters())  # the tied head counts once
    expected = sum(p.numel() * p.element_size() for p in params)
    ddp, ours, peer = (result["fsdp"][v]["bytes_per_rank"] for v in ("llmfast", "llmfast_fsdp", "peer"))
    assert ddp["params"] == ddp["grads"] == expected
    # AdamW: exp_avg and exp_avg_sq per parameter, plus one fp32 step counter each (replicated, not sharded)
    assert ddp["optimizer"] == 2 * expected + 4 * len(params)
    assert ours["params"] == ours["grads"] == expected // 2 == peer["params"]
    assert ours["optimizer"] == expected + 4 * len(params)
    assert abs(result["ratios"]["bytes_vs_ideal"] - 1) <= 0.05 and result["targets"]["bytes_within_5pct_of_ideal"]
    assert result["world_size"] == 2 and result["profile"] == "fsdp"
    # EP(2) alone: dense parameters replicated, each rank holds half of every expert tensor; FSDP2 x EP(2): half of all
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    ep, fsdp_ep = (result["fsdp"][v]["bytes_per_rank"] for v in bench_fsdp.EP_VARIANTS)
    assert 0 < experts < expected and ep["params"] == ep["grads"] == expected - experts // 2
    assert fsdp_ep["params"] == fsdp_ep["grads"] == expected // 2 and fsdp_ep["optimizer"] == ours["optimizer"]


def test_fsdp_x_ep_is_compared_with_fsdp_alone_and_ep_alone_per_repeat(result: dict[str, Any]) -> None:
    rates = {v: result["fsdp"][v]["segments_tokens_per_sec"] for v in ("llmfast_fsdp_ep", "llmfast_fsdp", "llmfast_ep")}
    for key, den in (("fsdp_ep_vs_fsdp", "llmfast_fsdp"), ("fsdp_ep_vs_ep", "llmfast_ep")):
        per_repeat = [a / b for a, b in zip(rates["llmfast_fsdp_ep"], rates[den], strict=True)]
        ratio = result["ratios"][key]
        assert ratio["low"] == min(per_repeat) <= ratio["median"] <= max(per_repeat) == ratio["high"]
    assert result["expert_parallel_size"] == 2
    assert "FSDP2 x EP tokens/sec vs EP alone" in bench_fsdp.fsdp_markdown(result)


def test_the_three_strategies_train_the_same_model_on_the_same_data(result: dict[str, Any]) -> None:
    losses = [result["fsdp"][v]["final_loss"] for v in (*bench_fsdp.FSDP_VARIANTS, *bench_fsdp.EP_VARIANTS)]
    assert all(abs(x - losses[0]) <= 1e-5 * abs(losses[0]) for x in losses)
    assert all(entry["tokens_per_sec"] > 0 for entry in result["fsdp"].values()) and len(result["fsdp"]) == 5
    table = bench_fsdp.fsdp_markdown(result)
    assert all(f"| {v} |" in table for v in result["fsdp"])


def test_cli_profile_fsdp_writes_json_and_table(
    result: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []

    def fake(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append({"args": args, **kwargs})
        return result

    monkeypatch.setattr(bench_fsdp, "run_fsdp_benchmark", fake)
    out = tmp_path / "fsdp.json"
    assert main(["--profile", "fsdp", "--json", str(out), "--repeats", "2", "--world-size", "4",
                 "--expert-parallel-size", "2"]) == 0  # fmt: skip
    assert calls[0]["repeats"] == 2 and calls[0]["expert_parallel_size"] == 2 and calls[0]["args"] == (4,)
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert "tokens/sec vs peer" in capsys.readouterr().out


def test_one_process_is_refused() -> None:
    with pytest.raises(ConfigError, match="world_size >= 2"):
        bench_fsdp.run_fsdp_benchmark(1)
    with pytest.raises(ConfigError, match="must divide the world size"):
        bench_fsdp.run_fsdp_benchmark(4, expert_parallel_size=3)
