"""sharding="fsdp" (FSDP2) under strategy="llmfast": equivalence with one process, shards, DCP resume and resharding.

The multi-process runs (gloo, CPU) are ``tests/fsdp_worker.py`` launched by Lightning; every step's global batch is
the same 4 rows for 1, 2 and 4 processes, split evenly, with equal label-token counts per rank (3 documents per
row, no padding) and the router's load-balancing loss weighted 0, so the mean of the ranks' mean losses is the
one-process loss. The one-process reference runs in this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import fsdp_worker as worker
import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_llmfast import ConfigError, LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.parallel.checkpoint import (
    consolidate_checkpoint,
    is_distributed_checkpoint,
    load_distributed_checkpoint,
)
from lightning_llmfast.parallel.fsdp import materialize_module, mixed_precision_policy, shard_module

WORKER = Path(worker.__file__)
HALF = f"epoch=0-step={worker.STEPS // 2}.ckpt"


def _launch(devices: int, out: Path, *args: str, timeout: int, returncode: int = 0) -> None:
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(devices), str(out), *args],
        cwd=out.parent, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == returncode, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 processes as FSDP2(2) x EP(2) SIGKILLed after their half-way checkpoint; 2 processes (fresh, resumed from
    their own half-way checkpoint, resumed from the killed 4-process one, meta init); 1 process in this one (fresh,
    resumed from the 2-process checkpoint); 4 processes as FSDP2(2) x EP(2) again (fresh, resumed from the 2-process
    FSDP2 checkpoint, resumed from the killed run's checkpoint, meta init with activation offload)."""
    root = tmp_path_factory.mktemp("fsdp")
    dirs = {n: root / f"world{n}" for n in (1, 2, 4)}
    killed = root / "killed"
    _launch(4, killed, "--ep", "2", "--kill-at", str(worker.STEPS // 2), timeout=300, returncode=-9)
    assert not list(killed.glob("result-*.pt"))  # it died mid-run
    killed_ckpt = str(killed / "ckpts" / HALF)
    _launch(2, dirs[2], "--resume", str(dirs[2] / "ckpts" / HALF), "--resume-other", killed_ckpt, "--meta",
            timeout=300)  # fmt: skip
    dirs[1].mkdir()
    sys_argv = sys.argv  # the worker's one-process path, run here: no process group
    try:
        sys.argv = [str(WORKER), "1", str(dirs[1]), "--resume", str(dirs[2] / "ckpts" / HALF)]
        worker.main()
    finally:
        sys.argv = sys_argv
    _launch(4, dirs[4], "--resume", str(dirs[2] / "ckpts" / HALF), "--resume-other", killed_ckpt, "--ep", "2",
            "--meta", "--offload", timeout=400)  # fmt: skip
    return dirs


def _result(directory: Path, tag: str) -> dict[str, Any]:
    return torch.load(directory / f"result-{tag}.pt", weights_only=True)


def _assert_rel(a: list[float] | dict[str, torch.Tensor], b: Any, tol: float = 1e-5) -> None:
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else [(torch.tensor(a), torch.tensor(b))]
    for x, y in pairs:
        assert x.shape == y.shape
        # Relative in the 2-norm: Adam turns summation-order rounding in an expert's few routed rows into elementwise
        # differences near 1e-5 of the tensor's largest entry, while the tensor as a whole agrees far closer.
        assert ((x - y).norm() / y.norm()).item() <= tol


@pytest.mark.parametrize("world", [2, 4])
def test_n_processes_equal_one_process_on_the_same_global_batch(runs: dict[str, Path], world: int) -> None:
    one, many = _result(runs[1], "fresh"), _result(runs[world], "fresh")
    assert one["world"] == 1 and many["world"] == world
    assert len(many["losses"]) == worker.STEPS
    _assert_rel(many["losses"], one["losses"])
    _assert_rel(many["norms"], one["norms"])  # train/grad_norm: the global norm, clipped at worker.CLIP
    assert max(one["norms"]) > worker.CLIP  # clipping was active
    _assert_rel(many["weights"], one["weights"])
    torch.manual_seed(0)
    init = MoEGPTLightningModule(MoEGPTConfig(**worker.CONFIG)).state_dict()
    assert not torch.allclose(one["weights"]["model.embed.weight"], init["model.embed.weight"])  # it trained
    assert one["tied"] and many["tied"]
    # train/grad_sync_ms: FSDP2's reduce-scatters of the last step, timed (one process reduces nothing)
    assert "train/grad_sync_ms" not in one["system"] and many["system"]["train/grad_sync_ms"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_one_nth_of_every_parameter_and_its_optimizer_state(runs: dict[str, Path], world: int) -> None:
    ranks = [torch.load(runs[world] / f"rank{r}-fresh.pt", weights_only=True)["shards"] for r in range(world)]
    single = torch.load(runs[1] / "rank0-fresh.pt", weights_only=True)["shards"]
    assert not any(s["dtensor"] for s in single.values())  # one process shards nothing
    assert ranks[0].keys() == single.keys()
    for name, full in single.items():
        numel = torch.Size(full["global"]).numel()
        expert = world == 4 and ".experts." in name  # FSDP2(2) x EP(2): E / 2 experts per rank, split over 2
        for shards in ranks:
            s = shards[name]
            assert s["dtensor"] and s["placements"] == (["_S(0, 2)", "S(0)"] if expert else ["S(0)"]), name
            assert s["global"] == full["global"]
            assert s["local"] == (full["global"][0] // world, *full["global"][1:]), name
            assert s["opt_local"] == {"exp_avg": numel // world, "exp_avg_sq": numel // world}, name


def test_resume_with_two_processes_is_bitwise_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    fresh, resumed = _result(runs[2], "fresh"), _result(runs[2], "resumed")
    half = worker.STEPS // 2
    assert resumed["losses"] == fresh["losses"][half:]
    assert all(torch.equal(resumed["weights"][k], w) for k, w in fresh["weights"].items())
    assert is_distributed_checkpoint(runs[2] / "ckpts" / HALF)
    assert sorted(p.name for p in (runs[2] / "ckpts" / HALF).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_sigkill_on_fsdp_x_ep_and_resume_is_bitwise_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    fresh, resumed = _result(runs[4], "fresh"), _result(runs[4], "other")  # "other": the SIGKILLed run's checkpoint
    half = worker.STEPS // 2
    assert len(resumed["losses"]) == worker.STEPS - half > 0
    assert resumed["losses"] == fresh["losses"][half:] and resumed["norms"] == fresh["norms"][half:]
    assert all(torch.equal(resumed["weights"][k], w) for k, w in fresh["weights"].items())
    killed = runs[4].parent / "killed" / "ckpts"
    assert sorted(p.name for p in killed.iterdir()) == [HALF]  # nothing was written after the kill


def test_a_four_process_fsdp_x_ep_checkpoint_continues_on_two_with_equal_losses(runs: dict[str, Path]) -> None:
    four, one, resharded = _result(runs[4], "fresh"), _result(runs[1], "fresh"), _result(runs[2], "other")
    assert resharded["world"] == 2
    half = worker.STEPS // 2
    _assert_rel(resharded["losses"], four["losses"][half:])
    _assert_rel(resharded["losses"], one["losses"][half:])
    _assert_rel(resharded["weights"], one["weights"])


@pytest.mark.parametrize("world", [1, 4])
def test_a_two_process_checkpoint_loads_into_one_and_four(runs: dict[str, Path], world: int) -> None:
    reference, resumed = _result(runs[1], "fresh"), _result(runs[world], "resumed")
    assert resumed["world"] == world
    half = worker.STEPS // 2
    _assert_rel(resumed["losses"], reference["losses"][half:])
    _assert_rel(resumed["weights"], reference["weights"])


@pytest.mark.parametrize("world", [2, 4])
def test_meta_device_model_is_sharded_then_materialised_and_trains_in_bf16_mixed(
    runs: dict[str, Path], world: int
) -> None:
    """2 processes: FSDP2; 4 processes: FSDP2(2) x EP(2) with every layer's saved activations offloaded."""
    meta = _result(runs[world], "meta")
    assert len(meta["losses"]) == 2 and all(torch.isfinite(torch.tensor(meta["losses"])))
    assert meta["tied"]
    # "bf16-mixed": the sharded master weights stay fp32, FSDP2 gathers them in bf16 for compute
    assert all(s["dtensor"] and not s["meta"] and s["dtype"] == torch.float32 for s in meta["shards"].values())
    assert meta["compute_dtypes"] == ["torch.bfloat16"]
    # the package's callbacks work on top: one metadata build per batch, global token counts of both ranks
    assert meta["metadata_builds_last_batch"] == 1
    assert meta["throughput"]["train/tokens"] == 2 * worker.ROWS * worker.SEQ_LEN  # 2 steps of the global batch
    if world == 4:
        experts = [s for name, s in meta["shards"].items() if ".experts." in name]
        assert experts and all(s["placements"] == ["_S(0, 2)", "S(0)"] for s in experts)
        stats = meta["offload_stats"]
        assert stats["offloaded_bytes"] > 0 and stats["checked_out"] == 0, stats
    else:
        assert meta["offload_stats"] is None
    for name, w in meta["weights"].items():
        assert torch.isfinite(w).all(), name
        if name.endswith("norm.weight"):  # reset_parameters gave ones; two AdamW steps of lr 1e-2 move them < 0.05
            assert (w - 1).abs().max() < 0.05, name


def test_consolidated_export_loads_for_inference(runs: dict[str, Path], tmp_path: Path) -> None:
    out = consolidate_checkpoint(runs[2] / "ckpts" / f"epoch=0-step={worker.STEPS}.ckpt", tmp_path / "m" / "x.ckpt")
    blob = torch.load(out, weights_only=True)
    assert "optimizer_states" not in blob and blob["global_step"] == worker.STEPS
    module = MoEGPTLightningModule.load_from_checkpoint(out)
    final = _result(runs[2], "fresh")["weights"]
    state = module.state_dict()
    assert all(torch.equal(state[k], w) for k, w in final.items())


def test_registered_names_and_bad_sharding() -> None:
    for name, offload in (("llmfast_fsdp", False), ("llmfast_fsdp_offload", True)):
        params = StrategyRegistry[name]["init_params"]
        assert params == {"sharding": "fsdp", "offload": offload}
    trainer = L.Trainer(strategy="llmfast_fsdp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, LLMFastStrategy) and trainer.strategy.sharding == "fsdp"
    for bad in ("zero3", "FSDP", None, 1):
        with pytest.raises(ConfigError, match="sharding must be one of"):
            LLMFastStrategy(sharding=bad)  # type: ignore[arg-type]
    strategy = LLMFastStrategy(sharding="fsdp", expert_parallel_size=2)  # FSDP2 x EP: checked against the world
    assert (strategy.sharding, strategy.expert_parallel_size) == ("fsdp", 2)


def test_precision_maps_to_fsdp_mixed_precision() -> None:
    policy = mixed_precision_policy("bf16-mixed")
    assert policy is not None and (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("32-true") is None and mixed_precision_policy("bf16-true") is None
    with pytest.raises(ConfigError, match="bf16-mixed"):
        mixed_precision_policy("16-mixed")


class _NoStack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)


@pytest.mark.parametrize(
    ("module", "layers", "match"),
    [
        (_NoStack, None, "no nn.ModuleList of identical blocks"),
        (lambda: MoEGPTLightningModule(MoEGPTConfig(**worker.CONFIG)), "model.blocks", "no attribute 'blocks'"),
    ],
)
def test_a_layer_stack_that_cannot_be_found_raises_before_any_step(module: Any, layers: Any, match: str) -> None:
    model = module()
    trainer = L.Trainer(
        strategy=LLMFastStrategy(sharding="fsdp", layers=layers), accelerator="cpu", devices=1, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
    assert trainer.global_step == 0 and getattr(model, "steps", 0) == 0


def test_meta_modules_without_reset_parameters_raise_before_allocating() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ConfigError, match=r"missing on 1 \(Scale\)"):
        materialize_module(model, torch.device("cpu"))
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    with torch.device("meta"):
        gpt = MoEGPT(MoEGPTConfig(**worker.CONFIG))
    assert materialize_module(gpt, torch.device("cpu")) and not materialize_module(gpt, torch.device("cpu"))
    assert not any(p.is_meta for p in gpt.parameters()) and gpt.lm_head.weight is gpt.embed.weight
    assert all(torch.equal(gpt.get_submodule(n).weight, torch.ones(32)) for n in ("norm", "layers.0.attn_norm"))


def test_a_meta_transformers_model_is_materialised_by_reset_parameters_and_its_init_weights() -> None:
    """RMSNorm and the rotary tables of a transformers model have no ``reset_parameters()``: its ``_init_weights``
    initialises them as transformers does (the eagerly built model is the reference)."""
    transformers = pytest.importorskip("transformers")
    from lightning_llmfast.moe.adapters import swap_moe_blocks

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, rope_theta=500.0,
    )  # fmt: skip
    eager = transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    swap_moe_blocks(model, backend="torch")
    assert materialize_module(model, torch.device("cpu"))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert len(norms) == 4 * 2 + 1 and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert torch.isfinite(model(input_ids=torch.arange(9)[None]).logits).all()
    std = config.initializer_range  # transformers' init, not torch's (Embedding std 1, Linear Kaiming uniform)
    for layer in (model.model.embed_tokens, model.lm_head, model.model.layers[0].self_attn.q_proj):
        assert abs(layer.weight.std().item() / std - 1) < 0.15 and abs(layer.weight.mean().item()) < std / 4


def test_single_process_fsdp_is_plain_and_refuses_a_non_distributed_checkpoint(tmp_path: Path) -> None:
    bad = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, bad)
    with pytest.raises(ConfigError, match="not a distributed"):
        load_distributed_checkpoint(bad, nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="not a distributed"):
        consolidate_checkpoint(tmp_path, tmp_path / "out.ckpt")
    model = MoEGPTLightningModule(MoEGPTConfig(**worker.CONFIG))
    trainer = L.Trainer(
        strategy="llmfast_fsdp", accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="resumes from distributed checkpoint directories"):
        trainer.fit(model, train_dataloaders=worker.Batches([worker.rank_batch(worker.global_batches()[0], 0, 1)]),
                    ckpt_path=bad)  # fmt: skip
    assert trainer.strategy.model is model and trainer.strategy.device_mesh is None
    assert not dist.is_initialized()


def test_shard_module_refuses_what_fsdp_could_not_shard_before_any_collective() -> None:
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(2))
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    model = Direct()
    # mesh=None: the arguments are checked before fully_shard (the only user of the mesh) runs
    with pytest.raises(ConfigError, match=r"holds parameters directly \(\['scale'\]\)"):
        shard_module(model, None, list(model.layers))  # type: ignore[arg-type]
    for layers in ([], [nn.Linear(2, 2)], [model]):
        with pytest.raises(ConfigError, match="non-empty blocks inside Direct"):
            shard_module(model, None, layers)  # type: ignore[arg-type]
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing was sharded
