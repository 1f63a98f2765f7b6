"""``PreparedBatches`` / ``PreparedDataModule``: every segment is its document's tokens, equal disjoint batches per
rank, new orders per epoch, blending by weight, exact resume, vocabulary checks and flat anonymous memory."""

from __future__ import annotations

import importlib.util
import pickle
import re
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import transformers
from _distributed import run_distributed
from _prepared import make_texts, make_tokenizer, write_jsonl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from lightning_llmfast import DataError, HFCausalLMModule, MoEGPTConfig, MoEGPTLightningModule, PreparedDataModule
from lightning_llmfast.data import IGNORE_INDEX, PackedBatch, PreparedBatches, PreparedDataset
from lightning_llmfast.data.prepare import PrepareConfig, prepare
from lightning_llmfast.data.prepared import SPLITS

SEQ_LEN = 16
REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two prepared directories from one tokenizer (A: 150 documents, B: 40), and their reference token ids."""
    root = tmp_path_factory.mktemp("prepared")
    tokenizer = make_tokenizer(root / "tok")
    hf = AutoTokenizer.from_pretrained(tokenizer)
    out: dict[str, Any] = {"root": root, "tokenizer": tokenizer, "vocab": len(hf)}
    for name, count, seed in (("a", 150, 1), ("b", 40, 2)):
        texts = make_texts(count, seed=seed, max_words=70)
        write_jsonl(root / f"{name}.jsonl", texts)
        prepare(PrepareConfig(inputs=(str(root / f"{name}.jsonl"),), tokenizer=str(tokenizer), output=str(root / name),
                              seq_len=(SEQ_LEN,), val_fraction=0.15, chunk_docs=32, progress=False))  # fmt: skip
        out[name] = str(root / name)
        out[f"{name}_ids"] = [hf(t, add_special_tokens=False)["input_ids"] + [hf.eos_token_id] for t in texts]
    return out


def _segments(batch: PackedBatch) -> list[tuple[int, list[int]]]:
    """``(document, tokens)`` of every segment, after checking labels and positions inside it."""
    bounds = batch.cu_seqlens_cpu.tolist()  # type: ignore[union-attr]
    ids, labels, positions = (t.flatten().tolist() for t in (batch.input_ids, batch.labels, batch.position_ids))
    assert batch.documents is not None and len(batch.documents) == len(bounds) - 1
    out = []
    for document, a, b in zip(batch.documents, bounds[:-1], bounds[1:], strict=True):
        assert positions[a:b] == list(range(b - a))
        if document < 0:  # padding tail: nothing to learn
            assert labels[a:b] == [IGNORE_INDEX] * (b - a)
            continue
        assert labels[a : b - 1] == ids[a + 1 : b] and labels[b - 1] == IGNORE_INDEX
        out.append((document, ids[a:b]))
    return out


def _chunks_seen(batches: list[PackedBatch], reference: list[list[int]]) -> Counter[tuple[int, int]]:
    """Which ``seq_len`` chunk ``(document, k)`` every segment is; fails on a segment that is not one."""
    seen: Counter[tuple[int, int]] = Counter()
    for batch in batches:
        for document, tokens in _segments(batch):
            ref = reference[document]
            matches = [k for k in range(0, len(ref), SEQ_LEN) if ref[k : k + SEQ_LEN] == tokens]
            assert matches, f"segment of document {document} is not a chunk of its tokens"
            seen[(document, matches[0] // SEQ_LEN)] += 1
    return seen


def _all_chunks(documents: list[int], reference: list[list[int]]) -> Counter[tuple[int, int]]:
    return Counter((d, k) for d in documents for k in range(-(-len(reference[d]) // SEQ_LEN)))


def _epoch(dataset: PreparedBatches, epoch: int, start: int = 0, num_workers: int = 0) -> list[PackedBatch]:
    dataset.set_position(epoch, start)
    return list(DataLoader(dataset, batch_size=None, num_workers=num_workers))


def test_every_segment_of_every_batch_is_its_documents_tokens_over_an_epoch(data: dict[str, Any]) -> None:
    source = PreparedDataset(data["a"])
    reference = data["a_ids"]
    train = PreparedBatches([source], "train", seq_len=SEQ_LEN, batch_size=3, shuffle_seed=7)
    val = PreparedBatches([source], "val", seq_len=SEQ_LEN, batch_size=3, uneven="fill", world_size=2, rank=1)
    train_seen = _chunks_seen(_epoch(train, 0), reference)
    val_seen = _chunks_seen(_epoch(val, 0), reference)
    train_docs, val_docs = {d for d, _ in train_seen}, {d for d, _ in val_seen}
    assert not train_docs & val_docs and len(train_docs) == source.manifest["splits"]["train"]["documents"]
    # one epoch of training: every chunk of every training document once
    assert train_seen == _all_chunks(sorted(train_docs), reference)
    # rank 1's validation batches are chunks of validation documents, each at most once
    assert val_seen and max(val_seen.values()) == 1


def test_each_epoch_has_a_new_order_that_workers_do_not_change(data: dict[str, Any]) -> None:
    def batches(**kwargs: Any) -> PreparedBatches:
        return PreparedBatches([PreparedDataset(data["a"])], "train", seq_len=SEQ_LEN, batch_size=4, **kwargs)

    def key(batch: PackedBatch) -> tuple[Any, ...]:
        return (tuple(batch.documents or ()), tuple(batch.input_ids.flatten().tolist()))

    first = [key(b) for b in _epoch(batches(shuffle_seed=3), 0)]
    assert first == [key(b) for b in _epoch(batches(shuffle_seed=3), 0, num_workers=2)]
    assert first != [key(b) for b in _epoch(batches(shuffle_seed=3), 1)]
    assert first != [key(b) for b in _epoch(batches(shuffle_seed=4), 0)]

    def rows(epoch: list[PackedBatch]) -> list[tuple[int, ...]]:
        return sorted(tuple(row) for b in epoch for row in b.input_ids.tolist())

    shuffled, in_order = _epoch(batches(shuffle_seed=3), 0), _epoch(batches(), 0)
    assert rows(shuffled) == rows(in_order) and [key(b) for b in in_order] != first  # the same rows, reordered
    # resuming a position skips exactly the first batches
    assert [key(b) for b in _epoch(batches(shuffle_seed=3), 0, start=5)] == first[5:]


def test_blending_two_directories_by_weight(data: dict[str, Any]) -> None:
    a, b = PreparedDataset(data["a"]), PreparedDataset(data["b"])
    rows_a, rows_b = a.layout(SEQ_LEN, "train").num_rows, b.layout(SEQ_LEN, "train").num_rows
    blend = PreparedBatches([a, b], "train", seq_len=SEQ_LEN, batch_size=5, weights=[0.5, 0.5], shuffle_seed=1)
    total = rows_a + rows_b
    assert blend.slots_per_source == [total // 2 + total % 2, total // 2] and rows_b < total // 2
    batches = _epoch(blend, 0)
    reference = data["a_ids"] + data["b_ids"]  # documents of b come after a's
    seen = _chunks_seen(batches, reference)
    rows_of = Counter(0 if row[0][0] < len(a) else 1 for rows in blend.epoch_batches(0) for row in rows)
    assert rows_of == Counter({0: total // 2 + total % 2, 1: total // 2})
    # b is sampled above its size: each of its rows once per pass, every row in all but the last pass
    b_chunks = Counter({k: v for k, v in seen.items() if k[0] >= len(a)})
    passes = Counter(b_chunks.values())
    assert set(passes) <= {total // 2 // rows_b, total // 2 // rows_b + 1}
    with pytest.raises(DataError, match=r"weights: one per prepared dataset \(2\), got 1"):
        PreparedBatches([a, b], "train", seq_len=SEQ_LEN, batch_size=5, weights=[1.0], shuffle_seed=1)
    # a length it was not prepared with is packed from the document index: every train document, whole, in rows of 5
    other = PreparedBatches([a, b], "train", seq_len=5, batch_size=3, shuffle_seed=2)
    pieces: dict[int, list[tuple[int, list[int]]]] = {}
    for batch, rows in zip(_epoch(other, 0), other.epoch_batches(0), strict=True):
        assert batch.input_ids.shape[1] == 5
        for (document, tokens), (_, start, _) in zip(_segments(batch), (p for row in rows for p in row), strict=True):
            pieces.setdefault(document, []).append((start, tokens))
    train = [d for d in range(len(reference)) if d not in _val_documents(a, b)]
    assert sorted(pieces) == train
    assert all([t for _, ts in sorted(pieces[d]) for t in ts] == reference[d] for d in train)


def _val_documents(*sources: PreparedDataset) -> set[int]:
    """The validation documents of the sources, numbered in their concatenation (read from their val layouts)."""
    found, offset = set(), 0
    for source in sources:
        layout = source.layout(SEQ_LEN, "val")
        found |= {offset + d for r in range(layout.num_rows) for d, _, _ in layout.row(r)}
        offset += len(source)
    return found


def _rank_epochs(rank: int, world: int, path: str) -> None:
    def batches(start: int = 0) -> list[list[tuple[int, tuple[int, ...]]]]:
        dataset = PreparedBatches([PreparedDataset(path)], "train", seq_len=SEQ_LEN, batch_size=2, shuffle_seed=11,
                                  rank=rank, world_size=world)  # fmt: skip
        return [[(d, tuple(t)) for d, t in _segments(b)] for b in _epoch(dataset, 1, start)]

    mine = batches()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    assert len({len(g) for g in gathered}) == 1 and len(mine) > 3  # equal batch counts on every rank
    segments = [s for g in gathered for batch in g for s in batch]
    assert len(segments) == len(set(segments))  # disjoint: no chunk on two ranks (or twice on one)
    assert batches(start=3) == mine[3:]  # a resumed position sees exactly the remaining batches


def test_two_ranks_get_equal_disjoint_batches_and_resume_exactly(data: dict[str, Any]) -> None:
    run_distributed(_rank_epochs, 2, data["a"], timeout=120)


class _TinyLM(L.LightningModule):
    """Embedding + head over the data's vocabulary; records what every training step saw."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)
        self.seen: list[tuple[int, tuple[int, ...], int]] = []

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.trainer.current_epoch, tuple(batch.documents or ()), int(batch.input_ids.sum())))
        logits = self.head(self.embed(batch.input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    module: L.LightningModule, data: PreparedDataModule, steps: int, ckpt: Path | None = None, **kw: Any
) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=steps, save_top_k=-1)] if ckpt else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(ckpt), enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
        val_check_interval=4, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, **kw)
    return trainer


def test_fit_resumes_mid_epoch_with_exactly_the_remaining_batches(data: dict[str, Any], tmp_path: Path) -> None:
    def module() -> PreparedDataModule:
        return PreparedDataModule(path=[data["a"], data["b"]], seq_len=SEQ_LEN, batch_size=4, num_workers=0, seed=2,
                                  weights=[2.0, 1.0])  # fmt: skip

    probe = module()
    probe.setup("fit")
    per_epoch = probe._dataset("train").plan(0).per_rank
    full = _TinyLM(data["vocab"])
    _fit(full, module(), per_epoch + 4)
    assert {epoch for epoch, _, _ in full.seen} == {0, 1}
    assert full.seen[:per_epoch] != [(1, d, s) for _, d, s in full.seen[per_epoch : 2 * per_epoch]]
    saved = per_epoch - 3
    _fit(_TinyLM(data["vocab"]), module(), saved, tmp_path)
    resumed = _TinyLM(data["vocab"])
    ckpt = str(next(tmp_path.glob("*.ckpt")))
    _fit(resumed, module(), per_epoch + 4, ckpt_path=ckpt)
    assert resumed.seen == full.seen[saved:]
    other = PreparedDataModule(path=[data["a"], data["b"]], seq_len=SEQ_LEN, batch_size=4, num_workers=0, seed=3,
                               weights=[2.0, 1.0])  # fmt: skip
    with pytest.raises(DataError, match=r"another configuration.*shuffle_seed: checkpoint 2, now 3"):
        _fit(_TinyLM(data["vocab"]), other, per_epoch + 4, ckpt_path=ckpt)


def test_the_reference_model_and_hf_module_train_and_a_smaller_vocabulary_is_refused(data: dict[str, Any]) -> None:
    vocab = data["vocab"]
    tiny = {"hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_size": 32, "num_experts": 2,
            "top_k": 1}  # fmt: skip
    hf = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 32}  # fmt: skip
    for make in (
        lambda v: MoEGPTLightningModule(MoEGPTConfig(vocab_size=v, **tiny)),
        lambda v: HFCausalLMModule(transformers.LlamaConfig(vocab_size=v, **hf)),
    ):

        def datamodule() -> PreparedDataModule:
            return PreparedDataModule(path=data["a"], seq_len=SEQ_LEN, batch_size=2, num_workers=0)

        module = make(vocab)
        before = [p.detach().clone() for p in module.parameters()]
        assert _fit(module, datamodule(), 2).global_step == 2
        assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # it trained
        with pytest.raises(DataError, match=f"the model embeds {vocab - 1} token ids but the data's tokenizer has "
                                            f"{vocab}.*vocab_size >= {vocab}"):  # fmt: skip
            _fit(make(vocab - 1), datamodule(), 2)


def test_incomplete_and_truncated_directories_are_refused_at_setup(data: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "copy"
    prepare(PrepareConfig(inputs=(str(data["root"] / "b.jsonl"),), tokenizer=str(data["tokenizer"]), output=str(root),
                          seq_len=(SEQ_LEN,), chunk_docs=8, shard_bytes=1, progress=False))  # fmt: skip
    shard = root / "tokens-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(DataError, match=re.escape(f"{root}: tokens-00001.bin has")):
        PreparedDataModule(path=str(root), seq_len=SEQ_LEN).setup("fit")
    (root / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"no manifest\.json, so the preparation did not finish"):
        PreparedDataModule(path=str(root), seq_len=SEQ_LEN).setup("fit")


def test_a_new_length_is_packed_once_in_prepare_data_and_opened_by_setup(
    data: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "b"
    prepare(PrepareConfig(inputs=(str(data["root"] / "b.jsonl"),), tokenizer=str(data["tokenizer"]), output=str(root),
                          seq_len=(SEQ_LEN,), val_fraction=0.15, progress=False))  # fmt: skip
    PreparedDataModule(path=str(root), seq_len=12).prepare_data()
    assert {p.name for p in root.glob("*L12*")} == {f"layout-L12-{s}" for s in SPLITS}
    monkeypatch.setattr("lightning_llmfast.data.layouts._PLACES", {})  # as in another process
    monkeypatch.setattr("lightning_llmfast.data.layouts.write_layout", None)  # setup on every rank packs nothing
    module = PreparedDataModule(path=str(root), seq_len=12, batch_size=2, num_workers=0)
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert batch.input_ids.shape == (2, 12) and module._has_split("val")


def test_the_example_cli_trains_on_a_prepared_directory(
    data: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("train_moe", REPO / "examples" / "train_moe.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    example.main([
        "fit", "--config", str(REPO / "examples" / "configs" / "tiny.yaml"), "--trainer.max_steps", "2",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--model.config.n_layers", "1", "--model.config.hidden_size", "32",
        "--data", "lightning_llmfast.PreparedDataModule", "--data.path", data["a"], "--data.seq_len", str(SEQ_LEN),
        "--data.batch_size", "2",
    ])  # fmt: skip
    metrics = (tmp_path / "runs" / "tiny").rglob("metrics.csv")
    assert any("train/loss" in path.read_text() for path in metrics)


def _rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_anonymous_memory_stays_flat_over_an_epoch_of_a_ten_times_larger_set(
    data: dict[str, Any], tmp_path: Path
) -> None:
    texts = make_texts(200, seed=8, max_words=40)
    growth = {}
    for scale in (1, 10):
        write_jsonl(tmp_path / f"{scale}.jsonl", texts * scale)
        prepare(PrepareConfig(inputs=(str(tmp_path / f"{scale}.jsonl"),), tokenizer=str(data["tokenizer"]),
                              output=str(tmp_path / str(scale)), seq_len=(SEQ_LEN,), val_fraction=0, chunk_docs=500,
                              progress=False))  # fmt: skip
        dataset = PreparedBatches([PreparedDataset(tmp_path / str(scale))], "train", seq_len=SEQ_LEN, batch_size=8,
                                  shuffle_seed=0)  # fmt: skip
        # what DataLoader workers receive: no memory map pickled as a copy of its data
        assert len(pickle.dumps(dataset)) < 16_000
        warm = 20
        samples = []
        for i, batch in enumerate(dataset):
            assert batch.num_tokens > 0
            if i == warm or (i % 50 == 0 and i > warm):
                samples.append(_rss_anon_kib())
        growth[scale] = (samples[-1] - samples[0], i + 1)
    batches_small, batches_large = growth[1][1], growth[10][1]
    assert batches_large > 9 * batches_small
    # over an epoch of the 10x set, anonymous memory grows by less than 1 MiB (nothing kept per batch or document)
    assert growth[10][0] < 1024 and growth[1][0] < 1024, growth
