"""Building blocks of the expert-parallel exchange (the exchange itself is
:func:`~lightning_llmfast.expert_parallel.payload.exchange`): a masked gather whose backward is the inverse gather
(no scatter, no atomics), the fixed blocks of capacity exchanges (:func:`block_maps`), the staging of host-side
handshakes, and the asynchronous ``all_to_all_single`` (:func:`all_to_all_async`) that every exchange issues.

An exchange is issued with ``async_op=True`` and waited for later (:meth:`InFlight.wait`). On CUDA it is issued on a
communication stream (one per device) that first waits for the compute stream (the rows are ready), and the wait makes
the compute stream wait for an event recorded after the exchange on that stream: the host never blocks, and the
compute stream runs whatever was queued before the wait while the exchange is in flight. On the CPU (gloo) the wait
blocks the host until the exchange completed. An :class:`~lightning_llmfast.comm.timing.ExchangeTimer` given to the
exchange stamps its span and the wait.

Example::

    grouped = masked_gather(rows, order, None, inverse, None)  # a permutation and its inverse
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast.comm.timing import ExchangeTimer

__all__ = ["BlockMaps", "InFlight", "all_to_all_async", "block_maps", "comm_device", "masked_gather", "stage_to_device"]

# The communication stream of each CUDA device (created on first use).
_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


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


class BlockMaps(NamedTuple):
    """Compact rows grouped into ``G`` groups <-> ``G`` fixed blocks of ``block`` rows (group ``g``'s rows first in
    block ``g``, zeros after): the gather maps both ways (:func:`block_maps`).

    Attributes:
        slot_src: ``(G * block,)`` the compact row of each block slot; ``slot_valid``: whether it holds one.
        row_slot: ``(R,)`` the block slot of each compact row; ``row_valid``: whether it has one.
    """

    slot_src: Tensor
    slot_valid: Tensor
    row_slot: Tensor
    row_valid: Tensor

    def pad(self, rows: Tensor) -> Tensor:
        """``(R, ...)`` compact rows into their blocks: ``(G * block, ...)`` (differentiable)."""
        return masked_gather(rows, self.slot_src, self.slot_valid, self.row_slot, self.row_valid)

    def unpad(self, slots: Tensor) -> Tensor:
        """``(G * block, ...)`` blocks back to the ``(R, ...)`` compact rows (differentiable)."""
        return masked_gather(slots, self.row_slot, self.row_valid, self.slot_src, self.slot_valid)


def block_maps(offsets: Tensor, block: int, num_rows: int) -> BlockMaps:
    """The :class:`BlockMaps` of ``num_rows`` compact rows whose groups end at ``offsets`` (``(G + 1,)``, on the
    device; rows from ``offsets[-1]`` on belong to no group), each group given ``block`` rows (it must fit). Built on
    the device, without a host read.

    Example::

        slots = block_maps(plan.offsets, capacity, plan.num_rows).pad(permute(x, plan))  # (E * C, H)
    """
    offsets = offsets.to(torch.int64)
    groups, device = offsets.shape[0] - 1, offsets.device
    slot = torch.arange(groups * block, device=device)
    group, within = slot // max(block, 1), slot % max(block, 1)
    slot_valid = within < (offsets[1:] - offsets[:-1])[group]
    slot_src = (offsets[:-1][group] + within).clamp(max=max(num_rows - 1, 0))
    row = torch.arange(num_rows, device=device)
    row_group = torch.searchsorted(offsets[1:], row, right=True).clamp(max=max(groups - 1, 0))
    row_slot = (row_group * block + row - offsets[row_group]).clamp(0, max(groups * block - 1, 0))
    return BlockMaps(slot_src, slot_valid, row_slot, row < offsets[-1])


class InFlight:
    """An ``all_to_all_single`` in flight; :meth:`wait` returns its output once the caller may read it.

    Attributes:
        out: the output buffer (filled once the exchange completed).
    """

    __slots__ = ("_done", "_timer", "_work", "out")

    def __init__(self, out: Tensor, work: Any, done: torch.cuda.Event | None, timer: ExchangeTimer | None) -> None:
        self.out, self._work, self._done, self._timer = out, work, done, timer

    def wait(self) -> Tensor:
        """The output, ordered after the exchange: the compute stream waits for it on CUDA, the host on the CPU."""
        timer = self._timer
        start = timer.clock.stamp() if timer is not None else None
        if self._done is not None:
            torch.cuda.current_stream(self.out.device).wait_event(self._done)
        else:
            self._work.wait()
        if timer is not None:
            timer.waited(start, timer.clock.stamp())
        return self.out


def all_to_all_async(
    rows: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: dist.ProcessGroup,
    timer: ExchangeTimer | None = None,
) -> InFlight:
    """Issue ``all_to_all_single`` of ``rows`` (``in_splits`` rows to each rank, ``out_splits`` from each; ``None``:
    equal) without waiting for it (module docstring); ``timer`` stamps it.

    Example::

        received = all_to_all_async(rows, out_splits, in_splits, group).wait()
    """
    count = rows.shape[0] if out_splits is None else sum(out_splits)
    out = rows.new_empty((count, *rows.shape[1:]))
    rows = rows.contiguous()
    if rows.device.type != "cuda":
        span = timer.begin() if timer is not None else None
        work = dist.all_to_all_single(out, rows, out_splits, in_splits, group=group, async_op=True)
        if timer is not None:
            work.get_future().add_done_callback(lambda _: timer.end(span))
        return InFlight(out, work, None, timer)
    stream = _comm_stream(rows.device)
    stream.wait_stream(torch.cuda.current_stream(rows.device))
    with torch.cuda.stream(stream):
        span = timer.begin() if timer is not None else None
        work = dist.all_to_all_single(out, rows, out_splits, in_splits, group=group, async_op=True)
        work.wait()  # the communication stream waits for the collective's own stream; the host does not
        done = torch.cuda.Event(enable_timing=timer is not None)
        done.record(stream)
    # Allocated on the compute stream, used on the communication one: not reused before the exchange is done.
    rows.record_stream(stream)
    out.record_stream(stream)
    if timer is not None:
        timer.end(span, done)
    return InFlight(out, work, done, timer)


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COMM_STREAMS:
        _COMM_STREAMS[device] = torch.cuda.Stream(device)
    return _COMM_STREAMS[device]
