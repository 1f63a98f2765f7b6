"""LightningCLI: the model's config fields in ``fit --help`` with help text, hints for misspelt flags, and
configuration errors in one line."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule, PackedDataModule
from lightning_llmfast.cli import LLMFastCLI, flag_hints

FIELDS = [f.name for f in dataclasses.fields(MoEGPTConfig)]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])  # the CLI gets `args=`; pytest's own flags are not for it


def test_fit_help_lists_every_config_field_with_a_line_of_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        LLMFastCLI(MoEGPTLightningModule, PackedDataModule, args=["fit", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in FIELDS:
        found = re.search(rf"--model\.config\.{name}\b[^\n]*\n\s+(\S[^\n]*)", text)
        assert found, f"--model.config.{name} missing from fit --help"
        assert not found.group(1).startswith("(type:"), f"--model.config.{name} has no help text"


@pytest.mark.parametrize(
    ("flag", "hint"),
    [
        ("--model.num_layers", "did you mean --model.config.n_layers?"),  # the one a user tries first
        ("--model.config.num_hidden_layers=6", "did you mean --model.config.n_layers?"),  # transformers' name
        ("--model.num_local_experts", "did you mean --model.config.num_experts?"),
        ("--model.config.hiden_size", "did you mean --model.config.hidden_size?"),  # a typo
        ("--model.learning_rate", "see the model section of --help"),
    ],
)
def test_misspelt_model_flags_get_a_hint(flag: str, hint: str) -> None:
    (got,) = flag_hints(["fit", flag, "8", "--trainer.max_steps", "3"], MoEGPTLightningModule)
    assert got == f"{flag.partition('=')[0]} is not an option; {hint}"


def test_valid_flags_get_no_hint() -> None:
    valid = [f"--model.config.{name}" for name in FIELDS] + ["--model.lr=0.1", "--model.config", "--model.help"]
    assert flag_hints(valid, MoEGPTLightningModule) == []


def test_the_cli_prints_the_hint_for_flags_and_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        LLMFastCLI(MoEGPTLightningModule, PackedDataModule, args=["--model.num_layers", "2"], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "hint: --model.num_layers is not an option; did you mean --model.config.n_layers?" in err

    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  config:\n    n_layers: 2\n    num_heads: 4\n")
    with pytest.raises(SystemExit):
        LLMFastCLI(MoEGPTLightningModule, PackedDataModule, args=["--config", str(config)], run=False)
    err = capsys.readouterr().err
    assert "hint: --model.config.num_heads is not an option; did you mean --model.config.n_heads?" in err
    assert "n_layers is not" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.config.n_layers", "0"], "error: ConfigError: MoEGPTConfig.n_layers must be an int >= 1, got 0"),
        (["--model.config.top_k", "9"], "error: ConfigError: MoEGPTConfig.top_k (9) must be <= num_experts (8)"),
    ],
)
def test_config_errors_end_the_run_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        LLMFastCLI(MoEGPTLightningModule, PackedDataModule, args=args, run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == message and "Traceback" not in "\n".join(err)


def test_a_valid_config_builds_the_module_from_the_flags() -> None:
    cli = LLMFastCLI(
        MoEGPTLightningModule, PackedDataModule, args=["--model.config.n_layers", "3", "--model.lr", "0.5"], run=False
    )
    assert cli.model.config == MoEGPTConfig(n_layers=3) and cli.model.lr == 0.5
    assert len(cli.model.model.layers) == 3


def test_the_default_config_is_not_shared_between_modules() -> None:
    a, b = MoEGPTLightningModule(), MoEGPTLightningModule()
    assert a.config == b.config == MoEGPTConfig() and a.config is not b.config
    a.config.dense_layers.append(0)
    assert b.config.dense_layers == [] and MoEGPTLightningModule().config.dense_layers == []
