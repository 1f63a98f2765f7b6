"""Permute gather and weighted combine (the data movement of permute/unpermute) in Triton, with their PyTorch
references: sync-free, without atomics, accumulating in float32 in a fixed order.

Example::

    rows = gather_rows(x, src)  # rows[r] = x[src[r]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import is_triton, tl, triton, triton_jit

__all__ = [
    "acc_dtype",
    "combine_rows",
    "combine_rows_reference",
    "combine_rows_triton",
    "gather_rows",
    "gather_rows_reference",
    "gather_rows_triton",
    "scale_rows",
]


def acc_dtype(data: Tensor) -> torch.dtype:
    """Accumulation dtype for activations ``data``: float32, or float64 for float64 data (gradcheck).

    Example::

        acc_dtype(torch.zeros(2, dtype=torch.bfloat16))  # torch.float32
    """
    return torch.float64 if data.dtype == torch.float64 else torch.float32


def gather_rows_reference(
    x: Tensor, src: Tensor, num_valid: Tensor | None = None, scale: Tensor | None = None, *, out: Tensor | None = None
) -> Tensor:
    """PyTorch reference of the permute gather: ``out[r] = scale[r] * x[src[r]]`` for ``r < num_valid``, zero after.

    Args:
        x: ``(num_tokens, hidden)``.
        src: ``(num_rows,)`` int64 row indices into ``x``.
        num_valid: 0-d integer tensor, or ``None`` when every row is valid. Rows from ``num_valid`` on are padding
            that keeps the output size static (capacity routing) and are zeroed.
        scale: optional ``(num_rows,)`` per-row factor, applied in float32 (float64 for float64 ``x``) before
            the cast back.
        out: a contiguous ``(num_rows, hidden)`` buffer of ``x``'s dtype to write into, or ``None`` (a new tensor).

    Returns:
        ``(num_rows, hidden)`` with the dtype of ``x`` (``out`` when given).

    Example::

        y = gather_rows_reference(x, torch.tensor([2, 0]))  # rows 2 and 0 of x
    """
    rows = x.index_select(0, src)
    if scale is not None:
        rows = scale_rows(rows, scale)
    if num_valid is not None:
        row_ok = torch.arange(src.numel(), device=src.device) < num_valid
        rows = rows.masked_fill(~row_ok.unsqueeze(1), 0)  # a fill, not a product: inf * 0 would be NaN
    if out is None:
        return rows
    return out.copy_(rows)


def scale_rows(rows: Tensor, scale: Tensor) -> Tensor:
    """``rows[r] * scale[r]``, the product taken in the accumulation dtype (:func:`acc_dtype`) and rounded once to
    ``rows``' dtype: ``rows`` ``(n, hidden)``, ``scale`` ``(n,)``.

    Example::

        weighted = scale_rows(torch.randn(3, 4), torch.tensor([0.5, 1.0, 2.0]))
    """
    return (rows * scale.to(acc_dtype(rows)).unsqueeze(1)).to(rows.dtype)


@triton_jit
def _gather_rows_kernel(
    x_ptr,
    src_ptr,
    num_valid_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    hidden,
    stride_x,
    stride_out,
    HAS_NUM_VALID: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r, :] = scale[r] * x[src[r], :]`` for a tile of rows and columns; padding rows are written as zeros."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if HAS_NUM_VALID:
        # Padding rows are neither read nor left uninitialised: zeros keep the expert GEMMs finite.
        read_ok = row_ok & (rows < tl.load(num_valid_ptr))
    else:
        read_ok = row_ok
    col_ok = cols < hidden
    vals = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=read_ok[:, None] & col_ok[None, :], other=0)
    if HAS_SCALE:
        factor = tl.load(scale_ptr + rows, mask=row_ok, other=0)
        vals = (vals.to(factor.dtype) * factor[:, None]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, vals, mask=row_ok[:, None] & col_ok[None, :])


def _tile_sizes(hidden: int) -> tuple[int, int]:
    """(rows, columns) per program: up to 256 columns and about 4096 elements per tile."""
    block_h = min(triton.next_power_of_2(max(hidden, 1)), 256)
    return max(1, min(16, 4096 // block_h)), block_h


def gather_rows_triton(
    x: Tensor, src: Tensor, num_valid: Tensor | None = None, scale: Tensor | None = None, *, out: Tensor | None = None
) -> Tensor:
    """Triton permute gather; same contract and outputs as :func:`gather_rows_reference`.

    Example::

        y = gather_rows_triton(x, plan.permutation.long() // plan.top_k)
    """
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, hidden = src.numel(), x.shape[1]
    if out is None:
        out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return out
    block_r, block_h = _tile_sizes(hidden)
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(hidden, block_h))
    _gather_rows_kernel[grid](
        x,
        src.contiguous(),
        num_valid if num_valid is not None else src,  # any tensor: never read when HAS_NUM_VALID is False
        scale.to(acc_dtype(x)).contiguous() if scale is not None else src,
        out,
        num_rows,
        hidden,
        x.stride(0),
        out.stride(0),
        HAS_NUM_VALID=num_valid is not None,
        HAS_SCALE=scale is not None,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
    )
    return out


def gather_rows(
    x: Tensor,
    src: Tensor,
    num_valid: Tensor | None = None,
    scale: Tensor | None = None,
    *,
    backend: str = "torch",
    out: Tensor | None = None,
) -> Tensor:
    """Permute gather ``out[r] = scale[r] * x[src[r]]`` (zero from row ``num_valid`` on); Triton or PyTorch.

    Args:
        x: ``(num_tokens, hidden)``.
        src: ``(num_rows,)`` int64 row indices into ``x``.
        num_valid: 0-d integer tensor or ``None`` (all rows valid).
        scale: optional ``(num_rows,)`` per-row factor.
        backend: ``"torch"`` or ``"triton"`` (already resolved).
        out: a contiguous ``(num_rows, hidden)`` buffer of ``x``'s dtype to write into, or ``None``.

    Returns:
        ``(num_rows, hidden)`` in the dtype of ``x`` (``out`` when given).

    Example::

        y = gather_rows(x, torch.tensor([2, 0]))
    """
    if is_triton(backend):
        return gather_rows_triton(x, src, num_valid, scale, out=out)
    return gather_rows_reference(x, src, num_valid, scale, out=out)


def combine_rows_reference(
    rows: Tensor, positions: Tensor, weights: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """PyTorch reference of the weighted combine: ``out[t] = sum_s weights[t, s] * rows[positions[t, s]]``.

    Summed in float32 (float64 for float64 rows) slot after slot, without atomics: bitwise reproducible.

    Args:
        rows: ``(num_rows, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        weights: ``(num_tokens, k)`` factors, or ``None`` for a plain sum.
        out_dtype: dtype of the result (default: that of ``rows``); a wider one keeps the float32 sums unrounded.

    Returns:
        ``(num_tokens, hidden)`` in ``out_dtype``.

    Example::

        out = combine_rows_reference(rows, torch.tensor([[0, 2], [1, 3]]), torch.full((2, 2), 0.5))
    """
    (num_tokens, top_k), hidden = positions.shape, rows.shape[1]
    acc = acc_dtype(rows)
    out = rows.new_zeros(num_tokens, hidden, dtype=acc)
    for slot in range(top_k):
        gathered = rows.index_select(0, positions[:, slot]).to(acc)
        out = out + (gathered if weights is None else gathered * weights[:, slot : slot + 1].to(acc))
    return out.to(out_dtype or rows.dtype)


@triton_jit
def _combine_rows_kernel(
    rows_ptr,
    positions_ptr,
    weights_ptr,
    out_ptr,
    num_tokens,
    hidden,
    stride_rows,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One tile of tokens and columns: accumulate the k weighted rows in a fixed order, in registers."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tokens < num_tokens
    mask = tok_ok[:, None] & (cols < hidden)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC)
    for s in tl.static_range(TOP_K):
        pair = tokens.to(tl.int64) * TOP_K + s
        pos = tl.load(positions_ptr + pair, mask=tok_ok, other=0)
        vals = tl.load(rows_ptr + pos[:, None] * stride_rows + cols[None, :], mask=mask, other=0).to(ACC)
        if HAS_WEIGHTS:
            vals = vals * tl.load(weights_ptr + pair, mask=tok_ok, other=0).to(ACC)[:, None]
        acc += vals
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows_triton(
    rows: Tensor, positions: Tensor, weights: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Triton weighted combine; same contract as :func:`combine_rows_reference` (float32 accumulation in order).

    Reads each pair's row once in its own dtype and writes ``(num_tokens, hidden)`` once: no ``(T, k, H)``
    intermediate.

    Example::

        out = combine_rows_triton(rows, positions, plan.weights)
    """
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    (num_tokens, top_k), hidden = positions.shape, rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or rows.dtype, device=rows.device)
    if num_tokens == 0 or hidden == 0:
        return out
    acc = acc_dtype(rows)
    block_t, block_h = _tile_sizes(hidden)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_rows_kernel[grid](
        rows,
        positions.contiguous(),
        weights.to(acc).contiguous() if weights is not None else positions,  # never read without HAS_WEIGHTS
        out,
        num_tokens,
        hidden,
        rows.stride(0),
        out.stride(0),
        TOP_K=top_k,
        HAS_WEIGHTS=weights is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
    )
    return out


def combine_rows(
    rows: Tensor,
    positions: Tensor,
    weights: Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    backend: str = "torch",
) -> Tensor:
    """Weighted combine ``out[t] = sum_s weights[t, s] * rows[positions[t, s]]``; Triton or the PyTorch reference.

    Args:
        rows: ``(num_rows, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        weights: ``(num_tokens, k)`` factors, or ``None`` for a plain sum.
        out_dtype: dtype of the result (default: that of ``rows``).
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``(num_tokens, hidden)`` in ``out_dtype``.

    Example::

        out = combine_rows(rows, positions, weights)
    """
    if is_triton(backend):
        return combine_rows_triton(rows, positions, weights, out_dtype)
    return combine_rows_reference(rows, positions, weights, out_dtype)
