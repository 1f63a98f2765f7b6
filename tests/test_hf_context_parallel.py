"""transformers models under context parallelism, model level (no Trainer): a rank's shard of a packed batch through
``HFCausalLMModule`` gives the one-process logits, loss and gradients (float64, 2 gloo processes) for Mixtral (K and
V gathered) and DeepSeek-V3 (multi-head latent attention gathering its latent and rope key: the gathered bytes are
the latent's); the MLA swap keeps every parameter name; models that cannot attend a shard are refused."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _distributed import run_distributed
from _pretrained import tiny_config

from lightning_llmfast import ConfigError, HFCausalLMModule, packed_model_inputs
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.expert_parallel import share_batch
from lightning_llmfast.hf.context import LatentGatherAttention, latent_gather_bytes, use_context_parallel
from lightning_llmfast.seqmeta import CONTEXT_STATS

transformers = pytest.importorskip("transformers")

VOCAB = 61
AUX = 0.01
# 4 rows of T = 13 (prime): one document of exactly T, length-1 documents, prime lengths, padding tails, and one
# document of 52 tokens cut at the row ends, which spans every rank.
LAYOUTS = ([13, 1, 1, 5, 7, 13, 2], [52], [2, 3, 1, 11, 3, 2, 1, 3, 17, 5])


def _batches() -> list[PackedBatch]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for lengths in LAYOUTS:
        docs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
        out.append(next(pack_documents(docs, seq_len=13, batch_size=4, vocab_size=VOCAB, lookahead=8)))
    return out


def _module(family: str) -> HFCausalLMModule:
    torch.manual_seed(1)
    config = tiny_config(family, VOCAB)
    config.num_hidden_layers = 2
    config._experts_implementation = "eager"  # float64: the grouped_mm experts take float32 and below only
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # biased routing, small enough to keep it varied
                buf.normal_(0.0, 0.05)
    module = HFCausalLMModule(model, aux_loss_coef=AUX, moe_backend="torch")
    module.configure_model()  # the grouped MoE blocks
    return module


def _loss(module: HFCausalLMModule, batch: PackedBatch, tokens: int, ranks: int = 1) -> torch.Tensor:
    """Cross entropy summed over the batch's (or shard's) labels over the whole batch's ``tokens``, plus the balance
    loss over the ``ranks`` sharing the batch (under ``share_batch`` each rank's is the batch's: the mean of theirs,
    as ``scale_by_token_share`` weighs it)."""
    logits = module(batch)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100, reduction="sum")
    return ce / tokens + AUX * module.aux_loss() / ranks


def _worker(rank: int, world: int, family: str) -> None:
    group = dist.group.WORLD
    reference = _module(family)
    module = copy.deepcopy(reference)
    swapped = use_context_parallel(module.model)
    attention = [m for m in module.model.modules() if isinstance(m, LatentGatherAttention)]
    assert swapped == len(attention) == (2 if family == "deepseek_v3" else 0)
    share_batch(module, group)
    for batch in _batches():
        tokens = int((batch.labels != -100).sum())
        _loss(reference, batch, tokens).backward()
        shard = batch.context_shard(rank, world, group)
        CONTEXT_STATS.reset()
        _loss(module, shard, tokens, world).backward()
        config = module.model.config
        if family == "deepseek_v3":  # one gather a layer, of the latent and the rope key only
            per_token = config.kv_lora_rank + config.qk_rope_head_dim
        else:  # one gather a layer, of every kv head's key and value
            per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        assert shard.input_ids.numel() * world == batch.input_ids.numel()
        assert CONTEXT_STATS.gathers == config.num_hidden_layers
        assert CONTEXT_STATS.gathered_bytes == config.num_hidden_layers * batch.input_ids.numel() * per_token * 8
        with torch.no_grad():
            logits = module(shard)
            expected = reference(batch).flatten(0, 1).index_select(0, shard.context.positions)
        torch.testing.assert_close(logits[0], expected, rtol=1e-6, atol=1e-6)  # float32 router (below)
    names = [n for n, p in reference.named_parameters() if p.grad is not None]
    assert names == [n for n, p in module.named_parameters() if p.grad is not None]
    for (name, mine), theirs in zip(module.named_parameters(), reference.parameters()):
        if mine.grad is None:
            continue
        grad = mine.grad.clone()
        dist.all_reduce(grad, group=group)  # the cp group's gradients, as DDP sums them
        # 1e-7: DeepSeek-V3's router computes in float32 whatever the model's dtype (every other gradient agrees to
        # float64's last bits).
        torch.testing.assert_close(grad, theirs.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("family", "cp"),
    [("deepseek_v3", 2), ("deepseek_v3", 4), ("mixtral", 2)],
    ids=["mla-cp2", "mla-cp4", "mixtral-cp2"],
)
def test_shards_equal_one_process_float64(family: str, cp: int) -> None:
    run_distributed(_worker, cp, family, timeout=180)


def test_latent_swap_keeps_names_and_gathers_the_latent_only() -> None:
    module = _module("deepseek_v3")
    before = {n: p for n, p in module.state_dict(keep_vars=True).items()}
    assert use_context_parallel(module.model) == 2
    assert use_context_parallel(module.model) == 0  # idempotent
    after = module.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    config = transformers.DeepseekV3Config()  # the released model's sizes
    latent, full = latent_gather_bytes(config, 2)
    assert (latent, full) == ((512 + 64) * 2, 128 * (128 + 64 + 128) * 2)


def test_models_that_cannot_attend_a_shard_are_refused() -> None:
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"Gemma2ForCausalLM.*attn_logit_softcapping"):
        use_context_parallel(model)
    # A model switched back to a mask-based attention meets a shard: refused, never a wrong block mask.
    module = _module("mixtral")
    module.model.set_attn_implementation("sdpa")
    shard = _batches()[0].context_shard(0, 2)
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM.*context-parallel shard.*'sdpa'"):
        packed_model_inputs(shard, module.model)


def test_module_setup_under_context_parallelism_restores_varlen_or_refuses() -> None:
    module = _module("qwen3_moe")
    module.model.set_attn_implementation("sdpa")
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(context_parallel_size=2))  # what setup reads
    module.setup("fit")
    assert module.model.config._attn_implementation == "llmfast_varlen"
    module.model.config.attention_dropout = 0.1  # set after construction: cannot attend a shard
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM.*attention_dropout"):
        module.setup("fit")
    module._trainer = SimpleNamespace(strategy=SimpleNamespace())  # another strategy: no context parallelism
    module.setup("fit")
