"""The end-to-end peer: transformers' own Mixtral MoE block as the reference model's feed-forward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError

if TYPE_CHECKING:
    from lightning_llmfast.moe import NaiveMoEBlock

__all__ = ["HFMixtralFFN"]


class HFMixtralFFN(nn.Module):
    """transformers' ``MixtralSparseMoeBlock`` (``grouped_mm`` experts) as the reference model's feed-forward.

    The block itself is transformers' code, unchanged. This wrapper only exposes what the reference model reads
    after every forward: ``last_aux_loss``, computed with transformers' own ``load_balancing_loss_func`` from the
    router logits (as ``MixtralForCausalLM`` does when it trains with router logits).

    Args:
        block: a ``MixtralSparseMoeBlock``.

    Attributes:
        moe: the wrapped block.
        last_aux_loss: 0-d load-balancing loss of the last forward.

    Example::

        ffn = HFMixtralFFN.from_naive(naive_block)  # same function as naive_block, transformers' kernels
        y = ffn(x)  # (B, T, H)
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        self.moe = block
        self._loss_fn = load_balancing_loss_func
        self._router_logits: Tensor | None = None
        self.last_aux_loss: Tensor | None = None
        # The block drops its router logits; a hook on its router keeps them for the loss.
        block.gate.register_forward_hook(self._keep_router_logits)

    def _keep_router_logits(self, module: nn.Module, args: Any, output: tuple[Tensor, ...]) -> None:
        self._router_logits = output[0]

    @classmethod
    def from_naive(cls, naive: NaiveMoEBlock) -> HFMixtralFFN:
        """Build transformers' block with the same weights as ``naive`` (so the same function), on its device.

        Our experts store ``gate_up_proj`` as ``(E, H, 2F)`` and ``down_proj`` as ``(E, F, H)`` (``x @ W``);
        transformers stores ``(E, 2F, H)`` and ``(E, H, F)`` (``F.linear``): the copies are transposes.

        Raises:
            ImportError: transformers is not installed, or has no ``grouped_mm`` experts implementation.
        """
        from transformers import MixtralConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
            raise ImportError("this transformers version has no 'grouped_mm' experts implementation")
        if not naive.normalize or naive.score != "softmax":
            raise ConfigError("the Mixtral peer needs softmax scores renormalised over the top-k (as Mixtral does)")
        config = MixtralConfig(
            hidden_size=naive.hidden_size,
            intermediate_size=naive.ffn_size,
            num_local_experts=naive.num_experts,
            num_experts_per_tok=naive.top_k,
            router_jitter_noise=0.0,
            hidden_act="silu",
            experts_implementation="grouped_mm",
        )
        block = MixtralSparseMoeBlock(config).to(naive.router.weight.device)
        with torch.no_grad():
            block.gate.weight.copy_(naive.router.weight)
            block.experts.gate_up_proj.copy_(naive.experts.gate_up_proj.transpose(1, 2))
            block.experts.down_proj.copy_(naive.experts.down_proj.transpose(1, 2))
        return cls(block)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(B, T, H)`` to ``(B, T, H)``."""
        y = self.moe(x)
        self.last_aux_loss = self._loss_fn((self._router_logits,), self.moe.experts.num_experts, self.moe.top_k)
        return y
