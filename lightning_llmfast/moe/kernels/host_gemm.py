"""The grouped GEMM on CPU into a reused output buffer.

ATen's CPU ``grouped_mm`` is a loop of ``mm_out`` over the groups into a fresh output; from 32 MiB that output is
mapped anew and faulted in on every step (see :mod:`~lightning_llmfast.moe.kernels.host_memory`). This runs the same
loop, one ``torch.mm(out=)`` per group into a slice of an output from the pool, so the result has the same bits
and costs no page faults once the pool holds its buffer: a ``(65536, 256) x (64, 256, 1024)`` grouped GEMM took
430 ms instead of 560 ms on this project's CPU (one thread, 2026-12-02). Elsewhere (accelerators, smaller outputs,
the pool turned off) :func:`grouped_mm` is ``F.grouped_mm``.

Like ATen's CPU kernel, the loop reads the group ends on the host; it runs only for CPU tensors, where there is no
device to wait for, inside one op registered for the CPU alone (``lightning_llmfast::host_grouped_mm``), under
:func:`~lightning_llmfast.bench.counters.host_kernel`.

Example::

    out = grouped_mm(rows, weight, ends)  # (M, K) x (E, K, N) -> (M, N); (K, M) x (M, N) -> (E, K, N)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast.bench.counters import host_kernel
from lightning_llmfast.moe.kernels import host_memory

__all__ = ["grouped_mm", "grouped_mm_shape"]


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)``; on CPU with an output of 32 MiB or more, into a pooled buffer.

    Args:
        a: ``(M, K)`` rows grouped along ``M`` (with ``b`` ``(E, K, N)``), or ``(K, M)`` (with ``b`` ``(M, N)``: the
            weight gradient, groups along ``M``).
        b: ``(E, K, N)`` or ``(M, N)``.
        offs: ``(E,)`` int32 group ends.

    Returns:
        ``(M, N)`` or ``(E, K, N)``; as with ``F.grouped_mm``, rows past the last end are left unwritten. Called
        where autograd records it (inputs that require grad, grad mode on) it is ``F.grouped_mm``: the loop is a
        kernel for the custom ops' implementations, which compute their own gradients.
    """
    differentiable = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if a.device.type != "cpu" or differentiable or not host_memory.pooled(grouped_mm_shape(a, b, offs), a.dtype):
        return F.grouped_mm(a, b, offs=offs)
    return torch.ops.lightning_llmfast.host_grouped_mm(a, b, offs)


def grouped_mm_shape(a: Tensor, b: Tensor, offs: Tensor) -> tuple[int, ...]:
    """The shape of ``grouped_mm(a, b, offs)``: ``(M, N)`` for ``b`` ``(E, K, N)``, else ``(E, K, N)``."""
    return (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[-1])


@torch.library.custom_op("lightning_llmfast::host_grouped_mm", mutates_args=(), device_types="cpu")
def _host_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """ATen's CPU ``grouped_mm`` loop into an output from the pool."""
    with host_kernel():  # a CPU kernel reading host memory: no sync (see SyncCounter)
        ends = offs.tolist()
    out = host_memory.empty_rows(*grouped_mm_shape(a, b, offs), dtype=a.dtype, device=a.device)
    start = 0
    for group, end in enumerate(ends):
        if b.dim() == 3:
            torch.mm(a[start:end], b[group], out=out[start:end])
        else:
            torch.mm(a[:, start:end], b[start:end], out=out[group])  # an empty group: zeros
        start = end
    return out


@_host_grouped_mm.register_fake
def _host_grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(grouped_mm_shape(a, b, offs))
