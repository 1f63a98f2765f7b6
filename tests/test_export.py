"""Export back to a transformers directory: bitwise round trip, after training the exported logits equal the module's,
from a one-process ``.ckpt`` and from a DCP checkpoint written by FSDP2 x EP or DDP x EP on 2 gloo processes (where
``save_pretrained`` is refused: each process holds part of the model); atomic; CLI errors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _pretrained import FAMILIES, VOCAB, save_tiny, tiny_config
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_llmfast import HFCausalLMModule, LLMFastStrategy
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.export import main
from lightning_llmfast.parallel import export as export_module

pytest.importorskip("transformers")

SEQ, STEPS = 12, 3


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_load_then_save_pretrained_reproduces_every_tensor_bitwise(family: str, tmp_path: Path) -> None:
    source = save_tiny(family, tmp_path / "source")
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    module = HFCausalLMModule.from_pretrained(source, moe_backend="torch")
    module.configure_model()
    module.materialize()
    out = module.save_pretrained(tmp_path / "out", max_shard_size="8KB")
    ours, theirs = _tensors(out), _tensors(source)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(theirs) and len(set(index.values())) > 1  # sharded
    assert (out / "tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
    assert (out / "generation_config.json").is_file() and (out / "config.json").is_file()


def test_save_pretrained_and_the_cli_write_the_source_dtype_unless_told(tmp_path: Path) -> None:
    """One rule on both paths: the source checkpoint's dtype (here bf16; the module trains in fp32), or ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    module = HFCausalLMModule.from_pretrained(tmp_path / "src", moe_backend="torch")
    module.configure_model()
    module.materialize()
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    written = {
        "save_pretrained": module.save_pretrained(tmp_path / "a"),
        "cli": tmp_path / "b" if main([str(tmp_path / "m.ckpt"), str(tmp_path / "b")]) == 0 else None,
        "save_pretrained fp32": module.save_pretrained(tmp_path / "c", dtype=torch.float32),
        "cli fp32": tmp_path / "d"
        if main([str(tmp_path / "m.ckpt"), str(tmp_path / "d"), "--dtype", "fp32"]) == 0
        else None,
    }
    for path, out in written.items():
        assert out is not None, path
        expected = torch.float32 if path.endswith("fp32") else torch.bfloat16
        assert {t.dtype for t in _tensors(out).values()} == {expected}, path
        assert json.loads((out / "config.json").read_text())["dtype"] == str(expected).removeprefix("torch."), path
    assert _tensors(tmp_path / "a").keys() == _tensors(tmp_path / "b").keys()
    assert all(torch.equal(v, _tensors(tmp_path / "b")[k]) for k, v in _tensors(tmp_path / "a").items())


def _batches(count: int, seed: int) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 1, 7, SEQ, 3, 9, 2)]
    batches = list(pack_documents(docs, SEQ, 2))
    return (batches * count)[:count]


def _module_logits(module: HFCausalLMModule, ids: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    module.eval()
    with torch.no_grad():
        logits = module.model(input_ids=ids).logits
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _exported_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trainer(strategy: Any, devices: int, ckpt: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt, filename="last")],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip


def test_trained_one_process_ckpt_exports_what_the_module_computes(tmp_path: Path) -> None:
    source = save_tiny("qwen3_moe", tmp_path / "source")
    module = HFCausalLMModule(str(source), lr=3e-2, warmup_steps=1, moe_backend="torch")
    trainer = _trainer(LLMFastStrategy(), 1, tmp_path / "ckpt")
    trainer.fit(module, DataLoader(_batches(STEPS, 0), batch_size=None))
    assert main([str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "out"), "--max-shard-size", "10KB"]) == 0
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    ours = _module_logits(module, ids)
    torch.testing.assert_close(_exported_logits(tmp_path / "out", ids), ours, rtol=0, atol=1e-5)
    before = _tensors(source)
    after = _tensors(tmp_path / "out")
    assert after.keys() == before.keys() and not torch.equal(after["model.norm.weight"], before["model.norm.weight"])


def _ep_worker(rank: int, world: int, source: str, out: str, sharding: str) -> None:
    from fsdp_worker import Batches

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    module = HFCausalLMModule(source, lr=3e-2, warmup_steps=1, aux_loss_coef=0.0, moe_backend="torch")
    strategy = LLMFastStrategy(sharding=sharding, expert_parallel_size=2, process_group_backend="gloo")
    trainer = _trainer(strategy, world, Path(out, "ckpt"))
    trainer.fit(module, Batches(_batches(STEPS, rank)))
    with pytest.raises(ConfigError, match=r"python -m lightning_llmfast\.export"):
        module.save_pretrained(Path(out, f"part{rank}"))  # this rank's experts are not the model's
    assert not list(Path(out).glob(f"*part{rank}*"))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = _module_logits(module, ids)
    if rank == 0:
        torch.save(logits, Path(out, "logits.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_ep_dcp_checkpoint_exports_what_the_module_computes(sharding: str, tmp_path: Path) -> None:
    from _distributed import run_distributed

    source = save_tiny("deepseek_v3", tmp_path / "source")
    run_distributed(_ep_worker, 2, str(source), str(tmp_path), sharding, timeout=300)
    checkpoint = tmp_path / "ckpt" / "last.ckpt"
    assert (checkpoint / ".metadata").is_file()  # a DCP directory
    assert main([str(checkpoint), str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    reference = torch.load(tmp_path / "logits.pt", weights_only=True)
    torch.testing.assert_close(_exported_logits(tmp_path / "out", ids), reference, rtol=0, atol=1e-5)
    exported, before = _tensors(tmp_path / "out"), _tensors(source)
    assert exported.keys() == before.keys()
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert not torch.equal(exported[key], before[key])  # trained, read back from the shards of both ranks
    bf16 = tmp_path / "bf16"
    assert main([str(checkpoint), str(bf16), "--dtype", "bf16"]) == 0
    assert {t.dtype for t in _tensors(bf16).values()} == {torch.bfloat16}
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_failed_export_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = save_tiny("llama", tmp_path / "source")
    module = HFCausalLMModule.from_pretrained(source)
    module.materialize()
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        export_module.save_file(*args, **kwargs)

    monkeypatch.setattr(export_module, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        module.save_pretrained(tmp_path / "out")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # neither the output nor its temporary
    module.save_pretrained(tmp_path / "out")
    with pytest.raises(ConfigError, match="exists"):
        module.save_pretrained(tmp_path / "out")


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "absent.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "absent.ckpt" in err and err.count("\n") == 1
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    assert main([str(tmp_path / "bad.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.ckpt" in err and "Traceback" not in err
    module_dir = save_tiny("llama", tmp_path / "source")
    (tmp_path / "out").mkdir()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    trainer.strategy.connect(HFCausalLMModule(str(module_dir)))
    trainer.strategy.lightning_module.materialize()
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    assert main([str(tmp_path / "m.ckpt"), str(tmp_path / "out")]) == 2
    assert "exists" in capsys.readouterr().err
    assert not list((tmp_path / "out").iterdir())


def test_moegpt_ckpt_exports_as_a_mixtral_computing_its_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule

    torch.manual_seed(3)
    config = MoEGPTConfig(vocab_size=37, hidden_size=24, n_layers=3, n_heads=4, n_kv_heads=2, ffn_size=12,
                          num_experts=5, top_k=3, tie_embeddings=False, init_std=0.3, rope_theta=500.0,
                          router_backend="torch")  # fmt: skip
    module = MoEGPTLightningModule(config)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    assert main([str(tmp_path / "m.ckpt"), str(tmp_path / "out")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "MixtralForCausalLM" and "lm_head.weight" in _tensors(tmp_path / "out")  # untied
    ids = torch.randint(0, 37, (3, 17))
    with torch.no_grad():
        expected, got = module.model(ids).double(), hf(input_ids=ids).logits.double()
    assert float((got - expected).abs().max()) < 1e-5 < float(expected.std())
    for refused, match in (({"dense_layers": [1]}, "dense"), ({"capacity_factor": 1.5}, "dropless")):
        other = MoEGPTLightningModule(MoEGPTConfig(**{**vars(config), **refused}))
        trainer.strategy.connect(other)
        trainer.save_checkpoint(tmp_path / "x.ckpt")
        with pytest.raises(ConfigError, match=match):
            export_module.export_checkpoint(tmp_path / "x.ckpt", tmp_path / "x")


def test_moegpt_config_stays_a_safe_global_after_an_export_reads_a_checkpoint(tmp_path: Path) -> None:
    # torch's safe_globals context removes what it added on exit, the import-time registration included: loading a
    # MoEGPTLightningModule checkpoint with weights_only must keep working after an export read one.
    from lightning_llmfast.models import MoEGPTConfig

    path = tmp_path / "hyper.pt"
    torch.save({"config": MoEGPTConfig(n_layers=1)}, path)
    with pytest.raises(CheckpointError, match="holds no model weights"):
        export_module.export_checkpoint(path, tmp_path / "out")
    assert torch.load(path, weights_only=True)["config"].n_layers == 1
