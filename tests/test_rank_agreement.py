"""Every expert-parallel rank enters the same collectives whatever its local sizes: a size disagreement planted on one
rank after a steady step makes every rank raise ``RoutingError`` (2 gloo processes, a timeout on every collective and
on the join), and the capacity dispatcher's collectives per step are counted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast.errors import RoutingError
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.moe import MoEBlock, MoEConfig

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
