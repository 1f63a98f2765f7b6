"""lightning_llmfast: remove the overhead between the big kernels of LLM and MoE training in Lightning.

Public names are resolved lazily so that ``import lightning_llmfast.moe`` (plain PyTorch) stays cheap;
importing the package registers the ``"llmfast"`` strategies with Lightning.

Example::

    import lightning as L
    from lightning_llmfast import SequenceMetadataCallback, TokenThroughputMonitor

    trainer = L.Trainer(strategy="llmfast", callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor()])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lightning_llmfast._lazy import lazy_dir, lazy_getattr
from lightning_llmfast.errors import (
    ConfigError,
    DataError,
    LLMFastError,
    MetadataError,
    OffloadError,
    RoutingError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "PackedBatch": "lightning_llmfast.data",
    "pack_documents": "lightning_llmfast.data",
    "TextCorpus": "lightning_llmfast.data",
    "SyntheticCorpus": "lightning_llmfast.data",
    "PackedDataModule": "lightning_llmfast.datamodule",
    "SequenceMetadata": "lightning_llmfast.seqmeta",
    "SequenceMetadataCache": "lightning_llmfast.seqmeta",
    "SequenceMetadataCallback": "lightning_llmfast.callbacks",
    "TokenThroughputMonitor": "lightning_llmfast.callbacks",
    "ExpertLoadMonitor": "lightning_llmfast.callbacks",
    "GroupedRouterMixin": "lightning_llmfast.mixin",
    "register_moe_adapter": "lightning_llmfast.moe",
    "LLMFastStrategy": "lightning_llmfast.strategy",
    "MoEGPT": "lightning_llmfast.models",
    "MoEGPTConfig": "lightning_llmfast.models",
    "MoEGPTLightningModule": "lightning_llmfast.models",
    "causal_lm_loss": "lightning_llmfast.losses",
    "scale_by_token_share": "lightning_llmfast.losses",
}

__all__ = [
    "ConfigError",
    "DataError",
    "ExpertLoadMonitor",
    "GroupedRouterMixin",
    "LLMFastError",
    "LLMFastStrategy",
    "MetadataError",
    "MoEGPT",
    "MoEGPTConfig",
    "MoEGPTLightningModule",
    "OffloadError",
    "PackedBatch",
    "PackedDataModule",
    "RoutingError",
    "SequenceMetadata",
    "SequenceMetadataCache",
    "SequenceMetadataCallback",
    "SyntheticCorpus",
    "TextCorpus",
    "TokenThroughputMonitor",
    "__version__",
    "causal_lm_loss",
    "pack_documents",
    "register_moe_adapter",
    "scale_by_token_share",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

# Registers "llmfast" and "llmfast_offload" in Lightning's StrategyRegistry, so Trainer(strategy="llmfast") works
# after `import lightning_llmfast`.
importlib.import_module("lightning_llmfast.strategy")

if TYPE_CHECKING:
    from lightning_llmfast.callbacks import ExpertLoadMonitor, SequenceMetadataCallback, TokenThroughputMonitor
    from lightning_llmfast.data import PackedBatch, SyntheticCorpus, TextCorpus, pack_documents
    from lightning_llmfast.datamodule import PackedDataModule
    from lightning_llmfast.losses import causal_lm_loss, scale_by_token_share
    from lightning_llmfast.mixin import GroupedRouterMixin
    from lightning_llmfast.models import MoEGPT, MoEGPTConfig, MoEGPTLightningModule
    from lightning_llmfast.moe import register_moe_adapter
    from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache
    from lightning_llmfast.strategy import LLMFastStrategy
