"""Lightning end to end: a short fit whose loss falls, and a token monitor that counts real tokens exactly."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_llmfast import (
    ConfigError,
    MoEGPTConfig,
    MoEGPTLightningModule,
    SequenceMetadataCallback,
    TokenThroughputMonitor,
)
from lightning_llmfast.data import SyntheticCorpus, pack_documents

VOCAB = 64
PAD = VOCAB - 1


class _Recorder(L.Callback):
    """Independent record of what the monitor should have counted: per-step loss and real tokens of each batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.tokens_by_step: dict[int, int] = {}
        self.flops = 0
        self.flops_by_step: dict[int, int] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        # count the non-padding positions from the tensors (PAD never occurs in a document), not from num_tokens
        self.tokens += int((batch.input_ids != PAD).sum())
        self.tokens_by_step[trainer.global_step] = self.tokens
        # FLOPs by hand: 6 per active parameter per token plus causal attention, from the recorded boundaries
        c = pl_module.config
        lengths = (batch.cu_seqlens_cpu[1:] - batch.cu_seqlens_cpu[:-1]).tolist()
        active = sum(
            p.numel() * (c.top_k / c.num_experts if ".experts." in n else 1)
            for n, p in pl_module.model.named_parameters()
            if not n.startswith("embed.")
        )
        active += c.hidden_size * c.vocab_size
        self.flops += 6 * active * sum(lengths) + 6 * c.n_layers * c.hidden_size * sum(n * n for n in lengths)
        self.flops_by_step[trainer.global_step] = self.flops


def _batches(num_batches: int, seq_len: int, batch_size: int, seed: int = 0) -> list[Any]:
    # A learnable corpus: each document counts upwards from a random start (next = token + 1 mod PAD), so a model
    # that learns the bigram rule drives the loss down within a few steps.
    g = torch.Generator().manual_seed(seed)
    corpus = SyntheticCorpus(num_docs=num_batches * batch_size * 4, mean_len=seq_len // 3, seed=seed, vocab_size=VOCAB)
    docs = [(torch.arange(len(doc)) + torch.randint(0, PAD, (1,), generator=g)) % PAD for doc in corpus]
    return list(pack_documents(docs, seq_len, batch_size, pad_id=PAD, vocab_size=VOCAB))[:num_batches]


def _module(**overrides: Any) -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=64, **overrides
    )
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2)


def test_fit_loss_falls_and_monitor_counts_real_tokens(tmp_path: Path) -> None:
    batches = _batches(20, seq_len=64, batch_size=4)
    recorder = _Recorder()
    monitor = TokenThroughputMonitor(log_every_n_steps=5, window_size=2, peak_flops=1e12)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=20,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=5,
        callbacks=[SequenceMetadataCallback(), monitor, recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_module(), train_dataloaders=DataLoader(batches, batch_size=None))

    assert len(recorder.losses) == 20
    first, last = sum(recorder.losses[:3]) / 3, sum(recorder.losses[-3:]) / 3
    assert last < 0.8 * first, recorder.losses

    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    # rows are indexed like Lightning's own: optimizer step n is logged at row n - 1
    logged = {int(r["step"]) + 1: float(r["train/tokens"]) for r in rows if r.get("train/tokens")}
    assert sorted(logged) == [5, 10, 15, 20]
    for step, tokens in logged.items():
        assert tokens == recorder.tokens_by_step[step]
    rates = [float(r["train/tokens_per_sec"]) for r in rows if r.get("train/tokens_per_sec")]
    assert len(rates) == 3 and all(r > 0 for r in rates)  # window of 2 log points: from the second on
    # MFU * peak / tokens-per-sec is the FLOPs per real token of the window; check it against the hand count
    for r in rows:
        if r.get("train/mfu"):
            step = int(r["step"]) + 1
            window_flops = recorder.flops_by_step[step] - recorder.flops_by_step[step - 5]
            window_tokens = recorder.tokens_by_step[step] - recorder.tokens_by_step[step - 5]
            per_token = float(r["train/mfu"]) * 1e12 / float(r["train/device/tokens_per_sec"])
            assert per_token == pytest.approx(window_flops / window_tokens, rel=1e-3)
    assert any(r.get("train/mfu") for r in rows)
    padding = [float(r["train/padding_fraction"]) for r in rows if r.get("train/padding_fraction")]
    assert all(0.0 <= p < 0.5 for p in padding)


def test_monitor_counts_each_micro_batch_under_gradient_accumulation(tmp_path: Path) -> None:
    batches = _batches(12, seq_len=32, batch_size=2, seed=1)
    recorder = _Recorder()
    monitor = TokenThroughputMonitor(log_every_n_steps=2, window_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path),
        callbacks=[monitor, recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_module(), train_dataloaders=DataLoader(batches, batch_size=None))
    assert monitor.total_tokens == recorder.tokens == sum(b.num_tokens for b in batches)
    assert monitor.last_metrics["train/tokens"] == recorder.tokens_by_step[6]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, r"log_every_n_steps must be an int >= 1, got 0"),
        ({"log_every_n_steps": "5"}, r"log_every_n_steps must be an int >= 1, got '5'"),
        ({"log_every_n_steps": 1.5}, r"log_every_n_steps must be an int >= 1, got 1.5"),
        ({"log_every_n_steps": True}, r"log_every_n_steps must be an int >= 1, got True"),
        ({"window_size": 1}, r"window_size must be an int >= 2, got 1"),
        ({"window_size": "5"}, r"window_size must be an int >= 2, got '5'"),
        ({"window_size": 2.5}, r"window_size must be an int >= 2, got 2.5"),
        ({"peak_flops": -1}, r"peak_flops must be a finite number > 0, got -1"),
        ({"peak_flops": float("nan")}, r"peak_flops must be a finite number > 0, got nan"),
        ({"num_tokens_fn": 5}, r"num_tokens_fn must be callable or None, got 5"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TokenThroughputMonitor(**kwargs)


def test_monitor_rejects_batches_without_token_counts(tmp_path: Path) -> None:
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, callbacks=[TokenThroughputMonitor()], enable_progress_bar=False
    )
    with pytest.raises(ConfigError, match="num_tokens"):
        trainer.fit(Plain(), train_dataloaders=DataLoader(torch.randn(4, 2), batch_size=2))


def test_monitor_sums_real_tokens_over_ranks_instead_of_scaling_rank_zero() -> None:
    """Two simulated ranks with different real-token counts: the global rate is their sum, not 2x rank 0's."""
    other_rank_real, other_rank_padded = 300, 512  # what the second rank counted between the two log points

    class TwoRankStrategy:
        def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
            assert reduce_op == "sum"
            return tensor + torch.tensor([other_rank_real, other_rank_padded])

    logged: list[dict[str, float]] = []

    class Logger:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            logged.append(metrics)

    trainer = SimpleNamespace(
        strategy=TwoRankStrategy(),
        loggers=[Logger()],
        is_global_zero=True,
        global_step=0,
        log_every_n_steps=1,
        precision="32-true",
    )
    module = SimpleNamespace(device=torch.device("cpu"), log=lambda *args, **kwargs: None)
    monitor = TokenThroughputMonitor(window_size=2)
    monitor.setup(trainer, module, "fit")  # type: ignore[arg-type]
    ids = torch.zeros(2, 256, dtype=torch.long)
    for step, real in ((1, 400), (2, 100)):
        monitor.on_train_batch_start(trainer, module, None, step)  # type: ignore[arg-type]
        trainer.global_step = step
        batch = SimpleNamespace(num_tokens=real, input_ids=ids)
        monitor.on_train_batch_end(trainer, module, None, batch, step)  # type: ignore[arg-type]
    first, second = logged
    assert first["train/tokens"] == 400 + other_rank_real
    assert second["train/tokens"] == 400 + 100 + 2 * other_rank_real
    assert second["train/padding_fraction"] == pytest.approx(1 - (100 + other_rank_real) / (512 + other_rank_padded))
    # over the window both rates divide by the same elapsed time: global / device = (100 + 300) / 100, not 2
    ratio = second["train/tokens_per_sec"] / second["train/device/tokens_per_sec"]
    assert ratio == pytest.approx((100 + other_rank_real) / 100)


def test_validate_runs_under_inference_mode_with_the_forward_of_no_grad(tmp_path: Path) -> None:
    """Trainer.validate/test/predict run under torch.inference_mode (Lightning's default): the RMSNorm Function's
    rebuild marking read the version counter that inference tensors lack, so they crashed."""
    module = _module()
    batches = _batches(2, seq_len=32, batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", strategy="llmfast", logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    (metrics,) = trainer.validate(module, dataloaders=DataLoader(batches, batch_size=None))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()) and metrics
    ids = batches[0].input_ids
    with torch.inference_mode():
        inferred = module.model(ids)
    with torch.no_grad():
        assert torch.equal(inferred, module.model(ids))
