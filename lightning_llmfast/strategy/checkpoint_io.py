"""The checkpoint IO of ``strategy="llmfast"``: ``torch.save`` files that carry a digest of every tensor, verified on
load (the digests are :mod:`lightning_llmfast.parallel.integrity`'s), and written atomically
(:mod:`lightning_llmfast.parallel.atomic`).

Example::

    trainer = L.Trainer(plugins=[VerifiedCheckpointIO()])  # the default under strategy="llmfast"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from torch import Tensor
from typing_extensions import override

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.parallel.atomic import clear_stale, write_file_atomically
from lightning_llmfast.parallel.integrity import DIGEST_KEY, tensor_digests, verify_tensor_digests

__all__ = ["VerifiedCheckpointIO"]


class VerifiedCheckpointIO(TorchCheckpointIO):
    """``torch.save``/``torch.load`` checkpoints that carry a digest of every tensor, verified on load.

    Saving moves the tensors to the host once (what ``torch.save`` does for device tensors anyway), digests them and
    stores the digests under :data:`DIGEST_KEY`; a local file is written beside its target, fsynced and renamed over
    it, so a kill during the save leaves the previous checkpoint whole (remote paths are written by fsspec as
    Lightning does). Loading verifies every tensor and drops the entry; an unreadable, truncated or altered file raises
    :class:`~lightning_llmfast.errors.CheckpointError` (under several processes the strategy makes every rank raise
    it together). Files without digests (written elsewhere) load unverified.

    Example::

        trainer = L.Trainer(plugins=[VerifiedCheckpointIO()])  # the default under strategy="llmfast"
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        host = apply_to_collection(checkpoint, Tensor, lambda t: t.detach().cpu())
        verified = {**host, DIGEST_KEY: tensor_digests(host)}
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(verified, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        clear_stale(path)
        write_file_atomically(path, lambda file: torch.save(verified, file))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        try:
            checkpoint = super().load_checkpoint(path, map_location, weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # a damaged archive fails in many ways inside torch.load
            raise CheckpointError(f"{path}: unreadable checkpoint ({type(err).__name__}: {err})") from err
        digests = checkpoint.pop(DIGEST_KEY, None) if isinstance(checkpoint, dict) else None
        if digests is not None:
            verify_tensor_digests(checkpoint, digests, path)
        return checkpoint
