"""The token dispatchers of the MoE block: how routed tokens reach the experts and how their outputs come back.

An :class:`~lightning_llmfast.moe.MoEBlock` is given its dispatcher at construction (or by expert parallelism through
:meth:`~lightning_llmfast.moe.MoEBlock.set_dispatcher`) and runs, for every forward::

    rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
    y = dispatcher.combine(expert_swiglu(rows, gate_up, down, act), ctx)

Implementations: :class:`LocalDispatcher` (every expert on this rank; the gather is fused into the first expert GEMM
and the combine weights into the second's epilogue, so no ``(T * k, H)`` rows are kept for backward),
:class:`~lightning_llmfast.expert_parallel.AllToAllDroplessDispatcher` and
:class:`~lightning_llmfast.expert_parallel.AllToAllCapacityDispatcher` (experts spread over a process group,
tokens exchanged with ``all_to_all_single``). Every dispatcher carries the kernel backend (``"auto"``: Triton on
CUDA, else the PyTorch reference) into the :class:`ExpertRows` it hands the experts, so that
:func:`~lightning_llmfast.moe.experts.expert_swiglu` runs the same kernels whichever dispatcher fed it.

Example::

    block = MoEBlock(config, dispatcher=LocalDispatcher(backend="torch"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.kernels import BACKENDS, resolve_backend
from lightning_llmfast.moe.routing import RoutingPlan
from lightning_llmfast.moe.token_rows import pair_values_to_rows, plan_indices, sum_rows

__all__ = ["ExpertRows", "LocalDispatcher", "RowGather", "TokenDispatcher", "compute_copy", "compute_dtype"]

_Side = TypeVar("_Side")


class RowGather(NamedTuple):
    """A gather fused into the first expert GEMM: row ``r`` of the experts' input is token ``tokens[r]``.

    Attributes:
        x: ``(T, H)`` the differentiable token activations (their gradient comes back in their dtype).
        tokens: ``(R,)`` int64 token of each row.
        positions: ``(T, k)`` int64 row of each pair (for the backward's combine).
        pair_mask: ``(T, k)`` 1 for kept pairs, 0 for dropped or masked ones, or ``None`` (all kept).
        num_valid: 0-d count of real rows (the rest are padding), or ``None`` (no padding).
        backend: gather kernels, ``"torch"`` or ``"triton"``.
    """

    x: Tensor
    tokens: Tensor
    positions: Tensor
    pair_mask: Tensor | None
    num_valid: Tensor | None
    backend: str


class ExpertRows(NamedTuple):
    """What the experts consume: rows grouped by (local) expert, materialised or as a fused gather.

    Attributes:
        rows: ``(M, H)`` rows grouped by expert; with ``gather``, the ``(T, H)`` token activations in the compute
            dtype that row ``r`` reads as ``rows[gather.tokens[r]]``.
        offsets: ``(E_local + 1,)`` int32 group boundaries (``offsets[0] == 0``).
        padded: rows from ``offsets[-1]`` on are padding (zero outputs and gradients).
        backend: the experts' kernels, already resolved: ``"torch"`` (the PyTorch reference) or ``"triton"``.
        gather: the fused gather, or ``None`` when ``rows`` are already the grouped rows.
        row_weights: ``(M,)`` combine weight of each row, applied to the expert outputs (in the second GEMM's
            epilogue), or ``None`` when the dispatcher's combine applies the weights.
    """

    rows: Tensor
    offsets: Tensor
    padded: bool
    backend: str
    gather: RowGather | None = None
    row_weights: Tensor | None = None


class TokenDispatcher(ABC):
    """Moves routed tokens to their experts (:meth:`dispatch`) and the expert outputs back (:meth:`combine`).

    A dispatcher holds no parameters; the block owns the experts. Payload dtype conversion (e.g. bf16 or fp8 rows
    on the wire) belongs inside the all-to-all dispatchers: cast after the local permutation in :meth:`dispatch`,
    back before the experts, and likewise around the return exchange in :meth:`combine`, so that the block, the
    experts and the local path never see it.

    Example::

        rows, ctx = dispatcher.dispatch(x, plan)
        y = dispatcher.combine(expert_swiglu(rows, gate_up, down), ctx)
    """

    @abstractmethod
    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        """Route ``x`` ``(T, H)`` by ``plan`` to this rank's experts.

        Args:
            x: ``(T, H)`` this rank's token activations.
            plan: their routing plan over all ``E`` experts.
            x_compute: ``x`` already in the compute dtype (autocast's; shared with the router), or ``None``.

        Returns:
            ``(rows, ctx)``: the :class:`ExpertRows` for the local experts, and what :meth:`combine` needs.
        """

    @abstractmethod
    def combine(self, rows: Tensor, ctx: Any) -> Tensor:
        """Bring the experts' output rows back to token order: ``(T, H)``, summed over each token's kept pairs.

        Args:
            rows: the experts' ``(M, H)`` outputs for :meth:`dispatch`'s rows.
            ctx: :meth:`dispatch`'s context.
        """

    def run(
        self,
        x: Tensor,
        plan: RoutingPlan,
        experts: Callable[[ExpertRows], Tensor],
        independent: Callable[[], _Side],
        *,
        x_compute: Tensor | None = None,
    ) -> tuple[Tensor, _Side]:
        """:meth:`dispatch`, ``experts``, :meth:`combine`, and ``independent`` (work that needs no routed result).

        Here in that order; a dispatcher that exchanges tokens may run ``independent`` while its exchanges are in
        flight, and the experts on a chunk of the rows while the next chunk travels (the all-to-all dispatchers
        with an ``overlap_chunks``).

        Args:
            x: ``(T, H)`` this rank's token activations.
            plan: their routing plan.
            experts: the experts on :class:`ExpertRows`: ``(M, H)`` outputs.
            independent: called once, its result returned.
            x_compute: as in :meth:`dispatch`.

        Returns:
            ``(combined (T, H), independent())``.

        Example::

            y, shared = dispatcher.run(x, plan, lambda rows: expert_swiglu(rows, gate_up, down), lambda: None)
        """
        rows, ctx = self.dispatch(x, plan, x_compute=x_compute)
        out = self.combine(experts(rows), ctx)
        return out, independent()

    def batch_aux_loss(self, plan: RoutingPlan) -> Tensor | None:
        """The load-balancing loss over the whole dispatch group's batch, or ``None`` (the block's own loss).

        Called once per training forward, after :meth:`combine`.
        """
        return None


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank: a fused gather into the first expert GEMM, weights in the second's epilogue.

    :meth:`dispatch` materialises no rows: it hands the experts the token activations with the gather indices and
    each row's combine weight; :meth:`combine` is a plain sum over each token's rows that keeps no rows for
    backward (module docstring).

    Args:
        backend: gather/combine kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

    Example::

        dispatcher = LocalDispatcher()
        rows, ctx = dispatcher.dispatch(x, plan)
        y = dispatcher.combine(expert_swiglu(rows, gate_up, down), ctx)
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.backend = backend

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        _check_tokens(x, plan, x_compute)
        backend = resolve_backend(self.backend, x.device)
        idx = plan_indices(plan)
        kept = plan.kept if plan.padded else None
        pair_mask = kept.to(x.dtype) if kept is not None else None
        row_weights = plan.row_weights
        if row_weights is None:
            weights = plan.weights if kept is None else plan.weights * kept.to(plan.weights.dtype)
            row_weights = pair_values_to_rows(weights, idx.pairs, idx.positions, kept)
        # x_compute is not detached: its grad_fn (a cast of the norm's output) lets the offloader rebuild it.
        gather = RowGather(x, idx.tokens, idx.positions, pair_mask, idx.num_valid, backend)
        tokens = compute_copy(x) if x_compute is None else x_compute
        rows = ExpertRows(tokens, plan.offsets, plan.padded, backend, gather=gather, row_weights=row_weights)
        return rows, gather

    def combine(self, rows: Tensor, ctx: RowGather) -> Tensor:
        return sum_rows(rows, ctx.positions, ctx.pair_mask, ctx.tokens, ctx.num_valid, ctx.backend)

    def __repr__(self) -> str:
        return f"LocalDispatcher(backend={self.backend!r})"


def _check_tokens(x: Tensor, plan: RoutingPlan, x_compute: Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise RoutingError(f"x must have shape (num_tokens={plan.num_tokens}, hidden), got {tuple(x.shape)}")
    if x_compute is not None:
        if x_compute.shape != x.shape:
            raise RoutingError(f"x_compute must have the shape of x {tuple(x.shape)}, got {tuple(x_compute.shape)}")
        if x_compute.dtype != compute_dtype(x):
            raise RoutingError(
                f"x_compute must have dtype {compute_dtype(x)} (compute_copy(x): x's, or autocast's), "
                f"got {x_compute.dtype}"
            )


def compute_copy(x: Tensor) -> Tensor:
    """``x`` in autocast's dtype when autocast is on (and ``x`` is a float type it casts), else ``x`` itself.

    Example::

        x_compute = compute_copy(x)
        logits = router(x_compute)  # autocast keeps an already cast input as is: one copy for router and experts
    """
    dtype = compute_dtype(x)
    return x if dtype == x.dtype else x.to(dtype)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of :func:`compute_copy`'s result: autocast's for a float ``x`` it casts, else ``x``'s.

    Example::

        compute_dtype(torch.randn(2, 2))  # torch.float32 outside autocast
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype
