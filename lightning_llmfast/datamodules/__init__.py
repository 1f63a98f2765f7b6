"""The LightningDataModules (Lightning layer): they wire the plain-PyTorch data pipeline (:mod:`lightning_llmfast.data`)
into ``Trainer.fit``: :class:`PackedDataModule` over the built-in byte-level corpora, :class:`PreparedDataModule` over
directories written by ``python -m lightning_llmfast.prepare``, both on :class:`PositionedDataModule` (loaders,
pinning, the checkpointed position).

Example::

    from lightning_llmfast.datamodules import PreparedDataModule

    trainer.fit(module, datamodule=PreparedDataModule(path="prepared/", seq_len=2048, batch_size=8))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

_LAZY: dict[str, str] = {
    "PackedDataModule": "lightning_llmfast.datamodules.packed",
    "PositionedDataModule": "lightning_llmfast.datamodules.positioned",
    "PositionedLoader": "lightning_llmfast.datamodules.positioned",
    "PreparedDataModule": "lightning_llmfast.datamodules.prepared",
    "model_vocab_size": "lightning_llmfast.datamodules.prepared",
}

__all__ = ["PackedDataModule", "PositionedDataModule", "PositionedLoader", "PreparedDataModule", "model_vocab_size"]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.datamodules.packed import PackedDataModule
    from lightning_llmfast.datamodules.positioned import PositionedDataModule, PositionedLoader
    from lightning_llmfast.datamodules.prepared import PreparedDataModule, model_vocab_size
