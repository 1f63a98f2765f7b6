"""Checkpoints that refuse corruption: a digest of every tensor written with the checkpoint and verified on load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_llmfast import CheckpointError, LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule, PackedBatch
from lightning_llmfast.data import pack_documents
from lightning_llmfast.parallel import integrity
from lightning_llmfast.parallel.checkpoint import (
    META_FILENAME,
    load_distributed_checkpoint,
    model_state,
    optimizer_state,
    save_distributed_checkpoint,
)
from lightning_llmfast.parallel.integrity import verify_shard_digests, write_shard_digests
from lightning_llmfast.strategy.checkpoint_io import VerifiedCheckpointIO

STEPS = 3


def _batches(n: int = STEPS) -> list[PackedBatch]:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (int(k),), generator=gen).tolist() for k in torch.randint(1, 15, (90,), generator=gen)]
    return list(pack_documents(docs, seq_len=19, batch_size=2, vocab_size=64))[:n]


def _module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    return MoEGPTLightningModule(config, warmup_steps=1)


def _fit(module: MoEGPTLightningModule, root: Path, steps: int, ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(
        default_root_dir=root, max_steps=steps, accelerator="cpu", devices=1, strategy=LLMFastStrategy(),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=True)],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(_batches(), batch_size=None), ckpt_path=ckpt_path)
    return trainer


def _corrupt_middle(file: Path, size: int = 1024) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    garbage = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    data[middle : middle + size] = bytes(garbage.tolist())
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 2 // 3])


def _assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor) and got[key].dtype == tensor.dtype, key


def test_single_file_checkpoints_refuse_corruption_even_when_last(tmp_path: Path) -> None:
    module = _module()
    _fit(module, tmp_path, STEPS)
    ckpt = tmp_path / "ckpt"
    last, newest = ckpt / "last.ckpt", ckpt / f"epoch=0-step={STEPS}.ckpt"
    io = VerifiedCheckpointIO()
    # intact: every tensor back bitwise, and the digests are not handed to Lightning
    loaded = io.load_checkpoint(newest)
    assert "llmfast_tensor_digests" not in loaded and loaded["global_step"] == STEPS
    _assert_bitwise(loaded["state_dict"], module.state_dict())
    for damage in (_corrupt_middle, _truncate):
        broken = tmp_path / f"{damage.__name__}.ckpt"
        shutil.copy(newest, broken)
        damage(broken)
        with pytest.raises(CheckpointError, match=rf"{broken.name}: (tensor '.+' differs|unreadable checkpoint)"):
            io.load_checkpoint(broken)
    # 1 KiB inside a tensor's bytes: the error names that tensor
    tensor_damage = tmp_path / "tensor.ckpt"
    shutil.copy(newest, tensor_damage)
    _corrupt_middle(tensor_damage, size=8)
    with pytest.raises(CheckpointError, match=r"tensor\.ckpt: tensor '(state_dict|optimizer_states)/.+' differs"):
        io.load_checkpoint(tensor_damage)
    # a corrupt last.ckpt is refused, not swapped for an older sibling (every rank must resume from the same one)
    _corrupt_middle(last)
    with pytest.raises(CheckpointError, match=r"last\.ckpt: (tensor '.+' differs|unreadable checkpoint)"):
        _fit(_module(), tmp_path / "again", STEPS + 1, ckpt_path=str(last))
    assert _fit(_module(), tmp_path / "again", STEPS + 1, ckpt_path=str(newest)).global_step == STEPS + 1


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 29)
        self.b = nn.Linear(29, 3, bias=False)


def _dcp_save(path: Path) -> tuple[_Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    model.b(model.a(torch.randn(5, 37))).sum().backward()
    optimizer.step()
    checkpoint = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)], "step": 1}
    save_distributed_checkpoint(checkpoint, path, rank=0)
    return model, optimizer


def test_distributed_checkpoints_refuse_corruption_even_when_last(tmp_path: Path) -> None:
    saved, _ = _dcp_save(tmp_path / "step=1.ckpt")
    target = _Tiny()
    meta = load_distributed_checkpoint(tmp_path / "step=1.ckpt", target)
    assert meta["step"] == 1
    _assert_bitwise(target.state_dict(), saved.state_dict())  # intact: bitwise
    for damage in (_corrupt_middle, _truncate):
        broken = tmp_path / f"{damage.__name__}.ckpt"
        shutil.copytree(tmp_path / "step=1.ckpt", broken)
        damage(broken / "__0_0.distcp")
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp: tensor '(state_dict|optimizer_0)\..+' differs"):
            load_distributed_checkpoint(broken, _Tiny())
    last = tmp_path / "last.ckpt"
    shutil.copytree(tmp_path / "step=1.ckpt", last)
    _corrupt_middle(last / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"last\.ckpt/__0_0\.distcp: tensor"):  # no fallback to a sibling
        load_distributed_checkpoint(last, _Tiny())


def test_shard_digests_hash_every_byte_once_and_see_damage_outside_the_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step=1.ckpt"
    _dcp_save(path)
    hashed: list[int] = []
    real = integrity._checksum

    def counting(data: np.ndarray) -> int:
        hashed.append(data.size)
        return real(data)

    monkeypatch.setattr(integrity, "_checksum", counting)
    extra = (".metadata", META_FILENAME)
    digest_file = write_shard_digests(path, 0, extra)
    files = [path / name for name in ("__0_0.distcp", *extra)]
    assert sum(hashed) == sum(f.stat().st_size for f in files)  # every byte once (it was twice, plus two copies)
    entries = json.loads(digest_file.read_text())
    assert all(e["chunks"] for name, e in entries.items() if name.endswith(".distcp"))
    verify_shard_digests(path)
    # a byte of a file without tensor chunks (the strategy's meta file) changed: found, and said so
    meta = path / META_FILENAME
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{META_FILENAME}: differs .* outside the tensor data"):
        verify_shard_digests(path)
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    # a digest of the previous format (one checksum of the whole file) still verifies, and still refuses damage
    for name, entry in entries.items():
        entry["checksum"] = real(np.fromfile(path / name, dtype=np.uint8))
        del entry["rest"]
    digest_file.write_text(json.dumps(entries))
    verify_shard_digests(path)
    _corrupt_middle(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"tensor '.+' differs"):
        verify_shard_digests(path)
