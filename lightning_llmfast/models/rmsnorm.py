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

import copy
import warnings
from typing import Any, overload

import torch
from torch import Tensor, nn

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast._rebuild import mark_rebuildable
from lightning_llmfast.errors import ConfigError

__all__ = ["RMSNorm", "RMSNormFunction", "add_rms_norm", "rms_norm", "swap_rms_norms"]


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
        grad_x, grad_weight = _norm_backward(x_hat, x.dtype, weight, rstd, grad, *ctx.needs_input_grad[:2])
        return grad_x, grad_weight, None


class _AddRMSNormFunction(torch.autograd.Function):
    """``rms_norm(h)`` for ``h = residual + branch``, saving ``residual`` and ``branch`` (aliases, no grad) instead of
    ``h``: backward adds them again. ``h`` itself comes from a plain add, so its gradient (and any hook on it) is
    what the unfused ops give; this Function only gives the norm's part.

    In a pre-norm block (``h = x + attn(norm(x))``, then ``norm(h)``) ``residual`` is the block's input, which the
    first norm saves anyway, and ``branch`` the attention output in the compute dtype: the second norm keeps a bf16
    tensor instead of the fp32 ``h`` (16.8 MB less per layer at hidden 1024, 8192 tokens). The output can be rebuilt
    from what it saves, as :class:`RMSNormFunction`'s.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, residual: Tensor, branch: Tensor, weight: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(_wide(h).pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(residual, branch, weight, rstd)
        out = _normalize(h, weight, rstd)
        mark_rebuildable(ctx, out)
        return out

    @staticmethod
    def llmfast_rebuild(ctx: Any, residual: Tensor, branch: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
        """The forward's output from its saved tensors, with the same bits."""
        # The sum is a temporary, freed once normalised: the rebuild holds no extra (..., H) fp32 tensor.
        return _scale(_wide(residual + branch) * rstd, _sum_dtype(residual, branch), weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, Tensor | None, None]:
        residual, branch, weight, rstd = ctx.saved_tensors
        # The forward's sum, recomputed (the same bits) and normalised at once: it is not held through backward.
        x_hat = _wide(residual + branch) * rstd
        dtype, needs = _sum_dtype(residual, branch), ctx.needs_input_grad
        grad_h, grad_weight = _norm_backward(x_hat, dtype, weight, rstd, grad, needs[0], needs[3])
        return grad_h, None, None, grad_weight, None


def _norm_backward(
    x_hat: Tensor, dtype: torch.dtype, weight: Tensor, rstd: Tensor, grad: Tensor, x_grad: bool, weight_grad: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``_normalize(x, weight, rstd)`` for ``x`` and ``weight`` (each ``None`` unless asked for), from
    ``x_hat = _wide(x) * rstd`` and ``x``'s dtype."""
    grad_x = grad_weight = None
    if weight_grad:
        grad_weight = (_wide(grad) * _wide(x_hat.to(dtype))).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
    if x_grad:
        # d/dx of x * rstd: rstd * (g - x_hat * mean(g * x_hat)), with g the gradient reaching the normalised input
        g = _wide(grad) * _wide(weight)
        grad_x = (rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(dtype)
    return grad_x, grad_weight


def _normalize(x: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
    return _scale(_wide(x) * rstd, x.dtype, weight)


def _scale(x_hat: Tensor, dtype: torch.dtype, weight: Tensor) -> Tensor:
    return x_hat.to(dtype) * weight


def _sum_dtype(residual: Tensor, branch: Tensor) -> torch.dtype:
    return torch.promote_types(residual.dtype, branch.dtype)  # of residual + branch (same shapes, no 0-dim rule)


def _wide(t: Tensor) -> Tensor:
    # At least fp32: bf16/fp16 squares lose too much precision; fp64 stays fp64.
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_norm_args(fn: str, x: object, weight: object, eps: object, x_name: str = "x") -> None:
    """Raise :class:`ConfigError` unless ``x`` is a floating ``(..., H)`` tensor, ``weight`` a ``(H,)`` tensor and
    ``eps`` a finite number >= 0. Shapes and dtypes only: nothing reads the device."""
    if not isinstance(x, Tensor) or x.dim() == 0 or not x.is_floating_point():
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        # An integer x would be normalised in fp32 and cast back to integers: silently truncated output.
        raise ConfigError(f"{fn}: {x_name} must be a floating-point tensor (..., H), got a {got}")
    if not isinstance(weight, Tensor) or weight.shape != (x.shape[-1],):
        got = f"shape {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ConfigError(
            f"{fn}: weight must be a tensor of shape (H,) = ({x.shape[-1]},), {x_name}'s last dim; got {got}"
        )
    check_number(f"{fn}: eps", eps, low=0)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` ``(..., H)`` with ``weight`` ``(H,)``, computed in at least fp32 (bf16 squares lose precision).

    Raises:
        ConfigError: ``x`` is not a floating-point tensor, ``weight`` is not ``(H,)``, or ``eps`` is not a finite
            number >= 0.

    Example::

        y = rms_norm(torch.randn(2, 5, 8), torch.ones(8), 1e-5)
    """
    _check_norm_args("rms_norm", x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(residual: Tensor, branch: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_norm(residual + branch), residual + branch)``, keeping ``branch`` instead of the sum for backward.

    Saves less where ``residual`` is saved anyway (a pre-norm block's input, which its first norm keeps) and
    ``branch`` is narrower than the sum (the bf16 output of an attention block added to an fp32 residual stream);
    a ``branch`` as wide as the sum gains nothing, so then the norm keeps the sum as :func:`rms_norm` does. The same
    bits as ``h = residual + branch; rms_norm(h, weight, eps)``, forward and backward.

    Raises:
        ConfigError: ``residual`` and ``branch`` have different shapes (a broadcast would save the wider one), or
            an argument :func:`rms_norm` rejects.

    Example::

        normed, h = add_rms_norm(x, attn_out, weight, 1e-5)  # x (B, T, H) fp32, attn_out (B, T, H) bf16
    """
    _check_norm_args("add_rms_norm", residual, weight, eps, "residual")
    if not isinstance(branch, Tensor) or not branch.is_floating_point():
        got = branch.dtype if isinstance(branch, Tensor) else type(branch).__name__
        raise ConfigError(f"add_rms_norm: branch must be a floating-point tensor, got {got}")
    if residual.shape != branch.shape:
        raise ConfigError(
            f"add_rms_norm: residual {tuple(residual.shape)} and branch {tuple(branch.shape)} must have one shape"
        )
    h = residual + branch
    if branch.element_size() >= h.element_size():
        # As wide as the sum (fp32 training): keeping it would save nothing. (Arguments checked above.)
        return RMSNormFunction.apply(h, weight, eps), h
    # Detached aliases: the same storages and version counters (an in-place change before backward still raises).
    return _AddRMSNormFunction.apply(h, residual.detach(), branch.detach(), weight, eps), h


class RMSNorm(nn.Module):
    """:func:`rms_norm` as a module, with a ``(dim,)`` ``weight``: the reference model's norm.

    Example::

        norm = RMSNorm(64, eps=1e-5)
        y = norm(torch.randn(2, 8, 64))
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        check_int("RMSNorm: dim", dim, low=1)
        check_number("RMSNorm: eps", eps, low=0)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Ones: the initialisation after materialising a module built on the meta device."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    @overload
    def forward(self, x: Tensor) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(residual + x), residual + x)`` (:func:`add_rms_norm`)."""
        # fp32 statistics; saves x and the (N, 1) inverse RMS only: the normalised copy is recomputed in backward.
        if residual is not None:
            return add_rms_norm(residual, x, self.weight, self.eps)
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
    """Replace, in place, every Llama-style RMSNorm inside ``model`` with an :class:`RMSNorm` sharing its ``weight``.

    A module qualifies when its class name ends in ``RMSNorm``, it has a 1-D ``weight`` Parameter, a float
    ``variance_epsilon`` (or ``eps``) and no hooks (they would be lost), and it computes what the replacement does:
    checked on a copy with a random weight, bit for bit and dtype for dtype, on float32, bfloat16 and float64
    inputs. (On the meta device, where nothing can run, only the transformers classes known to compute it are
    swapped.) Others stay, with a warning: Gemma's ``(1 + weight)`` norm, or Olmo2's weight applied before the cast.
    A norm reachable under several names or parents gets one replacement everywhere.

    The state-dict keys, the ``Parameter`` objects (so optimizers and tied weights) and the outputs do not change.
    Gradients are the same function but come from the norm's own backward, so they can differ in the last bit.
    The gain is in backward: the norm saves its input and inverse RMS only, and under
    :class:`~lightning_llmfast.offload.ActivationOffloader` the matmuls' saved copies of its output are rebuilt.

    Args:
        model: any module tree (``model`` itself is never replaced).

    Returns:
        The number of norms replaced (0 on a second call).

    Example::

        model = MixtralForCausalLM(config)
        swap_rms_norms(model)  # 2 per decoder layer + the final norm
    """
    replaced: dict[nn.Module, nn.Module | None] = {}  # original -> replacement (None: left as is)
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):  # every name, also a second name for the same module
            if child is None or isinstance(child, RMSNorm) or not type(child).__name__.endswith("RMSNorm"):
                continue
            if child not in replaced:
                replaced[child] = _replacement(child, name)
            if replaced[child] is not None:
                setattr(parent, name, replaced[child])
    return sum(r is not None for r in replaced.values())


class _LlamaRMSNorm(RMSNorm):
    """:class:`RMSNorm` with transformers' Llama semantics for float64 inputs: statistics in float32."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # type: ignore[override]
        if residual is not None or x.dtype != torch.float64:
            # The same bits as transformers' formula (checked at the swap); a residual (which transformers never
            # passes) takes this package's add_rms_norm.
            return super().forward(x, residual)  # type: ignore[call-overload]
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _replacement(module: nn.Module, name: str) -> nn.Module | None:
    eps = _llama_style_eps(module)
    if eps is None:
        warnings.warn(
            f"swap_rms_norms: {type(module).__qualname__} at {name!r} has hooks or does not compute a Llama-style "
            "RMSNorm; left as is",
            UserWarning,
            stacklevel=3,
        )
        return None
    with torch.device("meta"):  # its own weight is replaced at once: allocate nothing
        replacement = _LlamaRMSNorm(module.weight.shape[0], eps)
    replacement.weight = module.weight
    replacement.train(module.training)
    return replacement


def _llama_style_eps(module: nn.Module) -> float | None:
    """``module``'s epsilon if it computes what :class:`_LlamaRMSNorm` does with its ``weight``, else ``None``."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    if any(hooks):
        return None
    if weight.is_meta:
        return eps if type(module).__name__ in _LLAMA_STYLE else None
    # A copy with a random weight: with the usual all-ones init, "weight, then cast" and "cast, then weight" agree.
    probe = copy.deepcopy(module)
    generator = torch.Generator(device=weight.device).manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=generator, device=weight.device) + 1)
        ours = _LlamaRMSNorm(weight.shape[0], eps).to(weight.device)
        ours.weight = probe.weight
        x = torch.randn(3, 5, weight.shape[0], generator=generator, device=weight.device)
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            theirs, mine = probe(x.to(dtype)), ours(x.to(dtype))
            if theirs.dtype != mine.dtype or not torch.equal(theirs, mine):
                return None
    return eps
