"""Per-pair dot products (the combine's weight gradient) and the combine's backward in Triton, with their
PyTorch references.

Example::

    row_dots = pair_dots(a, b, torch.arange(a.shape[0])[:, None])  # (M, 1): <a[r], b[r]>
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import is_triton, tl, triton, triton_jit
from lightning_llmfast.moe.kernels.rows import acc_dtype, gather_rows_reference, gather_rows_triton

__all__ = [
    "row_dots",
    "combine_rows_backward",
    "combine_rows_backward_reference",
    "combine_rows_backward_triton",
    "pair_dots",
    "pair_dots_reference",
    "pair_dots_triton",
]


def row_dots(a: Tensor, b: Tensor, *, backend: str = "torch") -> Tensor:
    """``dots[r] = <a[r], b[r]>`` of two ``(M, F)`` row tensors: ``(M,)`` in float32 (float64 for float64 rows).

    :func:`pair_dots` with the identity for positions, without gathering the rows through it (on the reference
    path one batched product: the same bits as ``pair_dots(a, b, arange(M)[:, None])``).

    Example::

        grad_scale = row_dots(product, grad_product)  # the routing weights' gradient, one dot per row
    """
    if is_triton(backend):
        rows = torch.arange(a.shape[0], device=a.device).unsqueeze(1)
        return pair_dots_triton(a, b, rows).view(-1)
    acc = acc_dtype(a)
    return torch.bmm(a.to(acc).unsqueeze(1), b.to(acc).unsqueeze(2)).view(-1)


def pair_dots_reference(rows: Tensor, grad: Tensor, positions: Tensor) -> Tensor:
    """PyTorch reference of ``dots[t, s] = <rows[positions[t, s]], grad[t]>`` (the combine's weight gradient).

    Args:
        rows: ``(num_rows, hidden)``.
        grad: ``(num_tokens, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.

    Returns:
        ``(num_tokens, k)`` in float32 (float64 for float64 rows).

    Example::

        grad_weights = pair_dots_reference(rows, grad_out, positions)
    """
    num_tokens, top_k = positions.shape
    acc = acc_dtype(rows)
    gathered = rows.index_select(0, positions.reshape(-1)).view(num_tokens, top_k, rows.shape[1]).to(acc)
    return torch.bmm(gathered, grad.to(acc).unsqueeze(2)).squeeze(2)


@triton_jit
def _pair_dots_kernel(
    rows_ptr,
    grad_ptr,
    positions_ptr,
    out_ptr,
    num_pairs,
    hidden,
    stride_rows,
    stride_grad,
    TOP_K: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """A tile of pairs: dot products accumulated over column chunks, in a fixed order."""
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < num_pairs
    pos = tl.load(positions_ptr + pairs, mask=pair_ok, other=0)
    tokens = (pairs // TOP_K).to(tl.int64)
    acc = tl.zeros([BLOCK_P], dtype=ACC)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = pair_ok[:, None] & (cols < hidden)[None, :]
        a = tl.load(rows_ptr + pos[:, None] * stride_rows + cols[None, :], mask=mask, other=0).to(ACC)
        b = tl.load(grad_ptr + tokens[:, None] * stride_grad + cols[None, :], mask=mask, other=0).to(ACC)
        acc += tl.sum(a * b, axis=1)
    tl.store(out_ptr + pairs, acc, mask=pair_ok)


def pair_dots_triton(rows: Tensor, grad: Tensor, positions: Tensor) -> Tensor:
    """Triton per-pair dot products; same contract as :func:`pair_dots_reference`.

    Example::

        grad_weights = pair_dots_triton(rows, grad_out, positions)
    """
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    num_tokens, top_k = positions.shape
    acc = acc_dtype(rows)
    out = torch.empty(num_tokens, top_k, dtype=acc, device=rows.device)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    block_h = min(triton.next_power_of_2(max(rows.shape[1], 1)), 128)
    block_p = 32
    _pair_dots_kernel[(triton.cdiv(num_pairs, block_p),)](
        rows,
        grad,
        positions.contiguous(),
        out,
        num_pairs,
        rows.shape[1],
        rows.stride(0),
        grad.stride(0),
        TOP_K=top_k,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_P=block_p,
        BLOCK_H=block_h,
    )
    return out


def pair_dots(rows: Tensor, grad: Tensor, positions: Tensor, *, backend: str = "torch") -> Tensor:
    """Per-pair dot products ``dots[t, s] = <rows[positions[t, s]], grad[t]>``; Triton or the PyTorch reference.

    Args:
        rows: ``(num_rows, hidden)``.
        grad: ``(num_tokens, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``(num_tokens, k)`` in float32 (float64 for float64 rows).

    Example::

        row_dots = pair_dots(a, b, torch.arange(a.shape[0])[:, None])  # (M, 1): <a[r], b[r]>
    """
    if is_triton(backend):
        return pair_dots_triton(rows, grad, positions)
    return pair_dots_reference(rows, grad, positions)


def combine_rows_backward_reference(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of the combine's backward: ``(gather_rows_reference(grad, src, scale=scale),
    pair_dots_reference(rows, grad, positions))``.

    Args:
        grad: ``(num_tokens, hidden)`` gradient of the combined output.
        rows: ``(num_rows, hidden)`` the combined rows.
        src: ``(num_rows,)`` int64 token of each row.
        scale: ``(num_rows,)`` weight of each row.
        positions: ``(num_tokens, k)`` int64 row of each pair.

    Returns:
        ``grad_rows`` ``(num_rows, hidden)`` in the dtype of ``grad`` and ``grad_weights`` ``(num_tokens, k)`` in
        float32 (float64 for float64 rows).

    Example::

        grad_rows, grad_weights = combine_rows_backward_reference(grad_out, rows, tokens, row_weights, positions)
    """
    return gather_rows_reference(grad, src, scale=scale), pair_dots_reference(rows, grad, positions)


def combine_rows_backward_triton(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """Triton combine backward; same contract as :func:`combine_rows_backward_reference`.

    The scaled gather and the per-pair dots read ``grad`` and ``rows`` directly in their kernels, so two launches
    with no intermediate buffer.

    Example::

        grad_rows, grad_weights = combine_rows_backward_triton(grad_out, rows, tokens, row_weights, positions)
    """
    return gather_rows_triton(grad, src, scale=scale), pair_dots_triton(rows, grad, positions)


def combine_rows_backward(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor, *, backend: str = "torch"
) -> tuple[Tensor, Tensor]:
    """Gradients of the weighted combine for the rows and the weights; Triton or the PyTorch reference.

    ``grad_rows[r] = scale[r] * grad[src[r]]`` and ``grad_weights[t, s] = <rows[positions[t, s]], grad[t]>``.

    Args:
        grad: ``(num_tokens, hidden)``.
        rows: ``(num_rows, hidden)``.
        src: ``(num_rows,)`` int64 token of each row.
        scale: ``(num_rows,)`` weight of each row.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``grad_rows`` ``(num_rows, hidden)`` (dtype of ``grad``) and ``grad_weights`` ``(num_tokens, k)`` (float32,
        float64 for float64 rows).

    Example::

        grad_rows, grad_weights = combine_rows_backward(grad_out, rows, tokens, row_weights, positions)
    """
    if is_triton(backend):
        return combine_rows_backward_triton(grad, rows, src, scale, positions)
    return combine_rows_backward_reference(grad, rows, src, scale, positions)
