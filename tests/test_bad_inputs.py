"""Bad inputs get the package's errors: NumPy integers where ``_checks`` accepts them, an empty validation split,
meta-device inputs."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_llmfast import DataError, MetadataError, MoEGPTConfig, MoEGPTLightningModule, PackedDataModule
from lightning_llmfast.data import PackedDocumentDataset, SyntheticCorpus, pack_documents
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.seqmeta import SequenceMetadata


def test_numpy_integers_pack_like_python_ints() -> None:
    docs = [[3, 4, 5, 6, 7], [8], [9, 10, 11]]
    plain = list(pack_documents(docs, seq_len=7, batch_size=2, vocab_size=64))
    numpy = list(pack_documents(docs, seq_len=np.int64(7), batch_size=np.int32(2), vocab_size=np.int64(64),
                                pad_id=np.int16(0), lookahead=np.uint8(3)))  # fmt: skip
    assert len(plain) == len(numpy) > 0
    for a, b in zip(plain, numpy):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        assert type(b.max_seqlen) is int and type(b.num_tokens) is int
    dataset = PackedDocumentDataset(SyntheticCorpus(20, 9, seed=1), seq_len=np.int64(16), batch_size=np.int64(2),
                                    vocab_size=np.int64(258), world_size=np.int64(1), rank=np.int64(0))  # fmt: skip
    assert next(iter(dataset)).input_ids.shape == (2, 16)
    with pytest.raises(DataError, match=r"seq_len must be an int >= 2 \(one token and its next\), got True"):
        list(pack_documents(docs, seq_len=True, batch_size=2))
    with pytest.raises(DataError, match="pad_id must be an int in"):
        list(pack_documents(docs, seq_len=8, batch_size=2, vocab_size=8, pad_id=np.int64(8)))


def test_val_fraction_zero_trains_without_a_validation_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=258, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16,
                          num_experts=2, top_k=1, router_backend="torch")  # fmt: skip
    data = PackedDataModule(corpus="synthetic", seq_len=16, batch_size=2, num_workers=0, synthetic_num_docs=30,
                            synthetic_mean_len=9, val_fraction=0.0, limit_batches=2)  # fmt: skip
    trainer = L.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(MoEGPTLightningModule(config), datamodule=data)
    assert trainer.global_step == 2 and sum(trainer.num_val_batches) == 0
    assert data.val_dataloader() == []


def test_meta_device_inputs_get_data_and_metadata_errors() -> None:
    model = MoEGPT(MoEGPTConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16,
                                num_experts=2, top_k=1))  # fmt: skip
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with pytest.raises(DataError, match="meta-device"):
        model(ids)
    with pytest.raises(MetadataError, match="meta-device"):
        SequenceMetadata.from_position_ids(torch.zeros(2, 8, dtype=torch.long, device="meta"))


def test_expert_load_monitor_warns_when_the_mixin_swapped_nothing(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from lightning_llmfast import ExpertLoadMonitor, GroupedRouterMixin

    class Dense(GroupedRouterMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ExpertLoadMonitor()])  # fmt: skip
    with pytest.warns(UserWarning, match="Dense holds no MoE block to monitor"):
        trainer.fit(Dense(), train_dataloaders=DataLoader(torch.randn(2, 4), batch_size=2))
