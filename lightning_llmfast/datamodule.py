"""The import path :class:`PackedDataModule` had before the Lightning layer got its rooms (kept for users): it lives
in :mod:`lightning_llmfast.datamodules.packed`."""

from lightning_llmfast.datamodules.packed import PackedDataModule, PackedDocumentDataset

__all__ = ["PackedDataModule", "PackedDocumentDataset"]
