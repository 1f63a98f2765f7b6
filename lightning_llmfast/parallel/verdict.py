"""One decision for all ranks: each rank's verdict (an error, or none) combined by one collective, so every rank goes
on, or every rank raises. Checkpoint saves use it where ranks must agree a step is done (all flushed, renamed), and
resumes where each rank verified its own part of a checkpoint: one rank's damaged file stops every rank at the same
place, instead of leaving the others waiting in a collective the failed rank never enters.

Example::

    error = None
    try:
        verify_my_shards()
    except CheckpointError as err:
        error = err
    agree(error, "ckpts/last.ckpt")  # raises on every rank if any rank failed
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.expert_parallel.exchange import comm_device

__all__ = ["agree"]


def agree(error: BaseException | None, what: str, *, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` calls this with its own verdict; raises on every rank if any rank has an ``error``.

    A rank with an error raises it; the others raise :class:`CheckpointError` naming ``what`` and the ranks that
    failed. One all-reduce of one flag per rank (bounded by the group's timeout); without a process group (one
    process) the error, if any, is raised as is.

    Args:
        error: this rank's failure, or ``None``.
        what: the checkpoint (or step) the verdict is about, for the other ranks' message.
        group: the ranks that decide together (``None``: the world).

    Raises:
        CheckpointError: on the ranks without an error, when another rank had one.

    Example::

        agree(None if intact else CheckpointError(f"{path}: damaged"), str(path))
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    device = comm_device(group or dist.group.WORLD, torch.device("cpu"))  # NCCL reduces only CUDA tensors
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    if error is not None:
        raise error
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if failed:
        raise CheckpointError(f"{what}: rank(s) {failed} failed (see their error); every rank stops here")
