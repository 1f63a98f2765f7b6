"""Block-FP8 releases (DeepSeek-V3 layout) load per rank, dequantized, and export back in the training dtype.

The directory is built from a transformers ``save_pretrained`` of a tiny DeepSeek-V3 whose matrices span several
128 x 128 blocks (144, 260, 132, 136 rows or columns: partial last blocks): projections in ``float8_e4m3fn`` with a
``weight_scale_inv`` per block, the rest in bf16, ``quantization_config`` in config.json, and a multi-token-prediction
layer ``model.layers.3.*``. The reference is transformers' own ``from_pretrained`` of the same weights dequantized
block by block in float64 (``tests/_pretrained.py``). Loaded weights equal it bitwise and the logits within 1e-5, in
one process and under FSDP2 x EP on 2 gloo processes, where each rank parses each shard header once and reads less
than the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _pretrained import VOCAB, reference_logits, save_fp8_release
from safetensors.torch import load_file, save_file

from lightning_llmfast import HFCausalLMModule
from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.export import main
from lightning_llmfast.hf.fp8 import dequantize
from lightning_llmfast.parallel import pretrained

pytest.importorskip("transformers")

IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_fp8_release(tmp_path_factory.mktemp("fp8"))


def _loaded(directory: Path) -> HFCausalLMModule:
    module = HFCausalLMModule.from_pretrained(directory, moe_backend="torch")
    module.configure_model()
    assert module.materialize()
    return module


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_dequantize_any_rectangle_equals_the_block_loop() -> None:
    from _pretrained import quantize_blocks

    weight = torch.randn(300, 259, generator=torch.Generator().manual_seed(0))
    fp8, scale, real = quantize_blocks(weight)
    for rows, cols in (
        (slice(0, 300), slice(0, 259)),
        (slice(130, 131), slice(127, 259)),
        (slice(255, 257), slice(5, 6)),
    ):
        first, last = rows.start // 128, -(-rows.stop // 128)
        got = dequantize(fp8[rows, cols], scale[first:last], (128, 128), row=rows.start, col=cols.start)
        assert torch.equal(got, real[rows, cols].float()), (rows, cols)


def test_fp8_release_loads_like_transformers_on_the_dequantized_weights(
    release: tuple[Path, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    fp8_dir, real_dir = release
    parses: list[Path] = []
    monkeypatch.setattr(
        pretrained, "read_header", lambda path, parse=pretrained.read_header: parses.append(path) or parse(path)
    )
    with caplog.at_level(logging.WARNING, logger="lightning_llmfast.parallel.pretrained"):
        module = _loaded(fp8_dir)
    files = set(json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert sorted(parses) == sorted(fp8_dir / f for f in files) and len(files) > 2  # each header once
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skips) == 1 and "model.layers.3 " in skips[0], skips
    reference = AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32)
    ours = module.model.state_dict()
    for key, value in reference.state_dict().items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], value), key
    with torch.no_grad():
        logits = module.model(input_ids=IDS).logits
    torch.testing.assert_close(logits, reference_logits(real_dir, IDS), rtol=0, atol=1e-5)


def test_export_of_an_fp8_load_is_bf16_without_mtp_or_quantization(release: tuple[Path, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    fp8_dir, real_dir = release
    module = _loaded(fp8_dir)
    out = module.save_pretrained(tmp_path / "bf16")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["num_nextn_predict_layers"] == 0
    exported = _tensors(out)
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert not any(k.startswith("model.layers.3.") or k.endswith("_scale_inv") for k in exported)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for key, value in module.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value.bfloat16().float()), key
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    assert main([str(tmp_path / "m.ckpt"), str(tmp_path / "cli")]) == 0  # the CLI: the same rule, the same files
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == config
    assert _tensors(tmp_path / "cli").keys() == exported.keys()
    assert all(torch.equal(_tensors(tmp_path / "cli")[k], v) for k, v in exported.items())
    fp32 = module.save_pretrained(tmp_path / "fp32", dtype=torch.float32)
    assert {t.dtype for t in _tensors(fp32).values()} == {torch.float32}
    torch.testing.assert_close(reference_logits(fp32, IDS), reference_logits(real_dir, IDS), rtol=0, atol=1e-5)


def _break(kind: str, directory: Path) -> str:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    file = directory / weight_map[key]
    tensors = load_file(file)
    if kind == "scales missing":
        del tensors[key + "_scale_inv"]
        save_file(tensors, file)
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        del index["weight_map"][key + "_scale_inv"]
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        return key
    if kind == "scales of another shape":
        tensors[key + "_scale_inv"] = torch.ones(1, 1)
        save_file(tensors, file)
        return key + "_scale_inv"
    if kind == "fp8 without quantization_config":
        config = json.loads((directory / "config.json").read_text())
        del config["quantization_config"]
        (directory / "config.json").write_text(json.dumps(config))
        return "quantization_config"
    if kind == "another quantization method":
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"]["quant_method"] = "mxfp4"
        (directory / "config.json").write_text(json.dumps(config))
        return "mxfp4"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["scales missing", "scales of another shape", "fp8 without quantization_config", "another quantization method"],
)
def test_a_broken_fp8_release_is_refused_naming_it(kind: str, release: tuple[Path, Path], tmp_path: Path) -> None:
    directory = tmp_path / "broken"
    shutil.copytree(release[0], directory)
    name = _break(kind, directory)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _loaded(directory)


def _fsdp_ep_worker(rank: int, world: int, fp8_dir: Path, out: str) -> None:
    from lightning_llmfast.parallel import ParallelDims, parallelize

    parses: list[str] = []
    parse = pretrained.read_header
    pretrained.read_header = lambda path: parses.append(path.name) or parse(path)  # type: ignore[assignment]
    stats: list[Any] = []
    load = pretrained.PretrainedCheckpoint.load_into
    pretrained.PretrainedCheckpoint.load_into = lambda self, m: stats.append(load(self, m)) or stats[-1]  # type: ignore[method-assign]
    dims = ParallelDims(world, "fsdp", 2)
    dims.build_mesh("cpu")
    module = HFCausalLMModule.from_pretrained(fp8_dir, moe_backend="torch")
    module.configure_model()
    parallelize(module, dims, module.model.model.layers, device=torch.device("cpu"))
    assert module.model.model.layers[-1].mlp.experts.gate_up_proj.to_local().shape[0] == 2  # this rank's experts
    with torch.no_grad():
        logits = module.model(input_ids=IDS).logits
    torch.save({"logits": logits, "parses": parses, "bytes": stats[0].bytes_read}, Path(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_fp8_release_under_fsdp_x_ep_reads_each_header_once_and_only_its_share(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    from _distributed import run_distributed

    fp8_dir, real_dir = release
    run_distributed(_fsdp_ep_worker, 2, fp8_dir, str(tmp_path), timeout=180)
    files = sorted(set(json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"].values()))
    checkpoint = pretrained.PretrainedCheckpoint.open(fp8_dir)
    reference = reference_logits(real_dir, IDS)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["logits"], reference, rtol=0, atol=1e-5, msg=f"rank {rank}")
        assert sorted(got["parses"]) == files  # once per shard and rank
        assert 0.3 < got["bytes"] / checkpoint.total_bytes < 0.7, got["bytes"]  # about half, plus shared scale rows
