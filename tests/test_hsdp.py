"""sharding="hsdp": sharded within a node, replicated across nodes, on the one DeviceMesh (with expert parallelism).

The layout checks run on torch's fake process group, also through Lightning: ``Trainer(num_nodes=2, devices=2)``
gives the strategy its nodes, and an expert-parallel group that would span nodes fails before any step. The proof
runs 4 gloo processes as 2 nodes x 2 processes against an independent reference, torch's ``DistributedDataParallel``
on the same 4 processes and the same per-rank batches: HSDP (and HSDP x EP over 2) gives the DDP losses and gradients
(first step to 1e-5), the global gradient norm of ``clip_grad_norm_`` on the DDP model with clipping active, and close
weights after the steps; every rank holds half of every parameter (2 processes per node), equal to its replica on the
other node. Its DCP checkpoint resumes bitwise under HSDP, continues under FSDP2 over the 4 processes, and loads into
one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_llmfast import ConfigError, LLMFastStrategy, MoEGPTLightningModule
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.parallel import (
    ParallelDims,
    clip_grad_norm,
    load_distributed_checkpoint,
    parallelize,
    save_distributed_checkpoint,
)
from lightning_llmfast.parallel.checkpoint import model_state, optimizer_state
from lightning_llmfast.parallel.clip import sharded_grads

NODES, PER_NODE, ROWS, SEQ, VOCAB, STEPS, CLIP = 2, 2, 4, 8, 64, 4, 0.05
WORLD = NODES * PER_NODE


@pytest.mark.parametrize(
    ("world", "ep", "nodes", "match"),
    [(4, 1, 3, "does not split into num_nodes=3"), (8, 4, 4, "must divide the 2 ranks of a node"),
     (4, 1, 0, "num_nodes")],
)  # fmt: skip
def test_hsdp_refuses_a_world_that_does_not_split_into_nodes_or_an_ep_group_across_nodes(
    world: int, ep: int, nodes: int, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelDims(world, "hsdp", ep, num_nodes=nodes)
    with pytest.raises(ConfigError, match="sharding must be one of \\('ddp', 'fsdp', 'hsdp'\\)"):
        LLMFastStrategy(sharding="HSDP")
    assert LLMFastStrategy(sharding="hsdp", expert_parallel_size=2).sharding == "hsdp"


def test_hsdp_sizes() -> None:
    dims = ParallelDims(16, "hsdp", 4, num_nodes=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.ep, dims.edp) == (16, 2, 8, 4, 4)
    assert dims.fsdp_enabled and dims.hsdp
    fsdp = ParallelDims(16, "fsdp", 4, num_nodes=2)  # the nodes change nothing without "hsdp"
    assert (fsdp.dp, fsdp.dp_replicate, fsdp.dp_shard, fsdp.edp) == (16, 1, 16, 4)


@pytest.fixture
def fake_rank() -> Iterator[int]:
    """Rank 5 of 8 on torch's fake backend (no communication)."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield 5
    finally:
        dist.destroy_process_group()


def test_hsdp_mesh_replicates_over_nodes_and_shards_within_with_ep_inside_the_node(fake_rank: int) -> None:
    dims = ParallelDims(8, "hsdp", 2, num_nodes=2)  # nodes of ranks 0-3 and 4-7
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "edp", "ep") and tuple(mesh.shape) == (2, 2, 2)
    assert dims.dp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert dims.dp_mesh.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.dp_shard_mesh.mesh.tolist() == [4, 5, 6, 7]  # rank 5's node
    assert dims.ep_mesh.mesh.tolist() == [4, 5]  # its expert-parallel group, inside the node
    assert dims.edp_mesh.mesh.tolist() == [5, 7]  # the ranks of its node holding its experts
    assert dims.expert_mesh.mesh_dim_names == ("dp_replicate", "edp")
    assert dims.expert_mesh.mesh.tolist() == [[1, 3], [5, 7]]  # ... and their replicas on the other node
    assert dims.dp_group is not None and dist.get_world_size(dims.dp_group) == 8  # losses and norms: every rank


@pytest.fixture
def fake_node() -> Iterator[int]:
    """Rank 0 of 4 on torch's fake backend (its broadcasts deliver nothing: Lightning's come from rank 0), as
    Lightning sees it on the first of 2 nodes of 2 processes."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = "1"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield 0
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        dist.destroy_process_group()


class _SetupDone(Exception):
    pass


class _StopAfterSetup(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise _SetupDone  # set-up done: stop before any step


@pytest.mark.parametrize("ep", [1, 4])
def test_the_strategy_takes_the_nodes_from_the_trainer_and_refuses_ep_across_nodes(fake_node: int, ep: int) -> None:
    config = MoEGPTConfig(vocab_size=32, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_size=16)
    module = MoEGPTLightningModule(config)
    strategy = LLMFastStrategy(sharding="hsdp", expert_parallel_size=ep, process_group_backend="fake")
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=2, devices=2, strategy=strategy, max_steps=1, logger=False,
        callbacks=[_StopAfterSetup()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    if ep == 4:  # 4 ranks split the experts, 2 per node: an expert-parallel group would span both nodes
        with pytest.raises(ConfigError, match="expert_parallel_size=4 must divide the 2 ranks of a node"):
            trainer.fit(module, train_dataloaders=[0])
        return
    with pytest.raises(_SetupDone):
        trainer.fit(module, train_dataloaders=[0])
    dims = strategy.parallel_dims
    assert strategy.global_rank == fake_node and dims is not None
    assert (dims.num_nodes, dims.dp_replicate, dims.dp_shard) == (2, 2, 2)
    assert dims.dp_mesh.mesh.tolist() == [[0, 1], [2, 3]] and dims.dp_shard_mesh.mesh.tolist() == [0, 1]
    weight = module.model.layers[0].attn.qkv.weight
    assert isinstance(weight, DTensor) and weight.device_mesh == dims.dp_mesh
    assert weight.placements == (Replicate(), Shard(0)) and weight.to_local().numel() * 2 == weight.numel()


# ---------------------------------------------------------------------------------------------- 2 nodes x 2 processes


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=16, num_experts=4,
        router_backend="torch",
    )  # fmt: skip
    return nn.ModuleDict({"model": MoEGPT(config)})


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


class _Forward(nn.Module):
    """The reference model as one module whose ``forward`` DDP wraps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model["model"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _mine(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids[rank * ROWS // WORLD : (rank + 1) * ROWS // WORLD]


def _sharded(sharding: str, ep: int, seed: int = 0) -> tuple[nn.Module, ParallelDims]:
    model = _model(seed)
    dims = ParallelDims(WORLD, sharding, ep, num_nodes=NODES)
    dims.build_mesh("cpu")
    parallelize(model, dims, list(model["model"].layers), device=torch.device("cpu"))
    return model, dims


def _step(model: nn.Module, dims: ParallelDims, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    _loss(model["model"](_mine(ids)), _mine(ids)).backward()
    norm = clip_grad_norm(sharded_grads(list(model.parameters()), set(), dims.edp), CLIP, dims.dp_group)
    optimizer.step()
    optimizer.zero_grad()
    return norm


def _check_shares(model: nn.Module) -> None:
    """Every parameter is a DTensor replicated over the nodes and sharded within (the routed experts over "ep" and
    "edp"): this rank holds half of the model, the same half as its replica on the other node, another half than its
    node's other rank."""
    held = full = 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        names = p.device_mesh.mesh_dim_names
        assert names is not None and names[:2] in {("dp_replicate", "dp_shard"), ("dp_replicate", "edp")}, names
        first, *rest = p.placements  # the rest: Shard, or FSDP2's _StridedShard over "edp" of an EP-sharded expert
        assert first.is_replicate() and all(not x.is_replicate() for x in rest), (name, p.placements)
        held += p.to_local().numel()
        full += p.numel()
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(WORLD)]
    dist.all_gather(sizes, torch.tensor(local.numel()))
    assert len({int(s) for s in sizes}) == 1
    shards = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(shards, local)
    rank = dist.get_rank()
    replica, neighbour = (rank + PER_NODE) % WORLD, rank ^ 1
    assert torch.equal(shards[replica], local)
    assert not torch.equal(shards[neighbour], local)
    assert held * PER_NODE == full, (held, full)


def _equals_ddp(rank: int, ep: int, root: str) -> None:
    """HSDP (x EP) against DDP over the same processes, same batches; rank 0 saves the per-step losses."""
    model, dims = _sharded("hsdp", ep)
    ddp = DistributedDataParallel(_Forward(_model()))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ddp)]
    losses = []
    for step, ids in enumerate(_batches()):
        loss = _loss(model["model"](_mine(ids)), _mine(ids))
        loss.backward()
        ref_loss = _loss(ddp(_mine(ids)), _mine(ids))
        ref_loss.backward()
        losses.append((loss.item(), ref_loss.item()))
        tol = 1e-5 if step == 0 else 1e-4
        assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item()), (step, loss, ref_loss)
        if step == 0:
            for (name, p), ref in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
                assert _rel(_full(p.grad), ref.grad) < 1e-5, name
        ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        norm = clip_grad_norm(sharded_grads(list(model.parameters()), set(), dims.edp), CLIP, dims.dp_group)
        assert ref_norm > CLIP and _rel(norm, ref_norm) < tol, (step, norm, ref_norm)
        for (name, p), ref in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
            assert _rel(_full(p.grad), ref.grad) < tol, (step, name)  # clipped alike
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        assert _rel(_full(p.detach()), ref.detach()) < 1e-4, name
    _check_shares(model)
    if rank == 0:
        torch.save(torch.tensor(losses), f"{root}/losses-ep{ep}.pt")


def _checkpoint(rank: int, root: str) -> None:
    """Save an HSDP run half-way; another seed's HSDP model resumes it bitwise, FSDP2 over the 4 ranks continues
    it with the same norms; rank 0 keeps the half-way full weights for the one-process load."""
    half = STEPS // 2
    model, dims = _sharded("hsdp", 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step, ids in enumerate(_batches()):
        if step == half:
            state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)]}
            save_distributed_checkpoint({**state, "global_step": half}, f"{root}/half", rank=rank)
            full = {k: _full(v).clone() for k, v in model.state_dict().items()}
        norms.append(_step(model, dims, optimizer, ids))
    for sharding, seed in (("hsdp", 1), ("fsdp", 2)):
        resumed, resumed_dims = _sharded(sharding, 1, seed=seed)
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        assert load_distributed_checkpoint(f"{root}/half", resumed, [resumed_optimizer])["global_step"] == half
        resumed_norms = [_step(resumed, resumed_dims, resumed_optimizer, ids) for ids in _batches()[half:]]
        if sharding == "hsdp":
            assert all(torch.equal(a, b) for a, b in zip(resumed_norms, norms[half:], strict=True))
            for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
                assert torch.equal(p.to_local(), q.to_local()), name
        else:
            assert _rel(torch.stack(resumed_norms), torch.stack(norms[half:])) < 1e-5
    if rank == 0:
        torch.save(full, f"{root}/half.pt")


def _all(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    for ep in (1, 2):
        _equals_ddp(rank, ep, root)
    _checkpoint(rank, root)


@pytest.mark.slow
def test_hsdp_on_two_nodes_of_two_equals_ddp_holds_half_and_its_checkpoint_resumes_anywhere(tmp_path: Path) -> None:
    run_distributed(_all, WORLD, str(tmp_path), timeout=400)
    for ep in (1, 2):
        losses = torch.load(tmp_path / f"losses-ep{ep}.pt", weights_only=True)
        assert losses.shape == (STEPS, 2) and (losses[0, 0] - losses[0, 1]).abs() <= 1e-5
    single = _model(seed=3)  # one process, no process group: reads every shard
    optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2)
    load_distributed_checkpoint(tmp_path / "half", single, [optimizer])
    full: dict[str, Any] = torch.load(tmp_path / "half.pt", weights_only=True)
    for name, value in single.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert optimizer.state  # AdamW's moments came with it
