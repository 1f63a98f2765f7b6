"""PackedDataModule: sharding across workers and ranks, a real Trainer fit, LightningCLI configuration."""

from __future__ import annotations

import itertools
from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader

from lightning_llmfast import PackedDataModule
from lightning_llmfast.data import IGNORE_INDEX, VOCAB_SIZE, PackedBatch, SyntheticCorpus, pack_documents
from lightning_llmfast.datamodules.packed import PackedDocumentDataset
from lightning_llmfast.errors import ConfigError, DataError


def _sequences(batches: list[PackedBatch]) -> list[tuple[int, ...]]:
    """Real (non-padding) sequences of the batches, read from ``cu_seqlens`` and ``labels`` with loops."""
    found = []
    for batch in batches:
        if batch.documents is not None and all(d < 0 for d in batch.documents):
            continue  # a filler batch: copies of real sequences, all labels ignored
        ids, labels = batch.input_ids.flatten().tolist(), batch.labels.flatten().tolist()
        cu = batch.cu_seqlens_cpu.tolist()
        for start, end in itertools.pairwise(cu):
            if ids[start] != 0:  # documents below use ids >= 1; pad_id is 0
                assert labels[end - 1] == IGNORE_INDEX
                found.append(tuple(ids[start:end]))
    return found


def _unique_documents(n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``n`` documents of 1..``max_len`` tokens whose first token is unique (pad_id 0 never occurs)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n,), generator=generator).tolist()
    return [[1 + d, *torch.randint(1, VOCAB_SIZE, (k,), generator=generator).tolist()] for d, k in enumerate(lengths)]


def _rank_batches(documents, world_size, num_workers, **kwargs) -> list[list[PackedBatch]]:
    out = []
    for rank in range(world_size):
        dataset = PackedDocumentDataset(
            documents, seq_len=13, batch_size=3, vocab_size=VOCAB_SIZE, rank=rank, world_size=world_size, **kwargs
        )
        out.append(list(DataLoader(dataset, batch_size=None, num_workers=num_workers)))
    return out


@pytest.mark.parametrize("num_docs", [1, 8, 53])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(("num_workers", "uneven"), [(0, "drop"), (2, "drop"), (2, "fill")])
def test_every_rank_gets_the_same_number_of_batches_and_no_document_twice(num_docs, world_size, num_workers, uneven):
    documents = _unique_documents(num_docs, 12, seed=num_docs)  # each fits a row: one sequence per document
    per_rank = _rank_batches(documents, world_size, num_workers, shuffle_seed=3, uneven=uneven)
    assert len({len(batches) for batches in per_rank}) == 1
    real = [b for batches in per_rank for b in batches if any(d >= 0 for d in b.documents)]
    fillers = [b for batches in per_rank for b in batches if all(d < 0 for d in b.documents)]
    seen = Counter(_sequences(real))
    assert all(count == 1 for count in seen.values())  # no document twice
    assert set(seen) <= {tuple(d) for d in documents}
    # Reference: the same documents packed by one packer; the global batch count decides what each rank gets.
    total = len(list(pack_documents(documents, 13, 3, vocab_size=VOCAB_SIZE)))
    if uneven == "fill":
        assert seen == Counter(tuple(d) for d in documents) and len(per_rank[0]) == -(-total // world_size)
        assert len(fillers) == len(per_rank[0]) * world_size - total
        assert all(bool((b.labels == IGNORE_INDEX).all()) for b in fillers)
    else:
        assert len(per_rank[0]) == total // world_size and not fillers
        missing = sum(len(d) for d in documents) - sum(len(t) for t in seen)
        assert missing <= (world_size - 1) * 3 * 13  # less than one batch per rank is left out
        assert len(real) == total - total % world_size


def test_limit_batches_is_exact_for_any_number_of_workers():
    documents = _unique_documents(60, 12)
    for num_workers in (0, 2):
        per_rank = _rank_batches(documents, 2, num_workers, limit_batches=4)
        assert [len(b) for b in per_rank] == [4, 4]
        unlimited = _rank_batches(documents, 2, 0)
        for limited, full in zip(per_rank, unlimited):
            assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(limited, full[:4]))


def test_each_epoch_is_a_new_permutation_and_still_a_partition():
    documents = _unique_documents(40, 12)
    dataset = PackedDocumentDataset(documents, seq_len=13, batch_size=3, vocab_size=VOCAB_SIZE, shuffle_seed=5,
                                    uneven="fill")  # fmt: skip
    orders = []
    for epoch in (0, 1, 0):
        dataset.set_epoch(epoch)
        sequences = _sequences(list(DataLoader(dataset, batch_size=None, num_workers=2)))
        assert Counter(sequences) == Counter(tuple(d) for d in documents)
        orders.append([s[0] for s in sequences])
    assert orders[0] != orders[1] and orders[0] == orders[2]  # new order per epoch, reproducible per (seed, epoch)
    other = PackedDocumentDataset(documents, seq_len=13, batch_size=3, vocab_size=VOCAB_SIZE, shuffle_seed=6)
    assert other.order(0) != dataset.order(0)
    assert sorted(dataset.order(1)) == list(range(40))
    unshuffled = PackedDocumentDataset(documents, seq_len=13, batch_size=3, vocab_size=VOCAB_SIZE)
    assert list(unshuffled.order(0)) == list(unshuffled.order(3)) == list(range(40))


@pytest.mark.parametrize(("workers_before", "workers_after"), [(0, 0), (2, 2), (2, 0), (0, 2)])
def test_a_position_resumes_exactly_whatever_the_workers(workers_before, workers_after):
    corpus = SyntheticCorpus(50, mean_len=20, seed=1)

    def batches(num_workers, epoch, start):
        dataset = PackedDocumentDataset(corpus, seq_len=16, batch_size=2, vocab_size=VOCAB_SIZE, shuffle_seed=0,
                                        rank=1, world_size=2)  # fmt: skip
        dataset.set_position(epoch, start)
        return list(DataLoader(dataset, batch_size=None, num_workers=num_workers))

    full = batches(workers_before, 1, 0)
    assert len(full) > 6
    resumed = batches(workers_after, 1, 5)
    assert len(resumed) == len(full) - 5
    assert all(torch.equal(a.input_ids, b.input_ids) and a.documents == b.documents for a, b in zip(resumed, full[5:]))


def test_limit_batches_and_tiny_shards():
    corpus = SyntheticCorpus(40, mean_len=30, seed=2)
    dataset = PackedDocumentDataset(corpus, seq_len=16, batch_size=2, vocab_size=VOCAB_SIZE, limit_batches=5)
    assert len(list(DataLoader(dataset, batch_size=None, num_workers=2))) == 5
    # more shards than documents: the empty shards yield nothing instead of failing
    few = PackedDocumentDataset([[1, 2, 3]], seq_len=4, batch_size=1, vocab_size=VOCAB_SIZE, rank=1, world_size=2)
    assert list(few) == []
    with pytest.raises(ConfigError, match="rank"):
        PackedDocumentDataset([[1]], seq_len=4, batch_size=1, vocab_size=VOCAB_SIZE, rank=2, world_size=2)


class _TinyLM(L.LightningModule):
    """Embedding + linear head: enough to check what the data module hands to ``training_step``."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)
        self.seen: list[tuple[int, int, int, bool]] = []

    def _loss(self, batch: PackedBatch) -> torch.Tensor:
        logits = self.head(self.embed(batch.input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, PackedBatch)
        self.seen.append((batch.batch_size, batch.seq_len, batch.num_tokens, batch.cu_seqlens_cpu is not None))
        loss = self._loss(batch)
        self.log("train/loss", loss, batch_size=batch.batch_size)
        return loss

    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), batch_size=batch.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trainer_fit_on_packed_batches(num_workers):
    data = PackedDataModule(
        corpus="synthetic",
        synthetic_num_docs=64,
        synthetic_mean_len=40,
        seq_len=32,
        batch_size=4,
        num_workers=num_workers,
        limit_batches=2,
        limit_val_batches=1,
    )
    model = _TinyLM(vocab_size=data.vocab_size)
    trainer = _trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2
    assert [s[:2] for s in model.seen] == [(4, 32)] * 2 and all(s[3] for s in model.seen)
    assert all(0 < s[2] <= 4 * 32 for s in model.seen)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])


def test_stdlib_data_module_batches():
    data = PackedDataModule(seq_len=64, batch_size=2, num_workers=0, max_docs=4, limit_batches=3)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == 3 and all(b.input_ids.shape == (2, 64) for b in batches)
    assert all(int(b.input_ids.max()) < data.vocab_size for b in batches)
    assert len(list(data.val_dataloader())) > 0


def test_lightning_cli_fills_the_data_module_from_config(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])
    cli = LightningCLI(
        _TinyLM,
        PackedDataModule,
        run=False,
        args={
            "data": {"corpus": "synthetic", "seq_len": 24, "batch_size": 3, "num_workers": 0, "limit_batches": 1},
            "trainer": {"logger": False, "enable_checkpointing": False, "max_steps": 1},
        },
        save_config_callback=None,
    )
    assert isinstance(cli.datamodule, PackedDataModule)
    assert (cli.datamodule.corpus, cli.datamodule.seq_len, cli.datamodule.batch_size) == ("synthetic", 24, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"corpus": "wikipedia"}, ConfigError, "corpus"),
        ({"corpus": "files"}, ConfigError, "paths"),
        ({"paths": ["a.txt"]}, ConfigError, "paths"),
        ({"num_workers": -1}, ConfigError, "num_workers"),
        ({"limit_batches": 0}, ConfigError, "limit_batches"),
        ({"seq_len": 1}, DataError, "seq_len"),
        ({"batch_size": 0}, DataError, "batch_size"),
        ({"pad_id": VOCAB_SIZE}, DataError, "pad_id"),
    ],
)
def test_data_module_rejects_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackedDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": None}, ConfigError, r"num_workers must be an int >= 0, got None"),
        ({"num_workers": "2"}, ConfigError, r"num_workers must be an int >= 0, got '2'"),
        ({"num_workers": 1.5}, ConfigError, r"num_workers must be an int >= 0, got 1.5"),
        ({"pin_memory": "no"}, ConfigError, r"pin_memory must be True or False, got 'no'"),
        ({"shuffle": 0}, ConfigError, r"shuffle must be True or False, got 0"),
        ({"limit_batches": "3"}, ConfigError, r"limit_batches must be an int >= 1, got '3'"),
        ({"limit_batches": 1.5}, ConfigError, r"limit_batches must be an int >= 1, got 1.5"),
        ({"limit_batches": True}, ConfigError, r"limit_batches must be an int >= 1, got True"),
        ({"limit_val_batches": -1}, ConfigError, r"limit_val_batches must be an int >= 1, got -1"),
        ({"val_fraction": 2.0}, DataError, r"val_fraction must be a finite number >= 0 and <= 1, got 2.0"),
        ({"val_fraction": -1.0}, DataError, r"val_fraction must be a finite number >= 0 and <= 1, got -1.0"),
        ({"val_fraction": None}, DataError, r"val_fraction must be a finite number"),
        ({"max_docs": 0}, DataError, r"max_docs must be an int >= 1, got 0"),
        ({"max_docs": -5}, DataError, r"max_docs must be an int >= 1, got -5"),
        ({"max_docs": 2.5}, DataError, r"max_docs must be an int >= 1, got 2.5"),
        ({"seed": None}, DataError, r"seed must be an int .*got None"),
        ({"seed": 1.5}, DataError, r"seed must be an int .*got 1.5"),
        ({"synthetic_num_docs": 0}, DataError, r"synthetic_num_docs must be an int >= 1, got 0"),
        ({"synthetic_mean_len": float("inf")}, DataError, r"synthetic_mean_len must be a finite number >= 1"),
        ({"synthetic_distribution": "zipf"}, DataError, r"synthetic_distribution must be one of"),
    ],
)
def test_data_module_rejects_bad_types_and_corpus_arguments_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackedDataModule(**{"corpus": "synthetic", **kwargs})


def test_data_module_max_docs_caps_both_synthetic_splits():
    data = PackedDataModule(corpus="synthetic", synthetic_num_docs=40, val_fraction=0.25, max_docs=3, num_workers=0)
    assert len(data.corpus_for("train")) == 3 and len(data.corpus_for("val")) == 3
    data = PackedDataModule(corpus="synthetic", synthetic_num_docs=40, val_fraction=0.25, num_workers=0)
    assert len(data.corpus_for("train")) == 40 and len(data.corpus_for("val")) == 10


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"limit_batches": -1}, ConfigError, r"limit_batches must be an int >= 0, got -1"),
        ({"limit_batches": 1.5}, ConfigError, r"limit_batches must be an int >= 0, got 1.5"),
        ({"limit_batches": "3"}, ConfigError, r"limit_batches must be an int >= 0, got '3'"),
        ({"rank": 0.5}, ConfigError, r"rank must be an int >= 0, got 0.5"),
        ({"rank": -1}, ConfigError, r"rank must be an int >= 0, got -1"),
        ({"world_size": 0}, ConfigError, r"world_size must be an int >= 1, got 0"),
        ({"world_size": 2.0}, ConfigError, r"world_size must be an int >= 1, got 2.0"),
        ({"shuffle_seed": 1.5}, ConfigError, r"shuffle_seed must be an int .*got 1.5"),
        ({"shuffle_seed": 2**64}, ConfigError, r"shuffle_seed must be an int .*got 18446744073709551616"),
        ({"corpus": iter([[1, 2]])}, DataError, r"corpus must be a sized, indexable sequence of documents"),
    ],
)
def test_dataset_rejects_bad_arguments_at_construction(kwargs, error, match):
    args = {"corpus": [[1, 2, 3]] * 4, "seq_len": 4, "batch_size": 1, "vocab_size": VOCAB_SIZE, **kwargs}
    with pytest.raises(error, match=match):
        PackedDocumentDataset(args.pop("corpus"), **args)


def test_dataset_limit_batches_zero_yields_nothing():
    dataset = PackedDocumentDataset([[1, 2, 3]] * 4, seq_len=4, batch_size=1, vocab_size=VOCAB_SIZE, limit_batches=0)
    assert list(dataset) == []


def test_data_module_missing_files_fail_at_setup(tmp_path):
    data = PackedDataModule(corpus="files", paths=[str(tmp_path / "nope")], num_workers=0)
    with pytest.raises(DataError, match="does not exist"):
        data.setup("fit")


def _reference_losses(module, batches):
    """Per-sequence (document, summed token loss, label tokens) from a float64 loop over each segment."""
    entries = []
    with torch.no_grad():
        for batch in batches:
            logits = module(batch).double().flatten(0, 1)
            labels, cu = batch.labels.flatten(), batch.cu_seqlens_cpu.tolist()
            for segment, document in enumerate(batch.documents):
                if document < 0:
                    continue
                terms = [
                    torch.logsumexp(logits[p], 0) - logits[p, labels[p]]
                    for p in range(cu[segment], cu[segment + 1])
                    if labels[p] != IGNORE_INDEX
                ]
                entries.append((document, float(sum(terms)) if terms else 0.0, len(terms)))
    return entries


def test_validate_test_and_predict_with_the_reference_module(monkeypatch):
    from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule

    torch.manual_seed(0)
    config = MoEGPTConfig(hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32, num_experts=4)
    module = MoEGPTLightningModule(config)
    data = PackedDataModule(corpus="synthetic", synthetic_num_docs=60, synthetic_mean_len=30, seq_len=32,
                            batch_size=3, num_workers=0, test_fraction=0.2)  # fmt: skip
    logged: list[str] = []
    monkeypatch.setattr("lightning_llmfast.datamodules.packed.rank_zero_info", logged.append)
    trainer = _trainer()
    (tested,) = trainer.test(module, datamodule=data, verbose=False)
    predictions = trainer.predict(module, datamodule=data)
    trainer.validate(module, datamodule=data, verbose=False)
    module.eval()
    batches = list(data.test_dataloader())
    reference = _reference_losses(module, batches)
    # test/loss is the split's mean token loss (every label token weighs the same, whatever its batch)
    total, tokens = sum(e[1] for e in reference), sum(e[2] for e in reference)
    assert tested["test/loss"] == pytest.approx(total / tokens, rel=1e-5)
    # predict: one entry per sequence, in order, with its document, mean token loss and label tokens
    got = [(d, float(x), int(n)) for p in predictions for d, x, n in zip(p["documents"], p["loss"], p["tokens"])]
    assert [g[0] for g in got] == [r[0] for r in reference]
    assert [g[2] for g in got] == [r[2] for r in reference]
    for (_, loss, n), (_, ref_sum, _) in zip(got, reference):
        assert loss == pytest.approx(ref_sum / max(n, 1), rel=1e-4, abs=1e-6)
    assert sorted({g[0] for g in got}) == list(range(len(data.corpus_for("test"))))  # every test document
    # what the plan dropped or filled is logged once per split, however often the loaders are built
    summaries = [line for line in logged if "PackedDataModule test split" in line]
    assert len(summaries) == 1 and "per rank on 1 rank(s)" in summaries[0]


def test_filler_batches_weigh_nothing_in_the_validation_loss():
    from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule

    torch.manual_seed(0)
    module = MoEGPTLightningModule(MoEGPTConfig(hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_size=32))
    corpus = SyntheticCorpus(5, mean_len=20, seed=1)
    real = PackedDocumentDataset(corpus, seq_len=16, batch_size=2, vocab_size=VOCAB_SIZE, uneven="fill")
    # rank 1 of 4 sees only filler copies when there are fewer batches than ranks
    filled = PackedDocumentDataset(corpus, seq_len=16, batch_size=2, vocab_size=VOCAB_SIZE, uneven="fill",
                                   rank=3, world_size=4)  # fmt: skip
    assert real.plan(0).per_rank < 4 and all(filler for _, filler in filled.plan(0).rank_batches(3))
    trainer = _trainer()
    (alone,) = trainer.validate(module, DataLoader(real, batch_size=None), verbose=False)
    both = torch.utils.data.ChainDataset([real, filled])
    (with_fillers,) = _trainer().validate(module, DataLoader(both, batch_size=None), verbose=False)
    assert with_fillers["val/loss"] == pytest.approx(alone["val/loss"], rel=1e-6)
