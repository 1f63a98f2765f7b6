"""The checkpoint IO of ``strategy="llmfast"``: ``torch.save`` files that carry a digest of every tensor, verified on
load (the digests are :mod:`lightning_llmfast.parallel.integrity`'s).

Example::

    trainer = L.Trainer(plugins=[VerifiedCheckpointIO()])  # the default under strategy="llmfast"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.parallel.integrity import DIGEST_KEY, load_intact, tensor_digests, verify_tensor_digests

__all__ = ["VerifiedCheckpointIO"]


class VerifiedCheckpointIO(TorchCheckpointIO):
    """``torch.save``/``torch.load`` checkpoints that carry a digest of every tensor, verified on load.

    Saving moves the tensors to the host once (what ``torch.save`` does for device tensors anyway), digests them and
    stores the digests under :data:`DIGEST_KEY`. Loading verifies every tensor and drops the entry; an unreadable,
    truncated or altered file raises :class:`~lightning_llmfast.errors.CheckpointError`, and a corrupt ``last*``
    checkpoint falls back to the newest intact one beside it (:func:`load_intact`). Files without digests (written
    elsewhere) load unverified.

    Example::

        trainer = L.Trainer(plugins=[VerifiedCheckpointIO()])  # the default under strategy="llmfast"
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        host = apply_to_collection(checkpoint, Tensor, lambda t: t.detach().cpu())
        super().save_checkpoint({**host, DIGEST_KEY: tensor_digests(host)}, path, storage_options)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        def load(file: Path) -> dict[str, Any]:
            try:
                checkpoint = super(VerifiedCheckpointIO, self).load_checkpoint(file, map_location, weights_only)
            except FileNotFoundError:
                raise
            except Exception as err:  # a damaged archive fails in many ways inside torch.load
                raise CheckpointError(f"{file}: unreadable checkpoint ({type(err).__name__}: {err})") from err
            digests = checkpoint.pop(DIGEST_KEY, None) if isinstance(checkpoint, dict) else None
            if digests is not None:
                verify_tensor_digests(checkpoint, digests, file)
            return checkpoint

        return load_intact(path, load)
