"""``ActivationOffload`` under Lightning's strategies: bit-identical gradients with and without offload (one process,
and 2 gloo processes under DDPStrategy, FSDPStrategy, ModelParallelStrategy and ``LLMFastStrategy(sharding="fsdp")``
with its own offload); under FSDP2 the unsharded parameters are never offloaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_llmfast.callbacks import ActivationOffload
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload import OffloadConfig

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
    from lightning_llmfast import LLMFastStrategy
    from lightning_llmfast.callbacks import ActivationOffload
    from lightning_llmfast.offload import ActivationOffloader, CpuCopier, OffloadConfig

    kind, offload, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    config = OffloadConfig(force=True, min_offload_bytes=0, keep_last_layers=0)
    STEPS = 3
    sources, unsharded, overlap = set(), set(), []


    class Recording(CpuCopier):
        def copy(self, pairs, to_host, after=()):
            if to_host:  # at the end of a layer call: its unsharded parameters were alive throughout it
                ptrs = {src.untyped_storage().data_ptr() for _, src in pairs}
                sources.update(ptrs)
                overlap.extend(ptrs & unsharded)
            return super().copy(pairs, to_host, after)


    ActivationOffloader._make_copier = staticmethod(Recording)


    def _record_unsharded(layer):
        unsharded.clear()
        unsharded.update(p.untyped_storage().data_ptr() for p in layer.parameters() if type(p) is nn.Parameter)


    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            block = lambda: nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12))  # noqa: E731
            self.layers = nn.ModuleList(block() for _ in range(3))
            self.head = nn.Linear(12, 1)
            self.grads = []

        def configure_model(self):
            if kind != "model_parallel":
                return
            from torch.distributed.fsdp import fully_shard
            for layer in self.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                # after FSDP2's own pre-forward hook: the parameters the layer runs with (unsharded)
                layer.register_forward_pre_hook(lambda m, a: _record_unsharded(m))
            fully_shard(self.head, mesh=self.device_mesh["data_parallel"])  # training_step calls no root forward

        def training_step(self, batch, batch_idx):
            x, y = batch
            for layer in self.layers:
                x = x + layer(x)
            return (self.head(x).squeeze(-1) - y).square().mean()

        def on_after_backward(self):
            local = [getattr(p.grad, "_local_tensor", p.grad) for p in self.parameters()]
            self.grads.append([g.detach().flatten().tolist() for g in local])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1 + self.trainer.global_rank)
            data = list(zip(torch.randn(STEPS * 4, 12, generator=g), torch.randn(STEPS * 4, generator=g)))
            return DataLoader(data, batch_size=4)


    timeout = timedelta(seconds=60)
    strategy = {
        "single": lambda: SingleDeviceStrategy(device="cpu"),
        "ddp": lambda: DDPStrategy(process_group_backend="gloo", timeout=timeout),
        "fsdp": lambda: FSDPStrategy(process_group_backend="gloo", timeout=timeout),
        "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout),
        # ours: the strategy shards with FSDP2 and drives the same offload machinery itself
        "llmfast_fsdp": lambda: LLMFastStrategy(
            sharding="fsdp", layers="layers", process_group_backend="gloo", timeout=timeout,
            offload=config if offload else None,
        ),
    }[kind]()
    callback = ActivationOffload(config, layers="layers")
    use_callback = offload and kind != "llmfast_fsdp"
    model = Toy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if kind == "single" else 2, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback] if use_callback else [],
    )
    trainer.fit(model)
    with open(f"{out}.{trainer.global_rank}", "w") as f:
        json.dump({
            "grads": model.grads, "sources": len(sources),
            "stats": trainer.strategy.offload_stats if kind == "llmfast_fsdp" else callback.stats,
            "overlap": len(overlap), "unsharded": len(unsharded),
        }, f)
    from lightning_llmfast.bench.processes import leave_world

    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
    """
)


def _run(tmp_path: Path, kind: str, offload: bool) -> list[dict]:
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    out = tmp_path / f"{kind}{int(offload)}.json"
    proc = subprocess.run(
        [sys.executable, str(script), kind, str(int(offload)), str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"{out.name}.*"))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "single",
        "ddp",
        pytest.param("fsdp", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDPStrategy needs CUDA")),
        "model_parallel",
        "llmfast_fsdp",
    ],
)
def test_gradients_bit_identical_with_and_without_the_callback(tmp_path: Path, kind: str) -> None:
    ranks = 1 if kind == "single" else 2
    plain, offloaded = _run(tmp_path, kind, False), _run(tmp_path, kind, True)
    assert len(plain) == len(offloaded) == ranks
    for ref, got in zip(plain, offloaded):
        assert len(got["grads"]) == 3 and got["grads"] == ref["grads"]  # every step, every rank: the same bits
        assert got["stats"]["offloaded_bytes"] > 0 and got["stats"]["checked_out"] == 0
        assert got["sources"] > 0
        if kind == "model_parallel":
            assert got["unsharded"] > 0 and got["overlap"] == 0  # FSDP2's unsharded parameters stay on the device


def test_callback_validates_its_settings_at_construction() -> None:
    with pytest.raises(OffloadError, match="offload_layers"):
        ActivationOffload(OffloadConfig(offload_layers=-1))
    with pytest.raises(OffloadError, match="config must be an OffloadConfig"):
        ActivationOffload({"force": True})  # type: ignore[arg-type]
    with pytest.raises(OffloadError, match="rebuild must be one of"):
        ActivationOffload(OffloadConfig(rebuild="gemms"))  # type: ignore[arg-type]
    config = OffloadConfig(rebuild="norms+gemms", rebuild_gemm_layers=2)
    assert ActivationOffload(config).config is config
