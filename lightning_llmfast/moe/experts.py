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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.checks import check_offsets_meta, check_offsets_values, check_swiglu_inputs
from lightning_llmfast.moe.expert_ops import _grouped_mm, _silu_glu, _swiglu_down
from lightning_llmfast.moe.grouped_fallback import (
    aligned_operands,
    grouped_mm_dtype_ok,
    triton_grouped_swiglu,
    use_triton,
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
