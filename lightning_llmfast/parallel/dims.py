"""The one parallel layout of a run: pipeline stages, data parallelism, context and expert parallelism on one mesh.

:class:`ParallelDims` is built once from the world size, ``sharding``, ``expert_parallel_size``,
``context_parallel_size``, ``pipeline_parallel_size`` and the number of nodes; it validates them and builds the only
:class:`~torch.distributed.device_mesh.DeviceMesh` of the run (torchtitan's layout). Ranks are laid out outermost
first as ``pp x dp_replicate x dp_shard x cp``:

- ``"pp"``: pipeline stages (:attr:`ParallelDims.pp`); the ``world / pp`` ranks of one stage (a *stage group*) hold
  the same layers, and every other dimension lives inside a stage;
- ``"dp_replicate"``: under ``sharding="hsdp"`` one index per node of the stage (replicas), else of size 1;
- ``"dp_shard"``: the ranks that read different batches within a replica;
- ``"cp"``: the ranks that split one batch's positions (context parallelism); consecutive ranks, so a cp group stays
  inside a node whenever ``cp`` divides the ranks of a node.

Dense parameters are sharded (FSDP) or replicated (DDP) over ``dp_shard x cp`` (the flattened ``"dp_shard_cp"``;
under ``"hsdp"`` the 2-D ``("dp_replicate", "dp_shard_cp")``): the ranks of a cp group hold the same parameters and
share one batch. The routed experts are split over ``"ep"`` groups drawn from the same ``dp_shard x cp`` ranks
(``("edp", "ep")``: ``ep`` must divide ``dp_shard * cp``), so ``ep=2`` with ``cp=2`` on two ranks is valid. Token-
weighted losses, token counts and router statistics reduce over every rank of a stage (:attr:`ParallelDims.dp_group`,
``dp x cp``); samplers hand one stream of batches to each cp group (:attr:`ParallelDims.dp` streams, this rank's is
:attr:`ParallelDims.data_parallel_rank`); what spans stages (the gradient norm, tied embeddings) adds
:attr:`ParallelDims.pp_group`.

Without ``pp`` and ``cp`` the meshes are today's: ``("edp", "ep")`` of shape ``(world / N, N)`` flattened to
``"dp_shard"``, and under ``"hsdp"`` ``("dp_replicate", "edp", "ep")`` with the dense ``("dp_replicate",
"dp_shard")``.

Example::

    dims = ParallelDims(world_size=8, sharding="fsdp", expert_parallel_size=4)
    dims.edp  # 2
    mesh = dims.build_mesh("cuda")   # after init_process_group
    dims.ep_mesh.get_group()         # the 4 ranks that exchange tokens

    dims = ParallelDims(world_size=16, sharding="hsdp", expert_parallel_size=4, num_nodes=2)
    (dims.dp_replicate, dims.dp_shard)  # (2, 8): each rank holds 1/8 of every parameter

    dims = ParallelDims(8, "fsdp", expert_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2)
    (dims.pp, dims.dp, dims.cp, dims.stage_size)  # (2, 2, 2, 4)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError

__all__ = ["CP", "DP", "DP_REPLICATE", "DP_SHARD", "DP_SHARD_CP", "EDP", "EP", "PP", "SHARDINGS", "ParallelDims"]

SHARDINGS: tuple[str, ...] = ("ddp", "fsdp", "hsdp")
"""Values of ``LLMFastStrategy(sharding=...)``: replicated (DDP), sharded over the world (FSDP2), or sharded within a
node and replicated across nodes (HSDP: FSDP2 on a 2-D mesh)."""

PP = "pp"
"""Mesh dimension of the pipeline stages (outermost: stages may sit on different nodes)."""
DP = "dp"
"""Mesh dimension of every rank of a stage (``"dp_replicate"`` x ``"dp_shard"`` x ``"cp"``)."""
DP_REPLICATE = "dp_replicate"
"""Mesh dimension of the replicas under ``"hsdp"``: one index per node of a stage."""
DP_SHARD = "dp_shard"
"""Mesh dimension of the ranks that read different batches within a replica (and, without ``cp``, the ranks dense
parameters are sharded over)."""
CP = "cp"
"""Mesh dimension of the ranks that split one batch's positions (context parallelism)."""
DP_SHARD_CP = "dp_shard_cp"
"""``"dp_shard"`` x ``"cp"`` flattened, with ``cp > 1``: the ranks dense parameters are sharded over."""
EP = "ep"
"""Mesh dimension of the ranks that split the routed experts."""
EDP = "edp"
"""Mesh dimension of the ranks that hold the same experts (``dp_shard * cp / ep`` per replica)."""


@dataclass
class ParallelDims:
    """Validated sizes of the parallel layout and, after :meth:`build_mesh`, its one device mesh.

    Args:
        world_size: number of ranks, ``>= 1``.
        sharding: ``"ddp"`` (dense parameters replicated), ``"fsdp"`` (sharded with FSDP2 over the ranks of a stage)
            or ``"hsdp"`` (sharded with FSDP2 over the ranks of a node, replicated across the nodes of a stage).
        expert_parallel_size: ``N``, the ranks that split every MoE block's routed experts; it must divide
            ``dp_shard * cp`` (the ranks of a stage; under ``"hsdp"``: of a node).
        num_nodes: the nodes the world spans (Lightning's ``Trainer(num_nodes=...)``), each with
            ``world_size / num_nodes`` consecutive ranks; under ``"hsdp"`` the replicas (per stage).
        context_parallel_size: ranks that split the positions of one batch; it must divide the ranks of a stage
            (under ``"hsdp"``: of a node, so that a cp group never leaves its node).
        pipeline_parallel_size: pipeline stages; it must divide ``world_size`` (under ``"hsdp"``: ``num_nodes``).

    Raises:
        ConfigError: at construction, for a size that is not an int ``>= 1``, a ``sharding`` outside
            :data:`SHARDINGS`, a world that does not split into ``num_nodes`` equal nodes or ``pp`` equal stages, a
            ``cp`` that does not divide a stage (under ``"hsdp"``: a node), or ``N`` not dividing ``dp_shard * cp``.

    Example::

        dims = ParallelDims(4, "fsdp", 2)
        (dims.dp_shard, dims.edp, dims.ep)  # (4, 2, 2)
        dims = ParallelDims(4, "hsdp", num_nodes=2)
        (dims.dp_replicate, dims.dp_shard)  # (2, 2)
        dims = ParallelDims(2, "ddp", expert_parallel_size=2, context_parallel_size=2)
        (dims.dp, dims.cp, dims.ep)  # (1, 2, 2): the two ranks share one batch and split the experts
    """

    world_size: int
    sharding: str = "ddp"
    expert_parallel_size: int = 1
    num_nodes: int = 1
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dense_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_shard_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _stage_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, low=1)
        check_int("expert_parallel_size", self.expert_parallel_size, low=1)
        check_int("num_nodes", self.num_nodes, low=1)
        check_int("context_parallel_size", self.context_parallel_size, low=1)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, low=1)
        if not isinstance(self.sharding, str) or self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.world_size % self.num_nodes:
            raise ConfigError(
                f"the world of {self.world_size} ranks does not split into num_nodes={self.num_nodes} equal nodes"
            )
        if self.world_size % self.pp:
            raise ConfigError(
                f"pipeline_parallel_size={self.pp} must divide the world size {self.world_size}: each stage is "
                "held by world / pp ranks"
            )
        if self.hsdp and self.num_nodes % self.pp:
            raise ConfigError(
                f"sharding='hsdp' replicates across nodes: pipeline_parallel_size={self.pp} must divide "
                f"num_nodes={self.num_nodes}, so that every stage spans whole nodes"
            )
        if self.stage_size % self.cp:
            raise ConfigError(
                f"context_parallel_size={self.cp} must divide the {self.stage_size} ranks of a stage "
                f"(world {self.world_size} / pipeline_parallel_size {self.pp})"
            )
        ranks_per_node = self.world_size // self.num_nodes
        if self.hsdp and ranks_per_node % self.cp:
            raise ConfigError(
                f"sharding='hsdp': context_parallel_size={self.cp} must divide the {ranks_per_node} ranks of a node "
                "(a cp group exchanges keys and values every layer and stays inside its node)"
            )
        if (self.dp_shard * self.cp) % self.ep:
            if self.hsdp:
                where = f"the {self.dp_shard * self.cp} ranks of a node (world {self.world_size} / num_nodes "
                where += f"{self.num_nodes}), so that an expert-parallel group stays inside its node"
            elif self.pp == 1 and self.cp == 1:
                where = f"the world size {self.world_size}"
            else:
                where = f"dp_shard x cp = {self.dp_shard * self.cp} (the ranks of a stage sharing its parameters)"
            raise ConfigError(f"expert_parallel_size={self.ep} must divide {where}")

    @property
    def hsdp(self) -> bool:
        """Whether dense parameters are sharded within a node and replicated across nodes (``"hsdp"``)."""
        return self.sharding == "hsdp"

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return self.pipeline_parallel_size

    @property
    def cp(self) -> int:
        """Ranks that split one batch's positions."""
        return self.context_parallel_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: ``world_size / pp`` (``dp_replicate * dp_shard * cp``)."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel streams of batches: ``world_size / (pp * cp)`` (``dp_replicate * dp_shard``), the
        samplers' ``num_replicas``."""
        return self.stage_size // self.cp

    @property
    def dp_replicate(self) -> int:
        """Replicas of every parameter within a stage: its nodes under ``"hsdp"``, else ``1`` (DDP's replicas count
        as shards of the data, see :attr:`dp_shard`)."""
        return self.num_nodes // self.pp if self.hsdp else 1

    @property
    def dp_shard(self) -> int:
        """Streams of batches within a replica: ``dp / dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def ep(self) -> int:
        """Expert-parallel ranks per group (``N``)."""
        return self.expert_parallel_size

    @property
    def edp(self) -> int:
        """Ranks of a stage holding the same experts: ``stage_size / N`` (under ``"hsdp"``, across its nodes)."""
        return self.stage_size // self.expert_parallel_size

    @property
    def ep_enabled(self) -> bool:
        """Whether the experts are split (``N > 1``)."""
        return self.expert_parallel_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether dense parameters are sharded with FSDP2 (``"fsdp"`` or ``"hsdp"``) over several ranks."""
        return self.sharding != "ddp" and self.stage_size > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits: its index along ``"pp"``, ``"dp_replicate"``, ``"dp_shard"`` and ``"cp"``.

        Example::

            ParallelDims(8, "fsdp", context_parallel_size=2, pipeline_parallel_size=2).coordinates(5)
            # {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 1}
        """
        check_int("rank", rank, low=0)
        if rank >= self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size}")
        pp, local = divmod(rank, self.stage_size)
        replica, local = divmod(local, self.dp_shard * self.cp)
        shard, cp = divmod(local, self.cp)
        return {PP: pp, DP_REPLICATE: replica, DP_SHARD: shard, CP: cp}

    def data_parallel_rank(self, rank: int) -> int:
        """The stream of batches global ``rank`` reads, in ``[0, dp)``: the samplers' ``rank`` (the ranks of a cp
        group, and the stages of a pipeline, read the same stream)."""
        at = self.coordinates(rank)
        return at[DP_REPLICATE] * self.dp_shard + at[DP_SHARD]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build (once) the meshes over the default process group: one world mesh and its views, the experts'
        ``(["pp"], ["dp_replicate"], "edp", "ep")`` (returned), the dense ``("pp", "dp_replicate", "dp_shard",
        "cp")`` and the stage's ``("pp", "dp")``; a dimension of size one is left out of the experts' view and of
        the parameters' meshes, so that without ``pp``/``cp`` they are today's.

        Args:
            device_type: the device the process group's backend serves (``"cuda"`` for NCCL, ``"cpu"`` for gloo).

        Returns:
            The experts' mesh; later calls return the same object.

        Raises:
            ConfigError: no initialised process group, or one of another size than ``world_size``.

        Example::

            mesh = dims.build_mesh("cpu")
            dims.dp_shard_mesh.size() == dims.world_size
        """
        if self._mesh is not None:
            return self._mesh
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("the parallel layout needs an initialised torch.distributed process group")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"the process group has {dist.get_world_size()} ranks, the layout was built for {self.world_size}"
            )
        # One world mesh and views of it (torchtitan's unflatten): experts, dense parameters, the stage.
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        pp = ((PP, self.pp),) if self.pp > 1 else ()
        rep = ((DP_REPLICATE, self.dp_replicate),) if self.hsdp else ()
        experts = (*pp, *rep, (EDP, self.dp_shard * self.cp // self.ep), (EP, self.ep))
        self._mesh = _view(world, experts)
        self._dense_mesh = _view(
            world, ((PP, self.pp), (DP_REPLICATE, self.dp_replicate), (DP_SHARD, self.dp_shard), (CP, self.cp))
        )
        shard = DP_SHARD_CP if self.cp > 1 else DP_SHARD
        params = _view(world, (*pp, *rep, (shard, self.dp_shard * self.cp)))
        self._dp_mesh = params[DP_REPLICATE, shard] if self.hsdp else params[shard]
        self._dp_shard_mesh = params[shard]
        self._stage_mesh = _view(world, ((PP, self.pp), (DP, self.stage_size)))
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The experts' mesh: ``("edp", "ep")`` (:attr:`dp_shard_mesh` is it flattened), ``("dp_replicate", "edp",
        "ep")`` under ``"hsdp"``, with a leading ``"pp"`` under pipeline parallelism.

        Raises:
            ConfigError: before :meth:`build_mesh`.
        """
        return self._built(self._mesh)

    @property
    def dp_shard_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks dense parameters are sharded over: ``dp_shard x cp`` of this stage (``"dp_shard"``,
        or ``"dp_shard_cp"`` with ``cp > 1``)."""
        return self._built(self._dp_shard_mesh)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh dense parameters are ``fully_shard`` ed over: :attr:`dp_shard_mesh`, or under ``"hsdp"`` the 2-D
        ``("dp_replicate", "dp_shard[_cp]")`` (FSDP2 then shards over the node, all-reduces over the replicas)."""
        return self._built(self._dp_mesh)

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The mesh the experts are ``fully_shard`` ed over: :attr:`edp_mesh`, or under ``"hsdp"`` the 2-D
        ``("dp_replicate", "edp")`` (sharded inside the node, replicated across nodes)."""
        mesh = self.mesh
        return mesh[DP_REPLICATE, EDP] if self.hsdp else mesh[EDP]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's expert-parallel group."""
        return self.mesh[EP]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that hold this rank's experts (under ``"hsdp"``: those of its node)."""
        return self.mesh[EDP]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's context-parallel group (the ranks sharing its batch)."""
        return self._built(self._dense_mesh)[CP]

    @property
    def pp_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's pipeline: one rank of every stage."""
        return self._built(self._dense_mesh)[PP]

    @property
    def stage_mesh(self) -> DeviceMesh:
        """1-D mesh of every rank of this rank's stage (``dp x cp``)."""
        return self._built(self._stage_mesh)[DP]

    def _built(self, mesh: DeviceMesh | None) -> DeviceMesh:
        if mesh is None:
            raise ConfigError("ParallelDims.build_mesh() has not been called yet")
        return mesh

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The group of every rank of this rank's stage (``dp x cp`` of them: token-weighted losses, token counts,
        router statistics), or ``None`` with one rank or before :meth:`build_mesh`."""
        return None if self._stage_mesh is None or self.world_size == 1 else self.stage_mesh.get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's context-parallel group, or ``None`` without context parallelism or before :meth:`build_mesh`."""
        return None if self._dense_mesh is None or self.cp == 1 else self.cp_mesh.get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline (one rank per stage), or ``None`` without stages or before :meth:`build_mesh`."""
        return None if self._dense_mesh is None or self.pp == 1 else self.pp_mesh.get_group()


def _view(world: DeviceMesh, dims: tuple[tuple[str, int], ...]) -> DeviceMesh:
    """``world`` (1-D) unflattened into the named ``dims`` (sizes multiplying to the world)."""
    names, sizes = zip(*dims, strict=True)
    return world._unflatten(0, tuple(sizes), tuple(names))
