"""The reference model: packing never leaks across documents, before/after paths agree, no syncs when cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast import ConfigError, DataError, MetadataError, MoEGPT, MoEGPTConfig, SequenceMetadata
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


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_layers": None}, r"MoEGPTConfig.n_layers must be an int >= 1, got None"),
        ({"hidden_size": 32.0}, r"MoEGPTConfig.hidden_size must be an int >= 1, got 32.0"),
        ({"top_k": True}, r"MoEGPTConfig.top_k must be an int >= 1, got True"),
        ({"vocab_size": True}, r"MoEGPTConfig.vocab_size must be an int >= 1, got True"),
        ({"num_experts": "4"}, r"MoEGPTConfig.num_experts must be an int >= 1, got '4'"),
        ({"capacity_factor": 0.0}, r"MoEGPTConfig.capacity_factor must be a finite number > 0, got 0.0"),
        ({"capacity_factor": -1.0}, r"MoEGPTConfig.capacity_factor must be a finite number > 0"),
        ({"capacity_factor": float("inf")}, r"MoEGPTConfig.capacity_factor must be a finite number > 0, got inf"),
        ({"norm_eps": -1e-5}, r"MoEGPTConfig.norm_eps must be a finite number >= 0"),
        ({"norm_eps": float("nan")}, r"MoEGPTConfig.norm_eps must be a finite number >= 0, got nan"),
        ({"rope_theta": 0}, r"MoEGPTConfig.rope_theta must be a finite number > 0, got 0"),
        ({"init_std": -0.02}, r"MoEGPTConfig.init_std must be a finite number >= 0"),
        ({"tie_embeddings": "no"}, r"MoEGPTConfig.tie_embeddings must be True or False, got 'no'"),
        ({"dense_layers": (0.5,)}, r"MoEGPTConfig.dense_layers entry must be an int, got 0.5"),
        ({"dense_layers": [True]}, r"MoEGPTConfig.dense_layers entry must be an int, got True"),
        ({"dense_layers": 1}, r"MoEGPTConfig.dense_layers must be a list of layer indices, got 1"),
        ({"router_backend": "naive", "capacity_factor": 1.0}, r"router_backend='naive' is dropless"),
    ],
)
def test_config_is_validated_at_construction(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoEGPTConfig(**{**TINY, **overrides})  # the config alone: no model is built


def test_config_accepts_a_tuple_of_dense_layers() -> None:
    model = _model(dense_layers=(1,))
    assert sum(1 for _ in model.moe_blocks()) == 1


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.tensor([[3, 50]]),), DataError, r"token ids must lie in \[0, vocab_size=50\), got 1 outside it"),
        ((torch.tensor([[-1, 3]]),), DataError, r"token ids must lie in \[0, vocab_size=50\).*first -1"),
        ((torch.tensor([[1.0, 2.0]]),), DataError, r"input_ids: must be a \(B, T\) int64 or int32 tensor.*float32"),
        ((torch.tensor([1, 2]),), DataError, r"input_ids: must be a \(B, T\) .*shape \(2,\)"),
        ((torch.tensor([[1, 2]], dtype=torch.int16),), DataError, r"input_ids: .*torch.int16"),
        (([[1, 2]],), DataError, r"input_ids: must be a \(B, T\) .*got list"),
        ((torch.tensor([[1, 2]]), torch.tensor([0, 1])), MetadataError, r"position_ids: .*shape \(1, 2\), got"),
        ((torch.tensor([[1, 2]]), torch.tensor([[0.0, 1.0]])), MetadataError, r"position_ids: .*torch.float32"),
    ],
)
@pytest.mark.parametrize("attention_metadata", ["per_layer", "dense", "cached"])
def test_forward_rejects_bad_ids_with_our_errors(args: tuple, error: type, match: str, attention_metadata: str) -> None:
    model = _model(attention_metadata=attention_metadata, router_backend="naive")
    with pytest.raises(error, match=match):
        model(*args)


def test_forward_takes_int32_ids() -> None:
    model = _model()
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids.int()), model(ids))


@pytest.mark.parametrize("mode", ["cached", "dense", "per_layer"])
def test_position_ids_of_one_row_apply_to_every_row(mode: str) -> None:
    """HF's ``arange(T)[None]``: the same positions for each row, as if none were given."""
    torch.manual_seed(0)
    cfg = MoEGPTConfig(n_layers=1, hidden_size=32, n_heads=2, n_kv_heads=1, ffn_size=32, num_experts=2)
    model = MoEGPT(MoEGPTConfig(**{**cfg.__dict__, "attention_metadata": mode}))
    ids = torch.randint(0, cfg.vocab_size, (3, 8))
    assert torch.equal(model(ids, torch.arange(8)[None]), model(ids))
    with pytest.raises(MetadataError, match=r"position_ids: .*\(3, 8\) \(or \(1, 8\)\)"):
        model(ids, torch.arange(8)[None].expand(2, 8))
