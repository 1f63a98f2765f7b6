"""The reference model: packing never leaks across documents, before/after paths agree, no syncs when cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast import ConfigError, MoEGPT, MoEGPTConfig, SequenceMetadata
from lightning_llmfast.bench import SyncCounter
from lightning_llmfast.data import pack_documents

TINY = dict(vocab_size=50, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=48, num_experts=4, top_k=2)


def _model(**overrides: object) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEGPTConfig(**{**TINY, **overrides}))


def _packed_row(doc_lens: list[int], seq_len: int, seed: int) -> tuple[list[torch.Tensor], object]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in doc_lens]
    (batch,) = list(pack_documents(docs, seq_len, batch_size=1, vocab_size=TINY["vocab_size"]))
    return docs, batch


def _grads(model: MoEGPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention_metadata", ["per_layer", "cached"])
@pytest.mark.parametrize("router_backend", ["naive", "torch"])
def test_document_in_packed_row_equals_document_alone(attention_metadata: str, router_backend: str) -> None:
    """The core packing property: logits and gradients of one document do not depend on its row neighbours."""
    model = _model(attention_metadata=attention_metadata, router_backend=router_backend)
    docs, batch = _packed_row([5, 1, 11, 7], seq_len=31, seed=1)  # 24 real tokens, 7 padding, prime lengths
    # find document 2 (length 11) by its boundaries in the packed row
    starts = (batch.position_ids[0] == 0).nonzero().flatten().tolist()
    target = next(s for s in starts if torch.equal(batch.input_ids[0, s : s + 11], docs[2]))
    probe = torch.randn(11, TINY["vocab_size"])

    logits_packed = model(batch.input_ids, batch.position_ids)[0, target : target + 11]
    (logits_packed * probe).sum().backward()
    grads_packed = _grads(model)
    model.zero_grad()

    logits_alone = model(docs[2][None])[0]
    (logits_alone * probe).sum().backward()
    grads_alone = _grads(model)

    torch.testing.assert_close(logits_packed, logits_alone, rtol=1e-5, atol=1e-6)
    assert grads_packed.keys() == grads_alone.keys()
    for name in grads_alone:
        torch.testing.assert_close(grads_packed[name], grads_alone[name], rtol=1e-4, atol=1e-6, msg=name)


def test_before_and_after_paths_agree() -> None:
    """per_layer+naive (before) and cached+grouped (after) compute the same function from the same weights."""
    _, batch = _packed_row([1, 30, 2, 17, 13], seq_len=64, seed=2)
    before = _model(attention_metadata="per_layer", router_backend="naive")
    after = _model(attention_metadata="cached", router_backend="torch")
    after.load_state_dict(before.state_dict())
    out_before = before(batch.input_ids, batch.position_ids)
    out_after = after(batch.input_ids, batch.position_ids, SequenceMetadata.from_batch(batch))
    torch.testing.assert_close(out_after, out_before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.aux_loss(), before.aux_loss(), rtol=1e-5, atol=1e-6)


def test_cached_path_has_no_host_sync_and_per_layer_syncs_every_layer() -> None:
    _, batch = _packed_row([9, 3, 20], seq_len=40, seed=3)
    meta = SequenceMetadata.from_batch(batch)
    cached = _model(n_layers=3, attention_metadata="cached", router_backend="torch")
    with SyncCounter() as sc:
        logits = cached(batch.input_ids, batch.position_ids, meta)
        F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100).backward()
    assert sc.num_syncs == 0, sc.syncs

    before = _model(n_layers=3, attention_metadata="per_layer", router_backend="naive")
    with SyncCounter() as sc:
        before(batch.input_ids, batch.position_ids)
    assert sc.syncs["_local_scalar_dense"] >= 3 and sc.syncs["nonzero"] >= 3


def test_flops_per_batch_matches_hand_count() -> None:
    model = _model(dense_layers=[1])
    c = model.config
    hd, h, f, e, k = c.head_dim, c.hidden_size, c.ffn_size, c.num_experts, c.top_k
    attn = h * (c.n_heads + 2 * c.n_kv_heads) * hd + c.n_heads * hd * h
    norms = 2 * h
    moe_active = h * e + (h * 2 * f + f * h) * k  # router + k experts
    dense = h * 2 * f + f * h
    active = 2 * (attn + norms) + moe_active + dense + h + h * c.vocab_size  # + final norm + LM head
    lengths = [3, 1, 12]
    expected = 6 * active * 16 + 6 * c.n_layers * hd * c.n_heads * (9 + 1 + 144)
    assert model.flops_per_batch(lengths) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        {"hidden_size": 30},  # 30 / 4 heads is not an integer
        {"n_kv_heads": 3},
        {"top_k": 5},
        {"attention_metadata": "nope"},
        {"router_backend": "loop"},
        {"dense_layers": [2]},
        {"n_layers": 0},
        {"router_backend": "naive", "capacity_factor": 1.0},
    ],
)
def test_bad_config_raises_config_error(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _model(**overrides)
