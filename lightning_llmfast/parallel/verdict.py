"""One decision for all ranks: each rank's verdict (an error, or none) combined by one collective, so every rank goes
on, or every rank raises the same error. Checkpoint saves use it where ranks must agree a step is done (all flushed,
renamed), and resumes where each rank verified its own part of a checkpoint: one rank's damaged file or failed write
stops every rank at the same place with the same message (naming the rank and its cause), instead of leaving the
others waiting in a collective the failed rank never enters.

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

from lightning_llmfast import errors
from lightning_llmfast.errors import CheckpointError, LLMFastError
from lightning_llmfast.expert_parallel.exchange import comm_device

__all__ = ["agree"]


def _error_class(name: str) -> type[LLMFastError]:
    """Our error class of that name (the failing rank's, raised alike on every rank), else :class:`CheckpointError`."""
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, LLMFastError) else CheckpointError


def agree(error: BaseException | None, what: str, *, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` calls this with its own verdict; raises on every rank if any rank has an ``error``.

    Every rank raises the same error: the class of the first failing rank's error where it is one of ours
    (:mod:`lightning_llmfast.errors`), else :class:`CheckpointError` (a full disk's ``OSError``, ``torch.save``'s
    ``RuntimeError``, a pickling error), with one message naming ``what``, the first failing rank, its error's class
    and text, and the other failing ranks; the failing rank's own error is its ``__cause__``. One all-reduce of one
    flag per rank, then, only when a rank failed, one all-gather of the failures' descriptions (both bounded by the
    group's timeout); without a process group (one process) the error, if any, is raised as is.

    Args:
        error: this rank's failure, or ``None``.
        what: the checkpoint (or step) the verdict is about.
        group: the ranks that decide together (``None``: the world).

    Raises:
        LLMFastError: on every rank when any rank had an error (:class:`CheckpointError` unless the first failing
            rank's error is another of ours).

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
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    mine = None if error is None else (type(error).__name__, str(error))
    causes: list[tuple[str, str] | None] = [None] * len(flags)
    dist.all_gather_object(causes, mine, group=group)  # every rank knows a rank failed: every rank enters it
    first = causes[failed[0]]
    assert first is not None
    others = f"; rank(s) {failed[1:]} failed too" if len(failed) > 1 else ""
    message = f"{what}: rank {failed[0]} failed with {first[0]}: {first[1]}{others}; every rank stops here"
    raise _error_class(first[0])(message) from error
