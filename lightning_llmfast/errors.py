"""Errors raised by lightning_llmfast.

Every error a user can trigger with bad input is a subclass of :class:`LLMFastError`, itself a
``ValueError``, so callers can catch either the precise class or all of ours at once.
"""

from __future__ import annotations

__all__ = [
    "LLMFastError",
    "DataError",
    "MetadataError",
    "RoutingError",
    "OffloadError",
    "ConfigError",
    "CheckpointError",
]


class LLMFastError(ValueError):
    """Base class of every input or configuration error raised by this package."""


class DataError(LLMFastError):
    """A corpus, document or packing argument is invalid (empty corpus, bad token ids, ``seq_len < 2``...)."""


class MetadataError(LLMFastError):
    """Packed-sequence metadata is invalid or does not match the batch it is used with."""


class RoutingError(LLMFastError):
    """MoE routing input is invalid (non-finite logits, ``top_k`` out of range, wrong shapes...)."""


class OffloadError(LLMFastError):
    """Activation-offload configuration is invalid (negative sizes, headroom below 1, no layers found...)."""


class ConfigError(LLMFastError):
    """A model, strategy or callback configuration is invalid."""


class CheckpointError(LLMFastError):
    """A checkpoint is unreadable, truncated or differs from what was saved (its content digest does not match)."""
