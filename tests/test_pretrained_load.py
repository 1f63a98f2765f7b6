"""``HFCausalLMModule`` from a local pretrained directory: built on the meta device, weights read per rank.

Tiny checkpoints of every supported family are written sharded by transformers' ``save_pretrained`` (per-expert keys
on disk, several files, tensors split across them). After loading, every parameter and persistent buffer equals
transformers' own ``from_pretrained`` bitwise, the rotary tables are computed, tied weights tied, and the logits equal
transformers' (1e-5) in one process and, in ``test_per_rank_load_*``, under FSDP2, EP and FSDP2 x EP on 2 gloo
processes, where each rank holds only its shards. Broken checkpoints are refused naming the key or file. Counters: each
shard header is parsed once per rank, each byte read once, the pieces go to the device in a few staging batches; under
DDP every rank reads locally and DDP's start-up broadcast is off.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _pretrained import FAMILIES, MOE_FAMILIES, VOCAB, reference_logits, save_tiny, tiny_config
from safetensors.torch import load_file, save_file

from lightning_llmfast import HFCausalLMModule
from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.hf.state_dict import FAMILIES as ADAPTERS
from lightning_llmfast.hf.state_dict import state_dict_adapter

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {family: save_tiny(family, root / family) for family in FAMILIES}


def _loaded(directory: Path) -> HFCausalLMModule:
    module = HFCausalLMModule.from_pretrained(directory, moe_backend="torch")
    assert all(t.is_meta for t in module.parameters())  # nothing read before the weights have a place
    module.configure_model()  # the grouped MoE blocks, as Trainer.fit swaps them
    assert module.materialize()
    return module


@pytest.mark.parametrize("family", FAMILIES)
def test_load_equals_transformers_from_pretrained(family: str, checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    directory = checkpoints[family]
    module = _loaded(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ours, theirs = module.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    for (name, buf), (_, ref_buf) in zip(module.model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(buf, ref_buf), name  # rotary tables computed, DeepSeek's correction bias read
    assert all(m.training for m in module.modules())
    if reference.config.tie_word_embeddings:
        assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    if family in MOE_FAMILIES:
        assert type(module.model.model.layers[-1].mlp).__name__ == "HFGroupedMoeBlock"
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = module.model(input_ids=ids).logits
    torch.testing.assert_close(logits, reference_logits(directory, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_key_table_maps_both_ways(family: str, checkpoints: dict[str, Path]) -> None:
    directory = checkpoints[family]
    on_disk: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        on_disk.update(load_file(file))
    adapter = state_dict_adapter(family)
    in_memory = adapter.from_hf(on_disk)
    reference = _loaded(directory).model.state_dict()
    tied = {"lm_head.weight"} if "lm_head.weight" not in on_disk else set()
    assert in_memory.keys() == reference.keys() - tied
    for key, value in in_memory.items():
        assert torch.equal(value, reference[key]), key
    back = adapter.to_hf(in_memory)
    assert back.keys() == on_disk.keys()
    assert all(torch.equal(back[key], value) for key, value in on_disk.items())
    first = adapter.experts
    assert first is not None and any(f".experts.3.{first.down}.weight" in key for key in on_disk)


def test_load_from_checkpoint_and_cli_argument_keep_the_directory(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import lightning as L

    directory = checkpoints["qwen3_moe"]
    module = _loaded(directory)
    assert module.hparams["model"] == str(directory)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(module)
    with torch.no_grad():
        module.model.model.norm.weight.add_(1.5)  # differs from the directory's weights
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    restored = HFCausalLMModule.load_from_checkpoint(tmp_path / "m.ckpt")
    assert not any(t.is_meta for t in restored.parameters())
    for key, value in module.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "broken"
    shutil.copytree(directory, target)
    return target


def _index(directory: Path) -> dict[str, str]:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def _rewrite_index(directory: Path, weight_map: dict[str, str]) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"] = weight_map
    path.write_text(json.dumps(index))


def _break(kind: str, directory: Path) -> str:
    """Break ``directory`` as ``kind`` says; returns what the error message must name."""
    weight_map = _index(directory)
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    file = directory / weight_map[key]
    if kind == "key missing from its shard":
        tensors = load_file(file)
        del tensors[key]
        save_file(tensors, file, metadata={"format": "pt"})
        return key
    if kind == "key missing everywhere":
        tensors = load_file(file)
        del tensors[key]
        save_file(tensors, file, metadata={"format": "pt"})
        _rewrite_index(directory, {k: v for k, v in weight_map.items() if k != key})
        return key
    if kind == "unexpected key":
        tensors = load_file(file)
        tensors["model.layers.1.mlp.experts.4.up_proj.weight"] = tensors[key].clone()
        save_file(tensors, file, metadata={"format": "pt"})
        _rewrite_index(directory, {**weight_map, "model.layers.1.mlp.experts.4.up_proj.weight": file.name})
        return "model.layers.1.mlp.experts.4.up_proj.weight"
    if kind == "shape mismatch":
        config = json.loads((directory / "config.json").read_text())
        config["moe_intermediate_size"] = 16  # a checkpoint of another size
        (directory / "config.json").write_text(json.dumps(config))
        return "model.layers.0.mlp.experts.0.gate_proj.weight"
    if kind == "truncated shard":
        os.truncate(file, file.stat().st_size - 7)
        return file.name
    if kind == "corrupt shard":
        file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + b"\x00" * 64)
        return file.name
    if kind == "shard absent":
        file.unlink()
        return file.name
    if kind == "no config.json":
        (directory / "config.json").unlink()
        return "config.json"
    if kind == "unsupported architecture":
        config = json.loads((directory / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (directory / "config.json").write_text(json.dumps(config))
        return "GPT2LMHeadModel"
    raise AssertionError(kind)


BROKEN = (
    "key missing from its shard", "key missing everywhere", "unexpected key", "shape mismatch", "truncated shard",
    "corrupt shard", "shard absent", "no config.json", "unsupported architecture",
)  # fmt: skip


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_checkpoint_is_refused_naming_it(kind: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["qwen3_moe"], tmp_path)
    name = _break(kind, directory)
    error = ConfigError if kind == "unsupported architecture" else CheckpointError
    with pytest.raises(error, match=name.replace(".", r"\.")) as info:
        _loaded(directory)
    if kind == "unsupported architecture":
        assert all(family in str(info.value) for family in ADAPTERS)


def test_one_load_parses_each_header_once_and_reads_each_byte_once(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_llmfast.parallel import pretrained

    parses: list[Path] = []
    parse = pretrained.read_header
    monkeypatch.setattr(pretrained, "read_header", lambda path: parses.append(path) or parse(path))
    stats: list[pretrained.LoadStats] = []
    load = pretrained.PretrainedCheckpoint.load_into
    monkeypatch.setattr(
        pretrained.PretrainedCheckpoint, "load_into", lambda self, m: stats.append(load(self, m)) or stats[-1]
    )
    directory = checkpoints["qwen3_moe"]
    _loaded(directory)
    files = sorted(set(_index(directory).values()))
    assert sorted(p.name for p in parses) == files and len(files) > 2
    checkpoint = pretrained.PretrainedCheckpoint.open(directory)
    (done,) = stats
    assert done.bytes_read == checkpoint.total_bytes  # every byte once, the tied lm_head absent from the files
    assert done.reads == len(checkpoint.files) and done.batches == 1  # 4 MiB of staging holds this checkpoint


def test_a_shard_truncated_after_open_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["qwen3_moe"], tmp_path)
    module = HFCausalLMModule.from_pretrained(directory, moe_backend="torch")
    last = sorted(directory.glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 5)
    with pytest.raises(CheckpointError, match=last.name):
        module.materialize()


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such pretrained directory"):
        HFCausalLMModule(str(tmp_path / "absent"))


# ---------------------------------------------------------------------------------------------------------------
# Per-rank loading on 2 gloo processes
# ---------------------------------------------------------------------------------------------------------------

LAYOUTS = (("fsdp", 1), ("ddp", 2), ("fsdp", 2))  # FSDP2, EP (DDP), FSDP2 x EP
FIXED_OVERHEAD = 8 << 20  # bytes a rank may use beyond its share and one tensor (allocator, FSDP2 state, mappings)


def _peak_rss_of_fsdp_load(world: int, directory: Path) -> tuple[int, int]:
    """``(peak RSS growth while sharding and loading, bound)`` of this rank for a FSDP2 load of ``directory``."""
    from lightning_llmfast.bench.rss import PeakRSS
    from lightning_llmfast.parallel import ParallelDims, parallelize
    from lightning_llmfast.parallel.pretrained import PretrainedCheckpoint

    checkpoint = PretrainedCheckpoint.open(directory)
    largest = max(torch.Size(s).numel() * checkpoint.dtypes[k].itemsize for k, s in checkpoint.shapes.items())
    dims = ParallelDims(world, "fsdp")
    dims.build_mesh("cpu")
    module = HFCausalLMModule.from_pretrained(directory, moe_backend="torch")
    module.configure_model()
    with PeakRSS() as rss:  # VmHWM reset here, read after loading, before any forward
        parallelize(module, dims, module.model.model.layers, device=torch.device("cpu"))
    return rss.growth, checkpoint.total_bytes // world + largest + FIXED_OVERHEAD


def _parallel_worker(rank: int, world: int, checkpoints: dict[str, Path], out: str) -> None:
    from torch.distributed.tensor import DTensor

    from lightning_llmfast.parallel import ParallelDims, parallelize

    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    results: dict[str, Any] = {}
    for family in MOE_FAMILIES:
        for sharding, ep in LAYOUTS:
            dims = ParallelDims(world, sharding, ep)
            dims.build_mesh("cpu")
            module = HFCausalLMModule.from_pretrained(checkpoints[family], moe_backend="torch")
            module.configure_model()
            parallelize(module, dims, module.model.model.layers, device=torch.device("cpu"))
            assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
            experts = module.model.model.layers[-1].mlp.experts.gate_up_proj
            local = experts.to_local() if isinstance(experts, DTensor) else experts
            assert local.shape[0] == 4 // world, (family, sharding, ep, local.shape)  # this rank's experts only
            with torch.no_grad():
                results[f"{family}/{sharding}/ep{ep}"] = module.model(input_ids=ids).logits
    # measured after the loads above ran the same code: a worker forked from a server faults in the library pages a
    # code path first runs, which are not the load's memory
    results["rss"] = torch.tensor(_peak_rss_of_fsdp_load(world, checkpoints["large"]))
    if rank == 0:
        torch.save(results, Path(out, "logits.pt"))


@pytest.mark.slow
def test_per_rank_load_under_fsdp_ep_and_fsdp_x_ep_equals_transformers(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Also the per-rank peak RSS counter of a 2-process FSDP2 load of a 29 MiB checkpoint against the bound: its
    share + the largest tensor + a fixed overhead (a rank reading the whole checkpoint would exceed it)."""
    from _distributed import run_distributed
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    large = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(large).save_pretrained(tmp_path / "large", max_shard_size="8MB")
    run_distributed(_parallel_worker, 2, {**checkpoints, "large": tmp_path / "large"}, str(tmp_path), timeout=240)
    results = torch.load(tmp_path / "logits.pt", weights_only=True)
    growth, bound = results.pop("rss").tolist()
    assert 0 < growth <= bound, (growth / 2**20, bound / 2**20)
    assert bound - FIXED_OVERHEAD < 29 << 20  # the bound is below the whole checkpoint
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    assert len(results) == len(MOE_FAMILIES) * len(LAYOUTS)
    for family in MOE_FAMILIES:
        reference = reference_logits(checkpoints[family], ids)
        for sharding, ep in LAYOUTS:
            got = results[f"{family}/{sharding}/ep{ep}"]
            torch.testing.assert_close(got, reference, rtol=0, atol=1e-5, msg=f"{family} {sharding} ep={ep}")


# ---------------------------------------------------------------------------------------------------------------
# DDP: one read per byte (each rank reads locally, DDP's start-up broadcast is off)
# ---------------------------------------------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, directory: str, out: str) -> None:
    import lightning as L
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp
    from fsdp_worker import Batches

    from lightning_llmfast import LLMFastStrategy
    from lightning_llmfast.data import pack_documents
    from lightning_llmfast.parallel import pretrained

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    syncs: list[int] = []
    stats: list[Any] = []
    parses: list[str] = []
    sync = ddp._sync_module_states
    ddp._sync_module_states = lambda *a, **k: syncs.append(1) or sync(*a, **k)  # type: ignore[assignment]
    load = pretrained.PretrainedCheckpoint.load_into
    pretrained.PretrainedCheckpoint.load_into = lambda self, m: stats.append(load(self, m)) or stats[-1]  # type: ignore[method-assign]
    parse = pretrained.read_header
    pretrained.read_header = lambda path: parses.append(path.name) or parse(path)  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for name, ep, source in (("pretrained", 1, directory), ("pretrained_ep", 2, directory), ("random", 1, None)):
        for record in (syncs, stats, parses):
            record.clear()
        model = source if source is not None else tiny_config("qwen3_moe")
        module = HFCausalLMModule(model, moe_backend="torch", aux_loss_coef=0.0)
        strategy = LLMFastStrategy(expert_parallel_size=ep, process_group_backend="gloo")
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, use_distributed_sampler=False,
        )  # fmt: skip
        docs = [torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(rank))]
        trainer.fit(module, Batches(list(pack_documents(docs, 8, 1))))
        replicated = [p for n, p in module.named_parameters() if ".experts." not in n]
        digest = torch.stack([p.detach().double().sum() for p in replicated])
        gathered = [torch.empty_like(digest) for _ in range(world)]
        dist.all_gather(gathered, digest)
        results[name] = {
            "syncs": len(syncs), "bytes": stats[0].bytes_read if stats else 0, "parses": len(parses),
            "equal": all(torch.equal(g, gathered[0]) for g in gathered),
        }  # fmt: skip
    torch.save(results, Path(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ddp_reads_each_byte_once_per_rank_without_a_broadcast(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from _distributed import run_distributed

    from lightning_llmfast.parallel.pretrained import PretrainedCheckpoint

    directory = checkpoints["qwen3_moe"]
    run_distributed(_ddp_worker, 2, str(directory), str(tmp_path), timeout=240)
    checkpoint = PretrainedCheckpoint.open(directory)
    files = len(set(checkpoint.files.values()))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["pretrained"] == {"syncs": 0, "bytes": checkpoint.total_bytes, "parses": files, "equal": True}
        ep = got["pretrained_ep"]  # the replicated weights whole, half the experts
        assert ep["syncs"] == 0 and ep["parses"] == files and ep["equal"], ep
        assert checkpoint.total_bytes * 0.3 < ep["bytes"] < checkpoint.total_bytes * 0.8, ep
        assert got["random"]["syncs"] == 1 and got["random"]["equal"]  # random weights still come from rank 0
