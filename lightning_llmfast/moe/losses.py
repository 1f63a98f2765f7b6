"""Router losses over the one counting pass, honouring a token mask: Switch/GShard balance (per micro-batch, or
with counts accumulated over a step), DeepSeek-V3's sequence-wise balance over packed documents, and the z-loss.

All are sync-free: token counts stay on the device, sizes come from shapes, and documents are handled with one
integer scatter and a gather (no loop over documents, no ``(documents, T)`` matrix). Every balance loss equals 1
for perfectly uniform routing.

Documents split across ranks (context parallelism: each rank of a group routes pieces of the batch's documents) are
balanced document by document: :class:`SequenceBoundaries` then number the documents over the whole batch and name
the group, and the per-document integer counts are summed over it with one all-reduce (no gradient flows through
them: the loss is differentiable through the local probabilities only, so the backward needs no exchange).

Example::

    plan = route(logits, top_k=2, token_mask=mask)
    loss = plan.aux_loss + plan.sequence_aux_loss(SequenceBoundaries(document_ids, 2)) + 1e-3 * plan.z_loss
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_reduce, wait_tensor

from lightning_llmfast.errors import RoutingError

__all__ = ["SequenceBoundaries", "balance_loss", "masked_probs", "sequence_balance_loss", "z_loss"]


class SequenceBoundaries(NamedTuple):
    """The packed documents of ``T`` routed tokens, for the sequence-wise balance loss.

    The caller owns the sequence metadata (e.g. :class:`~lightning_llmfast.seqmeta.SequenceMetadata`) and passes its
    boundaries down: ``SequenceBoundaries(metadata.document_ids, metadata.num_sequences)``.

    Under context parallelism the rank's tokens are pieces of documents that other ranks of ``group`` hold pieces
    of too: ``document_ids`` then number the documents of the whole batch, alike on every rank of the group.

    Attributes:
        document_ids: ``(T,)`` integer document index of every token, in ``[0, num_documents)``.
        num_documents: the number of documents (a host int: it sizes the per-document counts).
        group: the ranks holding the other pieces of these documents (a ``ProcessGroup``), or ``None``: every
            document is whole here.

    Example::

        boundaries = SequenceBoundaries(torch.tensor([0, 0, 0, 1, 1]), 2)
    """

    document_ids: Tensor
    num_documents: int
    group: Any = None

    @classmethod
    def rows(cls, num_rows: int, length: int, device: torch.device) -> SequenceBoundaries:
        """Each of ``num_rows`` rows of ``length`` tokens as one document.

        Example::

            SequenceBoundaries.rows(2, 3, torch.device("cpu")).document_ids  # tensor([0, 0, 0, 1, 1, 1])
        """
        ids = torch.arange(num_rows, device=device).repeat_interleave(length)
        return cls(ids, num_rows)


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
    probs: Tensor, expert_ids: Tensor, token_mask: Tensor | None, boundaries: SequenceBoundaries
) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the documents with a valid token.

    For document ``d`` with ``L`` valid tokens: ``sum_e f_e * P_e`` with ``f_e = E / (k * L) * (selections of e)``
    and ``P_e = mean_t p'_te`` over its valid tokens. Summed per token as ``<p'_t, c_{d(t)}> * E / (k * L_d ** 2)``,
    so only the integer counts ``c`` go through a scatter (exact and deterministic).

    With ``boundaries.group`` the counts ``c`` and lengths ``L`` (integers, no gradient) are summed over the group
    (one all-reduce of ``D * (E + 1)`` integers) and the rank's per-token sum is multiplied by the group's size: the
    mean over the group's ranks of the returned values, and of their gradients (what data parallelism averages), is
    the loss of one process holding every piece.

    Args:
        probs: ``(T, E)`` float32 normalised router probabilities ``p'``, differentiable.
        expert_ids: ``(T, k)`` selected experts (before any capacity limit).
        token_mask: ``(T,)`` bool or ``None``.
        boundaries: the packed documents of the ``T`` tokens.

    Returns:
        0-d float32 (0 when no token is valid).

    Raises:
        RoutingError: ``boundaries`` not :class:`SequenceBoundaries` of ``T`` tokens on the probabilities' device.

    Example::

        loss = sequence_balance_loss(plan.router_probs, plan.expert_ids, None, SequenceBoundaries(doc_ids, 3))
    """
    num_tokens, num_experts = probs.shape
    top_k = expert_ids.shape[1]
    if not isinstance(boundaries, SequenceBoundaries):
        raise RoutingError(f"boundaries must be SequenceBoundaries, got {type(boundaries).__name__}")
    doc = boundaries.document_ids
    if not isinstance(doc, Tensor) or tuple(doc.shape) != (num_tokens,) or doc.is_floating_point():
        got = f"{doc.dtype} of shape {tuple(doc.shape)}" if isinstance(doc, Tensor) else type(doc).__name__
        raise RoutingError(
            f"boundaries.document_ids must be a ({num_tokens},) integer tensor (one per token), got {got}"
        )
    if doc.device != probs.device:
        raise RoutingError(f"boundaries.document_ids is on {doc.device} but the router's tokens are on {probs.device}")
    num_docs = max(boundaries.num_documents, 1)
    doc = doc.long()
    valid = torch.ones(num_tokens, dtype=torch.int64, device=probs.device) if token_mask is None else token_mask.long()
    keys = (doc.unsqueeze(1) * num_experts + expert_ids.long()).reshape(-1)
    counts = torch.zeros(num_docs * num_experts, dtype=torch.int64, device=probs.device)
    counts.scatter_add_(0, keys, valid.repeat_interleave(top_k))
    lengths = torch.zeros(num_docs, dtype=torch.int64, device=probs.device).scatter_add_(0, doc, valid)
    ranks = 1
    if boundaries.group is not None:
        # Every rank's pieces of each document: one all-reduce of the integer counts and lengths (queued, no host read).
        # Functional: traceable by torch.compile as well.
        summed = wait_tensor(all_reduce(torch.cat([counts, lengths]), "sum", boundaries.group))
        counts, lengths = summed[: counts.numel()], summed[counts.numel() :]
        ranks = dist.get_world_size(boundaries.group)
    docs_used = (lengths > 0).sum().clamp(min=1)
    scale = ranks * num_experts / (top_k * lengths.clamp(min=1).to(torch.float32).square() * docs_used)  # (D,)
    per_token = (masked_probs(probs, token_mask) * counts.view(num_docs, num_experts)[doc].to(torch.float32)).sum(1)
    return torch.dot(per_token, scale[doc])
