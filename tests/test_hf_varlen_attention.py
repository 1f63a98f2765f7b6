"""transformers models attend over packed batches through the package's varlen attention (``"llmfast_varlen"``):
logits and gradients equal to transformers' own model run on each document alone (float64) and to the dense-mask
path; no ``(B, 1, T, T)`` mask; saved activations linear in the row length; unsupported attention refused."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from lightning_llmfast import ConfigError, HFCausalLMModule, packed_model_inputs
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.saved import SavedBytes
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.hf.attention import VARLEN_ATTENTION, use_varlen_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
_COMMON = {"vocab_size": VOCAB, "hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4}
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, num_key_value_heads=2, head_dim=6, intermediate_size=20, moe_intermediate_size=12,
        num_experts=4, num_experts_per_tok=2,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_key_value_heads=1, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2
    ),
    # MLA: queries and keys of 8 + 4 = 12 dims a head, values of 5.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_COMMON, num_key_value_heads=4, intermediate_size=20, moe_intermediate_size=12, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=5, n_shared_experts=1, routed_scaling_factor=2.5,
    ),
    "llama": lambda: transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, intermediate_size=20),
}  # fmt: skip
# Tolerance against the documents run alone: DeepSeek-V3's router computes in float32 whatever the model's dtype, so
# its routing weights differ in float32's last bits between a 39-token batch and a document alone.
ALONE_ATOL = {"deepseek_v3": 1e-6}
# Rows of T = 13 (prime): one document of exactly T; documents of prime lengths; length-1 documents at a row's end.
DOC_LENGTHS = (13, 1, 5, 7, 2, 3, 1, 1, 6)


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._experts_implementation = "eager"  # float64: the grouped_mm experts take float32 and below only
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    with torch.no_grad():  # a non-zero correction bias exercises DeepSeek-V3's biased routing
        for buffer_name, buf in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buf.normal_()
    return model


def _batch(seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in DOC_LENGTHS]
    batch = next(pack_documents(docs, seq_len=13, batch_size=3, vocab_size=VOCAB))
    assert batch.cu_seqlens.tolist() == [0, 13, 14, 21, 26, 28, 34, 37, 38, 39]
    return batch


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_module_default_equals_each_document_alone_and_the_dense_mask_path(name: str) -> None:
    reference = _model(name, seed=len(name))
    module = HFCausalLMModule(copy.deepcopy(reference))
    assert module.model.config._attn_implementation == VARLEN_ATTENTION  # whatever the model was built with
    batch = _batch(seed=len(name))
    weights = torch.randn(batch.input_ids.numel(), VOCAB, dtype=torch.float64)

    inputs = packed_model_inputs(batch, module.model)
    assert inputs["attention_mask"].untyped_storage().nbytes() == 1  # a placeholder, no (B, 1, T, T) mask
    with SyncCounter(host=batch) as counter:
        logits = module(batch).reshape(-1, VOCAB)
        (logits * weights).sum().backward()
    if name == "llama":  # (transformers' own MoE blocks, kept here to compare attention alone, read the device)
        assert counter.num_syncs == 0, counter.syncs
    ours = _grads(module.model)

    # Today's path: transformers' sdpa with the dense block-causal mask.
    dense_inputs = packed_model_inputs(batch, reference)
    assert dense_inputs["attention_mask"].shape == (3, 1, 13, 13)
    dense = reference(**dense_inputs).logits.reshape(-1, VOCAB)
    (dense * weights).sum().backward()
    dense_grads = _grads(reference)
    torch.testing.assert_close(logits, dense, rtol=0, atol=1e-12)

    # Independent reference: transformers' own model on each document alone, no packing at all.
    flat = batch.input_ids.reshape(-1)
    cu = batch.cu_seqlens.tolist()
    for s, e in itertools.pairwise(cu):
        alone = reference(input_ids=flat[s:e][None], use_cache=False).logits[0]
        (alone * weights[s:e]).sum().backward()
        torch.testing.assert_close(logits[s:e], alone, rtol=0, atol=ALONE_ATOL.get(name, 1e-12))
    alone_grads = _grads(reference)
    assert ours.keys() == dense_grads.keys() == alone_grads.keys() and len(ours) > 10
    for n, g in ours.items():
        torch.testing.assert_close(g, dense_grads[n], rtol=1e-10, atol=1e-12, msg=n)
        atol = ALONE_ATOL.get(name, 1e-12)
        torch.testing.assert_close(g, alone_grads[n], rtol=1e-10 if atol < 1e-9 else 1e-5, atol=atol, msg=n)


def test_the_model_called_without_metadata_attends_as_sdpa() -> None:
    """Generation and plain calls of ``module.model`` (padding masks included) behave as transformers' sdpa."""
    reference = _model("llama")
    module = HFCausalLMModule(copy.deepcopy(reference))
    ids = torch.randint(1, VOCAB, (2, 9))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :4] = 0  # left padding
    for kwargs in ({}, {"attention_mask": padding}):
        got = module.model(input_ids=ids, use_cache=False, **kwargs).logits
        want = reference(input_ids=ids, use_cache=False, **kwargs).logits
        torch.testing.assert_close(got[padding.bool()], want[padding.bool()], rtol=0, atol=1e-12)
    generated = module.model.generate(ids[1:], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, reference.generate(ids[1:], max_new_tokens=3, do_sample=False))


def test_saved_activations_grow_linearly_with_the_row_length() -> None:
    """Rows of 8192 vs 2048 tokens holding 2048-token documents: every storage a training step saves for backward
    grow 4x (5.6 MB -> 22.5 MB; the dense-mask sdpa path: 38.9 MB -> 558 MB, 14.3x, the mask saved as float32)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=16, max_position_embeddings=8192,
    )  # fmt: skip
    module = HFCausalLMModule(config)
    saved = {}
    for seq_len in (2048, 8192):
        docs = [torch.randint(1, VOCAB, (2048,)).tolist() for _ in range(seq_len // 2048)]
        batch = next(pack_documents(docs, seq_len=seq_len, batch_size=1, vocab_size=VOCAB))
        assert batch.max_seqlen == 2048 and batch.cu_seqlens.numel() == seq_len // 2048 + 1
        with SavedBytes(exclude=module.parameters()) as counter:
            module._loss(batch)  # what the forward saves is what the backward would read
        saved[seq_len] = counter.nbytes
    ratio = saved[8192] / saved[2048]
    assert 3.9 <= ratio <= 4.6, (saved, ratio)


def test_attention_that_cannot_run_through_it_is_refused_at_setup() -> None:
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM: cannot attend through 'llmfast_varlen': attention_drop"):
        HFCausalLMModule(config)
    gemma = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=16,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"Gemma2ForCausalLM: .*attn_logit_softcapping=50"):
        HFCausalLMModule(gemma, attn_implementation="eager")
    with pytest.raises(ConfigError, match="does not dispatch through transformers' AttentionInterface"):
        use_varlen_attention(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dropout": 0.1}, "attention dropout 0.1"),
        ({"softcap": 30.0}, "passes `softcap`"),
        ({"s_aux": torch.zeros(4)}, "passes `s_aux`"),
        ({"is_causal": False}, "only causal attention"),
        ({"attention_mask": torch.ones(1, 1, 5, 5, dtype=torch.bool)}, "an attention mask the package did not build"),
        ({"llmfast_metadata": "cu_seqlens"}, "must be a SequenceMetadata, got str"),
    ],
    ids=["dropout", "softcap", "sinks", "non_causal", "foreign_mask", "not_metadata"],
)
def test_a_packed_call_the_varlen_attention_cannot_honour_is_refused(kwargs: dict, match: str) -> None:
    from lightning_llmfast.hf.attention import varlen_attention_forward
    from lightning_llmfast.seqmeta import SequenceMetadata

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    call = {"attention_mask": None, "llmfast_metadata": SequenceMetadata.from_lengths([2, 3]), **kwargs}
    with pytest.raises(ConfigError, match=match):
        varlen_attention_forward(torch.nn.Module(), q, k, k, **call)


def test_a_sliding_window_is_exact_up_to_its_length_and_refused_beyond() -> None:
    torch.manual_seed(0)
    config = transformers.MistralConfig(**_COMMON, num_key_value_heads=2, intermediate_size=20, sliding_window=7)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    module = HFCausalLMModule(copy.deepcopy(reference))
    short = next(pack_documents([[3] * 7, [4] * 5, [5]], seq_len=13, batch_size=1, vocab_size=VOCAB))
    torch.testing.assert_close(module(short), reference(**packed_model_inputs(short, reference)).logits)
    with pytest.raises(ConfigError, match="sliding window of 7 tokens and a document of 13"):
        module(_batch(seed=0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs a CUDA device")
def test_mla_values_padded_for_flash_attention_on_cuda() -> None:
    """DeepSeek-V3's values (8 dims) narrower than its queries and keys (16): padded to one head size for FlashAttention
    varlen, sliced back; equal to the dense-mask path in bf16."""
    config = CONFIGS["deepseek_v3"]()
    config.qk_nope_head_dim, config.v_head_dim = 12, 8
    config._experts_implementation = "eager"  # the tiny experts' rows are not 16-byte aligned for grouped_mm
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(
        "cuda", torch.bfloat16
    )
    module = HFCausalLMModule(copy.deepcopy(reference))
    batch = _batch(seed=1).to("cuda")
    got = module(batch).float()
    want = reference(**packed_model_inputs(batch, reference)).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
