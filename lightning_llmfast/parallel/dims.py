"""The one parallel layout of a run: data-parallel sharding and expert parallelism on one DeviceMesh.

:class:`ParallelDims` is built once from the world size, ``sharding`` and ``expert_parallel_size``; it validates
them and builds the only :class:`~torch.distributed.device_mesh.DeviceMesh` of the run (torchtitan's layout):

- ``("edp", "ep")`` of shape ``(world / N, N)``: the ``N`` ranks of an ``"ep"`` group split the routed experts
  between them, the ranks of an ``"edp"`` group hold the same experts (and, under FSDP, shard them further);
- ``"dp_shard"``: the same ranks flattened, every rank of the world: dense parameters are sharded (FSDP) or
  replicated (DDP) over it, and token-weighted losses count the tokens of all of its ranks.

Rank ``r`` sits at ``(r // N, r % N)``: expert-parallel groups are blocks of consecutive ranks (one node each when
``N`` divides the GPUs per node). Sharding, expert dispatch, gradient reduction, clipping, losses and checkpoints all
read their groups from this object.

Example::

    dims = ParallelDims(world_size=8, sharding="fsdp", expert_parallel_size=4)
    dims.edp  # 2
    mesh = dims.build_mesh("cuda")   # after init_process_group
    dims.ep_mesh.get_group()         # the 4 ranks that exchange tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError

__all__ = ["DP_SHARD", "EDP", "EP", "SHARDINGS", "ParallelDims"]

SHARDINGS: tuple[str, ...] = ("ddp", "fsdp")
"""Values of ``LLMFastStrategy(sharding=...)``."""

DP_SHARD = "dp_shard"
"""Mesh dimension of every data-parallel rank (dense parameters; the world)."""
EP = "ep"
"""Mesh dimension of the ranks that split the routed experts."""
EDP = "edp"
"""Mesh dimension of the ranks that hold the same experts (``dp_shard / ep``)."""


@dataclass
class ParallelDims:
    """Validated sizes of the parallel layout and, after :meth:`build_mesh`, its one device mesh.

    Args:
        world_size: number of ranks, ``>= 1``.
        sharding: ``"ddp"`` (dense parameters replicated) or ``"fsdp"`` (sharded with FSDP2).
        expert_parallel_size: ``N``, the ranks that split every MoE block's routed experts; it must divide
            ``world_size``.

    Raises:
        ConfigError: at construction, for a ``world_size`` or ``N`` that is not an int ``>= 1``, a ``sharding``
            outside :data:`SHARDINGS`, or ``N`` not dividing ``world_size``.

    Example::

        dims = ParallelDims(4, "fsdp", 2)
        (dims.dp_shard, dims.edp, dims.ep)  # (4, 2, 2)
    """

    world_size: int
    sharding: str = "ddp"
    expert_parallel_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_shard_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, low=1)
        check_int("expert_parallel_size", self.expert_parallel_size, low=1)
        if not isinstance(self.sharding, str) or self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.world_size % self.expert_parallel_size:
            raise ConfigError(
                f"expert_parallel_size={self.expert_parallel_size} must divide the world size {self.world_size}"
            )

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks: all of them."""
        return self.world_size

    @property
    def ep(self) -> int:
        """Expert-parallel ranks per group (``N``)."""
        return self.expert_parallel_size

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: ``world_size / N``."""
        return self.world_size // self.expert_parallel_size

    @property
    def ep_enabled(self) -> bool:
        """Whether the experts are split (``N > 1``)."""
        return self.expert_parallel_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether dense parameters are sharded with FSDP2 over several ranks."""
        return self.sharding == "fsdp" and self.world_size > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build (once) the ``("edp", "ep")`` mesh over the default process group and its flattened ``"dp_shard"``.

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
        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=(EDP, EP))
        self._dp_shard_mesh = mesh._flatten(DP_SHARD)
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The ``("edp", "ep")`` mesh (:attr:`dp_shard_mesh` is it flattened).

        Raises:
            ConfigError: before :meth:`build_mesh`.
        """
        return self._built()[0]

    @property
    def dp_shard_mesh(self) -> DeviceMesh:
        """1-D mesh of every data-parallel rank (dense FSDP sharding, token counts, clipping)."""
        return self._built()[1]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's expert-parallel group."""
        return self.mesh[EP]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that hold this rank's experts."""
        return self.mesh[EDP]

    def _built(self) -> tuple[DeviceMesh, DeviceMesh]:
        if self._mesh is None or self._dp_shard_mesh is None:
            raise ConfigError("ParallelDims.build_mesh() has not been called yet")
        return self._mesh, self._dp_shard_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group, or ``None`` with one rank or before :meth:`build_mesh`."""
        return None if self._dp_shard_mesh is None else self._dp_shard_mesh.get_group()
