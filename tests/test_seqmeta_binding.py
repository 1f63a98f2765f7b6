"""Packed metadata that can never be stale: bound to the tokens and fields it describes, checked once on the host."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmfast import MetadataError, MoEGPTConfig, MoEGPTLightningModule, PackedBatch, SequenceMetadataCallback
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.data import batch as batch_module
from lightning_llmfast.data import pack_documents
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache
from lightning_llmfast.seqmeta.binding import marked_by

CONFIG = {"vocab_size": 64, "hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 32}


def _batches(n: int, seed: int, seq_len: int = 24, rows: int = 2) -> list[PackedBatch]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (200,), generator=gen).tolist()
    docs = [torch.randint(1, 64, (k,), generator=gen).tolist() for k in lengths]
    out = list(pack_documents(docs, seq_len=seq_len, batch_size=rows, vocab_size=64))[:n]
    assert len(out) == n
    return out


def _model(seed: int = 0) -> MoEGPT:
    torch.manual_seed(seed)
    return MoEGPT(MoEGPTConfig(**CONFIG, num_experts=4, top_k=2, router_backend="torch")).eval()


def _reference(model: MoEGPT, batch: PackedBatch) -> torch.Tensor:
    """The batch's logits with metadata built from its own boundaries, bypassing every cache."""
    return model(batch.input_ids, batch.position_ids, metadata=SequenceMetadata.from_batch(batch))


# ------------------------------------------------------------------------------------------- another batch
@pytest.mark.parametrize("binding", ["none", "watch", "batch_model"])
def test_plain_loop_second_batch_is_rebuilt_or_rejected_with_and_without_watch(binding: str) -> None:
    model = _model()
    first, second, third = _batches(3, seed=1)
    assert first.input_ids.shape == second.input_ids.shape
    assert not torch.equal(first.cu_seqlens, second.cu_seqlens)  # a stale reuse would change the logits
    cache = SequenceMetadataCache()
    handles = cache.watch(model) if binding == "watch" else []
    with cache.batch(first, model=model if binding == "batch_model" else None):
        torch.testing.assert_close(model(first.input_ids, first.position_ids), _reference(model, first))
        # Another batch of the same shape: the model binds its tokens and positions, so it is rebuilt for them.
        torch.testing.assert_close(model(second.input_ids, second.position_ids), _reference(model, second))
        # Without position ids nothing describes the other tokens: an error, never the first batch's boundaries.
        with pytest.raises(MetadataError, match="not the batch the cache version was opened for"):
            model(third.input_ids)
        # Given the batch (what packed_model_inputs does), the cache rebuilds for it, from host fields.
        cache.bind(second.input_ids, source=second)
        assert cache.get().cu_seqlens.tolist() == second.cu_seqlens.tolist()
        # Back on the first batch's own tensor: its metadata again, not rebuilt.
        builds = cache.stats["builds"]
        torch.testing.assert_close(model(first.input_ids, first.position_ids), _reference(model, first))
        assert cache.stats["builds"] == builds and cache.stats["rebinds"] == 3
    assert marked_by(first.input_ids) is None  # the version's mark is gone with it
    for handle in handles:
        handle.remove()


def test_lookup_with_other_position_ids_is_rebuilt_for_them() -> None:
    first, second = _batches(2, seed=8)
    hidden = torch.zeros(first.input_ids.numel(), 4)
    cache = SequenceMetadataCache()
    with cache.batch(first):
        assert cache.get(hidden, position_ids=first.position_ids).cu_seqlens.tolist() == first.cu_seqlens.tolist()
        # The layer sees other position ids than the ones the metadata describes: identity differs, rebuilt.
        rebuilt = cache.get(hidden, position_ids=second.position_ids)
        assert rebuilt.cu_seqlens.tolist() == second.cu_seqlens.tolist() and cache.stats["rebinds"] == 1
        # Equal values in another tensor are rebuilt too (identity, never a device read), with equal boundaries.
        copy = first.position_ids.clone()
        assert cache.get(hidden, position_ids=copy).cu_seqlens.tolist() == first.cu_seqlens.tolist()
        assert cache.stats["rebinds"] == 2


def test_callback_rebuilds_for_a_teacher_forward_on_another_batch(tmp_path: Path) -> None:
    train = _batches(3, seed=2)
    others = _batches(3, seed=3)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    class WithTeacher(MoEGPTLightningModule):
        def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            other = others[batch_idx]
            with torch.no_grad():
                # the same batch twice (a second view): reused; another batch of the same shape: rebuilt
                seen.append(
                    (
                        self.model(batch.input_ids, batch.position_ids),
                        _reference(self.model, batch),
                        self.model(other.input_ids, other.position_ids),
                        _reference(self.model, other),
                    )
                )
            return loss

    torch.manual_seed(0)
    module = WithTeacher(MoEGPTConfig(**CONFIG, num_experts=4, top_k=2, router_backend="torch"), warmup_steps=1)
    callback = SequenceMetadataCallback()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, train_dataloaders=DataLoader(train, batch_size=None))
    assert len(seen) == 3
    for again, ref, teacher, teacher_ref in seen:
        torch.testing.assert_close(again, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(teacher, teacher_ref, rtol=0, atol=1e-6)
    # per step: the batch's build, and one rebuild for the teacher's tokens
    assert callback.cache.stats["builds"] == 2 * 3 and callback.cache.stats["rebinds"] == 3


# ---------------------------------------------------------------------------------------------- in-place edits
def test_an_in_place_edit_of_cu_seqlens_raises_or_is_rebuilt() -> None:
    model = _model()
    (batch,) = _batches(1, seed=4)
    hidden = torch.zeros(batch.input_ids.numel(), 8)
    cache = SequenceMetadataCache()
    with cache.batch(batch):
        before = cache.get(hidden)
        assert cache.get(hidden) is before
        # An edit that makes cu_seqlens disagree with position_ids: an error, not other boundaries.
        cu = batch.cu_seqlens
        original = cu.clone()
        cu[2] += 1
        with pytest.raises(MetadataError, match="position_ids disagree with cu_seqlens"):
            cache.get(hidden)
        with pytest.raises(MetadataError, match="position_ids disagree with cu_seqlens"):
            model(batch.input_ids, batch.position_ids)
        # A consistent edit (split the first segment in two, and restart its positions): rebuilt for the new fields.
        cu.copy_(original)
        first_len = int(cu[1])
        assert first_len >= 2
        new_cu = torch.cat([cu[:1], torch.tensor([1], dtype=cu.dtype), cu[1:]])
        edited = PackedBatch(
            input_ids=batch.input_ids,
            labels=batch.labels,
            position_ids=batch.position_ids.clone(),
            cu_seqlens=new_cu,
            max_seqlen=batch.max_seqlen,
            num_tokens=batch.num_tokens,
        )
        edited.position_ids.view(-1)[1:first_len] -= 1
    with cache.batch(edited):
        meta = cache.get(hidden)
        assert meta.cu_seqlens.tolist() == new_cu.tolist()
        edited.position_ids.view(-1)[1:first_len] += 1  # positions edited back: disagree with the boundaries
        with pytest.raises(MetadataError, match="position_ids disagree"):
            cache.get(hidden)


def test_validate_checks_once_and_again_only_after_an_edit() -> None:
    (batch,) = _batches(1, seed=5)
    with mock.patch.object(batch_module, "check_packed_fields", wraps=batch_module.check_packed_fields) as spy:
        batch.validate()
        batch.validate()
        moved = batch.to("cpu")  # checked before the move: the copy needs no check of its own
        moved.validate()
        SequenceMetadata.from_batch(moved)
        assert spy.call_count == 1
        moved.position_ids[0, 0] += 0  # an in-place op bumps the version even when no value changes
        moved.validate()
        assert spy.call_count == 2


# ----------------------------------------------------------------------------------------- inconsistent fields
def _fields(batch: PackedBatch, **changes: object) -> PackedBatch:
    values = {name: getattr(batch, name) for name in ("input_ids", "labels", "position_ids", "max_seqlen")}
    values.update(cu_seqlens=batch.cu_seqlens.clone(), num_tokens=batch.num_tokens)
    values.update(changes)
    return PackedBatch(**values)  # type: ignore[arg-type]


def test_inconsistent_fields_raise_at_first_use_or_when_the_version_opens() -> None:
    (good,) = _batches(1, seed=6, seq_len=12)
    cu = good.cu_seqlens.clone()
    rows, t = good.input_ids.shape
    shifted = cu.clone()
    shifted[1] += 1 if shifted[1] + 1 < shifted[2] else -1
    crossing = torch.tensor([0, t + 1, rows * t], dtype=torch.int32)
    cases = [
        (_fields(good, cu_seqlens=shifted), "position_ids disagree with cu_seqlens"),
        (
            _fields(
                good,
                cu_seqlens=crossing,
                position_ids=torch.cat([torch.arange(t + 1), torch.arange(t - 1)]).view(rows, t),
            ),
            "row 1 does not start a segment",
        ),
        (_fields(good, num_tokens=0), "num_tokens: 0 real tokens is impossible"),
        (_fields(good, cu_seqlens_cpu=shifted), "cu_seqlens and cu_seqlens_cpu hold different boundaries"),
    ]
    for bad, match in cases:
        for use in (bad.validate, lambda b=bad: b.to("cpu"), lambda b=bad: SequenceMetadata.from_batch(b)):
            with pytest.raises(MetadataError, match=match):
                use()
        with pytest.raises(MetadataError, match=match), SequenceMetadataCache().batch(bad) as cache:
            cache.get()  # not reached: the version opens by building and checking the batch


# ------------------------------------------------------------------------------------ transformers field names
def test_from_batch_reads_transformers_flattening_collator_fields_without_syncs() -> None:
    transformers = pytest.importorskip("transformers")
    features = [{"input_ids": list(range(1, n + 1))} for n in (3, 1, 5, 2)]
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    with SyncCounter(host=collated) as sc:
        meta = SequenceMetadata.from_batch(collated)
    assert sc.num_syncs == 0
    assert meta.cu_seqlens.tolist() == [0, 3, 4, 9, 11] and meta.max_seqlen == 5
    # RoBERTa-style positions that start at 2 give the same boundaries.
    offset = transformers.DataCollatorWithFlattening(position_ids_start=2)(features)["position_ids"]
    assert int(offset.min()) == 2
    assert SequenceMetadata.from_position_ids(offset).cu_seqlens.tolist() == [0, 3, 4, 9, 11]
    with pytest.raises(MetadataError, match="must restart at 2 or count up by one"):
        SequenceMetadata.from_position_ids(torch.tensor([[2, 3, 5, 2]]))


# -------------------------------------------------------------------------------------------------- host syncs
def test_bound_cache_keeps_forward_and_backward_free_of_host_syncs() -> None:
    model = _model().train()
    first, second = _batches(2, seed=7)
    cache = SequenceMetadataCache()
    handles = cache.watch(model)
    with SyncCounter(host=[first, second]) as sc:  # collator batches, not moved: host data, checked on the host
        for batch in (first, second):
            with cache.batch(batch):
                model(batch.input_ids, batch.position_ids).float().sum().backward()
                cache.bind(first.input_ids, source=first)  # a second batch named with its host fields
                cache.get()
    assert sc.num_syncs == 0, sc.syncs
    assert cache.stats["builds"] == 3 and cache.stats["reads"] == 2 * (2 + 1)
    for handle in handles:
        handle.remove()
