"""``SequenceMetadataCallback``: one packed-sequence metadata build per batch, with no change to ``training_step``.

The callback owns lifecycles only; building, validating and caching live in :mod:`lightning_llmfast.seqmeta`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_llmfast._layers import resolve_layers
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.seqmeta import SequenceMetadataCache

__all__ = ["SequenceMetadataCallback"]

Validate = Literal["first_layer", "every_layer", "off"]
_VALIDATE = ("first_layer", "every_layer", "off")


def _hidden_and_positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The layer's hidden states (first floating-point tensor) and position ids (``position_ids=``, or the first
    int64 tensor argument shaped like the hidden states' tokens)."""
    values = [*args, *kwargs.values()]
    hidden = next((t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    positions = kwargs.get("position_ids")
    if positions is None and hidden is not None:
        tokens = hidden.shape[:-1]
        positions = next(
            (t for t in args if isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.shape == tokens), None
        )
    return hidden, positions


class SequenceMetadataCallback(L.Callback):
    """Builds each batch's packed-sequence metadata once, at the first transformer layer, for every layer to reuse.

    At the first batch it finds the model's layers (after ``configure_model``, so layers built there count) and
    installs a forward pre-hook on the first one; each batch-start hook
    (train, validation, test, predict) opens a new :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` version
    for the batch and each batch-end hook closes it, so nothing is reused across batches. Layers read the metadata
    with ``active_cache().get(hidden)`` (the reference model does this in ``attention_metadata="cached"`` mode).
    Batches may be a ``PackedBatch``, a mapping or object holding ``cu_seqlens`` (with ``max_seqlen``) or
    ``position_ids``, or a tuple/list holding one; failing those, the metadata is built from the position ids the
    first layer receives. The model's input embeddings are watched (:meth:`SequenceMetadataCache.watch`), so a
    second forward on other tokens inside one batch (a teacher, a contrastive pair) never reuses this batch's
    boundaries. Logs ``seqmeta/builds_per_step`` and ``seqmeta/reads_per_step`` (lookups by layers or
    :func:`~lightning_llmfast.packed_model_inputs`; host integers, no sync) and warns at the end of a fit that ran
    training steps in which nothing read the metadata: such a model ignores it (a transformers model given
    ``input_ids``/``position_ids`` directly, for example) and may attend across documents.

    Args:
        validate: ``"first_layer"`` checks the first layer's token count against the metadata; ``"every_layer"``
            also checks every layer's input (host-side shape arithmetic); ``"off"`` checks nothing.
        layers: the transformer layers (a module list) or the attribute path to them from the LightningModule
            (``"model.layers"``); by default the largest ``nn.ModuleList`` of identical blocks.

    Example::

        trainer = L.Trainer(callbacks=[SequenceMetadataCallback()])
        trainer.fit(MoEGPTLightningModule(), datamodule=PackedDataModule())
    """

    def __init__(
        self, validate: Validate = "first_layer", layers: nn.ModuleList | Sequence[nn.Module] | str | None = None
    ) -> None:
        if validate not in _VALIDATE:
            raise ConfigError(f"validate: must be one of {_VALIDATE}, got {validate!r}")
        self.validate = validate
        self.layers = layers
        self.cache = SequenceMetadataCache()
        self._handles: list[RemovableHandle] = []
        self._builds_at_begin = 0
        self._reads_at_begin = 0
        self._unread_steps = self._train_steps = 0

    @property
    def builds_last_batch(self) -> int:
        """Metadata builds of the most recent (or current) batch."""
        return self.cache.stats["builds"] - self._builds_at_begin

    @property
    def reads_last_batch(self) -> int:
        """Metadata lookups by consumers (layers, ``packed_model_inputs``) in the most recent (or current) batch."""
        return self.cache.stats["reads"] - self._reads_at_begin

    def _install_hooks(self, pl_module: L.LightningModule) -> None:
        # At the first batch rather than in setup(): configure_model, which may build the layers, runs after setup.
        found = resolve_layers(pl_module, self.layers, hint="SequenceMetadataCallback(layers=...)")
        self._handles.extend(self.cache.watch(pl_module))
        self._handles.append(found[0].register_forward_pre_hook(self._build_hook, with_kwargs=True))
        if self.validate == "every_layer":
            for layer in found[1:]:
                self._handles.append(layer.register_forward_pre_hook(self._check_hook, with_kwargs=True))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown when fit raises: an open cache would serve this batch's metadata to every later
        # forward of the model in this process (a notebook after an out-of-memory error).
        self._release()

    def _release(self) -> None:
        self._remove_hooks()
        self.cache.end()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _build_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A forward outside a batch hook (e.g. generation in on_train_epoch_end) has no version: leave it alone.
        if not self.cache.is_open:
            return
        hidden, positions = _hidden_and_positions(args, kwargs)
        self.cache.get(hidden, position_ids=positions, check=self.validate != "off", read=False)

    def _check_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.cache.is_open:
            return
        hidden, _ = _hidden_and_positions(args, kwargs)
        if hidden is not None:
            self.cache.check(hidden)

    def _begin(self, pl_module: L.LightningModule, batch: Any) -> None:
        if not self._handles:
            self._install_hooks(pl_module)
        self._builds_at_begin = self.cache.stats["builds"]
        self._reads_at_begin = self.cache.stats["reads"]
        self.cache.begin(batch)

    # Batch hooks: a new version per batch (micro-batch under gradient accumulation), closed at its end.
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._begin(pl_module, batch)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.cache.end()
        reads = self.reads_last_batch
        self._train_steps += 1
        self._unread_steps += reads == 0 and not self.cache.read_compiled
        for name, value in (("builds", self.builds_last_batch), ("reads", reads)):
            pl_module.log(f"seqmeta/{name}_per_step", float(value), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._unread_steps = self._train_steps = 0

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._unread_steps:
            warnings.warn(
                f"SequenceMetadataCallback: in {self._unread_steps} of {self._train_steps} training steps no layer "
                "read the packed metadata, so the model ignores the document boundaries and may attend across "
                "documents; read it with active_cache().get(hidden) in the layers, or for transformers models use "
                "lightning_llmfast.HFCausalLMModule / packed_model_inputs(batch, model)",
                UserWarning,
                stacklevel=2,
            )

    @override
    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin(pl_module, batch)

    @override
    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.cache.end()

    @override
    def on_test_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin(pl_module, batch)

    @override
    def on_test_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.cache.end()

    @override
    def on_predict_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin(pl_module, batch)

    @override
    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.cache.end()
