"""The SwiGLU activation between the two expert GEMMs, forward and backward each in one Triton launch, with their
PyTorch references.

Forward: ``p[r] = scale[r] * silu(gate[r]) * up[r]`` of ``(M, 2F)`` ``[gate | up]`` rows. The routing weight
``scale`` is applied to the down projection's input rather than its output (``(scale * p) @ W == scale * (p @ W)``
row by row), so that the combine after the GEMM is a plain sum and nothing but ``gate_up`` is kept for backward.

Backward, from ``grad`` (the gradient of the scaled ``p``, what the down projection's data gradient gives): the
``(M, 2F)`` gradient of ``gate_up`` for ``scale * grad``, the scaled product again (the down projection's weight
gradient needs it; recomputed rather than kept) and the routing weights' gradient ``<grad[r], p[r]>``. On the
reference path that is silu, two products, ``silu_backward``, two row scalings and a batched dot (seven launches on a
GPU), on the Triton path one kernel that reads ``gate_up`` and ``grad`` once.

Example::

    p = swiglu_forward(gate_up, scale)  # (M, F)
    grad_gate_up, p_again, grad_scale = swiglu_backward(grad_p, gate_up, scale, need_product=True, need_dots=True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmfast.moe.kernels.backend import is_triton, tl, triton, triton_jit
from lightning_llmfast.moe.kernels.rows import acc_dtype, scale_rows

__all__ = [
    "swiglu_backward",
    "swiglu_backward_reference",
    "swiglu_backward_triton",
    "swiglu_forward",
    "swiglu_forward_reference",
    "swiglu_forward_triton",
    "swiglu_grads",
]

SwigluGrads = tuple[Tensor, Tensor | None, Tensor | None]


def swiglu_forward_reference(gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    """PyTorch reference: ``silu(gate) * up`` in the input's dtype, times ``scale`` per row (in float32, one rounding).

    Args:
        gate_up: ``(M, 2F)``, the gate half first.
        scale: optional ``(M,)`` per-row factor.

    Returns:
        ``(M, F)`` in ``gate_up``'s dtype.

    Example::

        p = swiglu_forward_reference(torch.randn(3, 8))  # (3, 4)
    """
    gate, up = gate_up.chunk(2, dim=-1)
    product = F.silu(gate) * up
    return product if scale is None else scale_rows(product, scale)


def swiglu_backward_reference(
    grad: Tensor,
    gate_up: Tensor,
    scale: Tensor | None = None,
    *,
    need_product: bool = True,
    need_dots: bool = True,
    product_in_grad: bool = False,
) -> SwigluGrads:
    """PyTorch reference of the backward: ``(grad_gate_up, scaled product or None, dots or None)``.

    Written in ops autograd can differentiate, so it also serves a ``create_graph`` backward.

    Args:
        grad: ``(M, F)`` gradient of the (scaled) forward output.
        gate_up: ``(M, 2F)`` the forward's input.
        scale: the forward's ``(M,)`` factors, or ``None``.
        need_product: also return the forward's output again.
        need_dots: also return ``dots[r] = <grad[r], silu(gate[r]) * up[r]>`` (``(M,)``, float32; float64 for
            float64 rows): the gradient of ``scale``.
        product_in_grad: write the product over ``grad`` (a contiguous buffer of ``gate_up``'s dtype that the caller
            owns and needs no more) instead of returning a new ``(M, F)`` tensor: one buffer fewer held.

    Returns:
        ``grad_gate_up`` ``(M, 2F)`` (``gate_up``'s dtype, contiguous), the product (``grad`` itself with
        ``product_in_grad``), the dots.
    """
    buffer = grad
    gate, up = gate_up.chunk(2, dim=-1)
    silu = F.silu(gate)
    product = silu * up
    acc = acc_dtype(product)
    dots = (product.to(acc) * grad.to(acc)).sum(-1) if need_dots else None
    if scale is not None:
        grad, product = scale_rows(grad, scale), scale_rows(product, scale)
    grad_gate_up = torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * silu], dim=-1).to(gate_up.dtype)
    if not need_product:
        return grad_gate_up, None, dots
    return grad_gate_up, buffer.copy_(product) if product_in_grad else product, dots


@triton_jit
def _swiglu_forward_kernel(
    gate_up_ptr, scale_ptr, out_ptr, rows, ffn, stride_in, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):  # fmt: skip
    """One tile of rows and columns: ``out = scale * silu(gate) * up``, computed in float32, rounded once."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (r < rows)[:, None] & (c < ffn)[None, :]
    base = gate_up_ptr + r[:, None].to(tl.int64) * stride_in + c[None, :]
    gate = tl.load(base, mask=mask, other=0).to(tl.float32)
    up = tl.load(base + ffn, mask=mask, other=0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + r, mask=r < rows, other=0).to(tl.float32)[:, None]
    tl.store(out_ptr + r[:, None].to(tl.int64) * ffn + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton_jit
def _swiglu_backward_kernel(
    grad_ptr, gate_up_ptr, scale_ptr, grad_gate_up_ptr, product_ptr, dots_ptr, rows, ffn, stride_in,
    HAS_SCALE: tl.constexpr, NEED_PRODUCT: tl.constexpr, NEED_DOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):  # fmt: skip
    """A band of rows, every column: both halves' gradients, the scaled product and the row dots, in float32."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    factor = tl.load(scale_ptr + r, mask=row_ok, other=0).to(tl.float32) if HAS_SCALE else 1.0
    dots = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, ffn, BLOCK_F):
        c = start + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (c < ffn)[None, :]
        base = gate_up_ptr + r[:, None].to(tl.int64) * stride_in + c[None, :]
        gate = tl.load(base, mask=mask, other=0).to(tl.float32)
        up = tl.load(base + ffn, mask=mask, other=0).to(tl.float32)
        grad = tl.load(grad_ptr + r[:, None].to(tl.int64) * ffn + c[None, :], mask=mask, other=0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        if NEED_DOTS:
            dots += tl.sum(silu * up * grad, axis=1)
        if HAS_SCALE:
            grad = grad * factor[:, None]
        grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
        out = grad_gate_up_ptr + r[:, None].to(tl.int64) * (2 * ffn) + c[None, :]
        tl.store(out, grad_gate.to(grad_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(out + ffn, (grad * silu).to(grad_gate_up_ptr.dtype.element_ty), mask=mask)
        if NEED_PRODUCT:
            product = silu * up * factor[:, None] if HAS_SCALE else silu * up
            dst = product_ptr + r[:, None].to(tl.int64) * ffn + c[None, :]
            tl.store(dst, product.to(product_ptr.dtype.element_ty), mask=mask)
    if NEED_DOTS:
        tl.store(dots_ptr + r, dots.to(dots_ptr.dtype.element_ty), mask=row_ok)


def _block_f(ffn: int) -> int:
    return min(triton.next_power_of_2(max(ffn, 1)), 128)


def _rows_major(gate_up: Tensor) -> Tensor:
    return gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()


def swiglu_forward_triton(gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    """Triton :func:`swiglu_forward_reference` (one launch; float32 inside, one rounding)."""
    gate_up = _rows_major(gate_up)
    rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, ffn, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block_f = _block_f(ffn)
    block_m = max(1, 4096 // block_f)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(ffn, block_f))
    scale_arg = scale if scale is not None else gate_up  # never read without HAS_SCALE
    _swiglu_forward_kernel[grid](
        gate_up, scale_arg, out, rows, ffn, gate_up.stride(0), HAS_SCALE=scale is not None, BLOCK_M=block_m,
        BLOCK_F=block_f,
    )  # fmt: skip
    return out


def swiglu_backward_triton(
    grad: Tensor,
    gate_up: Tensor,
    scale: Tensor | None = None,
    *,
    need_product: bool = True,
    need_dots: bool = True,
    product_in_grad: bool = False,
) -> SwigluGrads:
    """Triton :func:`swiglu_backward_reference` (one launch; with ``product_in_grad`` each tile of ``grad`` is loaded
    before its product is stored)."""
    gate_up, grad = _rows_major(gate_up), grad.contiguous()
    rows, ffn = grad.shape
    grad_gate_up = torch.empty(rows, 2 * ffn, dtype=gate_up.dtype, device=gate_up.device)
    product = None
    if need_product:
        product = grad if product_in_grad else torch.empty(rows, ffn, dtype=gate_up.dtype, device=gate_up.device)
    dots = torch.empty(rows, dtype=acc_dtype(gate_up), device=gate_up.device) if need_dots else None
    if rows == 0:
        return grad_gate_up, product, None if dots is None else dots
    block_f = _block_f(ffn)
    block_m = max(1, 2048 // block_f)
    _swiglu_backward_kernel[(triton.cdiv(rows, block_m),)](
        grad, gate_up, scale if scale is not None else grad, grad_gate_up,
        product if product is not None else grad_gate_up, dots if dots is not None else grad_gate_up,
        rows, ffn, gate_up.stride(0), HAS_SCALE=scale is not None, NEED_PRODUCT=need_product,
        NEED_DOTS=need_dots, BLOCK_M=block_m, BLOCK_F=block_f,
    )  # fmt: skip
    return grad_gate_up, product, dots


def swiglu_forward(gate_up: Tensor, scale: Tensor | None = None, *, backend: str = "torch") -> Tensor:
    """``scale[r] * silu(gate[r]) * up[r]`` of ``(M, 2F)`` rows -> ``(M, F)``; Triton or the PyTorch reference.

    Example::

        p = swiglu_forward(hidden, row_weights, backend="triton")
    """
    if is_triton(backend):
        return swiglu_forward_triton(gate_up, scale)
    return swiglu_forward_reference(gate_up, scale)


def swiglu_backward(
    grad: Tensor,
    gate_up: Tensor,
    scale: Tensor | None = None,
    *,
    need_product: bool = True,
    need_dots: bool = True,
    backend: str = "torch",
    product_in_grad: bool = False,
) -> SwigluGrads:
    """Gradient of :func:`swiglu_forward` (see :func:`swiglu_backward_reference`); Triton or the reference.

    Example::

        grad_gate_up, product, grad_scale = swiglu_backward(grad_p, hidden, row_weights, backend="triton")
    """
    fn = swiglu_backward_triton if is_triton(backend) else swiglu_backward_reference
    return fn(grad, gate_up, scale, need_product=need_product, need_dots=need_dots, product_in_grad=product_in_grad)


@torch.library.custom_op("lightning_llmfast::swiglu_grads", mutates_args=("grad",))
def _swiglu_grads(
    grad: Tensor, gate_up: Tensor, scale: Tensor | None, need_product: bool, need_dots: bool, backend: str
) -> tuple[Tensor, Tensor]:
    """:func:`swiglu_backward` as an opaque op (a compiled backward traces around the kernel, never into it):
    ``(grad_gate_up, dots)``, the product written over ``grad`` when asked for; dots not asked for come back empty."""
    grad_gate_up, _, dots = swiglu_backward(
        grad, gate_up, scale, need_product=need_product, need_dots=need_dots, backend=backend, product_in_grad=True
    )
    return grad_gate_up, dots if dots is not None else grad.new_empty(0)


@_swiglu_grads.register_fake
def _swiglu_grads_fake(
    grad: Tensor, gate_up: Tensor, scale: Tensor | None, need_product: bool, need_dots: bool, backend: str
) -> tuple[Tensor, Tensor]:
    dots = gate_up.new_empty(grad.shape[0], dtype=acc_dtype(gate_up)) if need_dots else grad.new_empty(0)
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format), dots


def swiglu_grads(
    grad: Tensor,
    gate_up: Tensor,
    scale: Tensor | None,
    *,
    need_product: bool,
    need_dots: bool,
    backend: str,
    grad_is_scratch: bool = False,
) -> SwigluGrads:
    """:func:`swiglu_backward` through an opaque custom op, for autograd formulas that ``torch.compile`` traces.

    The product is written over ``grad`` when the caller passes ``grad_is_scratch=True`` (a buffer it owns and needs
    no more, such as a fresh GEMM output; contiguous, in ``gate_up``'s dtype): one ``(M, F)`` buffer fewer at the
    backward's peak. Otherwise over a copy.
    """
    if need_product and not (grad_is_scratch and grad.is_contiguous() and grad.dtype == gate_up.dtype):
        grad = grad.to(gate_up.dtype, memory_format=torch.contiguous_format, copy=True)
    grad_gate_up, dots = _swiglu_grads(grad, gate_up, scale, need_product, need_dots, backend)
    return grad_gate_up, grad if need_product else None, dots if need_dots else None
