"""The sharding half of ``strategy="llmfast"``: ``sharding="ddp" | "fsdp"`` on top of Lightning's DDPStrategy.

:class:`ShardedDataParallelBase` is the base of :class:`~lightning_llmfast.LLMFastStrategy`. With ``"fsdp"`` and
several processes it builds the device mesh in :meth:`~ShardedDataParallelBase.setup_environment`, and its
``_setup_sharded`` replaces DDP's wrapper with FSDP2 (:mod:`lightning_llmfast.parallel.fsdp`); with ``"fsdp"`` on any
world size, checkpoints are DCP directories (:mod:`lightning_llmfast.parallel.checkpoint`) restored after setup,
optimizer state included, so they reshard. With ``"ddp"`` every hook is DDPStrategy's.

Example::

    trainer = L.Trainer(strategy="llmfast_fsdp", accelerator="cuda", devices=8, precision="bf16-mixed")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_llmfast.errors import ConfigError, OffloadError
from lightning_llmfast.offload.offloader import resolve_layers
from lightning_llmfast.parallel import checkpoint as dcp_io
from lightning_llmfast.parallel.fsdp import (
    SHARDINGS,
    build_device_mesh,
    materialize_module,
    mixed_precision_policy,
    shard_module,
    sync_module_states,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.optim import Optimizer

__all__ = ["LayersSpec", "ShardedDataParallelBase"]

LayersSpec = Sequence[nn.Module] | nn.Module | str | None
"""How a layer stack is named: ``None`` (found), an attribute path, or the modules."""


class ShardedDataParallelBase(DDPStrategy):
    """DDPStrategy with ``sharding="fsdp"``: FSDP2 in place of the DDP wrapper and DCP checkpoints.

    Args:
        *args: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
        sharding: ``"ddp"`` (replicated model, DDPStrategy unchanged) or ``"fsdp"`` (FSDP2 sharded data parallel).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ConfigError: at construction for a ``sharding`` other than ``"ddp"`` or ``"fsdp"``.

    Example::

        class MyStrategy(ShardedDataParallelBase):  # LLMFastStrategy is one
            ...
    """

    def __init__(self, *args: Any, sharding: str = "ddp", **kwargs: Any) -> None:
        if not isinstance(sharding, str) or sharding not in SHARDINGS:
            raise ConfigError(f"{type(self).__name__}: sharding must be one of {SHARDINGS}, got {sharding!r}")
        super().__init__(*args, **kwargs)
        self.sharding = sharding
        self._device_mesh: DeviceMesh | None = None

    def _materialize_single(self) -> None:
        """One process under ``"fsdp"``: no sharding, but a model built on the meta device still needs weights."""
        assert self.lightning_module is not None
        materialize_module(self.lightning_module, self.root_device)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The device mesh of ``sharding="fsdp"`` with several processes (dimension ``"dp"``), else ``None``."""
        return self._device_mesh

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded states load into the sharded model and the optimizers built on it.
        return self.sharding == "fsdp" or super().restore_checkpoint_after_setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self.sharding != "fsdp"  # load_checkpoint restores them, resharded

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.sharding == "fsdp" and self.world_size > 1:
            self._device_mesh = build_device_mesh(self.root_device.type, self.world_size)

    def _check_fsdp_config(self, layers: LayersSpec) -> list[nn.Module]:
        """Everything ``sharding="fsdp"`` needs, checked on every world size before any step; returns the layers."""
        assert self.lightning_module is not None
        mixed_precision_policy(self.precision_plugin.precision)
        try:
            return resolve_layers(self.lightning_module, layers)
        except OffloadError as err:
            raise ConfigError(f"sharding='fsdp' shards the layer stack block by block: {err}") from err

    def _fsdp_mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed-precision policy for the precision setting (a subclass may change its reduce dtype)."""
        return mixed_precision_policy(self.precision_plugin.precision)

    def _setup_sharded(self, trainer: pl.Trainer, layers: LayersSpec) -> None:
        """Strategy setup with FSDP2 in place of the DDP wrapper: shard, materialise, then build the optimizers."""
        assert self.accelerator is not None and self.model is not None and self._device_mesh is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        assert module is not None
        if not any(p.is_meta for p in module.parameters()):
            sync_module_states(module)  # built eagerly on every rank: shard rank 0's weights, as DDP would
        policy = self._fsdp_mp_policy()
        shard_module(module, self._device_mesh, self._check_fsdp_config(layers), mp_policy=policy)
        if not materialize_module(module, self.root_device):
            module.to(self.root_device)  # buffers and parameters FSDP does not manage; shards are already there
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def teardown(self) -> None:
        # A setup that failed before materialising leaves meta tensors, which the base teardown's `.cpu()` cannot
        # move; give them (uninitialised) host storage so the error that stopped setup is the one the user sees.
        module = self.lightning_module
        if self.sharding == "fsdp" and module is not None:
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                module.to_empty(device="cpu")
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.sharding != "fsdp":
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        return dcp_io.model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.sharding != "fsdp":
            return super().optimizer_state(optimizer)
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return dcp_io.optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.sharding != "fsdp":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise ConfigError(f"{type(self).__name__}(sharding='fsdp'): save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))  # rank 0's path: every rank writes into the same directory
        dcp_io.save_distributed_checkpoint(checkpoint, path, rank=self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if self.sharding != "fsdp":
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(str(checkpoint_path)))
        if not dcp_io.is_distributed_checkpoint(path):
            raise ConfigError(
                f"{type(self).__name__}(sharding='fsdp') resumes from distributed checkpoint directories; {path} is "
                "not one (load a single-file checkpoint's weights with LightningModule.load_from_checkpoint)"
            )
        assert self.lightning_module is not None
        return dcp_io.load_distributed_checkpoint(
            path,
            self.lightning_module,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharding != "fsdp":
            super().load_model_state_dict(checkpoint, strict=strict)
        # under "fsdp", load_checkpoint already loaded the shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.sharding != "fsdp":
            super().load_optimizer_state_dict(checkpoint)
