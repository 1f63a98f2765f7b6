"""ParallelDims (the one mesh), NCCL's rules for the strategy's set-up collectives (proven with a spy on
``torch.distributed`` over torch's fake process group), and the bucketed start-up broadcast."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_llmfast import ConfigError, LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.parallel import ParallelDims, broadcast_module_states

COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "reduce_scatter", "gather", "scatter", "reduce",
)  # fmt: skip
ROOT = torch.device("meta")  # stands for the accelerator the process group's backend serves (NCCL: cuda)


@pytest.mark.parametrize(
    ("world", "sharding", "ep", "match"),
    [(0, "fsdp", 1, "world_size"), (4, "zero3", 1, "sharding"), (4, "fsdp", 0, "expert_parallel_size"),
     (6, "fsdp", 4, "must divide the world size 6"), (4, "ddp", True, "expert_parallel_size")],
)  # fmt: skip
def test_parallel_dims_refuse_a_layout_that_does_not_fit(world: int, sharding: str, ep: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelDims(world, sharding, ep)


def test_parallel_dims_sizes_and_no_mesh_before_build() -> None:
    dims = ParallelDims(8, "fsdp", 4)
    assert (dims.dp_shard, dims.edp, dims.ep, dims.ep_enabled, dims.fsdp_enabled) == (8, 2, 4, True, True)
    assert dims.dp_group is None
    with pytest.raises(ConfigError, match="build_mesh"):
        dims.ep_mesh  # noqa: B018


@pytest.fixture
def fake_world() -> Iterator[int]:
    """Rank 0 of 4 on torch's fake backend: collectives return at once, nothing is sent."""
    world = 4
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "RANK": "0", "WORLD_SIZE": str(world)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield world
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        dist.destroy_process_group()


class _Spy:
    """Fails the first collective called while the model is off the root device, and every collective handed a
    tensor of another device (what NCCL refuses); records the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: torch.nn.Module) -> None:
        self.calls: list[tuple[str, set[torch.device]]] = []
        self.module = module
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            if not self.calls:
                off = {p.device for p in self.module.parameters()} - {ROOT}
                assert not off, f"first collective ({name}) with parameters still on {off}, not on {ROOT}"
            devices = {t.device for t in tensors}
            assert devices <= {ROOT}, f"{name} handed tensors on {devices - {ROOT}}; the group serves {ROOT}"
            self.calls.append((name, devices))
            return original(*args, **kwargs)

        return spy


class _RootOnAccelerator(LLMFastStrategy):
    """The strategy with its root device on a non-CPU device, as under NCCL (its mesh stays on the fake backend)."""

    @property
    def root_device(self) -> torch.device:
        return ROOT

    @property
    def mesh_device_type(self) -> str:
        return "cpu"


class _Accelerator(CPUAccelerator):
    """A CPU accelerator that accepts the stand-in root device (no device to set up on the fake backend)."""

    def setup_device(self, device: torch.device) -> None:
        assert device == ROOT


class _SetupDone(Exception):
    pass


class _StopAfterSetup(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise _SetupDone  # set-up done: stop before any step


@pytest.mark.parametrize("ep", [1, 2])
def test_setup_moves_to_the_root_device_before_the_first_collective(
    fake_world: int, monkeypatch: pytest.MonkeyPatch, ep: int
) -> None:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=32, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_size=16)
    module = MoEGPTLightningModule(config)  # built eagerly on the CPU, as a user's module is
    spy = _Spy(monkeypatch, module)
    strategy = _RootOnAccelerator(sharding="fsdp", expert_parallel_size=ep, process_group_backend="fake")
    trainer = L.Trainer(
        accelerator=_Accelerator(), devices=fake_world, strategy=strategy, max_steps=1, logger=False,
        callbacks=[_StopAfterSetup()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(_SetupDone):
        trainer.fit(module, train_dataloaders=[0])
    assert spy.calls
    broadcasts = sum(name == "broadcast" for name, _ in spy.calls)
    tensors = {*module.parameters(), *module.buffers()}
    assert 1 <= broadcasts <= len({t.dtype for t in tensors})  # one bucket per dtype at this size, not one per tensor


def test_broadcast_module_states_buckets_by_dtype_and_size(fake_world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 1)).double()
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    sizes: list[tuple[torch.dtype, int]] = []
    original = dist.broadcast
    monkeypatch.setattr(dist, "broadcast", lambda t, **kw: sizes.append((t.dtype, t.numel())) or original(t, **kw))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # 80,000 bytes of the first weight alone exceed the bucket: it is one bucket, the rest (808 + 8 bytes) another.
    assert broadcast_module_states(model, torch.device("cpu"), bucket_bytes=40_000) == 3
    assert sorted(sizes, key=str) == sorted([(torch.float64, 10_000), (torch.float64, 201), (torch.int64, 3)], key=str)
    for key, value in model.state_dict().items():  # the fake backend sends nothing: the copies back are exact
        assert torch.equal(value, before[key]), key
