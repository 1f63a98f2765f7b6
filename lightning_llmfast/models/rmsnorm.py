"""Memory-lean RMSNorm for the reference model: same math, less saved for backward.

Written with plain autograd, ``(x * rstd).to(dtype) * weight`` keeps the normalised fp32 copy of its input
``(N, H)`` for the weight gradient, beside the input itself. :class:`RMSNormFunction` saves the input and the
``(N, 1)`` inverse RMS only and recomputes the normalised input in backward (as fused RMSNorm kernels do): at hidden
1024 with 8192 tokens per step that is 32 MB less per norm, two norms per layer.

Example::

    y = rms_norm(x, weight, 1e-5)  # x (..., H), weight (H,)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmfast._autograd import mark_rebuildable

__all__ = ["RMSNormFunction", "rms_norm"]


class RMSNormFunction(torch.autograd.Function):
    """``(x / rms(x)).to(x.dtype) * weight``, computed in at least fp32; saves ``x`` and ``rstd`` only.

    The output can be rebuilt from what it saves (:meth:`llmfast_rebuild`): when a later op saves the output (or its
    autocast copy) for backward, :class:`~lightning_llmfast.offload.ActivationOffloader` keeps a recipe instead.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        out = _normalize(x, weight, rstd)
        mark_rebuildable(ctx, out)
        return out

    @staticmethod
    def llmfast_rebuild(ctx: Any, x: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
        """The forward's output from its saved tensors, with the same bits (the same ops on the same values)."""
        return _normalize(x, weight, rstd)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = _wide(x) * rstd  # recomputed: (..., H)
        normed = x_hat.to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (_wide(grad) * _wide(normed)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd: rstd * (g - x_hat * mean(g * x_hat)), with g the gradient reaching the normalised input
            g = _wide(grad) * _wide(weight)
            grad_x = (rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def _normalize(x: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
    return (_wide(x) * rstd).to(x.dtype) * weight


def _wide(t: Tensor) -> Tensor:
    # At least fp32: bf16/fp16 squares lose too much precision; fp64 stays fp64.
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` ``(..., H)`` with ``weight`` ``(H,)``, computed in at least fp32 (bf16 squares lose precision).

    Example::

        y = rms_norm(torch.randn(2, 5, 8), torch.ones(8), 1e-5)
    """
    return RMSNormFunction.apply(x, weight, eps)
