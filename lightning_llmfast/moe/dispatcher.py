"""The token-dispatcher seam of the MoE block: how routed tokens reach the experts and how their outputs come back.

An :class:`~lightning_llmfast.moe.MoEBlock` is given its dispatcher at construction (or by expert parallelism through
:meth:`~lightning_llmfast.moe.MoEBlock.set_dispatcher`) and runs, for every forward::

    rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
    y = dispatcher.combine(expert_swiglu(rows, gate_up, down, act), ctx)

Implementations: :class:`~lightning_llmfast.moe.dispatch.LocalDispatcher` (every expert on this rank; the gather is
fused into the first expert GEMM and the combine weights into the second's epilogue),
:class:`~lightning_llmfast.moe.expert_parallel.AllToAllDroplessDispatcher` and
:class:`~lightning_llmfast.moe.expert_parallel.AllToAllCapacityDispatcher` (experts spread over a process group,
tokens exchanged with ``all_to_all_single``).

Example::

    block = MoEBlock(config, dispatcher=LocalDispatcher(backend="torch"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from torch import Tensor

from lightning_llmfast.moe.routing import RoutingPlan

__all__ = ["ExpertRows", "RowGather", "TokenDispatcher"]


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
        gather: the fused gather, or ``None`` when ``rows`` are already the grouped rows.
        row_weights: ``(M,)`` combine weight of each row, applied to the expert outputs (in the second GEMM's
            epilogue), or ``None`` when the dispatcher's combine applies the weights.
    """

    rows: Tensor
    offsets: Tensor
    padded: bool
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

    def batch_aux_loss(self, plan: RoutingPlan) -> Tensor | None:
        """The load-balancing loss over the whole dispatch group's batch, or ``None`` (the block's own loss).

        Called once per training forward, after :meth:`combine`.
        """
        return None
