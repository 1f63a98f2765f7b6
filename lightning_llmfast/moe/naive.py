"""SwiGLU expert weights and the naive ("before") MoE block.

:class:`NaiveMoEBlock` is the explicit baseline every benchmark compares against: it routes like HuggingFace's
``eager`` experts implementation (softmax top-k, ``bincount`` counts, a Python loop over experts with ``nonzero``
and ``index_add_``). Its host syncs are the point of a baseline and are marked ``# NOTE:``. It shares its parameter
names and layout with :class:`~lightning_llmfast.moe.block.MoEBlock`, so a state dict moves between the two.
"""

from __future__ import annotations

from numbers import Integral

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe.adapters import register_moe_adapter
from lightning_llmfast.moe.block import MoEBlock
from lightning_llmfast.moe.checks import check_block_input
from lightning_llmfast.moe.config import SCORES, MoEConfig, RoutingConfig
from lightning_llmfast.moe.experts import ExpertWeights
from lightning_llmfast.moe.stats import MoEStats

__all__ = ["SwiGLUExperts", "NaiveMoEBlock", "check_moe_args", "router_scores", "router_losses"]


def check_moe_args(hidden_size: int, ffn_size: int, num_experts: int, top_k: int, score: str) -> None:
    """Validate the constructor arguments shared by the MoE blocks.

    Raises:
        ConfigError: naming the offending argument and value.
    """
    for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts)):
        check_int(name, value, low=1)
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or not 1 <= top_k <= num_experts:  # as route()
        raise ConfigError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if score not in SCORES:
        raise ConfigError(f"score must be one of {sorted(SCORES)}, got {score!r}")


def router_scores(logits: Tensor, score: str) -> Tensor:
    """Router scores in float32: ``softmax`` over experts or element-wise ``sigmoid``.

    Args:
        logits: ``(num_tokens, num_experts)``.
        score: ``"softmax"`` or ``"sigmoid"``.

    Returns:
        ``(num_tokens, num_experts)`` float32 scores.
    """
    logits = logits.float()
    return logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()


def router_losses(logits: Tensor, probs: Tensor, tokens_per_expert: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Switch/GShard load-balancing loss and router z-loss.

    ``aux = E * sum_e f_e * P_e`` with ``f_e`` the fraction of (token, slot) pairs routed to expert ``e`` and
    ``P_e`` the mean router probability of ``e``; ``z = mean(logsumexp(logits) ** 2)``.

    Args:
        logits: ``(num_tokens, num_experts)`` router logits.
        probs: ``(num_tokens, num_experts)`` float32 router probabilities (softmax scores; sigmoid scores
            normalised per token).
        tokens_per_expert: ``(num_experts,)`` integer counts of routed pairs.
        top_k: experts per token.

    Returns:
        ``(aux_loss, z_loss)``, both 0-d float32 and differentiable with respect to ``logits``.
    """
    num_tokens, num_experts = logits.shape
    # max(T, 1) keeps T=0 finite (both losses are then 0) without a Python branch on a tensor.
    denom = max(num_tokens, 1)
    frac = tokens_per_expert.float() / (denom * top_k)
    aux = num_experts * (frac * probs.sum(dim=0) / denom).sum()
    z = logits.float().logsumexp(dim=-1).square().sum() / denom
    return aux, z


class SwiGLUExperts(ExpertWeights):
    """:class:`~lightning_llmfast.moe.experts.ExpertWeights` applied one expert at a time (the baseline's loop).

    Example::

        experts = SwiGLUExperts(num_experts=8, hidden_size=64, ffn_size=128)
        y = experts.expert_forward(3, torch.randn(5, 64))  # (5, 64)
    """

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        """Apply one expert.

        Args:
            expert: expert index in ``[0, E)``.
            x: ``(n, H)`` tokens.

        Returns:
            ``(n, H)``.
        """
        gate, up = (x @ self.gate_up_proj[expert]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[expert]


class NaiveMoEBlock(nn.Module):
    """Baseline top-k MoE block: ``bincount`` counting and a Python loop over experts (HF ``eager``-like).

    Maps ``[..., H]`` to ``[..., H]``. After every forward it stores one :class:`~lightning_llmfast.moe.MoEStats`
    record in ``stats``.

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        top_k: experts per token, ``1 <= top_k <= E``.
        normalize: renormalise the top-k weights to sum to 1.
        score: ``"softmax"`` or ``"sigmoid"``.

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``; ``router.weight`` is ``(E, H)``.
        experts: :class:`SwiGLUExperts`.
        stats: the last forward's :class:`~lightning_llmfast.moe.MoEStats` (counts, losses, router logits; no plan).

    Example::

        block = NaiveMoEBlock(hidden_size=64, ffn_size=128, num_experts=8, top_k=2)
        y = block(torch.randn(2, 10, 64))  # (2, 10, 64)
        loss = y.square().mean() + 0.01 * block.stats.aux_loss
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        normalize: bool = True,
        score: str = "softmax",
    ) -> None:
        super().__init__()
        check_moe_args(hidden_size, ffn_size, num_experts, top_k, score)
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize = normalize
        self.score = score
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = SwiGLUExperts(num_experts, hidden_size, ffn_size)
        self.stats: MoEStats | None = None

    def forward(self, x: Tensor) -> Tensor:
        """Route every token to its top-k experts and combine their outputs.

        Args:
            x: ``(..., H)`` in the block's dtype (any float dtype under autocast).

        Returns:
            ``(..., H)``, same dtype as ``x``.

        Raises:
            RoutingError: ``x`` is not a float ``(..., H)`` tensor on the block's device, or (outside autocast)
                its dtype is not the block's.
        """
        check_block_input(x, self.hidden_size, self.router.weight)
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        logits = self.router(x)  # (T, E)
        scores = router_scores(logits, self.score)
        top_w, top_i = scores.topk(self.top_k, dim=-1)  # (T, k), descending
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        # NOTE: host sync on CUDA (bincount computes its output size from the data); that is the baseline.
        counts = torch.bincount(top_i.flatten(), minlength=self.num_experts)
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            # NOTE: host sync: nonzero has a data-dependent output shape.
            token, slot = torch.nonzero(top_i == expert, as_tuple=True)
            y = self.experts.expert_forward(expert, x[token])
            out = out.index_add(0, token, (y * top_w[token, slot, None]).to(x.dtype))
        probs = scores if self.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        aux, z = router_losses(logits, probs, counts, self.top_k)
        num_pairs = logits.shape[0] * self.top_k
        # Dropless: no dropped pairs to count, no plan.
        self.stats = MoEStats(counts.to(torch.int32), aux, z, None, num_pairs, None, logits, None)
        return out.reshape(shape)

    def finish_step(self, group: object = None) -> None:
        """Nothing to close: the baseline keeps no per-step state (part of the MoE layer contract)."""

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, normalize={self.normalize}, score={self.score!r}"


def _adapt_naive(block: NaiveMoEBlock, backend: str = "auto") -> MoEBlock:
    """:class:`NaiveMoEBlock` -> :class:`MoEBlock` holding the same router and expert ``Parameter`` objects."""
    routing = RoutingConfig(top_k=block.top_k, score=block.score, normalize=block.normalize, backend=backend)
    # Built on the meta device: its own parameters are discarded at once, so they must not allocate.
    with torch.device("meta"):
        grouped = MoEBlock(MoEConfig(block.hidden_size, block.ffn_size, block.num_experts, routing))
    grouped.router = block.router
    grouped.experts.gate_up_proj = block.experts.gate_up_proj
    grouped.experts.down_proj = block.experts.down_proj
    grouped.train(block.training)
    return grouped


# The baseline registers its own adapter, so the runtime (moe.adapters) never imports the baseline.
register_moe_adapter(NaiveMoEBlock, _adapt_naive)
