"""strategy="llmfast": registry, single-device fast path, offload wiring, errors, checkpoint resume, 2-process DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import lightning_llmfast
from lightning_llmfast import (
    ConfigError,
    LLMFastStrategy,
    MoEGPTConfig,
    MoEGPTLightningModule,
    OffloadConfig,
    OffloadError,
)
from lightning_llmfast.data import SyntheticCorpus, pack_documents
from lightning_llmfast.offload.copier import CpuCopier as _Copier

VOCAB = 64


def _batches(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    docs = [
        torch.randint(0, VOCAB - 1, (len(d),), generator=g)
        for d in SyntheticCorpus(num_docs=100, mean_len=12, seed=0, vocab_size=VOCAB)
    ]
    batches = list(pack_documents(docs, 32, 2, pad_id=VOCAB - 1, vocab_size=VOCAB))[:n]
    assert len(batches) == n
    return DataLoader(batches, batch_size=None)  # already batched PackedBatch objects


def _module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_size=64)
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2)


class _Spy(L.Callback):
    """Records losses, offloader stats and what the strategy looked like during training."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.stats: list[dict[str, Any]] = []
        self.wrapped: list[bool] = []
        self.offloader: Any = None
        self.steps_started = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.steps_started += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.wrapped.append(isinstance(trainer.strategy.model, DistributedDataParallel))
        off = getattr(trainer.strategy, "offloader", None)
        if off is not None:
            self.offloader = off
            self.stats.append(dict(off.stats))


def _fit(strategy: Any, steps: int = 3, module: Any = None, **trainer_kwargs: Any) -> tuple[Any, _Spy, L.Trainer]:
    module = module if module is not None else _module()
    spy = _Spy()
    callbacks = [spy, *trainer_kwargs.pop("callbacks", [])]
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        defaults["enable_checkpointing"] = True
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **{**defaults, **trainer_kwargs})
    trainer.fit(module, train_dataloaders=_batches(min(steps, 3)))  # epochs of at most 3 batches
    return module, spy, trainer


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_strategies_registered_on_import() -> None:
    assert lightning_llmfast.LLMFastStrategy is LLMFastStrategy
    for name, offload in (("llmfast", False), ("llmfast_offload", True)):
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, LLMFastStrategy) and (strategy.offload_config is not None) is offload
    LLMFastStrategy.register_strategies(StrategyRegistry)  # guarded: registering again does not raise


def test_string_strategy_single_device_skips_ddp_and_matches_default() -> None:
    reference, _, _ = _fit("auto")
    module, spy, trainer = _fit("llmfast")
    assert isinstance(trainer.strategy, LLMFastStrategy) and trainer.strategy.single_process
    assert spy.wrapped == [False, False, False]  # no DistributedDataParallel wrapper, so no all-reduce
    assert not torch.distributed.is_initialized()
    assert _same(reference, module)  # same data order and math as a plain single-device run


def test_forced_offload_under_trainer_is_bit_identical_and_released() -> None:
    reference, _, _ = _fit("llmfast")
    strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))
    module, spy, _ = _fit(strategy)
    assert _same(reference, module)
    assert len(spy.stats) == 3
    assert all(s["offloaded_bytes"] > 0 and s["checked_out"] == 0 and s["lazy_reloads"] == 0 for s in spy.stats)
    # teardown released the offloader: hooks gone, pool empty; the last step's stats stay readable
    assert strategy.offloader is None and spy.offloader.stats["pool_bytes"] == 0
    assert strategy.offload_stats is not None
    assert strategy.offload_stats["offloaded_bytes"] == spy.stats[-1]["offloaded_bytes"] > 0
    assert LLMFastStrategy().offload_stats is None
    assert all(not layer._forward_pre_hooks for layer in module.model.layers)


def test_offload_layers_under_trainer_is_bit_identical_and_offloads_only_the_first_n(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference, _, _ = _fit("llmfast")
    runs = {}
    for spec in (None, 1, "auto"):
        if spec == "auto":  # the probe reports a practically infinite bandwidth: every eligible layer hides
            monkeypatch.setattr(_Copier, "bandwidth", lambda self, nbytes, host: 1e30)
        strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0, offload_layers=spec))
        module, spy, _ = _fit(strategy)
        assert _same(reference, module), spec
        assert all(s["checked_out"] == 0 and s["lazy_reloads"] == 0 for s in spy.stats)
        runs[spec] = spy.stats
    # three layers, keep_last_layers=1: None offloads layers 0 and 1, N=1 only layer 0 (same shapes every step)
    assert [s["offload_layers"] for s in runs[None]] == [2, 2, 2]
    assert [s["offload_layers"] for s in runs[1]] == [1, 1, 1]
    assert 0 < runs[1][0]["offloaded_bytes"] < runs[None][0]["offloaded_bytes"]
    # "auto": step 1 measures (nothing moves), then the plan is in effect: layer 0 (layer 1's prefetch would be
    # issued when layer 2 starts its backward, before anything is freed)
    assert [s["offload_layers"] for s in runs["auto"]] == [1, 1, 1]
    assert runs["auto"][0]["offloaded_bytes"] == 0
    assert [s["offloaded_bytes"] for s in runs["auto"][1:]] == [s["offloaded_bytes"] for s in runs[1][1:]]


@pytest.mark.parametrize(
    ("rebuild", "gemm_layers_setting", "gemm_layers"),
    [("norms", None, 0), ("norms+gemms", None, 3), ("norms+gemms", 2, 2)],
)
def test_bf16_mixed_under_trainer_rebuilds_weight_copies_and_is_bit_identical(
    rebuild: str, gemm_layers_setting: int | None, gemm_layers: int
) -> None:
    # Lightning's "bf16-mixed" autocast has no weight cache: the saved bf16 weight copies are rebuilt in backward.
    reference, _, _ = _fit("llmfast", precision="bf16-mixed")
    config = OffloadConfig(
        force=True,
        min_offload_bytes=0,
        rebuild=rebuild,  # type: ignore[arg-type]
        rebuild_gemm_layers=gemm_layers_setting,
    )
    strategy = LLMFastStrategy(offload=config)
    module, spy, _ = _fit(strategy, precision="bf16-mixed")
    assert _same(reference, module)
    # three layers, five weights each (qkv, output, router, gate/up, down), in the kept last layer as well
    assert [(s["recast_casts"], s["kept_casts"]) for s in spy.stats] == [(15, 0)] * 3
    assert all(s["offloaded_bytes"] > 0 and s["checked_out"] == 0 for s in spy.stats)
    # the two norms' bf16 outputs per layer, and with "norms+gemms" the experts' gate/up output (all or first N)
    assert [s["rebuilt_tensors"] for s in spy.stats] == [3 * 3 + gemm_layers] * 3


def test_recompute_under_trainer_is_bit_identical_and_leaves_the_model_as_it_was() -> None:
    reference, _, _ = _fit("llmfast")
    config = OffloadConfig(force=True, min_offload_bytes=0, offload_layers=1, recompute="selective")
    strategy = LLMFastStrategy(offload=config)
    module, spy, _ = _fit(strategy)
    assert _same(reference, module)
    assert [(s["offload_layers"], s["recompute_layers"]) for s in spy.stats] == [(1, 2)] * 3
    assert all("forward" not in layer.__dict__ for layer in module.model.layers)


def test_offload_on_cpu_without_force_warns_and_stays_off() -> None:
    with pytest.warns(UserWarning, match="needs a CUDA device"):
        _, spy, _ = _fit("llmfast_offload", steps=1)
    assert spy.offloader is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"keep_last_layers": -1}, "keep_last_layers"),
        ({"prefetch_layers": -3}, "prefetch_layers"),
        ({"pool_headroom": 0.5}, "pool_headroom"),
        ({"offload_layers": -1}, "offload_layers"),
        ({"offload_layers": "fastest"}, "offload_layers"),
        ({"rebuild_gemm_layers": 2}, "rebuild_gemm_layers"),
        ({"pool_headroom": float("inf")}, "pool_headroom"),
        # bool("no") is True: a string turned the CPU mechanism on
        ({"force": "no"}, "force"),
    ],
)
def test_bad_configuration_raises_at_construction(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(OffloadError, match=field) as info:
        LLMFastStrategy(offload=OffloadConfig(**kwargs))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("offload", ["no", 0, 1, {"force": True}])
def test_offload_that_is_not_a_config_or_bool_raises(offload: Any) -> None:
    # bool("no") is True: a string (or a number, or the settings as a dict) must not switch offload on
    with pytest.raises(OffloadError, match="offload must be an OffloadConfig, a bool or None"):
        LLMFastStrategy(offload=offload)


@pytest.mark.parametrize("removed", ["offload_activations", "force_offload", "min_offload_bytes", "rebuild_gemms"])
def test_removed_offload_keywords_raise_with_the_config_spelling(removed: str) -> None:
    # DDP would take unknown keywords (and on one process never use them): each one is refused by name instead.
    with pytest.raises(OffloadError, match=f"{removed} removed; pass offload=OffloadConfig"):
        LLMFastStrategy(**{removed: True})


@pytest.mark.parametrize("sharding", ["ddp", "fsdp", "hsdp"])
@pytest.mark.parametrize(
    ("keyword", "suggestion"),
    [("find_unused_parameter", "find_unused_parameters"), ("expert_paralel_size", "expert_parallel_size"),
     ("bucket_cap", "bucket_cap_mb"), ("qwertyuiop", None)],
)  # fmt: skip
def test_unknown_keywords_are_refused_at_construction_under_every_sharding(
    sharding: str, keyword: str, suggestion: str | None
) -> None:
    # FSDP2 would drop them in silence, DDP fail only at setup: refused by name, with the closest spelling.
    hint = rf" \(did you mean '{suggestion}'\?\)" if suggestion else ";"
    with pytest.raises(ConfigError, match=rf"unknown keyword\(s\) '{keyword}'{hint}"):
        LLMFastStrategy(sharding=sharding, **{keyword: 1})
    # what DDPStrategy and DistributedDataParallel take passes under every sharding
    strategy = LLMFastStrategy(
        sharding=sharding, find_unused_parameters=True, static_graph=False, process_group_backend="gloo", timeout=None
    )
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}


def test_layers_without_offload_warn_and_offload_true_is_the_defaults() -> None:
    with pytest.warns(UserWarning, match=r"layers= does nothing without offload"):
        LLMFastStrategy(layers=torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LLMFastStrategy().offload_config is None and LLMFastStrategy(offload=False).offload_config is None
        assert LLMFastStrategy(offload=True).offload_config == OffloadConfig()


def test_layers_matching_nothing_raise_at_setup_before_any_step() -> None:
    strategy = LLMFastStrategy(offload=OffloadConfig(force=True), layers="model.blocks")
    spy = _Spy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, callbacks=[spy],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(OffloadError, match="no attribute 'blocks'"):
        trainer.fit(_module(), train_dataloaders=_batches(2))
    assert spy.steps_started == 0


class _FailingModule(MoEGPTLightningModule):
    """Raises inside backward at a chosen global step (through a hook on the loss)."""

    fail_at = 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.fail_at:

            def boom(grad: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("boom in backward")

            loss.register_hook(boom)
        return loss


def test_exception_in_backward_releases_everything_and_next_fit_works() -> None:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_size=64)
    strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))
    spy = _Spy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, callbacks=[spy],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(_FailingModule(config, lr=1e-2), train_dataloaders=_batches(3))
    assert spy.offloader is not None and spy.offloader.stats["checked_out"] == 0
    assert strategy.offloader is None  # torn down after the exception
    # training goes on in the same process (Lightning binds a strategy object to one Trainer, so a fresh one)
    _, spy2, _ = _fit(LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0)), steps=2)
    assert len(spy2.stats) == 2 and spy2.stats[-1]["offloaded_bytes"] > 0


def test_checkpoint_resume_gives_the_same_subsequent_losses(tmp_path: Path) -> None:
    def strategy() -> LLMFastStrategy:
        return LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))

    _, full, _ = _fit(strategy(), steps=6)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _fit(strategy(), steps=3, callbacks=[saver])
    (ckpt,) = tmp_path.glob("*.ckpt")
    spy = _Spy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy(), max_steps=6, logger=False, callbacks=[spy],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_module(), train_dataloaders=_batches(3), ckpt_path=ckpt)  # epoch 2 start
    assert len(spy.losses) == 3 and len(spy.stats) == 3
    assert spy.losses == full.losses[3:]


_DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    import lightning_llmfast
    from lightning_llmfast import LLMFastStrategy, OffloadConfig

    devices, out = int(sys.argv[1]), sys.argv[2]
    GLOBAL_BATCH, STEPS = 8, 4


    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
            self.head = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            for layer in self.layers:
                x = layer(x)
            loss = (self.head(x).squeeze(-1) - y).square().mean()
            self.wrapped = type(self.trainer.strategy.model).__name__
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(STEPS * GLOBAL_BATCH, 16, generator=g), torch.randn(STEPS * GLOBAL_BATCH, generator=g)
            rank, world = self.trainer.global_rank, self.trainer.world_size
            # every global batch of 8 rows is split evenly over the ranks
            rows = [i for i in range(len(x)) if i % world == rank]
            return DataLoader(list(zip(x[rows], y[rows])), batch_size=GLOBAL_BATCH // world)


    model = Toy()
    init = [p.detach().flatten().tolist() for p in model.parameters()]
    strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    if trainer.global_rank == 0:
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(out, "w") as f:
            json.dump({"params": params, "init": init, "world": trainer.world_size, "wrapped": model.wrapped}, f)
    from lightning_llmfast.bench.processes import leave_world

    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
    """
)


def test_two_process_gloo_ddp_matches_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP_SCRIPT)
    results = {}
    for devices in (1, 2):
        out = tmp_path / f"out{devices}.json"
        proc = subprocess.run(
            [sys.executable, str(script), str(devices), str(out)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[devices] = json.loads(out.read_text())
    assert results[1]["world"] == 1 and results[2]["world"] == 2
    assert results[1]["wrapped"] == "Toy" and results[2]["wrapped"] == "DistributedDataParallel"
    for p1, p2, p0 in zip(results[1]["params"], results[2]["params"], results[1]["init"]):
        torch.testing.assert_close(torch.tensor(p2), torch.tensor(p1), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(torch.tensor(p1), torch.tensor(p0))  # training moved them: not vacuous


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (copy streams, pinned memory)")
def test_llmfast_offload_by_string_on_cuda_trains_and_offloads() -> None:
    reference, _, _ = _fit("llmfast", accelerator="cuda")
    module, spy, trainer = _fit("llmfast_offload", accelerator="cuda")
    assert trainer.strategy.offload_config is not None and spy.wrapped == [False, False, False]
    assert len(spy.stats) == 3 and all(s["pinned"] for s in spy.stats)
    # min_offload_bytes=1 MiB default: this tiny model saves nothing that large, so nothing moves but it runs
    assert all(s["lazy_reloads"] == 0 for s in spy.stats)
    for a, b in zip(reference.parameters(), module.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-3)  # 3 AdamW steps: loose
    strategy = LLMFastStrategy(offload=OffloadConfig(min_offload_bytes=0))
    module, spy, _ = _fit(strategy, accelerator="cuda")
    assert all(s["offloaded_bytes"] > 0 and s["lazy_reloads"] == 0 for s in spy.stats)
    for a, b in zip(reference.parameters(), module.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-3)  # 3 AdamW steps: loose


def test_process_group_shutdown_at_exit_is_registered_once_and_is_a_no_op_without_a_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_llmfast.strategy import llmfast as strategy_module

    registered: list[Any] = []
    monkeypatch.setattr(strategy_module.atexit, "register", registered.append)
    unregister = lambda f: registered.remove(f) if f in registered else None  # noqa: E731
    monkeypatch.setattr(strategy_module.atexit, "unregister", unregister)
    for _ in range(3):  # three fits in one process
        strategy_module._destroy_process_group_at_exit()
    assert registered == [strategy_module._destroy_default_process_group]
    assert strategy_module._EXIT_HANDLER_PID == os.getpid()
    assert not torch.distributed.is_initialized()
    strategy_module._destroy_default_process_group()  # nothing to destroy: no error


def test_process_group_shutdown_at_exit_leaves_a_forked_childs_inherited_group_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_llmfast.strategy import llmfast as strategy_module

    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # A child forked from the registering process (another pid) inherits the handler: it must not touch the group.
        monkeypatch.setattr(strategy_module, "_EXIT_HANDLER_PID", os.getpid() + 1)
        strategy_module._destroy_default_process_group()
        assert dist.is_initialized()
        monkeypatch.setattr(strategy_module, "_EXIT_HANDLER_PID", os.getpid())  # the registering process
        strategy_module._destroy_default_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
