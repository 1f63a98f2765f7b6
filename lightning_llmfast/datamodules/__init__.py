"""Lightning data modules over the planned batch datasets of :mod:`lightning_llmfast.data`.

Example::

    from lightning_llmfast.datamodules import PreparedDataModule

    data = PreparedDataModule(path="prepared/", seq_len=2048, batch_size=8)
"""

from __future__ import annotations

from lightning_llmfast.datamodules.positioned import PositionedDataModule, PositionedLoader
from lightning_llmfast.datamodules.prepared import PreparedDataModule, model_vocab_size

__all__ = ["PositionedDataModule", "PositionedLoader", "PreparedDataModule", "model_vocab_size"]
