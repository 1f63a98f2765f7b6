"""The import path of the token-weighted losses before the Lightning layer got its rooms (kept for users): they live
in :mod:`lightning_llmfast.modules.losses`."""

from lightning_llmfast.modules.losses import causal_lm_loss, scale_by_token_share

__all__ = ["causal_lm_loss", "scale_by_token_share"]
