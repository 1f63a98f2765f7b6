"""The grouped, sync-free MoE block: ``route`` -> ``permute`` -> grouped experts -> ``unpermute``.

:class:`MoEBlock` has the parameters (names, shapes, layout) of :class:`~lightning_llmfast.moe.naive.NaiveMoEBlock`
and computes the same function; it only replaces the bincount/``nonzero``/per-expert loop with one routing pass, a
stable gather and one grouped GEMM per projection, so neither its forward nor its backward reads a device value on
the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_llmfast._autograd import in_backward
from lightning_llmfast._checks import check_number
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe.dispatch import compute_copy, routed_swiglu
from lightning_llmfast.moe.experts import GroupedExperts
from lightning_llmfast.moe.kernels import BACKENDS
from lightning_llmfast.moe.naive import check_block_input, check_moe_args
from lightning_llmfast.moe.routing import DROP_POLICIES, RoutingPlan, route, update_expert_bias

__all__ = ["MoEBlock", "check_block_routing_args", "record_plan"]


def check_block_routing_args(capacity_factor: float | None, backend: str, drop_policy: str) -> None:
    """Validate routing options at construction time rather than at the first forward.

    Raises:
        ConfigError: naming the offending argument and value.
    """
    if capacity_factor is not None:
        # Finite, as route() requires: an infinite factor must fail here, not at the first forward.
        check_number("capacity_factor", capacity_factor, low=0, low_open=True)
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if drop_policy not in DROP_POLICIES:
        raise ConfigError(f"drop_policy must be one of {sorted(DROP_POLICIES)}, got {drop_policy!r}")


class MoEBlock(nn.Module):
    """Top-k mixture of SwiGLU experts with grouped, sync-free routing. Maps ``(..., H)`` to ``(..., H)``.

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        top_k: experts per token, ``1 <= top_k <= E``.
        capacity_factor: ``None`` (dropless) or a finite factor ``> 0`` of ``capacity = ceil(cf * T * k / E)``
            (at most ``T * k``).
        backend: routing kernels, ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.
        normalize: renormalise the top-k weights to sum to 1.
        score: ``"softmax"`` or ``"sigmoid"``.
        drop_policy: ``"position"`` or ``"score"`` (which overflow pairs a capacity limit drops).
        expert_bias: keep an aux-loss-free balancing bias (DeepSeek-V3) as the ``(E,)`` buffer ``expert_bias``.
        bias_update_rate: how far each training forward moves ``expert_bias`` toward balance, a finite number
            ``>= 0`` (:func:`~lightning_llmfast.moe.update_expert_bias`, in place and sync-free).

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``; ``router.weight`` is ``(E, H)``.
        experts: :class:`~lightning_llmfast.moe.GroupedExperts` (``gate_up_proj`` ``(E, H, 2F)``, ``down_proj``
            ``(E, F, H)``).
        expert_bias: ``(E,)`` float32 buffer, or ``None``.
        last_plan: the :class:`~lightning_llmfast.moe.RoutingPlan` of the last forward.
        last_aux_loss: 0-d differentiable load-balancing loss of the last forward.
        last_z_loss: 0-d differentiable router z-loss of the last forward.
        last_tokens_per_expert: ``(E,)`` int32 kept pairs per expert of the last forward.
        last_router_logits: ``(T, E)`` router logits of the last forward.
        last_nonfinite: 0-d bool tensor, whether the last router logits had NaN/inf (checked off the hot path,
            e.g. by :class:`~lightning_llmfast.callbacks.ExpertLoadMonitor`).

    Example::

        block = MoEBlock(hidden_size=64, ffn_size=128, num_experts=8, top_k=2)
        y = block(torch.randn(2, 16, 64))  # (2, 16, 64), no host sync
        loss = y.square().mean() + 0.01 * block.last_aux_loss + 1e-3 * block.last_z_loss
    """

    # Already grouped: swap_moe_blocks leaves it (and its children) alone.
    _llmfast_grouped = True

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        capacity_factor: float | None = None,
        backend: str = "auto",
        normalize: bool = True,
        score: str = "softmax",
        drop_policy: str = "position",
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        check_moe_args(hidden_size, ffn_size, num_experts, top_k, score)
        check_block_routing_args(capacity_factor, backend, drop_policy)
        check_number("bias_update_rate", bias_update_rate, low=0)
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.backend = backend
        self.normalize = normalize
        self.score = score
        self.drop_policy = drop_policy
        self.bias_update_rate = bias_update_rate
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_size)
        # The routed experts' call: replaced by an expert-parallel dispatch by shard_experts (moe/expert_parallel.py).
        self.expert_dispatch: Callable[..., Tensor] = routed_swiglu
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)
        self.last_plan: RoutingPlan | None = None
        self.last_aux_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None
        self.last_router_logits: Tensor | None = None
        self.last_nonfinite: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        """Route, dispatch, run the experts and combine, without a host sync.

        Args:
            x: ``(..., H)`` in the block's dtype (any float dtype under autocast).

        Returns:
            ``(..., H)``, same dtype as ``x``.

        Raises:
            RoutingError: ``x`` is not a float ``(..., H)`` tensor on the block's device, or (outside autocast)
                its dtype is not the block's: the block does not cast ``x`` itself (``nn.Linear`` neither).
        """
        check_block_input(x, self.hidden_size, self.router.weight)
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        # Cast once for router and experts: both keep this one (T, H) copy for backward (dispatch.py).
        x_compute = compute_copy(x)
        logits = self.router(x_compute)  # (T, E)
        plan = route(
            logits,
            self.top_k,
            score=self.score,
            normalize=self.normalize,
            capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy,
            expert_bias=self.expert_bias,
            validate=False,
            backend=self.backend,
        )
        experts = self.experts
        out = self.expert_dispatch(
            x, plan, experts.gate_up_proj, experts.down_proj, x_compute=x_compute, backend=self.backend
        ).to(x.dtype)
        # Not again when activation recomputation replays this forward inside backward.
        if self.expert_bias is not None and self.training and self.bias_update_rate > 0 and not in_backward():
            # After routing, so this forward selected with the bias it started with (DeepSeek-V3 updates per step).
            update_expert_bias(self.expert_bias, plan.tokens_per_expert, self.bias_update_rate)
        record_plan(self, plan, logits)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, backend={self.backend!r}, "
            f"normalize={self.normalize}, score={self.score!r}"
        )


def record_plan(block: nn.Module, plan: RoutingPlan, logits: Tensor) -> None:
    """Store a forward's routing results as the ``last_*`` attributes read by losses, metrics and callbacks.

    Args:
        block: the MoE block (ours or an adapted third-party one).
        plan: its :class:`~lightning_llmfast.moe.RoutingPlan`.
        logits: ``(T, E)`` router logits.
    """
    block.last_plan = plan
    block.last_aux_loss = plan.aux_loss
    block.last_z_loss = plan.z_loss
    block.last_tokens_per_expert = plan.tokens_per_expert
    block.last_router_logits = logits
    block.last_nonfinite = plan.nonfinite
