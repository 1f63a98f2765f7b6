"""Router losses over the one counting pass, honouring a token mask: Switch/GShard balance (per micro-batch, or
with counts accumulated over a step), DeepSeek-V3's sequence-wise balance over packed documents, and the z-loss.

All are sync-free: token counts stay on the device, sizes come from shapes, and documents are handled with one
integer scatter and a gather (no loop over documents, no ``(documents, T)`` matrix). Every balance loss equals 1
for perfectly uniform routing.

Example::

    plan = route(logits, top_k=2, token_mask=mask)
    loss = plan.aux_loss + plan.sequence_aux_loss(metadata) + 1e-3 * plan.z_loss
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmfast.errors import RoutingError
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["balance_loss", "masked_probs", "sequence_balance_loss", "z_loss"]


def masked_probs(probs: Tensor, token_mask: Tensor | None) -> Tensor:
    """``probs`` with the rows of masked tokens set to 0 (a select: a masked row may hold NaN)."""
    return probs if token_mask is None else probs.masked_fill(~token_mask.unsqueeze(1), 0.0)


def _num_valid(num_tokens: int, token_mask: Tensor | None) -> Tensor | int:
    """Valid tokens, at least 1: a host int without a mask, else a 0-d device tensor (no sync)."""
    return max(num_tokens, 1) if token_mask is None else token_mask.sum().clamp(min=1)


def balance_loss(counts: Tensor, probs: Tensor, token_mask: Tensor | None) -> Tensor:
    """Switch/GShard ``E * sum_e f_e * P_e``: ``f_e = counts_e / sum(counts)``, ``P_e`` the mean masked probability.

    Args:
        counts: ``(E,)`` integer pairs per expert (this micro-batch's, or summed over a step and over ranks).
        probs: ``(T, E)`` float32 router probabilities (sigmoid scores normalised per token), differentiable.
        token_mask: ``(T,)`` bool or ``None``.

    Returns:
        0-d float32, differentiable through ``probs`` (``sum(counts)`` is valid tokens * k for one micro-batch's
        counts, so ``f_e`` is Switch's fraction of routed pairs).
    """
    num_experts = probs.shape[1]
    prob_sums = masked_probs(probs, token_mask).sum(dim=0)
    total = counts.sum().clamp(min=1).to(torch.float32)
    return torch.dot(counts.to(torch.float32), prob_sums) * (
        num_experts / total / _num_valid(probs.shape[0], token_mask)
    )


def z_loss(logits: Tensor, token_mask: Tensor | None) -> Tensor:
    """Router z-loss: the mean over valid tokens of ``logsumexp(logits) ** 2`` (0-d float32)."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    if token_mask is not None:
        lse = lse.masked_fill(~token_mask, 0.0)
    return torch.dot(lse, lse) / _num_valid(logits.shape[0], token_mask)


def sequence_balance_loss(
    probs: Tensor, expert_ids: Tensor, token_mask: Tensor | None, metadata: SequenceMetadata
) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the documents with a valid token.

    For document ``d`` with ``L`` valid tokens: ``sum_e f_e * P_e`` with ``f_e = E / (k * L) * (selections of e)``
    and ``P_e = mean_t p'_te`` over its valid tokens. Summed per token as ``<p'_t, c_{d(t)}> * E / (k * L_d ** 2)``,
    so only the integer counts ``c`` go through a scatter (exact and deterministic).

    Args:
        probs: ``(T, E)`` float32 normalised router probabilities ``p'``, differentiable.
        expert_ids: ``(T, k)`` selected experts (before any capacity limit).
        token_mask: ``(T,)`` bool or ``None``.
        metadata: the packed document boundaries of the ``T`` tokens.

    Returns:
        0-d float32 (0 when no token is valid).

    Raises:
        RoutingError: ``metadata`` not a :class:`~lightning_llmfast.seqmeta.SequenceMetadata` of ``T`` tokens.
    """
    num_tokens, num_experts = probs.shape
    top_k = expert_ids.shape[1]
    if not isinstance(metadata, SequenceMetadata):
        raise RoutingError(f"metadata must be a SequenceMetadata, got {type(metadata).__name__}")
    if metadata.num_tokens != num_tokens:
        raise RoutingError(f"metadata describes {metadata.num_tokens} tokens but the plan routed {num_tokens}")
    num_docs = max(metadata.num_sequences, 1)
    doc = metadata.to(probs.device).document_ids  # (T,) int64, memoised
    valid = torch.ones(num_tokens, dtype=torch.int64, device=probs.device) if token_mask is None else token_mask.long()
    keys = (doc.unsqueeze(1) * num_experts + expert_ids.long()).reshape(-1)
    counts = torch.zeros(num_docs * num_experts, dtype=torch.int64, device=probs.device)
    counts.scatter_add_(0, keys, valid.repeat_interleave(top_k))
    lengths = torch.zeros(num_docs, dtype=torch.int64, device=probs.device).scatter_add_(0, doc, valid)
    docs_used = (lengths > 0).sum().clamp(min=1)
    scale = num_experts / (top_k * lengths.clamp(min=1).to(torch.float32).square() * docs_used)  # (D,)
    per_token = (masked_probs(probs, token_mask) * counts.view(num_docs, num_experts)[doc].to(torch.float32)).sum(1)
    return torch.dot(per_token, scale[doc])
