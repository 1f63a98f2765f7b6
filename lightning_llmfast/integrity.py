"""The import path of checkpoint integrity before the Lightning layer got its rooms (kept for users): the digests
live in :mod:`lightning_llmfast.parallel.integrity`, :class:`VerifiedCheckpointIO` in
:mod:`lightning_llmfast.strategy.checkpoint_io`."""

from lightning_llmfast.parallel.integrity import (
    DIGEST_KEY,
    tensor_digests,
    verify_shard_digests,
    verify_tensor_digests,
    write_shard_digests,
)
from lightning_llmfast.strategy.checkpoint_io import VerifiedCheckpointIO

__all__ = [
    "DIGEST_KEY",
    "VerifiedCheckpointIO",
    "tensor_digests",
    "verify_shard_digests",
    "verify_tensor_digests",
    "write_shard_digests",
]
