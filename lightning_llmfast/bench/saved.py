"""Bytes autograd saves for backward: every distinct storage packed by ``saved_tensors_hooks`` inside a window.

The counter behind the figures "saved activations per step": each storage counts once, however many views of it are
saved (a weight saved by two matmuls, a tensor and its transpose); storages given in ``exclude`` (the parameters)
and meta tensors do not count.

Example::

    with SavedBytes(exclude=model.parameters()) as saved:
        loss = model(batch).logits.sum()
    loss.backward()
    saved.nbytes  # activations, masks, indices: everything the backward will read
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Counts the distinct storages autograd saves inside the ``with`` block, and their bytes.

    Args:
        exclude: tensors whose storages are not counted (typically ``model.parameters()``).

    Attributes:
        nbytes: bytes of the distinct storages saved.
        storages: their number.
        sizes: the bytes of each, in the order first saved (``sorted(sizes)[-5:]``: what dominates).

    Example::

        with SavedBytes(exclude=module.parameters()) as saved:
            loss = module.training_step(batch, 0)
        saved.nbytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude if t.device.type != "meta"}
        self._seen: dict[int, torch.UntypedStorage] = {}  # held: a freed storage's address could come back
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.nbytes = 0
        self.storages = 0
        self.sizes: list[int] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._excluded and ptr not in self._seen:
            self._seen[ptr] = storage
            self.nbytes += storage.nbytes()
            self.storages += 1
            self.sizes.append(storage.nbytes())
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._seen.clear()
