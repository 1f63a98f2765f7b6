"""The one mesh with context and pipeline parallelism: ``pp x dp_replicate x dp_shard x cp``, expert groups drawn
from ``dp_shard x cp``, every group checked on torch's fake backend against the layout computed by hand."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.parallel import ParallelDims


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    assert group is not None
    return dist.get_process_group_ranks(group)


def _reference(world: int, pp: int, rep: int, shard: int, cp: int) -> dict[tuple[int, int, int, int], int]:
    """Global rank of every (pp, dp_replicate, dp_shard, cp) coordinate, outermost first (a loop, not a formula)."""
    coords = itertools.product(range(pp), range(rep), range(shard), range(cp))
    table = {c: r for r, c in enumerate(coords)}
    assert len(table) == world
    return table


LAYOUTS = [
    # world, sharding, ep, nodes, cp, pp
    (8, "fsdp", 2, 1, 2, 2),
    (8, "ddp", 4, 1, 2, 1),
    (8, "hsdp", 2, 4, 2, 2),
    (12, "fsdp", 3, 1, 3, 2),
    (2, "ddp", 2, 1, 2, 1),
    (6, "fsdp", 1, 1, 1, 3),
]


@pytest.mark.parametrize(("world", "sharding", "ep", "nodes", "cp", "pp"), LAYOUTS)
def test_every_group_is_the_hand_computed_layout(world: int, sharding: str, ep: int, nodes: int, cp: int, pp: int):
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = ParallelDims(
                world, sharding, ep, num_nodes=nodes, context_parallel_size=cp, pipeline_parallel_size=pp
            )
            dims.build_mesh("cpu")
            rep = nodes // pp if sharding == "hsdp" else 1
            shard = world // (pp * cp * rep)
            table = _reference(world, pp, rep, shard, cp)
            (me,) = [c for c, r in table.items() if r == rank]
            assert dims.coordinates(rank) == dict(zip(("pp", "dp_replicate", "dp_shard", "cp"), me, strict=True))
            assert dims.data_parallel_rank(rank) == me[1] * shard + me[2]
            assert dims.dp == rep * shard and dims.stage_size == world // pp
            p, a, b, c = me
            cp_ranks = [table[p, a, b, i] for i in range(cp)]
            stage = sorted(r for k, r in table.items() if k[0] == p)
            pipe = [table[i, a, b, c] for i in range(pp)]
            assert dims.cp_mesh.mesh.tolist() == cp_ranks
            assert dims.pp_mesh.mesh.tolist() == pipe
            assert (dims.cp_group is None) == (cp == 1) and (cp == 1 or _ranks(dims.cp_group) == cp_ranks)
            assert (dims.pp_group is None) == (pp == 1) and (pp == 1 or _ranks(dims.pp_group) == pipe)
            assert _ranks(dims.dp_group) == stage
            # Dense parameters: over dp_shard x cp of this replica (and the replicas under hsdp); no other stage.
            replica = sorted(r for k, r in table.items() if k[:2] == (p, a))
            assert dims.dp_shard_mesh.mesh.tolist() == replica
            if sharding == "hsdp":
                assert dims.dp_mesh.mesh.tolist() == [
                    sorted(r for k, r in table.items() if k[:2] == (p, i)) for i in range(rep)
                ]
            # Experts: consecutive blocks of ep ranks inside the replica, holders strided by ep.
            at = replica.index(rank)
            assert dims.ep_mesh.mesh.tolist() == replica[at - at % ep : at - at % ep + ep]
            assert dims.edp_mesh.mesh.tolist() == replica[at % ep :: ep]
            assert set(dims.ep_mesh.mesh.tolist()) <= set(stage)
        finally:
            dist.destroy_process_group()


def test_without_pp_and_cp_the_meshes_keep_their_names() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        dims = ParallelDims(4, "fsdp", 2)
        assert dims.build_mesh("cpu").mesh_dim_names == ("edp", "ep")
        assert dims.dp_mesh.mesh_dim_names == ("dp_shard",)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "pipeline_parallel_size": 4}, "pipeline_parallel_size=4 must divide the world size 6"),
        ({"world_size": 8, "pipeline_parallel_size": 2, "context_parallel_size": 3}, "context_parallel_size=3"),
        ({"world_size": 8, "sharding": "hsdp", "num_nodes": 4, "context_parallel_size": 4}, "ranks of a node"),
        ({"world_size": 8, "sharding": "hsdp", "num_nodes": 2, "pipeline_parallel_size": 4}, "num_nodes=2"),
        ({"world_size": 4, "context_parallel_size": 2, "expert_parallel_size": 8}, "dp_shard x cp = 4"),
        ({"world_size": 4, "context_parallel_size": 0}, "context_parallel_size"),
    ],
)
def test_bad_layouts_are_refused_naming_the_size(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelDims(**kwargs)


def test_ep_is_drawn_from_dp_shard_times_cp() -> None:
    dims = ParallelDims(2, "ddp", expert_parallel_size=2, context_parallel_size=2)
    assert (dims.dp, dims.cp, dims.ep, dims.edp) == (1, 2, 2, 1)
