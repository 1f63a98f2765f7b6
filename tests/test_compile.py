"""The default path compiles whole: ``torch.compile(fullgraph=True)`` under an active metadata cache, 0 graph breaks,
results equal to eager; the metadata binding keeps refusing stale metadata with compilation on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_llmfast import (
    HFCausalLMModule,
    MetadataError,
    PackedBatch,
    SequenceMetadataCallback,
    packed_model_inputs,
)
from lightning_llmfast.data import IGNORE_INDEX, pack_documents
from lightning_llmfast.models import MoEGPT, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.moe.adapters import swap_moe_blocks
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache

transformers = pytest.importorskip("transformers")

VOCAB = 64
BACKEND = "aot_eager"  # Dynamo capture and AOTAutograd's joint graph, without Inductor's code generation time
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 32}


def _batches(n: int, seed: int, seq_len: int = 23, rows: int = 2) -> list[PackedBatch]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, *torch.randint(1, 13, (150,), generator=gen).tolist()]
    docs = [torch.randint(1, VOCAB, (k,), generator=gen).tolist() for k in lengths]
    return list(pack_documents(docs, seq_len=seq_len, batch_size=rows, vocab_size=VOCAB))[:n]


def _reference_model() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEGPTConfig(**CONFIG, num_experts=4, top_k=2, router_backend="torch"))


def _qwen3_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    assert swap_moe_blocks(model, backend="torch") == 2
    return model


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def _loss_and_grads(fn: Callable[[], torch.Tensor], model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_compiled_equals_eager(step: Callable[[PackedBatch], torch.Tensor], model: torch.nn.Module) -> None:
    """``step`` compiled whole (fullgraph) against eager, on two batches opened as two cache versions."""
    cache = SequenceMetadataCache()
    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    for batch in _batches(2, seed=3):
        with cache.batch(batch, model=model):  # as SequenceMetadataCallback: the embeddings are watched
            explained = torch._dynamo.explain(step)(batch)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
            eager, eager_grads = _loss_and_grads(lambda b=batch: step(b), model)
            got, grads = _loss_and_grads(lambda b=batch: compiled(b), model)
            assert cache.read_compiled  # the compiled graph's lookups are seen (the callback's read check)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        assert len(grads) == len(eager_grads) > 0
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_reference_model_forward_and_loss_compile_whole_under_an_active_cache() -> None:
    model = _reference_model()

    def step(batch: PackedBatch) -> torch.Tensor:
        return _loss(model(batch.input_ids, batch.position_ids), batch.labels) + 0.01 * model.aux_loss()

    _assert_compiled_equals_eager(step, model)


def test_swapped_qwen3_moe_forward_compiles_whole_with_packed_model_inputs() -> None:
    model = _qwen3_moe()

    def step(batch: PackedBatch) -> torch.Tensor:
        return _loss(model(**packed_model_inputs(batch, model)).logits, batch.labels)

    _assert_compiled_equals_eager(step, model)


# ----------------------------------------------------------------------------------------------- stale metadata
def _eager_logits(model: MoEGPT, batch: PackedBatch) -> torch.Tensor:
    return model(batch.input_ids, batch.position_ids, metadata=SequenceMetadata.from_batch(batch))


def test_whole_model_compile_refuses_another_batch_in_the_open_version() -> None:
    model = _reference_model().eval()
    first, second, third = _batches(3, seed=5)
    assert first.input_ids.shape == second.input_ids.shape == third.input_ids.shape
    forward = torch.compile(lambda b: model(b.input_ids, b.position_ids), fullgraph=True, backend=BACKEND)
    cache = SequenceMetadataCache()
    with torch.no_grad():
        with cache.batch(first):
            torch.testing.assert_close(forward(first), _eager_logits(model, first), rtol=1e-5, atol=1e-5)
            # Same shapes, other tokens: Dynamo's guard on the version's mark retraces, and the traced bind refuses.
            with pytest.raises((MetadataError, torch._dynamo.exc.Unsupported), match=r"under torch\.compile"):
                forward(second)
        with cache.batch(third):  # the next version: its own boundaries, never the first batch's
            torch.testing.assert_close(forward(third), _eager_logits(model, third), rtol=1e-5, atol=1e-5)


def test_per_layer_compile_keeps_every_stale_metadata_guarantee() -> None:
    model = _reference_model().eval()
    for layer in model.layers:  # what compile=True does, as torchtitan: each layer whole, the forward eager
        layer.compile(fullgraph=True, backend=BACKEND)
    first, second, third = _batches(3, seed=6)
    cache = SequenceMetadataCache()
    with torch.no_grad(), cache.batch(first):
        torch.testing.assert_close(model(first.input_ids, first.position_ids), _eager_logits(model, first))
        # another batch of the same shape: rebuilt from its own position ids (equal to it alone)
        torch.testing.assert_close(model(second.input_ids, second.position_ids), _eager_logits(model, second))
        # nothing describes these tokens: refused inside the compiled layer (Dynamo wraps the error under fullgraph)
        with pytest.raises((MetadataError, torch._dynamo.exc.Unsupported), match="not the batch the cache version"):
            model(third.input_ids)
        # an in-place edit that makes the batch's fields disagree: an error, not other boundaries
        first.cu_seqlens[1] += 1
        with pytest.raises(MetadataError, match="position_ids disagree with cu_seqlens"):
            model(first.input_ids, first.position_ids)


# ---------------------------------------------------------------------------------------- Lightning compile=True
def _fit_losses(module: L.LightningModule, batches: list[PackedBatch], root: Path) -> list[float]:
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        default_root_dir=root, max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SequenceMetadataCallback(), Record()],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return losses


@pytest.mark.slow
def test_lightning_modules_compile_per_layer_and_train_as_eager(tmp_path: Path) -> None:
    batches = _batches(2, seed=7)
    config = MoEGPTConfig(**CONFIG, num_experts=4, top_k=2, router_backend="torch")
    runs = {}
    for compile in (False, BACKEND):
        torch.manual_seed(0)
        runs[compile] = (
            MoEGPTLightningModule(config, warmup_steps=1, compile=compile),
            HFCausalLMModule(_qwen3_moe(), warmup_steps=1, moe_backend="torch", compile=compile),
        )
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for eager, compiled in zip(runs[False], runs[BACKEND]):
        expected = _fit_losses(eager, batches, tmp_path)
        got = _fit_losses(compiled, batches, tmp_path)
        assert len(got) == len(batches)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the layers did run compiled
