"""The LightningDataModules (Lightning layer): they wire the plain-PyTorch data pipeline (:mod:`lightning_llmfast.data`)
into ``Trainer.fit``.

Example::

    from lightning_llmfast.datamodules import PackedDataModule

    trainer.fit(module, datamodule=PackedDataModule(seq_len=512, batch_size=8))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr

_LAZY: dict[str, str] = {
    "PackedDataModule": "lightning_llmfast.datamodules.packed",
}

__all__ = ["PackedDataModule"]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

if TYPE_CHECKING:
    from lightning_llmfast.datamodules.packed import PackedDataModule
