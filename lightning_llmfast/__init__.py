"""lightning_llmfast: remove the overhead between the big kernels of LLM and MoE training in Lightning.

Public names are resolved lazily, so ``import lightning_llmfast.moe`` (plain PyTorch) does not import the other parts.
Where Lightning is installed, importing the package registers the ``"llmfast"`` and ``"llmfast_offload"``
strategies in Lightning's ``StrategyRegistry``; without Lightning, ``data``, ``seqmeta``, ``moe`` and ``offload``
still import and work.

Example::

    import lightning as L
    from lightning_llmfast import SequenceMetadataCallback, TokenThroughputMonitor

    trainer = L.Trainer(strategy="llmfast", callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor()])
"""

from __future__ import annotations

import importlib

from lightning_llmfast._lazy import lazy_dir, lazy_getattr
from lightning_llmfast.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LLMFastError,
    MetadataError,
    OffloadError,
    RoutingError,
)

__version__ = "0.2.0"

# The public names: name -> module that defines it (imported on first use). Add new exports here; __all__, dir()
# and the lazy lookup follow from this one table.
_LAZY: dict[str, str] = {
    # plain PyTorch
    "PackedBatch": "lightning_llmfast.data",
    "pack_documents": "lightning_llmfast.data",
    "TextCorpus": "lightning_llmfast.data",
    "SyntheticCorpus": "lightning_llmfast.data",
    "SequenceMetadata": "lightning_llmfast.seqmeta",
    "SequenceMetadataCache": "lightning_llmfast.seqmeta",
    "register_moe_adapter": "lightning_llmfast.moe",
    "MoEGPT": "lightning_llmfast.models",
    "MoEGPTConfig": "lightning_llmfast.models",
    "OffloadConfig": "lightning_llmfast.offload",
    "PowerSGDConfig": "lightning_llmfast.comm",
    # Lightning layer
    "PackedDataModule": "lightning_llmfast.datamodules",
    "PreparedDataModule": "lightning_llmfast.datamodules",
    "SequenceMetadataCallback": "lightning_llmfast.callbacks",
    "TokenThroughputMonitor": "lightning_llmfast.callbacks",
    "ExpertLoadMonitor": "lightning_llmfast.callbacks",
    "ExpertBalanceCallback": "lightning_llmfast.callbacks",
    "ActivationOffload": "lightning_llmfast.callbacks",
    "SystemMetricsMonitor": "lightning_llmfast.callbacks",
    "GroupedRouterMixin": "lightning_llmfast.modules",
    "LLMFastStrategy": "lightning_llmfast.strategy",
    "VerifiedCheckpointIO": "lightning_llmfast.strategy",
    "MoEGPTLightningModule": "lightning_llmfast.modules",
    "causal_lm_loss": "lightning_llmfast.modules",
    "HFCausalLMModule": "lightning_llmfast.modules",
    "packed_model_inputs": "lightning_llmfast.hf",
    "scale_by_token_share": "lightning_llmfast.modules",
}

_ERRORS = (CheckpointError, ConfigError, DataError, LLMFastError, MetadataError, OffloadError, RoutingError)

__all__ = sorted([*_LAZY, *(error.__name__ for error in _ERRORS), "__version__"])

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

# Top-level packages whose absence only disables the Lightning layer (the plain-PyTorch parts do not need them).
_LIGHTNING_PACKAGES = frozenset({"lightning", "pytorch_lightning", "torchmetrics"})


def _register_strategies() -> bool:
    """Import the strategy module, which registers ``"llmfast"``/``"llmfast_offload"`` with Lightning.

    Returns ``False`` (and registers nothing) when Lightning is not installed; any other import error propagates.
    """
    try:
        importlib.import_module("lightning_llmfast.strategy")
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in _LIGHTNING_PACKAGES:
            raise
        return False
    return True


# So that Trainer(strategy="llmfast") works right after `import lightning_llmfast`.
_LIGHTNING_AVAILABLE = _register_strategies()
