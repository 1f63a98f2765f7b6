"""Memory-lean RMSNorm for the reference model: same math, less saved for backward.

Written with plain autograd, ``(x * rstd).to(dtype) * weight`` keeps the normalised fp32 copy of its input
``(N, H)`` for the weight gradient, beside the input itself. :class:`RMSNormFunction` saves the input and the
``(N, 1)`` inverse RMS only and recomputes the normalised input in backward (as fused RMSNorm kernels do): at hidden
1024 with 8192 tokens per step that is 32 MB less per norm, two norms per layer.

:func:`swap_rms_norms` puts :class:`RMSNorm` in place of Llama-style RMSNorm modules (transformers' Llama, Mistral,
Mixtral, Qwen2/3 and their MoE variants, OLMoE): the same function, the same ``weight`` Parameter, and outputs that
:class:`~lightning_llmfast.offload.ActivationOffloader` can rebuild in backward instead of keeping.

Example::

    y = rms_norm(x, weight, 1e-5)  # x (..., H), weight (H,)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmfast._autograd import mark_rebuildable

__all__ = ["RMSNorm", "RMSNormFunction", "rms_norm", "swap_rms_norms"]


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


class RMSNorm(nn.Module):
    """:func:`rms_norm` as a module, with a ``(dim,)`` ``weight``: the reference model's norm.

    Example::

        norm = RMSNorm(64, eps=1e-5)
        y = norm(torch.randn(2, 8, 64))
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics; saves x and the (N, 1) inverse RMS only: the normalised copy is recomputed in backward.
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# transformers classes computing `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`: swapped even
# when their weight is not materialised yet (meta device), where the function cannot be compared on an input.
_LLAMA_STYLE = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "OlmoeRMSNorm",
    }
)


def swap_rms_norms(model: nn.Module) -> int:
    """Replace, in place, every Llama-style RMSNorm inside ``model`` with :class:`RMSNorm` sharing its ``weight``.

    A module qualifies when its class name ends in ``RMSNorm``, it has a 1-D ``weight`` Parameter and a float
    ``variance_epsilon`` (or ``eps``), and it computes exactly what :func:`rms_norm` does: checked bit for bit on a
    random input in float32 and bfloat16 (on the meta device, where nothing can run, only the transformers classes
    known to compute it are swapped). Others, such as Gemma's ``(1 + weight)`` norm, stay, with a warning.
    The state-dict keys, the ``Parameter`` objects (so optimizers and tied weights) and the outputs do not change;
    the gain is in backward: the norm saves its input and inverse RMS only, and under
    :class:`~lightning_llmfast.offload.ActivationOffloader` the matmuls' saved copies of its output are rebuilt.

    Args:
        model: any module tree (``model`` itself is never replaced).

    Returns:
        The number of norms swapped (0 on a second call).

    Example::

        model = MixtralForCausalLM(config)
        swap_rms_norms(model)  # 2 per decoder layer + the final norm
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm) or not type(child).__name__.endswith("RMSNorm"):
                continue
            eps = _llama_style_eps(child)
            if eps is None:
                warnings.warn(
                    f"swap_rms_norms: {type(child).__qualname__} at {name!r} does not compute a Llama-style RMSNorm; "
                    "left as is",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            with torch.device("meta"):  # its own weight is replaced at once: allocate nothing
                replacement = RMSNorm(child.weight.shape[0], eps)
            replacement.weight = child.weight
            replacement.train(child.training)
            setattr(parent, name, replacement)
            swapped += 1
    return swapped


def _llama_style_eps(module: nn.Module) -> float | None:
    """``module``'s epsilon if it computes :func:`rms_norm` with its ``weight``, else ``None``."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    if weight.is_meta:
        return eps if type(module).__name__ in _LLAMA_STYLE else None
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(3, 5, weight.shape[0], generator=generator, device=weight.device)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            if not torch.equal(module(x.to(dtype)), rms_norm(x.to(dtype), weight, eps)):
                return None
    return eps
