"""Permute gather and weighted combine (the data movement of permute/unpermute) in Triton, with their PyTorch
references: sync-free, without atomics, accumulating in float32 in a fixed order.

Example::

    rows = gather_rows(x, src)  # rows[r] = x[src[r]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import _jit, is_triton, tl, triton
from lightning_llmfast.moe.kernels.host_memory import empty_rows

__all__ = [
    "combine_rows",
    "combine_rows_reference",
    "combine_rows_triton",
    "gather_rows",
    "gather_rows_reference",
    "gather_rows_triton",
]

# Elements per chunk of the PyTorch references' gathers: 1 MiB of float32, inside a CPU core's L2 with the
# chunk's other operands (measured on this project's CPU: 2**17 to 2**18 are equally fast, 2**19 is slower).
_CHUNK_ELEMENTS = 1 << 18


def _acc_dtype(data: Tensor) -> torch.dtype:
    """Accumulation dtype for activations ``data``: float32, or float64 for float64 data (gradcheck)."""
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
    if out is None and torch.is_grad_enabled() and x.requires_grad:  # differentiable: no out=
        out = x.index_select(0, src)
    else:
        if out is None:
            out = empty_rows(src.numel(), x.shape[1], dtype=x.dtype, device=x.device)
        torch.index_select(x, 0, src, out=out)
    if scale is not None:
        _scale_rows_(out, scale)
    if num_valid is not None:
        row_ok = torch.arange(src.numel(), device=src.device) < num_valid
        out.masked_fill_(~row_ok.unsqueeze(1), 0)  # a fill, not a product: inf * 0 would be NaN
    return out


def _scale_rows_(rows: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """``out[r] = rows[r] * scale[r]``, in place unless ``out`` is given; ``rows`` ``(n, hidden)``, ``scale`` ``(n,)``.

    One pass: the product is taken in the accumulation dtype (type promotion with the float32 scale) and rounded
    once into ``out``, the same bits as casting ``rows`` up, multiplying and casting back, without the wide copy.
    In place by default because the callers own ``rows`` (a fresh gather or GEMM output): a new ``(n, hidden)``
    buffer would cost a pass of page faults on CPU, where large allocations come fresh from the OS. Under a
    ``create_graph`` backward, where ``out=`` cannot be differentiated, a new tensor with the same bits instead.
    """
    factor = scale.to(_acc_dtype(rows)).unsqueeze(1)
    if torch.is_grad_enabled() and (rows.requires_grad or scale.requires_grad):
        return (rows * factor).to(rows.dtype)
    return torch.mul(rows, factor, out=rows if out is None else out)


def _chunk_size(row_elements: int, length: int) -> int:
    """Rows per chunk so that a chunk of ``row_elements``-element rows stays cache resident.

    The PyTorch references gather, reduce and scale chunk by chunk: each ``(chunk, hidden)`` tile is reused from
    cache instead of streaming a ``(T * k, hidden)`` intermediate through memory (about 2x faster on CPU at
    T=8192, k=8, H=256). ``torch.compile`` never traces these loops: :mod:`~lightning_llmfast.moe.permute` calls
    the references from inside opaque custom ops, so compiled and eager runs execute the same chunked code.
    """
    return max(1, _CHUNK_ELEMENTS // max(row_elements, 1))


@_jit
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
        scale.to(_acc_dtype(x)).contiguous() if scale is not None else src,
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

    Summed in float32 (float64 for float64 rows) in slot order, without atomics: bitwise reproducible. On CPU the
    tokens go in cache-sized chunks (:func:`_chunk_size`): for each, every slot's rows are gathered into one reused
    tile and accumulated into the chunk's sums, which stay in cache across the slots (streaming the whole ``(T,
    hidden)`` sums through memory once per slot measured 2-4x slower at T=4096-8192, k=2-8, H=256; a batched product
    per token, 10-30x slower). Elsewhere one chunk: each op is a kernel launch there.

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
    acc = _acc_dtype(rows)
    if top_k == 0:
        return rows.new_zeros(num_tokens, hidden, dtype=out_dtype or rows.dtype)
    out = empty_rows(num_tokens, hidden, dtype=acc, device=rows.device)
    factors = None if weights is None else weights.to(acc)
    # An unweighted first slot initialises the sums (adding it to zeros, but -0.0 kept): gathered straight into them
    # when they have its dtype, a pass fewer.
    direct = factors is None and acc == rows.dtype
    chunk = _chunk_size(2 * hidden, num_tokens) if rows.device.type == "cpu" else max(num_tokens, 1)
    tile = rows.new_empty(min(chunk, num_tokens), hidden)  # reused by every chunk and slot
    by_slot = positions.t().contiguous()  # (k, T): each slot's rows of a chunk are contiguous indices
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        sums, gathered = out[start:stop], tile[: stop - start]
        for slot in range(top_k):
            index = by_slot[slot, start:stop]
            if slot == 0 and direct:
                torch.index_select(rows, 0, index, out=sums)
                continue
            torch.index_select(rows, 0, index, out=gathered)
            factor = None if factors is None else factors[start:stop, slot : slot + 1]
            if slot == 0 and factor is None:
                sums.copy_(gathered)
            elif slot == 0:
                torch.mul(gathered, factor, out=sums)
            elif factor is None:
                sums.add_(gathered)
            else:
                sums.addcmul_(gathered, factor)
    return out.to(out_dtype or rows.dtype)


@_jit
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
    acc = _acc_dtype(rows)
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
