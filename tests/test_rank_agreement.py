"""Every expert-parallel rank enters the same collectives whatever its local sizes: a size disagreement planted on one
rank after a steady step makes every rank raise ``RoutingError`` (2 gloo processes, a timeout on every collective and
on the join), and the capacity dispatcher's collectives per step are counted; the strategy creates its process
groups once, however many fits and validates it runs, and refuses hierarchical dispatch on one node."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.data import pack_documents
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.parallel import ParallelDims

HIDDEN, TOKENS = 8, 7
_COLLECTIVES = ("all_gather_single", "all_to_all_single", "all_reduce", "all_gather", "broadcast")


@contextmanager
def _collectives() -> Iterator[Counter[str]]:
    """Calls of the torch.distributed collectives the dispatchers use, by name, while the context is open."""
    calls: Counter[str] = Counter()
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, spy(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _step(block: MoEBlock, tokens: int, seed: int) -> None:
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    block(x).square().mean().add(block.stats.aux_loss).backward()


def _capacity_block(world: int) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2, backend="torch", capacity_factor=1.0))
    return shard_experts(block, dist.group.WORLD)


def _planted(rank: int, world: int) -> None:
    block = _capacity_block(world)
    _step(block, TOKENS, rank)  # the sizes agree: checked, and cached
    # One step: one all-gather of sizes and loss counts, two exchanges each way; the loss all-reduces nothing more.
    with _collectives() as calls:
        _step(block, TOKENS, 10 + rank)
    assert calls == {"all_gather_single": 1, "all_to_all_single": 4}, calls
    assert block.dispatcher.host_syncs == 2
    # Rank 1 alone changes its number of tokens (another capacity), then its dtype: every rank raises, none hangs.
    with pytest.raises(RoutingError, match="disagree"):
        _step(block, TOKENS + (rank == 1), 20 + rank)
    with pytest.raises(RoutingError, match="disagree"), torch.autocast("cpu", torch.bfloat16, enabled=rank == 1):
        _step(block, TOKENS, 30 + rank)
    # The ranks are still in step: agreeing sizes (new ones on every rank) run again.
    _step(block, TOKENS + 2, 40 + rank)
    dropless = MoEBlock(MoEConfig.build(HIDDEN, 16, 2 * world, 2, backend="torch"))
    shard_experts(dropless, dist.group.WORLD)
    _step(dropless, TOKENS, rank)
    with pytest.raises(RoutingError, match="disagree"), torch.autocast("cpu", torch.bfloat16, enabled=rank == 1):
        _step(dropless, TOKENS, 50 + rank)


def test_planted_size_disagreement_raises_on_every_rank() -> None:
    run_distributed(_planted, 2, timeout=90)


def _trainer(strategy: LLMFastStrategy, nodes: int, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2 // nodes, num_nodes=nodes, strategy=strategy, max_steps=steps,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def _groups() -> int:
    """Process groups this rank belongs to (the default one included)."""
    return len(dist.distributed_c10d._world.pg_map)


def _setups(rank: int, world: int) -> None:
    # Lightning joins the process group run_distributed created (LightningEnvironment reads these).
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16, num_experts=4,
        router_backend="torch",
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    data = DataLoader([next(pack_documents([torch.randint(0, 64, (8,), generator=g)], 8, 1))], batch_size=None)
    # Two nodes of one process: hierarchical dispatch; then FSDP2 x EP on one node. A fit, two validates and a second
    # fit of the same module on the same strategy: every process group exists after the first fit already.
    for sharding, dispatch, nodes in (("ddp", "hierarchical", 2), ("fsdp", "flat", 1)):
        os.environ.update(LOCAL_RANK=str(rank % (2 // nodes)), NODE_RANK=str(rank // (2 // nodes)))
        module = MoEGPTLightningModule(config, lr=1e-2, warmup_steps=1)
        strategy = LLMFastStrategy(sharding=sharding, expert_parallel_size=2, ep_dispatch=dispatch,
                                   process_group_backend="gloo")  # fmt: skip
        _trainer(strategy, nodes, 1).fit(module, data, data)
        groups, mesh = _groups(), strategy.device_mesh
        trainer = module.trainer
        trainer.validate(module, data)
        trainer.validate(module, data)
        trainer.fit_loop.epoch_loop.max_steps = 2  # one more step
        trainer.fit(module, data, data)
        assert _groups() == groups and strategy.device_mesh is mesh, (sharding, _groups(), groups)
    # Hierarchical dispatch on one node (nothing crosses a node boundary) is refused on every rank, before any group.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    groups = _groups()
    ParallelDims(world, "ddp", 2).build_mesh("cpu")
    per_mesh = _groups() - groups  # the groups one mesh of this layout holds
    strategy = LLMFastStrategy(expert_parallel_size=2, ep_dispatch="hierarchical", process_group_backend="gloo")
    groups = _groups()
    with pytest.raises(ConfigError, match="spans several nodes"):
        _trainer(strategy, 1, 1).fit(MoEGPTLightningModule(config), data)
    assert _groups() == groups + per_mesh  # the new strategy's mesh only


def test_repeated_fit_and_validate_create_no_process_groups() -> None:
    run_distributed(_setups, 2, timeout=300)
