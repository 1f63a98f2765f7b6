"""transformers causal LMs on packed batches: every document's logits and gradients equal the document run alone."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_llmfast import (
    ConfigError,
    DataError,
    ExpertLoadMonitor,
    HFCausalLMModule,
    MetadataError,
    PackedDataModule,
    SequenceMetadata,
    SequenceMetadataCallback,
    TokenThroughputMonitor,
    packed_model_inputs,
)
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.data import pack_documents
from lightning_llmfast.moe import GroupedMoE
from lightning_llmfast.seqmeta import SequenceMetadataCache

transformers = pytest.importorskip("transformers")

VOCAB = 128
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, intermediate_size=48, num_key_value_heads=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **_COMMON, num_key_value_heads=2, intermediate_size=24, num_experts=4, num_experts_per_tok=2
    ),
}
# Lengths with several documents per row, one of length 1 and rows ending in padding tails.
DOC_LENGTHS = (5, 1, 7, 3, 9, 2, 6, 4)


def _model(name: str, attn: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.float()


def _batch(seed: int = 0, seq_len: int = 17, rows: int = 2):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in DOC_LENGTHS]
    batch = next(pack_documents(docs, seq_len=seq_len, batch_size=rows, vocab_size=VOCAB))
    cu = batch.cu_seqlens.tolist()
    per_row = [sum(1 for s in cu[:-1] if r * seq_len <= s < (r + 1) * seq_len) for r in range(rows)]
    assert min(per_row) >= 3, per_row  # every row really holds several segments
    assert 1 in [e - s for s, e in itertools.pairwise(cu)]  # a document of length 1
    return batch


def _segments(batch) -> list[tuple[int, int]]:
    cu = batch.cu_seqlens.tolist()
    return [(s, e) for s, e in itertools.pairwise(cu) if e > s]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_logits_and_gradients_equal_each_document_alone(name: str, attn: str, train: bool) -> None:
    model = _model(name, attn).train(train)
    batch = _batch(seed=len(name))
    weights = torch.randn(batch.input_ids.numel(), VOCAB, generator=torch.Generator().manual_seed(1))

    logits = model(**packed_model_inputs(batch, model)).logits.reshape(-1, VOCAB)
    (logits * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    flat = batch.input_ids.reshape(-1)
    worst = 0.0
    for s, e in _segments(batch):
        alone = model(input_ids=flat[s:e][None], use_cache=False).logits[0]
        (alone * weights[s:e]).sum().backward()
        worst = max(worst, (alone - logits[s:e]).abs().max().item())
    assert worst <= 1e-5, worst
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_swapped_moe_blocks_keep_documents_apart(name: str) -> None:
    module = HFCausalLMModule(_model(name, "sdpa"), moe_backend="torch")
    assert module.swap_moe_blocks("torch") == 2
    batch = _batch(seed=3)
    logits = module(batch).reshape(-1, VOCAB)
    flat = batch.input_ids.reshape(-1)
    for s, e in _segments(batch):
        alone = module.model(input_ids=flat[s:e][None], use_cache=False).logits[0]
        torch.testing.assert_close(alone, logits[s:e], rtol=0, atol=1e-5)


def test_transformers_defaults_attend_across_documents() -> None:
    """The bug packed_model_inputs exists for: input_ids + position_ids alone mix documents (a cache is created)."""
    model = _model("qwen3_moe", "sdpa").eval()
    batch = _batch()
    ours = model(**packed_model_inputs(batch, model)).logits
    naive = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert (ours - naive).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_host_sync_and_one_mask_per_metadata(attn: str) -> None:
    model = _model("llama", attn)
    batch = _batch()
    cache = SequenceMetadataCache()
    with SyncCounter(host=batch) as sc, cache.batch(batch):  # a collator batch: host data
        first = packed_model_inputs(batch, model)
        model(**first).logits.sum().backward()
        second = packed_model_inputs(batch, model)
    assert sc.num_syncs == 0, sc.syncs
    assert second["attention_mask"] is first["attention_mask"]  # built once per batch
    assert cache.stats["builds"] == 1 and cache.stats["reads"] == 2
    assert first["use_cache"] is False and first["position_ids"] is batch.position_ids
    mask = first["attention_mask"]
    assert mask.shape == (2, 1, 17, 17)
    if attn == "eager":
        assert mask.dtype == torch.float32 and mask.max() == 0


def test_mask_matches_a_loop_over_documents() -> None:
    batch = _batch(seed=5)
    meta = SequenceMetadata.from_batch(batch)
    from lightning_llmfast.hf import block_causal_mask

    for window in (None, 3):
        mask = block_causal_mask(meta, batch.seq_len, "sdpa", torch.float32, window)
        t = batch.seq_len
        ref = torch.zeros(batch.batch_size, 1, t, t, dtype=torch.bool)
        for s, e in _segments(batch):
            for q in range(s, e):
                for k in range(s, q + 1):
                    if window is None or q - k < window:
                        ref[q // t, 0, q % t, k % t] = True
        assert torch.equal(mask, ref)


def test_flash_attention_gets_varlen_kwargs_from_host_metadata() -> None:
    model = _model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = _batch()
    with SyncCounter(host=batch) as sc:
        kwargs = packed_model_inputs(batch, model)
    assert sc.num_syncs == 0
    assert "attention_mask" not in kwargs and kwargs["use_cache"] is False
    assert kwargs["cu_seq_lens_q"].tolist() == batch.cu_seqlens.tolist() == kwargs["cu_seq_lens_k"].tolist()
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == batch.max_seqlen
    assert isinstance(kwargs["max_length_q"], int)


def test_bad_inputs_raise_our_errors() -> None:
    model = _model("llama", "sdpa")
    batch = _batch()
    with pytest.raises(DataError, match="needs a PackedBatch"):
        packed_model_inputs({"input_ids": batch.input_ids}, model)
    with pytest.raises(ConfigError, match="with a `config`"):
        packed_model_inputs(batch, torch.nn.Linear(2, 2))
    with pytest.raises(MetadataError, match="describes 4 positions"):
        packed_model_inputs(batch, model, metadata=SequenceMetadata.from_lengths([4]))
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="'flex_attention' is not supported"):
        packed_model_inputs(batch, model)
    with pytest.raises(ConfigError, match="model: expected a transformers causal LM"):
        HFCausalLMModule(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="lr must be"):
        HFCausalLMModule(CONFIGS["llama"](), lr=0.0)


def test_loss_uses_the_shifted_labels_once_against_a_float64_loop() -> None:
    module = HFCausalLMModule(_model("qwen3_moe", "sdpa"), aux_loss_coef=0.0)
    batch = _batch(seed=7)
    ce, loss = module._loss(batch)
    flat = batch.input_ids.reshape(-1)
    total, count = 0.0, 0
    for s, e in _segments(batch):
        logits = module.model(input_ids=flat[s:e][None], use_cache=False).logits[0].double()
        labels = batch.labels.reshape(-1)[s:e]
        for i in range(e - s):
            if labels[i] != -100:
                assert labels[i] == flat[s + i + 1]  # labels are the next token of the same document
                total -= torch.log_softmax(logits[i], -1)[labels[i]].item()
                count += 1
    assert ce.item() == pytest.approx(total / count, rel=1e-5) and loss is ce
    # With the MoE load-balancing loss the objective grows by exactly coef * the blocks' summed aux loss.
    module.aux_loss_coef = 0.5
    module.swap_moe_blocks("torch")
    ce, loss = module._loss(batch)
    aux = module.aux_loss()
    assert aux is not None and loss.item() == pytest.approx(ce.item() + 0.5 * aux.item(), rel=1e-6)


def _fit_module(tmp_path: Path, max_steps: int = 30, **trainer_kwargs):
    module = HFCausalLMModule(CONFIGS["qwen3_moe"](), lr=1e-2, warmup_steps=2, moe_backend="torch")
    # Learnable documents (each counts up by its own step, modulo the vocabulary) of mixed lengths.
    gen = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(300):
        start, step, n = (int(v) for v in torch.randint(1, 40, (3,), generator=gen))
        docs.append([(start + i * (step % 5 + 1)) % VOCAB for i in range(n)])
    data = DataLoader(list(pack_documents(docs, seq_len=64, batch_size=2, vocab_size=VOCAB)), batch_size=None)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor(), ExpertLoadMonitor(), Record()],
        **trainer_kwargs,
    )
    return module, data, trainer, losses


def test_thirty_step_fit_loss_falls_and_the_metadata_is_read(tmp_path: Path) -> None:
    module, data, trainer, losses = _fit_module(tmp_path, strategy="llmfast")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=r"(?s)(?!SequenceMetadataCallback).*")
        trainer.fit(module, train_dataloaders=data)
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert sum(isinstance(m, GroupedMoE) for m in module.modules()) == 2
    assert trainer.logged_metrics["seqmeta/reads_per_step"] == 1.0
    assert trainer.logged_metrics["seqmeta/builds_per_step"] == 1.0


def test_callback_warns_when_nothing_reads_the_metadata(tmp_path: Path) -> None:
    class Naive(HFCausalLMModule):
        def forward(self, batch):  # what a user writes without packed_model_inputs
            return self.model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits

    module, data, trainer, _ = _fit_module(tmp_path, max_steps=3)
    naive = Naive(module.model, moe_backend="torch")
    with pytest.warns(UserWarning, match=r"in 3 of 3 training steps no layer read the packed metadata"):
        trainer.fit(naive, train_dataloaders=data)
    assert trainer.logged_metrics["seqmeta/reads_per_step"] == 0.0


def test_lightning_cli_builds_the_model_from_a_transformers_config(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        HFCausalLMModule,
        PackedDataModule,
        run=False,
        save_config_kwargs={"overwrite": True},
        args=[
            "--model.model=transformers.Qwen3MoeConfig",
            "--model.model.init_args.vocab_size=258",
            "--model.model.init_args.hidden_size=32",
            "--model.model.init_args.num_hidden_layers=2",
            "--model.model.init_args.num_attention_heads=4",
            "--model.model.init_args.num_key_value_heads=2",
            "--model.model.init_args.num_experts=4",
            "--model.model.init_args.num_experts_per_tok=2",  # at most num_experts: the swap checks its routing
            "--model.model.init_args.moe_intermediate_size=16",
            "--model.attn_implementation=eager",
            "--data.num_workers=0",
            "--data.max_docs=2",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    model = cli.model.model
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    assert model.config.hidden_size == 32 and cli.model.hparams.attn_implementation == "eager"
    assert model.config._attn_implementation == "llmfast_varlen"  # packed batches attend through it whatever built
    assert cli.model.swap_moe_blocks("torch") == 2


def test_fit_under_gradient_accumulation_and_plain_mean_outside_training(tmp_path: Path) -> None:
    module, data, trainer, losses = _fit_module(tmp_path, max_steps=2, accumulate_grad_batches=2)
    trainer.fit(module, train_dataloaders=data)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    # Outside training the loss is the plain mean over label tokens.
    batch = next(iter(data))
    logits = module(batch)
    ref = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    assert module._loss(batch)[0].item() == pytest.approx(ref.item(), rel=1e-6)


def _three_steps(tmp_path: Path, strategy) -> tuple[HFCausalLMModule, L.Trainer]:
    torch.manual_seed(0)
    module = HFCausalLMModule(CONFIGS["olmoe"](), lr=1e-2, warmup_steps=1, moe_backend="torch")
    batches = [_batch(seed=s) for s in range(3)]
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SequenceMetadataCallback(), ExpertLoadMonitor(log_every_n_steps=1)],
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return module, trainer


def test_activation_offload_strategy_trains_the_same_model(tmp_path: Path) -> None:
    from lightning_llmfast import LLMFastStrategy, OffloadConfig

    reference, trainer = _three_steps(tmp_path, "llmfast")
    assert 0 <= float(trainer.logged_metrics["moe/load_imbalance"])
    strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))
    offloaded, _ = _three_steps(tmp_path, strategy)
    assert strategy.offload_stats is not None and strategy.offload_stats["offloaded_bytes"] > 0
    for p, q in zip(reference.parameters(), offloaded.parameters()):
        assert torch.equal(p, q)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention needs a CUDA device")
def test_flash_attention_2_keeps_documents_apart_on_cuda() -> None:
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    config = CONFIGS["qwen3_moe"]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")
    model = model.to("cuda", torch.bfloat16)
    batch = _batch().to("cuda")
    with SyncCounter() as sc:
        logits = model(**packed_model_inputs(batch, model)).logits.reshape(-1, VOCAB).float()
    flat = batch.input_ids.reshape(-1)
    for s, e in _segments(batch):
        alone = model(input_ids=flat[s:e][None], use_cache=False).logits[0].float()
        torch.testing.assert_close(alone, logits[s:e], rtol=2e-2, atol=2e-2)
    assert sc.syncs.get("nonzero", 0) == 0  # the boundaries came from the host, not from position_ids
