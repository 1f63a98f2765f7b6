"""The one parallel layout of a run: data-parallel sharding and expert parallelism on one DeviceMesh.

:class:`ParallelDims` is built once from the world size, ``sharding``, ``expert_parallel_size`` and the number of
nodes; it validates them and builds the only :class:`~torch.distributed.device_mesh.DeviceMesh` of the run
(torchtitan's layout):

- ``("edp", "ep")`` of shape ``(world / N, N)``: the ``N`` ranks of an ``"ep"`` group split the routed experts
  between them, the ranks of an ``"edp"`` group hold the same experts (and, under FSDP, shard them further);
- ``"dp_shard"``: the same ranks flattened, every rank of the world: dense parameters are sharded (FSDP) or
  replicated (DDP) over it, and token-weighted losses count the tokens of all of its ranks.

Under ``sharding="hsdp"`` (sharded within a node, replicated across nodes) the mesh gains a leading
``"dp_replicate"`` dimension, one index per node: ``("dp_replicate", "edp", "ep")`` of shape
``(nodes, ranks_per_node / N, N)``. Dense parameters are sharded over ``"dp_shard"`` (the ranks of one node) and
replicated over ``"dp_replicate"`` (the 2-D mesh :attr:`ParallelDims.dp_mesh`); the experts are sharded over
``"edp"`` inside the node and replicated over ``"dp_replicate"`` (:attr:`ParallelDims.expert_mesh`); losses,
clipping and token counts still span every rank (:attr:`ParallelDims.dp_group`). An expert-parallel group then
never leaves its node.

Rank ``r`` sits at ``(r // N, r % N)`` (under ``"hsdp"``, at ``(r // ranks_per_node, ...)`` first): expert-parallel
groups are blocks of consecutive ranks (one node each when ``N`` divides the GPUs per node), as launchers number
ranks node by node. Sharding, expert dispatch, gradient reduction, clipping, losses and checkpoints all read their
groups from this object.

Example::

    dims = ParallelDims(world_size=8, sharding="fsdp", expert_parallel_size=4)
    dims.edp  # 2
    mesh = dims.build_mesh("cuda")   # after init_process_group
    dims.ep_mesh.get_group()         # the 4 ranks that exchange tokens

    dims = ParallelDims(world_size=16, sharding="hsdp", expert_parallel_size=4, num_nodes=2)
    (dims.dp_replicate, dims.dp_shard)  # (2, 8): each rank holds 1/8 of every parameter
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError

__all__ = ["DP", "DP_REPLICATE", "DP_SHARD", "EDP", "EP", "SHARDINGS", "ParallelDims"]

SHARDINGS: tuple[str, ...] = ("ddp", "fsdp", "hsdp")
"""Values of ``LLMFastStrategy(sharding=...)``: replicated (DDP), sharded over the world (FSDP2), or sharded within a
node and replicated across nodes (HSDP: FSDP2 on a 2-D mesh)."""

DP = "dp"
"""Mesh dimension of every data-parallel rank under ``"hsdp"`` (``"dp_replicate"`` x ``"dp_shard"``, the world)."""
DP_REPLICATE = "dp_replicate"
"""Mesh dimension of the replicas under ``"hsdp"``: one index per node."""
DP_SHARD = "dp_shard"
"""Mesh dimension of the ranks dense parameters are sharded over: the world, or one node's ranks under ``"hsdp"``."""
EP = "ep"
"""Mesh dimension of the ranks that split the routed experts."""
EDP = "edp"
"""Mesh dimension of the ranks that hold the same experts (``dp_shard / ep``)."""


@dataclass
class ParallelDims:
    """Validated sizes of the parallel layout and, after :meth:`build_mesh`, its one device mesh.

    Args:
        world_size: number of ranks, ``>= 1``.
        sharding: ``"ddp"`` (dense parameters replicated), ``"fsdp"`` (sharded with FSDP2 over the world) or
            ``"hsdp"`` (sharded with FSDP2 over the ranks of a node, replicated across nodes).
        expert_parallel_size: ``N``, the ranks that split every MoE block's routed experts; it must divide
            ``world_size`` (under ``"hsdp"``: the ranks of a node).
        num_nodes: the nodes the world spans (Lightning's ``Trainer(num_nodes=...)``), each with
            ``world_size / num_nodes`` consecutive ranks; under ``"hsdp"`` the replicas.

    Raises:
        ConfigError: at construction, for a ``world_size``, ``N`` or ``num_nodes`` that is not an int ``>= 1``, a
            ``sharding`` outside :data:`SHARDINGS`, a world that does not split into ``num_nodes`` equal nodes, or
            ``N`` not dividing ``world_size`` (under ``"hsdp"``: the ranks of a node).

    Example::

        dims = ParallelDims(4, "fsdp", 2)
        (dims.dp_shard, dims.edp, dims.ep)  # (4, 2, 2)
        dims = ParallelDims(4, "hsdp", num_nodes=2)
        (dims.dp_replicate, dims.dp_shard)  # (2, 2)
    """

    world_size: int
    sharding: str = "ddp"
    expert_parallel_size: int = 1
    num_nodes: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_shard_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, low=1)
        check_int("expert_parallel_size", self.expert_parallel_size, low=1)
        check_int("num_nodes", self.num_nodes, low=1)
        if not isinstance(self.sharding, str) or self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.world_size % self.num_nodes:
            raise ConfigError(
                f"the world of {self.world_size} ranks does not split into num_nodes={self.num_nodes} equal nodes"
            )
        if self.world_size % self.expert_parallel_size:
            raise ConfigError(
                f"expert_parallel_size={self.expert_parallel_size} must divide the world size {self.world_size}"
            )
        if self.hsdp and self.dp_shard % self.expert_parallel_size:
            raise ConfigError(
                f"sharding='hsdp' shards within a node: expert_parallel_size={self.expert_parallel_size} must divide "
                f"the {self.dp_shard} ranks of a node (world {self.world_size} / num_nodes {self.num_nodes}), so that "
                "an expert-parallel group stays inside its node"
            )

    @property
    def hsdp(self) -> bool:
        """Whether dense parameters are sharded within a node and replicated across nodes (``"hsdp"``)."""
        return self.sharding == "hsdp"

    @property
    def dp(self) -> int:
        """Data-parallel ranks: all of them (``dp_replicate * dp_shard``)."""
        return self.world_size

    @property
    def dp_replicate(self) -> int:
        """Replicas of every parameter: the nodes under ``"hsdp"``, else ``1`` (DDP's replicas count as shards of
        the data, see :attr:`dp_shard`)."""
        return self.num_nodes if self.hsdp else 1

    @property
    def dp_shard(self) -> int:
        """Ranks of the ``"dp_shard"`` dimension: all of them, or those of one node under ``"hsdp"``."""
        return self.world_size // self.dp_replicate

    @property
    def ep(self) -> int:
        """Expert-parallel ranks per group (``N``)."""
        return self.expert_parallel_size

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: ``world_size / N`` (under ``"hsdp"``, across every node)."""
        return self.world_size // self.expert_parallel_size

    @property
    def ep_enabled(self) -> bool:
        """Whether the experts are split (``N > 1``)."""
        return self.expert_parallel_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether dense parameters are sharded with FSDP2 (``"fsdp"`` or ``"hsdp"``) over several ranks."""
        return self.sharding != "ddp" and self.world_size > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build (once) the ``("edp", "ep")`` mesh over the default process group and its flattened ``"dp_shard"``;
        under ``"hsdp"`` the ``("dp_replicate", "edp", "ep")`` mesh and ``("dp_replicate", "dp_shard")``, both views
        of one world mesh (``"dp"``).

        Args:
            device_type: the device the process group's backend serves (``"cuda"`` for NCCL, ``"cpu"`` for gloo).

        Returns:
            The mesh; later calls return the same object.

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
        if self.hsdp:
            # One world mesh and two views of it (torchtitan's unflatten): the experts' layout and the dense one.
            world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=(DP,))
            shape = (self.dp_replicate, self.dp_shard // self.ep, self.ep)
            mesh = world._unflatten(0, shape, (DP_REPLICATE, EDP, EP))
            self._dp_mesh = world._unflatten(0, (self.dp_replicate, self.dp_shard), (DP_REPLICATE, DP_SHARD))
            self._dp_shard_mesh = self._dp_mesh[DP_SHARD]
            self._world_mesh = world
        else:
            mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=(EDP, EP))
            self._dp_shard_mesh = self._dp_mesh = self._world_mesh = mesh._flatten(DP_SHARD)
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The ``("edp", "ep")`` mesh (:attr:`dp_shard_mesh` is it flattened), ``("dp_replicate", "edp", "ep")``
        under ``"hsdp"``.

        Raises:
            ConfigError: before :meth:`build_mesh`.
        """
        return self._built()[0]

    @property
    def dp_shard_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks dense parameters are sharded over: every rank, or this node's under ``"hsdp"``."""
        return self._built()[1]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh dense parameters are ``fully_shard`` ed over: :attr:`dp_shard_mesh`, or under ``"hsdp"`` the 2-D
        ``("dp_replicate", "dp_shard")`` (FSDP2 then shards over the node, all-reduces over the replicas)."""
        self._built()
        assert self._dp_mesh is not None
        return self._dp_mesh

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

    def _built(self) -> tuple[DeviceMesh, DeviceMesh]:
        if self._mesh is None or self._dp_shard_mesh is None:
            raise ConfigError("ParallelDims.build_mesh() has not been called yet")
        return self._mesh, self._dp_shard_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The group of every data-parallel rank (:attr:`dp` of them: losses, token counts, clipping), or ``None``
        with one rank or before :meth:`build_mesh`."""
        return None if self._world_mesh is None else self._world_mesh.get_group()
