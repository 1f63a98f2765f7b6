"""The ``hf`` benchmark profile: HFCausalLMModule against transformers' own packed-data recipe, one run."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_llmfast.bench.e2e import E2ESettings
from lightning_llmfast.bench.suite import PROFILES
from lightning_llmfast.data import pack_documents

transformers = pytest.importorskip("transformers")

from lightning_llmfast.bench.hf import HF_VARIANTS, flatten_like_transformers, run_hf  # noqa: E402

TINY = {
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def test_flattened_fields_are_the_collators_and_give_the_same_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in (3, 5, 2, 6)]
    batch = next(pack_documents(docs, seq_len=8, batch_size=2, vocab_size=258))
    assert batch.num_tokens == 16  # rows filled exactly: no padding, so the collator sees the same tokens
    cu = batch.cu_seqlens.tolist()
    flat_ids = batch.input_ids.reshape(-1)
    features = [{"input_ids": flat_ids[s:e].tolist()} for s, e in itertools.pairwise(cu)]
    collated = transformers.DataCollatorWithFlattening()(features)
    ours = flatten_like_transformers(batch)
    for name in ("input_ids", "position_ids", "labels"):
        assert torch.equal(getattr(ours, name), collated[name]), name
    # transformers' own loss on these fields equals the plain mean cross entropy over our shifted labels.
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY, attn_implementation="sdpa"))
    hf_loss = model(**ours.fields(), use_cache=False).loss
    from lightning_llmfast import packed_model_inputs

    logits = model(**packed_model_inputs(batch, model)).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), batch.labels.flatten(), ignore_index=-100)
    assert hf_loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_hf_profile_runs_all_variants_with_zero_syncs_for_llmfast() -> None:
    assert "hf" in PROFILES
    settings = E2ESettings(
        model=TINY,
        seq_len=32,
        batch_size=2,
        mean_doc_len=10,
        warmup_steps=0,
        measured_steps=1,
        repeats=1,
        count_steps=1,
    )
    results, notes = run_hf(settings, "cpu", log=lambda _: None)
    assert set(results) == set(HF_VARIANTS)
    assert results["llmfast"]["host_syncs_per_step"] == 0
    assert results["hf_eager"]["host_syncs_per_step"] > 0  # transformers' per-expert loop reads the device
    assert results["llmfast"]["metadata_builds_per_step"] == 1
    losses = [r["final_loss"] for r in results.values()]
    assert max(losses) - min(losses) <= 1e-4 * max(losses)  # same weights, tokens and labels: same training
    assert all(r["tokens_per_sec"] > 0 and r["tokens_per_cpu_sec"] > 0 for r in results.values())
    assert any("final loss max relative difference" in n for n in notes)
