"""Building blocks of the expert-parallel exchange (the exchange itself is
:func:`~lightning_llmfast.expert_parallel.payload.exchange`): a masked gather whose backward is the inverse gather
(no scatter, no atomics), and the staging of host-side handshakes.

Example::

    grouped = masked_gather(rows, order, None, inverse, None)  # a permutation and its inverse
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["comm_device", "masked_gather", "stage_to_device"]


class _MaskedGather(torch.autograd.Function):
    """``out[i] = x[index[i]]`` where ``mask[i]`` (else 0), for a partial bijection between rows of ``x`` and ``out``.

    The backward is the inverse gather (``inverse``, ``inverse_mask``): no scatter, no atomics, deterministic.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, index: Tensor, mask: Tensor | None, inverse: Tensor, inverse_mask: Tensor | None
    ) -> Tensor:
        ctx.save_for_backward(inverse, inverse_mask)
        return _gather(x, index, mask)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        inverse, inverse_mask = ctx.saved_tensors
        return _gather(grad, inverse, inverse_mask), None, None, None, None


def _gather(x: Tensor, index: Tensor, mask: Tensor | None) -> Tensor:
    rows = x.index_select(0, index) if x.shape[0] else x.new_zeros((index.shape[0], *x.shape[1:]))
    # A select, not a product: masked rows may point at rows whose values are garbage (NaN * 0 is NaN).
    return rows if mask is None else torch.where(mask.unsqueeze(1), rows, 0)


def comm_device(group: dist.ProcessGroup, fallback: torch.device) -> torch.device:
    """Where tensors of host-side handshakes live: the CPU for gloo, else the device of the data (``fallback``), or
    the current CUDA device for NCCL when the data is still on the CPU."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl" and fallback.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def stage_to_device(values: Sequence[int], device: torch.device) -> Tensor:
    """Host integers (split sizes, handshake headers) as an int64 tensor on ``device``, without blocking the host.

    ``torch.tensor(values, device=cuda)`` copies from pageable memory, which the host waits for. Here the values are
    written into pinned memory and copied with ``non_blocking=True`` on the current stream, so later kernels on that
    stream see them and the host moves on. The pinned block comes from torch's caching host allocator, which does not
    hand it out again before the copy that read it has completed (so no staging buffer is overwritten in flight).

    Example::

        header = stage_to_device([num_tokens, dtype_code, hidden], counts.device)
    """
    staged = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return staged
    if torch.accelerator.is_available():
        staged = staged.pin_memory()
    return staged.to(device, non_blocking=True)


def masked_gather(
    x: Tensor, index: Tensor, mask: Tensor | None, inverse: Tensor, inverse_mask: Tensor | None
) -> Tensor:
    """``out[i] = x[index[i]]`` where ``mask[i]`` (else 0); ``inverse``/``inverse_mask`` map the other way (backward).

    Example::

        grouped = masked_gather(rows, order, None, inverse, None)  # a permutation and its inverse
    """
    return _MaskedGather.apply(x, index, mask, inverse, inverse_mask)
