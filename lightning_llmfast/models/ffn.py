"""Feed-forward layers of the reference MoE GPT: the dense SwiGLU, the choice of MoE block, and the document
boundaries the model passes to an MoE block's sequence aux loss.

Example::

    ffn = make_ffn(MoEGPTConfig(), layer_idx=0)  # an MoEBlock with the config's experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models.config import MoEGPTConfig
from lightning_llmfast.moe import MoEBlock, MoEConfig, SequenceBoundaries
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache

__all__ = ["DenseSwiGLU", "make_ffn", "sequence_boundaries"]


class DenseSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the dense feed-forward of the layers in ``MoEGPTConfig.dense_layers``."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def make_ffn(config: MoEGPTConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: dense, the naive baseline MoE or the grouped :class:`MoEBlock`."""
    if layer_idx in config.dense_layers:
        return DenseSwiGLU(config.hidden_size, config.ffn_size)
    args = (config.hidden_size, config.ffn_size, config.num_experts, config.top_k)
    if config.router_backend == "naive":
        if config.capacity_factor is not None:
            raise ConfigError(
                "MoEGPTConfig.router_backend='naive' is dropless; capacity_factor needs a grouped backend"
            )
        from lightning_llmfast.moe.naive import NaiveMoEBlock  # the baseline, loaded only when asked for

        return NaiveMoEBlock(*args)
    return MoEBlock(MoEConfig.build(*args, capacity_factor=config.capacity_factor, backend=config.router_backend))


def sequence_boundaries(metadata: SequenceMetadata | Tensor | None, hidden: Tensor) -> SequenceBoundaries | None:
    """The packed documents of ``hidden``'s tokens for an MoE block's sequence aux loss, from the batch's metadata
    (passed in, or the active cache's); ``None`` without any (the block then treats each row as a document).

    On a context-parallel shard the metadata's sequences are the rank's pieces: each token is given its piece's
    document, numbered over the whole batch (``ContextShard.documents``, memoised on the metadata), and the group
    holding the documents' other pieces, so that the block balances whole documents as one process does.

    Example::

        boundaries = sequence_boundaries(metadata, x)
        y = moe_block(x, boundaries=boundaries)
    """
    if not isinstance(metadata, SequenceMetadata):
        cache = active_cache()
        metadata = cache.get(hidden) if cache is not None else None
    if metadata is None:
        return None
    shard = metadata.context
    if shard is None:
        return SequenceBoundaries(metadata.document_ids, metadata.num_sequences)
    ids = metadata.document_ids

    def documents() -> Tensor:
        return shard.documents.to(ids.device, non_blocking=True)[ids]

    # Memoised in eager mode only: a memo filled while tracing would give the first layer another graph.
    documents = documents() if torch.compiler.is_compiling() else metadata.memo(("cp_documents", ids.device), documents)
    group = None if shard.size == 1 else shard.group if shard.group is not None else dist.group.WORLD
    return SequenceBoundaries(documents, shard.num_documents, group)
