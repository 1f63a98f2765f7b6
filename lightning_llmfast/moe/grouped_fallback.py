"""Sync-free grouped GEMMs where ``torch.nn.functional.grouped_mm`` refuses the inputs.

``grouped_mm`` runs CPU float32/bfloat16/float16 and CUDA bfloat16 (sm80+), with 16-byte aligned sizes and
strides. Its own CUDA fallback for other dtypes copies the offsets to the host (``offs.cpu()``), and a per-expert
loop slices rows with host offsets: both sync every MoE layer. The precision plugins produce float32 (``32-true``),
float16 (``16-mixed``) and bfloat16; for each this module offers a path without a host read:

- sizes not 16-byte aligned (``H`` or ``F`` odd for the dtype): :func:`aligned_operands` zero-pads ``H`` and ``F``
  to the alignment, so ``grouped_mm`` accepts them; a zero column adds nothing to any dot product and
  ``act(0) * 0 = 0`` for the padded gate/up columns, so the sliced result is exact;
- CUDA float32 / float16 (and bfloat16 before sm80): :func:`grouped_gemm_triton`, a Triton grouped GEMM whose
  programs find their expert from the device offsets (grid ``cdiv(M, BM) + E`` row tiles, a host-known bound),
  with its backward (the input gradient by the same kernel on the transposed weights, the weight gradient by a
  per-expert reduction over the expert's rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast.moe.kernels import triton, triton_available

if triton is not None:
    import triton.language as tl

__all__ = ["aligned_operands", "grouped_gemm_triton", "grouped_mm_dtype_ok", "triton_grouped_swiglu", "use_triton"]

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def grouped_mm_dtype_ok(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``grouped_mm`` takes these dtypes on this device (alignment aside). Host metadata only."""
    if not hasattr(F, "grouped_mm") or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    if x.device.type == "cuda":
        # grouped_mm's CUDA kernels are bf16-only and need sm80+ (CUTLASS grouped GEMM).
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and x.dtype in _CPU_DTYPES


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def aligned_operands(x: Tensor, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(x, gate_up, down)`` zero-padded so ``H`` and ``F`` meet ``grouped_mm``'s 16-byte alignment, or ``None``.

    ``None`` when ``grouped_mm`` does not take the dtype on this device (padding cannot help). The gate and up
    halves are padded separately so the ``[gate | up]`` split still falls in the middle. The result of the padded
    experts, sliced to ``[:, :H]``, equals the unpadded one; gradients flow back through the padding.

    Example::

        xp, gate_up_p, down_p = aligned_operands(x, gate_up, down)  # H=12, F=12 in bf16 -> H=16, F=16
    """
    if not grouped_mm_dtype_ok(x, gate_up, down):
        return None
    align = 16 // x.element_size()
    hidden, ffn = x.shape[1], down.shape[1]
    pad_h, pad_f = _round_up(hidden, align) - hidden, _round_up(ffn, align) - ffn
    gate, up = gate_up[..., :ffn], gate_up[..., ffn:]
    gate_up = torch.cat([F.pad(gate, (0, pad_f, 0, pad_h)), F.pad(up, (0, pad_f, 0, pad_h))], dim=-1)
    return F.pad(x, (0, pad_h)), gate_up, F.pad(down, (0, pad_h, 0, pad_f))


def use_triton(x: Tensor) -> bool:
    """Whether :func:`triton_grouped_swiglu` runs on ``x`` (Triton for its device, a dtype it multiplies)."""
    return x.dtype in _TRITON_DTYPES and triton_available(x.device)


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        x_ptr, w_ptr, out_ptr, offs_ptr, N, K, num_experts,
        sxm, sxk, swe, swk, swn, som, son,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # Row tile pid_m -> (expert, first row): the experts' tiles in order, counted from the device offsets.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = pid_m * 0 - 1
        row0 = pid_m * 0
        row_end = pid_m * 0
        seen = pid_m * 0
        for e in range(num_experts):
            start = tl.load(offs_ptr + e).to(tl.int32)
            end = tl.load(offs_ptr + e + 1).to(tl.int32)
            tiles = (end - start + BM - 1) // BM
            hit = (pid_m >= seen) & (pid_m < seen + tiles)
            expert = tl.where(hit, e, expert)
            row0 = tl.where(hit, start + (pid_m - seen) * BM, row0)
            row_end = tl.where(hit, end, row_end)
            seen += tiles
        if expert >= 0:
            rows = row0 + tl.arange(0, BM)
            cols = pid_n * BN + tl.arange(0, BN)
            row_ok, col_ok = rows < row_end, cols < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                a = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, (row_ok[:, None]) & (ks[None, :] < K), 0.0)
                b = tl.load(
                    w_ptr + expert * swe + ks[:, None] * swk + cols[None, :] * swn,
                    (ks[:, None] < K) & (col_ok[None, :]),
                    0.0,
                )
                if IEEE:
                    acc += tl.dot(a, b, input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
            out = out_ptr + rows[:, None] * som + cols[None, :] * son
            tl.store(out, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(
        x_ptr, g_ptr, out_ptr, offs_ptr, K, N,
        sxm, sxk, sgm, sgn, soe, sok, son,
        BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # grad_w[e] = x[rows of e].T @ g[rows of e], summed over the expert's rows in BM chunks.
        e, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(offs_ptr + e).to(tl.int32)
        end = tl.load(offs_ptr + e + 1).to(tl.int32)
        ks = pid_k * BK + tl.arange(0, BK)
        cols = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for m0 in range(start, end, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < end
            a = tl.load(x_ptr + rows[None, :] * sxm + ks[:, None] * sxk, (ks[:, None] < K) & row_ok[None, :], 0.0)
            b = tl.load(g_ptr + rows[:, None] * sgm + cols[None, :] * sgn, row_ok[:, None] & (cols[None, :] < N), 0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        out = out_ptr + e * soe + ks[:, None] * sok + cols[None, :] * son
        tl.store(out, acc.to(out_ptr.dtype.element_ty), (ks[:, None] < K) & (cols[None, :] < N))


_BLOCK = 32  # tl.dot needs tiles of at least 16; 32 keeps the interpreter's work small and the GPU busy enough


def _forward(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``out[r] = x[r] @ w[e]`` for the rows ``offsets[e]:offsets[e+1]``; rows outside every group are zero."""
    rows, num_experts, n = x.shape[0], w.shape[0], w.shape[2]
    out = x.new_zeros(rows, n)
    if rows and n:
        grid = (triton.cdiv(rows, _BLOCK) + num_experts, triton.cdiv(n, _BLOCK))
        _grouped_gemm_kernel[grid](
            x, w, out, offsets, n, x.shape[1], num_experts, *x.stride(), *w.stride(), *out.stride(),
            BM=_BLOCK, BN=_BLOCK, BK=_BLOCK, IEEE=x.dtype == torch.float32,
        )  # fmt: skip
    return out


def _weight_grad(x: Tensor, grad: Tensor, offsets: Tensor, num_experts: int) -> Tensor:
    k, n = x.shape[1], grad.shape[1]
    out = x.new_zeros(num_experts, k, n)
    if x.shape[0] and k and n:
        grid = (num_experts, triton.cdiv(k, _BLOCK), triton.cdiv(n, _BLOCK))
        _grouped_wgrad_kernel[grid](
            x, grad, out, offsets, k, n, *x.stride(), *grad.stride(), *out.stride(),
            BM=_BLOCK, BK=_BLOCK, BN=_BLOCK, IEEE=x.dtype == torch.float32,
        )  # fmt: skip
    return out


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offsets)
        return _forward(x, w, offsets)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, offsets = ctx.saved_tensors
        grad_x = _forward(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(x, grad, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_gemm_triton(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Grouped GEMM without a host read: rows ``offsets[e]:offsets[e+1]`` of ``x`` times ``w[e]``; differentiable.

    Args:
        x: ``(M, K)`` rows grouped by expert.
        w: ``(E, K, N)`` weights (any strides).
        offsets: ``(E+1,)`` integer group boundaries on ``x``'s device (``offsets[0] == 0``); rows from
            ``offsets[-1]`` on belong to no group and come back as zeros, with zero gradient.

    Returns:
        ``(M, N)`` in ``x``'s dtype (products accumulated in float32; float32 inputs without TF32).

    Example::

        y = grouped_gemm_triton(x, experts.down_proj, offsets)
    """
    return _GroupedGemm.apply(x, w, offsets)


def triton_grouped_swiglu(
    x: Tensor, offsets: Tensor, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]
) -> Tensor:
    """SwiGLU experts (``act(gate) * up`` then ``down``) over grouped rows with :func:`grouped_gemm_triton`."""
    gate, up = grouped_gemm_triton(x, gate_up, offsets).chunk(2, dim=-1)
    return grouped_gemm_triton(act(gate) * up, down, offsets)
