"""Grouped SwiGLU experts: every expert's GEMM in one ``torch.nn.functional.grouped_mm`` call.

Rows arrive grouped by expert (see :func:`lightning_llmfast.moe.permute`) with ``offsets`` marking the groups, so
one grouped GEMM per projection replaces HF ``eager``'s per-expert loop and its ``nonzero`` syncs.

Measured on this project's 2-core CPU box (torch 2.13, fp32, forward+backward of the two projections, median of 5,
interleaved; ``python benchmarks/bench_moe.py`` repeats it for the whole block):

====================================  ===========  ===================  ==========================
shape (H=256, F=512)                  grouped_mm   per-expert loop      one dense GEMM, same rows
====================================  ===========  ===================  ==========================
M=T*k=8192,  E=8  (T=4096, k=2)       102-145 ms   113-123 ms           99-114 ms
M=T*k=65536, E=64 (T=8192, k=8)       986-1236 ms  3754-4032 ms         1245-1867 ms
====================================  ===========  ===================  ==========================

``grouped_mm`` is as fast as one dense GEMM over the same rows (the limit) and needs no host offsets. Wrapped in
a custom op (the built-in meta function is bf16-only) it traces with ``torch.compile(fullgraph=True)`` in any
dtype. It is the path wherever the op accepts the inputs: CPU float32 / bfloat16 / float16 and CUDA bfloat16 on
sm80+, with 16-byte aligned sizes and strides. Odd sizes are zero-padded to the alignment and CUDA float32/float16
go through a Triton grouped GEMM (:mod:`~lightning_llmfast.moe.grouped_fallback`), both without a host read; only
float64 (or a GPU without Triton) falls back to the per-expert loop, which needs the offsets on the host: one
``# NOTE:`` sync. A "gather the weights per row" trick
is sync-free but materialises ``(M, H, 2F)`` weights, so it loses at any useful size and is not offered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast._autograd import eager_custom_op
from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.checks import check_offsets_meta, check_offsets_values, check_swiglu_inputs
from lightning_llmfast.moe.grouped_fallback import (
    aligned_operands,
    grouped_mm_dtype_ok,
    triton_grouped_swiglu,
    use_triton,
)
from lightning_llmfast.moe.kernels.swiglu import (
    swiglu_backward_reference,
    swiglu_forward,
    swiglu_forward_reference,
    swiglu_grads,
)

__all__ = [
    "ExpertWeights",
    "GroupedExperts",
    "autocast_inputs",
    "grouped_mm_supported",
    "grouped_swiglu",
    "per_expert_loop",
]


def grouped_mm_supported(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` accepts the SwiGLU experts' inputs, forward and backward.

    Decided from dtypes, devices, sizes and strides only (host metadata), so asking costs no sync.

    Args:
        x: ``(M, H)`` rows grouped by expert.
        gate_up: ``(E, H, 2F)`` weights (a view with any strides).
        down: ``(E, F, H)`` weights (a view with any strides).
    """
    if not grouped_mm_dtype_ok(x, gate_up, down):
        return False
    align = 16 // x.element_size()
    # Every operand, the intermediate (M, F) activations and the gradients included, needs 16-byte aligned
    # leading strides, else the op raises: H and F must be multiples of the alignment, and so every weight stride.
    sizes_ok = x.shape[1] % align == 0 and down.shape[1] % align == 0
    return sizes_ok and all(s % align == 0 for w in (gate_up, down) for s in w.stride() if s != 1)


@torch.library.custom_op("lightning_llmfast::grouped_mm", mutates_args=())
def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as a custom op.

    The built-in op's meta function accepts bfloat16 only, so ``torch.compile`` cannot trace it for the float32
    CPU path; as an opaque custom op with its own shape function and backward it traces for every dtype.
    ``a`` ``(M, K)`` with ``b`` ``(E, K, N)`` gives ``(M, N)``; ``a`` ``(K, M)`` with ``b`` ``(M, N)`` (the weight
    gradient) gives ``(E, K, N)``, groups running along ``M``.
    """
    return F.grouped_mm(a, b, offs=offs)


@_grouped_mm.register_fake
def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    # grouped_mm rejects stride-0 (expanded) gradients such as those of a plain .sum().
    grad = grad.contiguous()
    grad_a = _grouped_mm(grad, b.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
    grad_b = _grouped_mm(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("lightning_llmfast::swiglu", mutates_args=())
def _silu_glu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``(M, 2F)`` ``[gate | up]`` rows, with a backward that fills one ``(M, 2F)`` buffer.

    Autograd's default backward of ``chunk -> silu -> mul`` builds the gate and up gradients in separate ``(M, F)``
    buffers and concatenates them (``chunk``'s backward): a full extra pass over ``(M, 2F)`` plus two buffers. At
    T=8192, E=64, k=8 (M=65536, F=512) that ``cat`` alone took 0.31 s of a 4.9 s block forward+backward. A custom
    op rather than an ``autograd.Function``: its backward writes with ``out=`` into halves of one buffer, which
    Dynamo cannot trace ("non-contiguous out="), whereas an opaque op runs the same code compiled or not.

    Only ``gate_up`` is saved: backward recomputes ``silu(gate)``. Keeping it would hold another ``(M, F)`` per layer
    until backward (46 MB at hidden 1024, ffn 1408, 8192 tokens, top-2: 9% of what a reference layer saves) to spare
    one elementwise pass (about 4% of the block's forward+backward on CPU; memory-bound and negligible on a GPU).
    """
    return swiglu_forward_reference(gate_up)


@_silu_glu.register_fake
def _silu_glu_fake(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("lightning_llmfast::swiglu_backward", mutates_args=())
def _silu_glu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """Gradient of :func:`_silu_glu` for ``gate_up``: ``(M, 2F)`` from ``grad`` ``(M, F)``."""
    return swiglu_backward_reference(grad, gate_up, need_product=False, need_dots=False)[0]


@_silu_glu_backward.register_fake
def _silu_glu_backward_fake(grad: Tensor, gate_up: Tensor) -> Tensor:
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _silu_glu_setup(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_glu_grad(ctx: Any, grad: Tensor) -> Tensor:
    (gate_up,) = ctx.saved_tensors
    return _silu_glu_backward(grad, gate_up)


_silu_glu.register_autograd(_silu_glu_grad, setup_context=_silu_glu_setup)


@torch.library.custom_op("lightning_llmfast::swiglu_down", mutates_args=())
def _swiglu_down(gate_up: Tensor, down: Tensor, offs: Tensor, scale: Tensor | None, backend: str) -> Tensor:
    """The down projection of the SwiGLU product, ``grouped_mm(scale * silu(gate) * up, down)``: ``(M, 2F)`` ->
    ``(M, H)``.

    One op so that its backward can rebuild the ``(M, F)`` product from ``gate_up`` (saved anyway for the SwiGLU
    gradient) instead of keeping it as the GEMM's input: per reference layer at hidden 1024, ffn 1408, 8192 tokens,
    top-2 that is 46 MB less held until backward, for one elementwise pass in backward.

    ``scale`` ``(M,)`` (optional) multiplies each row by its routing weight before the GEMM (the same as after it,
    row by row), so that the combine after it is a plain sum that keeps no rows for backward. Its gradient
    ``<grad[r], out_unscaled[r]>`` is taken as ``<(grad @ down^T)[r], product[r]>`` (the same value), from tensors
    the backward has anyway. The activation and its backward are one launch each on the Triton path
    (:mod:`~lightning_llmfast.moe.kernels.swiglu`). ``down`` ``(E, F, H)``; ``offs`` ``(E,)`` int32 group ends;
    ``backend``: of the activation (``"torch"`` or ``"triton"``).
    """
    return F.grouped_mm(swiglu_forward(gate_up, scale, backend=backend), down, offs=offs)


@_swiglu_down.register_fake
def _swiglu_down_fake(gate_up: Tensor, down: Tensor, offs: Tensor, scale: Tensor | None, backend: str) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], down.shape[-1])


def _swiglu_down_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    *saved, ctx.backend = inputs
    ctx.save_for_backward(*saved)


def _swiglu_down_grad(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    gate_up, down, offs, scale = ctx.saved_tensors
    need_gate_up, need_down, _, need_scale, _ = ctx.needs_input_grad
    need_scale = need_scale and scale is not None
    grad = grad.contiguous()  # grouped_mm rejects stride-0 (expanded) gradients
    grad_gate_up = product = grad_scale = None
    if need_gate_up or need_scale:
        grad_product = _grouped_mm(grad, down.transpose(-1, -2), offs)  # of the scaled product
        grad_gate_up, product, grad_scale = swiglu_grads(
            grad_product, gate_up, scale, need_product=need_down, need_dots=need_scale, backend=ctx.backend
        )
        grad_scale = None if grad_scale is None else grad_scale.to(scale.dtype)
    elif need_down:
        product = swiglu_forward_reference(gate_up, scale)  # traceable: a compiled backward never sees Triton
    grad_down = _grouped_mm(product.transpose(0, 1), grad, offs) if need_down else None
    return grad_gate_up if need_gate_up else None, grad_down, None, grad_scale, None


_swiglu_down.register_autograd(_swiglu_down_grad, setup_context=_swiglu_down_setup)
# Eager calls skip the dispatcher, compiled ones keep the registered ops (see eager_custom_op).
_grouped_mm, _silu_glu, _silu_glu_backward, _swiglu_down = (
    eager_custom_op(op) for op in (_grouped_mm, _silu_glu, _silu_glu_backward, _swiglu_down)
)


def _swiglu(gate_up: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``act(gate) * up`` of ``(M, 2F)`` ``[gate | up]`` rows -> ``(M, F)``."""
    if act is F.silu:
        return _silu_glu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def autocast_inputs(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` in autocast's dtype when autocast is on for ``device``, else unchanged.

    A custom op and a 3-D weight escape autocast's casting lists: the experts cast as autocast would for a linear.
    """
    if not torch.is_autocast_enabled(device.type):
        return tensors
    dtype = torch.get_autocast_dtype(device.type)
    return tuple(t.to(dtype) for t in tensors)


def grouped_swiglu(
    x: Tensor,
    offsets: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor] = F.silu,
    *,
    padded: bool = False,
    validate: bool = True,
) -> Tensor:
    """SwiGLU experts over rows grouped by expert.

    Rows ``offsets[e]:offsets[e+1]`` go through expert ``e``. With ``padded=True`` (a capacity limit, where the
    caller keeps a static ``M`` and rows from ``offsets[-1]`` on are padding) those rows come back as zeros and get
    zero gradient; without it every row must belong to a group (dropless: ``offsets[-1] == M``).

    Args:
        x: ``(M, H)`` rows grouped by expert.
        offsets: ``(E+1,)`` int32 exclusive prefix sums of the group sizes (``offsets[0] == 0``).
        gate_up: ``(E, H, 2F)`` (any strides; HF's ``(E, 2F, H)`` weights pass as ``.transpose(1, 2)`` views);
            the gate half comes first along the last dimension, then the up half.
        down: ``(E, F, H)`` (any strides).
        act: activation applied to the gate half.
        padded: zero the rows from ``offsets[-1]`` on (``grouped_mm`` leaves them uninitialised).
        validate: check the offsets' values (start at 0, non-decreasing, end at ``M``, or at most ``M`` when
            ``padded``). One host sync on an accelerator; callers whose offsets come from
            :func:`~lightning_llmfast.moe.route` pass ``False``. Shapes and dtypes are always checked. The
            per-expert fallback reads the offsets on the host anyway and always checks them.

    Returns:
        ``(M, H)`` in ``x``'s dtype.

    Raises:
        RoutingError: wrong shapes (``x`` not ``(M, H)``, ``gate_up`` not ``(E, H, 2F)``, ``down`` not
            ``(E, F, H)``, ``offsets`` not an ``(E+1,)`` integer tensor), ``x`` and the weights in different
            dtypes (outside autocast), or bad offset values.

    Example::

        experts = GroupedExperts(4, 8, 16)
        offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
        y = grouped_swiglu(torch.randn(6, 8), offsets, experts.gate_up_proj, experts.down_proj)  # (6, 8)
    """
    check_swiglu_inputs(x, gate_up, down)
    check_offsets_meta(offsets, gate_up.shape[0])
    x, gate_up, down = autocast_inputs(x.device, x, gate_up, down)
    if not x.dtype == gate_up.dtype == down.dtype:
        raise RoutingError(
            f"x ({x.dtype}) and the weights (gate_up {gate_up.dtype}, down {down.dtype}) must share a dtype "
            "outside autocast"
        )
    grouped = grouped_mm_supported(x, gate_up, down)
    aligned = None if grouped else aligned_operands(x, gate_up, down)
    loop = not grouped and aligned is None and not use_triton(x)
    bounds = None
    if validate or loop:
        # NOTE: host sync: the offsets read on the host (one .tolist()), to check them (validate=True) or
        # because the per-expert loop (float64, or no Triton for a CUDA float32/float16 input) slices rows with them.
        bounds = offsets.tolist()
        check_offsets_values(bounds, x.shape[0], padded)
    if aligned is not None:  # sync-free: zero-padded to grouped_mm's alignment, exact after the slice
        xp, gate_up_p, down_p = aligned
        return grouped_swiglu(xp, offsets, gate_up_p, down_p, act, padded=padded, validate=False)[:, : x.shape[1]]
    if not grouped and not loop:  # sync-free: the Triton grouped GEMM (CUDA float32/float16)
        return triton_grouped_swiglu(x, offsets.to(x.device), gate_up, down, act)
    if grouped:
        return _grouped_mm_swiglu(x, offsets, gate_up, down, act, padded)
    return _per_expert_swiglu(x, bounds, gate_up, down, act)


def per_expert_loop(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether :func:`grouped_swiglu` takes the per-expert loop (offsets read on the host) for these inputs: neither
    ``grouped_mm`` (directly or zero-padded to its alignment) nor the Triton grouped GEMM takes them."""
    if grouped_mm_supported(x, gate_up, down):
        return False
    return aligned_operands(x, gate_up, down) is None and not use_triton(x)


def _grouped_mm_swiglu(
    x: Tensor, offsets: Tensor, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor], padded: bool
) -> Tensor:
    """:func:`grouped_swiglu` through ``torch._grouped_mm`` (no host sync)."""
    # grouped_mm takes the group ends (offsets[1:]) as its int32 `offs`, on x's device.
    ends = offsets[1:].to(device=x.device, dtype=torch.int32)
    valid = None
    if padded:
        # grouped_mm neither writes the padding rows of its output nor of its input gradient: mask both
        # sides with a device-side compare (no sync) so garbage never reaches the combine or the tokens.
        valid = (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1)
        x = torch.where(valid, x, 0)
    hidden = _grouped_mm(x.contiguous(), gate_up, ends)
    if act is F.silu:
        out = _swiglu_down(hidden, down, ends, None, "torch")
    else:
        out = _grouped_mm(_swiglu(hidden, act), down, ends)
    return out if valid is None else torch.where(valid, out, 0)


def _per_expert_swiglu(
    x: Tensor, bounds: list[int], gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]
) -> Tensor:
    """:func:`grouped_swiglu` as a loop over experts, the rows sliced by offsets already read on the host."""
    out = x.new_zeros(x.shape[0], down.shape[-1])
    for expert in range(gate_up.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        out[start:end] = _swiglu(x[start:end] @ gate_up[expert], act) @ down[expert]
    return out


class ExpertWeights(nn.Module):
    """The weights of ``num_experts`` SwiGLU feed-forward experts, stored as two 3-D tensors.

    Expert ``e`` computes ``(silu(x @ W_gate) * (x @ W_up)) @ W_down`` where ``W_gate = gate_up_proj[e, :, :F]``
    (the first half of the last dimension), ``W_up = gate_up_proj[e, :, F:]`` (the second half) and
    ``W_down = down_proj[e]``. The ``[in, out]`` layout is the one ``torch.nn.functional.grouped_mm`` consumes
    without a transpose. :class:`GroupedExperts` and the naive baseline's
    :class:`~lightning_llmfast.moe.SwiGLUExperts` share it, so weights move between the two blocks unchanged.

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        ffn_size: ``F``, the intermediate size of one expert.

    Raises:
        ConfigError: a size that is not an int >= 1.

    Attributes:
        gate_up_proj: ``(E, H, 2F)`` parameter, initialised ``N(0, 0.02)``.
        down_proj: ``(E, F, H)`` parameter, initialised ``N(0, 0.02)``.

    Example::

        weights = ExpertWeights(num_experts=8, hidden_size=64, ffn_size=128)
        weights.gate_up_proj.shape  # torch.Size([8, 64, 256])
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size), ("ffn_size", ffn_size)):
            check_int(name, value, low=1)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise both weights from ``N(0, 0.02)``."""
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, ffn_size={self.ffn_size}"


class GroupedExperts(ExpertWeights):
    """:class:`ExpertWeights` applied to rows grouped by expert, all experts in one grouped GEMM per projection.

    Example::

        experts = GroupedExperts(num_experts=4, hidden_size=8, ffn_size=16)
        offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
        y = experts(torch.randn(6, 8), offsets)  # (6, 8)
    """

    def forward(self, x: Tensor, offsets: Tensor, *, padded: bool = False, validate: bool = True) -> Tensor:
        """Apply expert ``e`` to rows ``offsets[e]:offsets[e+1]``.

        Args:
            x: ``(M, H)`` rows grouped by expert.
            offsets: ``(E+1,)`` int32 group boundaries.
            padded: rows from ``offsets[-1]`` on are padding (capacity limit); they come back as zeros.
            validate: check the offsets' values (one host sync on an accelerator; see :func:`grouped_swiglu`).

        Returns:
            ``(M, H)``.

        Raises:
            RoutingError: as :func:`grouped_swiglu`.
        """
        return grouped_swiglu(x, offsets, self.gate_up_proj, self.down_proj, padded=padded, validate=validate)
