"""Grouped SwiGLU experts: :func:`expert_swiglu`, the one expert computation of every MoE block and dispatcher.

Rows arrive from a dispatcher as :class:`~lightning_llmfast.moe.dispatcher.ExpertRows`: grouped by expert with
``offsets`` marking the groups, either materialised (the all-to-all dispatchers) or as a gather fused into the first
GEMM (the local dispatcher), with the kernel backend the dispatcher resolved. One grouped GEMM per projection replaces
HF ``eager``'s per-expert loop and its ``nonzero`` syncs; the SwiGLU activation between them runs on that backend (one
Triton launch forward and one backward, or the PyTorch reference).

``torch.nn.functional.grouped_mm`` needs no host offsets. Wrapped in a custom op (the built-in meta function is
bf16-only) it traces with ``torch.compile(fullgraph=True)`` in any dtype. It is the path wherever the op accepts
the inputs: CPU float32 / bfloat16 / float16 and CUDA bfloat16 on
sm80+, with 16-byte aligned sizes and strides. Odd sizes are zero-padded to the alignment and CUDA float32/float16
go through a Triton grouped GEMM (:mod:`~lightning_llmfast.moe.grouped_fallback`), both without a host read; only
float64 (or a GPU without Triton) falls back to the per-expert loop, which needs the offsets on the host: one
``# NOTE:`` sync. A "gather the weights per row" trick
is sync-free but materialises ``(M, H, 2F)`` weights, so it loses at any useful size and is not offered.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe.checks import check_offsets_meta, check_offsets_values, check_swiglu_inputs
from lightning_llmfast.moe.dispatcher import ExpertRows, LocalDispatcher
from lightning_llmfast.moe.expert_ops import gather_grouped_mm, grouped_mm, silu_glu, swiglu_down
from lightning_llmfast.moe.grouped_fallback import (
    aligned_operands,
    grouped_mm_dtype_ok,
    triton_grouped_swiglu,
    use_triton,
)
from lightning_llmfast.moe.kernels import resolve_backend
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import permute_rows

__all__ = [
    "ExpertWeights",
    "GroupedExperts",
    "autocast_inputs",
    "expert_swiglu",
    "grouped_mm_supported",
    "per_expert_loop",
    "routed_swiglu",
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
        return silu_glu(gate_up)
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


def _grouped_swiglu(
    x: Tensor,
    offsets: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    *,
    padded: bool,
    validate: bool,
    backend: str,
) -> Tensor:
    """SwiGLU experts over materialised rows grouped by expert (see :func:`expert_swiglu`); ``(M, H)`` in ``x``'s
    dtype. ``validate``: check the offsets' values (one host sync on an accelerator)."""
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
        out = _grouped_swiglu(xp, offsets, gate_up_p, down_p, act, padded=padded, validate=False, backend=backend)
        return out[:, : x.shape[1]]
    if not grouped and not loop:  # sync-free: the Triton grouped GEMM (CUDA float32/float16)
        return triton_grouped_swiglu(x, offsets.to(x.device), gate_up, down, act)
    if grouped:
        return _grouped_mm_swiglu(x, offsets, gate_up, down, act, padded, backend)
    return _per_expert_swiglu(x, bounds, gate_up, down, act)


def expert_swiglu(
    rows: ExpertRows,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor] = F.silu,
    *,
    validate: bool = False,
) -> Tensor:
    """SwiGLU experts over dispatched rows: ``(M, H)`` outputs, times ``rows.row_weights`` when given.

    Rows ``offsets[e]:offsets[e+1]`` go through expert ``e``; rows from ``offsets[-1]`` on (``rows.padded``) come back
    as zeros with zero gradient. A fused gather (``rows.gather``) goes into the first grouped GEMM and the row weights
    into the second's epilogue; where ``grouped_mm`` does not take the inputs (float64, odd sizes, older GPUs) or
    ``act`` is not ``F.silu``, the rows are gathered first and weighted after the experts. The SwiGLU activation runs
    on ``rows.backend`` (Triton or the PyTorch reference), whichever dispatcher made the rows.

    Args:
        rows: a dispatcher's :class:`~lightning_llmfast.moe.dispatcher.ExpertRows`.
        gate_up: ``(E_local, H, 2F)`` expert weights (any strides; HF's ``(E, 2F, H)`` weights pass as
            ``.transpose(1, 2)`` views), gate half first.
        down: ``(E_local, F, H)`` expert weights (any strides).
        act: activation of the gate half.
        validate: check the offsets' values of materialised rows (start at 0, non-decreasing, end at ``M``, or at
            most ``M`` when padded): one host sync on an accelerator. Offsets from a routing plan need no check.

    Returns:
        ``(M, H)`` in the compute dtype.

    Raises:
        RoutingError: wrong shapes (rows not ``(M, H)``, ``gate_up`` not ``(E, H, 2F)``, ``down`` not
            ``(E, F, H)``, offsets not an ``(E+1,)`` integer tensor), rows and weights in different dtypes (outside
            autocast), or (``validate``) bad offset values.

    Example::

        rows, ctx = dispatcher.dispatch(x, plan)
        y = dispatcher.combine(expert_swiglu(rows, experts.gate_up_proj, experts.down_proj), ctx)
    """
    gather = rows.gather
    if gather is None:
        out = _grouped_swiglu(
            rows.rows, rows.offsets, gate_up, down, act, padded=rows.padded, validate=validate, backend=rows.backend
        )
        return out if rows.row_weights is None else out * rows.row_weights.unsqueeze(1).to(out.dtype)
    x_compute = rows.rows
    check_swiglu_inputs(x_compute, gate_up, down)
    check_offsets_meta(rows.offsets, gate_up.shape[0])
    gate_up, down = autocast_inputs(x_compute.device, gate_up, down)
    if act is not F.silu or not grouped_mm_supported(x_compute, gate_up, down):
        g = gather  # materialised first: the experts' own fallbacks
        permuted = permute_rows(g.x, g.tokens, g.num_valid, g.positions, g.pair_mask, g.backend)
        materialised = ExpertRows(permuted, rows.offsets, rows.padded, rows.backend, row_weights=rows.row_weights)
        return expert_swiglu(materialised, gate_up, down, act)
    # grouped_mm's `offs`: the group ends. It leaves rows past the last end unwritten, so with padding (capacity,
    # token mask) the last group also takes the padding rows: gathered as zeros, with zero weight, they come out as
    # zeros from both GEMMs, forward and backward, and add nothing to the weight gradients. No mask pass is needed.
    ends = rows.offsets[1:]
    if rows.padded:
        ends = F.pad(rows.offsets[1:-1], (0, 1), value=gather.tokens.shape[0])
    g = gather
    hidden = gather_grouped_mm(
        g.x, x_compute, g.tokens, g.num_valid, g.positions, g.pair_mask, gate_up, ends, g.backend
    )
    return swiglu_down(hidden, down, ends, rows.row_weights, rows.backend)


def per_expert_loop(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether :func:`expert_swiglu` takes the per-expert loop (offsets read on the host) for these inputs: neither
    ``grouped_mm`` (directly or zero-padded to its alignment) nor the Triton grouped GEMM takes them."""
    if grouped_mm_supported(x, gate_up, down):
        return False
    return aligned_operands(x, gate_up, down) is None and not use_triton(x)


def _grouped_mm_swiglu(
    x: Tensor,
    offsets: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    padded: bool,
    backend: str,
) -> Tensor:
    """:func:`_grouped_swiglu` through ``grouped_mm`` (no host sync), the activation on ``backend``."""
    # grouped_mm takes the group ends (offsets[1:]) as its int32 `offs`, on x's device.
    ends = offsets[1:].to(device=x.device, dtype=torch.int32)
    valid = None
    if padded:
        # grouped_mm neither writes the padding rows of its output nor of its input gradient: mask both
        # sides with a device-side compare (no sync) so garbage never reaches the combine or the tokens.
        valid = (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1)
        x = torch.where(valid, x, 0)
    hidden = grouped_mm(x.contiguous(), gate_up, ends)
    if act is F.silu:
        out = swiglu_down(hidden, down, ends, None, backend)
    else:
        out = grouped_mm(_swiglu(hidden, act), down, ends)
    return out if valid is None else torch.where(valid, out, 0)


def _per_expert_swiglu(
    x: Tensor, bounds: list[int], gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]
) -> Tensor:
    """:func:`_grouped_swiglu` as a loop over experts, the rows sliced by offsets already read on the host."""
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

    def forward(
        self, x: Tensor, offsets: Tensor, *, padded: bool = False, validate: bool = True, backend: str = "auto"
    ) -> Tensor:
        """Apply expert ``e`` to rows ``offsets[e]:offsets[e+1]`` (:func:`expert_swiglu` over materialised rows).

        Args:
            x: ``(M, H)`` rows grouped by expert.
            offsets: ``(E+1,)`` int32 group boundaries.
            padded: rows from ``offsets[-1]`` on are padding (capacity limit); they come back as zeros.
            validate: check the offsets' values (one host sync on an accelerator; see :func:`expert_swiglu`).
            backend: the activation's kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

        Returns:
            ``(M, H)``.

        Raises:
            RoutingError: as :func:`expert_swiglu`, or an unknown ``backend``.
        """
        rows = ExpertRows(x, offsets, padded, resolve_backend(backend, x.device))
        return expert_swiglu(rows, self.gate_up_proj, self.down_proj, validate=validate)


def routed_swiglu(
    x: Tensor,
    plan: RoutingPlan,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor] = F.silu,
    *,
    x_compute: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Deprecated: :class:`~lightning_llmfast.moe.dispatcher.LocalDispatcher` and :func:`expert_swiglu` in one call,
    ``out[t] = sum_s weights[t, s] * expert_{e(t, s)}(x[t])`` over kept pairs. Use the dispatcher and
    :func:`expert_swiglu` (the example below); this name stays for code written against it.

    Args:
        x: ``(T, H)`` token activations.
        plan: their routing plan.
        gate_up: ``(E, H, 2F)`` expert weights (any strides), gate half first.
        down: ``(E, F, H)`` expert weights (any strides).
        act: activation of the gate half.
        x_compute: ``x`` already cast to the compute dtype (autocast's), to be shared with the router's matmul;
            ``None``: cast here.
        backend: ``"auto"`` (Triton gathers on CUDA), ``"torch"`` or ``"triton"``.

    Returns:
        ``(T, H)`` in the compute dtype.

    Raises:
        RoutingError: ``x`` is not ``(plan.num_tokens, H)``, ``gate_up``/``down`` are not ``(E, H, 2F)``/
            ``(E, F, H)`` with ``E = plan.num_experts``, or ``x_compute`` has another shape or a dtype other than
            ``compute_copy(x)``'s.

    Example::

        dispatcher = LocalDispatcher()
        rows, ctx = dispatcher.dispatch(x, route(router(x), 2, validate=False))
        y = dispatcher.combine(expert_swiglu(rows, experts.gate_up_proj, experts.down_proj), ctx)
    """
    warnings.warn(
        "routed_swiglu is deprecated: use LocalDispatcher().dispatch, expert_swiglu and LocalDispatcher.combine",
        DeprecationWarning,
        stacklevel=2,
    )
    dispatcher = LocalDispatcher(backend)
    rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
    check_swiglu_inputs(x, gate_up, down)
    if gate_up.shape[0] != plan.num_experts:
        raise RoutingError(
            f"gate_up and down must have E=plan.num_experts={plan.num_experts} experts, got {gate_up.shape[0]}"
        )
    return dispatcher.combine(expert_swiglu(rows, gate_up, down, act), ctx)
