"""Fine-tuning: warm-up then cosine decay to ``min_lr_ratio`` (the optimizer's learning rate at every step against
the formula), ``val/ppl`` beside ``val/loss``, and ``examples/configs/finetune.yaml`` fine-tuning a local pretrained
directory through the example CLI."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _pretrained import save_tiny
from torch.utils.data import DataLoader

from lightning_llmfast import HFCausalLMModule, LLMFastStrategy
from lightning_llmfast.data import pack_documents
from lightning_llmfast.modules.hf import lr_factor

pytest.importorskip("transformers")

ROOT = Path(__file__).parents[1]


def _expected(step: int, warmup: int, total: int, ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup + 1) / (total - warmup))
    return ratio + (1 - ratio) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize(("warmup", "total", "ratio"), [(1, 7, 0.0), (3, 11, 0.1), (4, 4, 0.5), (0, 5, 1.0)])
def test_lr_factor_is_linear_warmup_then_cosine_to_the_floor(warmup: int, total: int, ratio: float) -> None:
    factor = lr_factor(warmup, total, ratio)
    w = max(1, warmup)
    for step in range(total + 3):
        want = _expected(step, w, total, ratio) if total > w else min(1.0, (step + 1) / w)
        assert factor(step) == pytest.approx(want)
    if total > w and ratio < 1:
        assert factor(total - 1) == pytest.approx(ratio) and factor(total + 2) == pytest.approx(ratio)


class _LearningRates(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _batches(count: int, vocab: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in (4, 1, 9, 11, 2, 6, 7, 3, 10, 5) * count]
    return list(pack_documents(docs, 11, 2))[:count]


def test_fit_follows_the_schedule_and_logs_val_ppl(tmp_path: Path) -> None:
    source = save_tiny("qwen3", tmp_path / "source")
    module = HFCausalLMModule(str(source), lr=0.01, warmup_steps=2, min_lr_ratio=0.2)
    record = _LearningRates()
    steps = 6
    trainer = L.Trainer(
        accelerator="cpu", strategy=LLMFastStrategy(), max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record], num_sanity_val_steps=0,
        val_check_interval=steps,
    )  # fmt: skip
    val = _batches(3, 61, 1)
    trainer.fit(module, DataLoader(_batches(steps, 61, 0), batch_size=None), DataLoader(val, batch_size=None))
    assert record.lrs == pytest.approx([0.01 * _expected(s, 2, steps, 0.2) for s in range(steps)])
    metrics = trainer.callback_metrics
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-6)
    module.eval()
    with torch.no_grad():  # val/loss: the batch-size weighted mean of the batches' token means
        losses = [(torch.nn.functional.cross_entropy(module(b)[b.labels != -100], b.labels[b.labels != -100]),
                   b.batch_size) for b in val]  # fmt: skip
    mean = sum(loss * size for loss, size in losses) / sum(size for _, size in losses)
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(mean)), rel=1e-5)


@pytest.mark.slow
def test_finetune_config_fine_tunes_a_pretrained_directory_with_the_example_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)  # the config's checkpoints go to runs/finetune/ under the working directory
    source = save_tiny("qwen3_moe", tmp_path / "source", vocab_size=300)  # the default corpus is bytes (258 ids)
    model = AutoModelForCausalLM.from_pretrained(source)
    spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples" / "train_moe.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = [
        "fit", "--config", str(ROOT / "examples/configs/finetune.yaml"), "--model.model", str(source),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), "--data.seq_len", "32",
        "--data.batch_size", "2", "--data.num_workers", "0",
    ]  # fmt: skip
    cli = example.main(args)
    assert isinstance(cli.model, HFCausalLMModule) and cli.model.hparams["model"] == str(source)
    assert cli.trainer.global_step == 2 and "val/ppl" in cli.trainer.callback_metrics
    trained = cli.model.model.state_dict()
    assert not torch.equal(trained["model.norm.weight"], model.state_dict()["model.norm.weight"])
    assert (tmp_path / "runs/finetune/checkpoints/last.ckpt/.metadata").is_file()  # what the export takes
