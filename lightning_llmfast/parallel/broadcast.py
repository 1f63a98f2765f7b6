"""One rank's tree of results on every rank of a group: the pipeline's last stage shares what it computed.

Example::

    result = broadcast_tree(result if runner.has_last else None, runner.last_rank, runner.group, root_device)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["broadcast_tree"]


@dataclass(frozen=True)
class _Slot:
    """A tensor leaf of a broadcast tree, as the other ranks receive it first (a leaf to pytree, not a tuple)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_tree(value: Any, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """``value`` of group rank ``src`` on every rank of ``group``: any tree of dicts, lists and tuples.

    Its tensors travel by ``dist.broadcast`` on ``device`` (the root device: NCCL's tensors on the GPU) and arrive
    there; the rest (the tree's structure, other leaves, the tensors' shapes and dtypes) in one
    ``broadcast_object_list``. ``src`` gets ``value`` back unchanged; the others ignore theirs.

    Example::

        result = broadcast_tree(result if runner.has_last else None, last_rank, runner.group, root_device)
    """
    mine = dist.get_rank(group) == src
    tensors: list[Tensor] = []

    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        tensors.append(leaf)
        return _Slot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)

    header = [pytree.tree_map(slot, value) if mine else None]
    dist.broadcast_object_list(header, group_src=src, group=group, device=device)
    slots = [leaf for leaf in pytree.tree_leaves(header[0]) if isinstance(leaf, _Slot)]
    received = []
    for s in slots:
        buffer = (
            tensors[s.index].detach().to(device).contiguous()
            if mine
            else torch.empty(s.shape, dtype=s.dtype, device=device)
        )
        dist.broadcast(buffer, group_src=src, group=group)
        received.append(buffer)
    if mine:
        return value
    return pytree.tree_map(lambda leaf: received[leaf.index] if isinstance(leaf, _Slot) else leaf, header[0])
