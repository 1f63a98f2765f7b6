"""The reference MoE GPT: a decoder-only transformer over packed documents.

One file a reader can hold in their head (after nanoGPT). Shapes: ``B`` rows, ``T`` positions per row, ``N = B*T``
flattened positions, ``H`` hidden size, ``nh``/``nkv`` query/key-value heads of size ``hd``.

Two switches select the "before" and "after" of this package so benchmarks compare them on the same weights:

- ``attention_metadata="per_layer"`` (before): every layer derives document boundaries from ``position_ids`` on the
  device (a ``nonzero`` and an ``.item()``, as HF transformers' packed path does) and builds its own dense mask.
  ``"dense"`` (the peer: HF transformers' SDPA path): one dense packed-sequence mask per forward, shared by the layers.
  ``"cached"`` (after): boundaries come from one :class:`~lightning_llmfast.seqmeta.SequenceMetadata` per batch
  (passed in, or from the active :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache`) and attention is varlen.
- ``router_backend="naive"`` (before): bincount + per-expert loop; ``"torch" | "triton" | "auto"`` (after): the grouped,
  sync-free router of :mod:`lightning_llmfast.moe`.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError, DataError, MetadataError
from lightning_llmfast.models.config import MoEGPTConfig
from lightning_llmfast.models.ffn import make_ffn, sequence_boundaries
from lightning_llmfast.models.rmsnorm import RMSNorm
from lightning_llmfast.moe import MoEBlock, MoELayer
from lightning_llmfast.seqmeta import (
    SequenceMetadata,
    active_cache,
    context_attention,
    start_context_keys,
    varlen_attention,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["MoEGPT", "MoEGPTConfig"]

_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes
_POSITION_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def rope_tables(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(B, T, head_dim // 2)`` for rotary embeddings at the given per-token positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, T, heads, hd)`` by tables ``(B, T, hd // 2)`` (half-split layout, as Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def dense_document_mask(position_ids: Tensor) -> Tensor:
    """Dense packed-sequence mask ``(B, 1, T, T)`` from ``(B, T)`` positions: True where a query may attend a key
    (same document, not in the future). Sync-free, but ``O(B*T^2)`` memory and attention work."""
    doc = torch.cumsum(position_ids == 0, dim=-1)  # (B, T) document index inside each row
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def per_layer_document_mask(position_ids: Tensor) -> Tensor:
    """The "before": derive boundaries on the device and build a dense mask, as a layer without a cache does."""
    flat = position_ids.reshape(-1)
    # NOTE: two host syncs, deliberately: this is how per-layer rebuilding behaves in popular stacks (cu_seqlens via
    # nonzero, max_seqlen via .item() for the kernel); the cached path exists to remove them.
    starts = torch.nonzero(flat == 0).flatten()
    cu_seqlens = torch.cat([starts, starts.new_tensor([flat.numel()])])
    _max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return dense_document_mask(position_ids)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE that never crosses a document boundary."""

    def __init__(self, config: MoEGPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.mode = config.attention_metadata
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.proj = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], position_ids: Tensor, metadata: SequenceMetadata | Tensor | None
    ) -> Tensor:
        """``x`` ``(B, T, H)``; ``metadata`` is the batch's boundaries ("cached") or its dense mask ("dense")."""
        b, t, _ = x.shape
        if self.mode == "cached":
            metadata = _layer_metadata(x, metadata)
            if isinstance(metadata, SequenceMetadata) and metadata.context is not None:
                return self._context_parallel(x, rope, metadata)
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
        q = apply_rope(q.view(b, t, self.n_heads, self.head_dim), *rope)
        k = apply_rope(k.view(b, t, self.n_kv_heads, self.head_dim), *rope)
        # A copy of v (N * nkv * hd): as a view it would keep the whole (N, qkv_out) projection alive until
        # backward, 4x what attention needs at 16/8/8 heads (25 MB per layer at hidden 1024 and 8192 tokens, and
        # bus bytes for the offloader, which copies whole storages). q and k are fresh tensors from RoPE anyway.
        v = v.contiguous().view(b, t, self.n_kv_heads, self.head_dim)
        if self.mode != "cached":
            mask = per_layer_document_mask(position_ids) if self.mode == "per_layer" else metadata
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
            ).transpose(1, 2)
        else:
            assert isinstance(metadata, SequenceMetadata)
            n = b * t
            out = varlen_attention(
                q.reshape(n, self.n_heads, self.head_dim),
                k.reshape(n, self.n_kv_heads, self.head_dim),
                v.reshape(n, self.n_kv_heads, self.head_dim),
                metadata,
            )
        return self.proj(out.reshape(b, t, self.n_heads * self.head_dim))

    def _context_parallel(self, x: Tensor, rope: tuple[Tensor, Tensor], metadata: SequenceMetadata) -> Tensor:
        """A context-parallel shard: the keys and values are projected first and their all-gather over the cp group
        starts before the query projection, which runs while they travel (the same weights, sliced by rows)."""
        b, t, _ = x.shape
        n, q_out = b * t, self.n_heads * self.head_dim
        k, v = F.linear(x, self.qkv.weight[q_out:]).split(self.n_kv_heads * self.head_dim, dim=-1)
        k = apply_rope(k.view(b, t, self.n_kv_heads, self.head_dim), *rope)
        finish = start_context_keys(
            k.reshape(n, self.n_kv_heads, self.head_dim), v.reshape(n, self.n_kv_heads, self.head_dim), metadata
        )
        q = apply_rope(F.linear(x, self.qkv.weight[:q_out]).view(b, t, self.n_heads, self.head_dim), *rope)
        out = context_attention(q.reshape(n, self.n_heads, self.head_dim), *finish(), metadata)
        return self.proj(out.reshape(b, t, q_out))


def _layer_metadata(x: Tensor, metadata: SequenceMetadata | Tensor | None) -> SequenceMetadata | Tensor:
    """The metadata a "cached" layer attends with: the given one, or the active cache's for ``x``."""
    if metadata is not None:
        return metadata
    cache = active_cache()
    if cache is None:
        raise ConfigError("cached attention needs `metadata` or an active SequenceMetadataCache")
    return cache.get(x)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; ``x`` is ``(B, T, H)``."""

    def __init__(self, config: MoEGPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn = make_ffn(config, layer_idx)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        position_ids: Tensor,
        metadata: SequenceMetadata | Tensor | None = None,
    ) -> Tensor:
        # x + attn(...) fused into the second norm: it keeps the bf16 attention output for backward, not the fp32 sum
        # (x itself is kept by the first norm anyway).
        normed, x = self.ffn_norm(self.attn(self.attn_norm(x), rope, position_ids, metadata), residual=x)
        if isinstance(self.ffn, MoEBlock) and self.ffn.config.aux_loss == "sequence":
            # The model owns the sequence metadata: the block gets the document boundaries as an argument.
            return x + self.ffn(normed, boundaries=sequence_boundaries(metadata, normed))
        return x + self.ffn(normed)


class MoEGPT(nn.Module):
    """Decoder-only MoE transformer over packed rows.

    Example::

        model = MoEGPT(MoEGPTConfig())
        logits = model(batch.input_ids, batch.position_ids)  # (B, T, vocab_size)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()) + 0.01 * model.aux_loss()
    """

    def __init__(self, config: MoEGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        # Output projections are scaled down with depth (GPT-2) so the residual stream does not grow with n_layers.
        for name in ("proj", "down", "down_proj"):
            sub = getattr(module, name, None)
            weight = getattr(sub, "weight", sub)
            if isinstance(weight, nn.Parameter):
                nn.init.normal_(weight, std=std / math.sqrt(2 * self.config.n_layers))

    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, metadata: SequenceMetadata | None = None
    ) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for ``input_ids`` ``(B, T)``.

        Args:
            input_ids: token ids ``(B, T)``, int64 or int32, in ``[0, vocab_size)``.
            position_ids: ``(B, T)``, restarting at 0 at every document of a packed row; ``None`` means one
                document per row.
            metadata: boundaries of the flattened ``B*T`` positions; in ``"cached"`` mode, when neither this nor an
                active :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache` is given, it is built once here
                from ``position_ids`` (one host sync if they live on an accelerator).

        Raises:
            DataError: ``input_ids`` is not a 2-D int64/int32 tensor, is on the meta device, or (on the CPU) holds
                an id outside ``[0, vocab_size)``. Token values are not checked ahead of time: that would read the
                device every step. On an accelerator an out-of-range id fails in the embedding kernel (a device-side
                assert); the packed data path checks every id on the host when packing
                (:func:`~lightning_llmfast.data.pack_documents` with ``vocab_size``).
            MetadataError: ``position_ids`` is not an integer tensor of ``input_ids``' shape (or ``(1, T)``).
        """
        _check_inputs(input_ids, position_ids)
        b, t = input_ids.shape
        cache = active_cache() if metadata is None else None
        if cache is not None and cache.is_open:
            # Bind this forward's tokens (and positions, when given): another batch never gets this one's boundaries.
            cache.bind(input_ids, position_ids=position_ids)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        elif position_ids.shape[0] != b:
            position_ids = position_ids.expand(b, t)
        mode = self.config.attention_metadata
        layer_meta: SequenceMetadata | Tensor | None = metadata
        if mode == "cached" and metadata is None and active_cache() is None:
            layer_meta = SequenceMetadata.from_position_ids(position_ids)
        elif mode == "dense":
            layer_meta = dense_document_mask(position_ids)  # once per forward, shared by every layer
        rope = rope_tables(position_ids, self.config.head_dim, self.config.rope_theta)
        try:
            x = self.embed(input_ids)
        except IndexError:  # the CPU kernel's bounds check: the happy path pays nothing for this
            vocab = self.config.vocab_size
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]  # NOTE: reads the ids, on the error path only
            if bad.numel() == 0:
                raise  # not the ids: some other embedding failure
            raise DataError(
                f"input_ids: token ids must lie in [0, vocab_size={vocab}), got {bad.numel()} outside it "
                f"(first {bad[0].item()})"
            ) from None
        for layer in self.layers:
            x = layer(x, rope, position_ids, layer_meta)
        return self.lm_head(self.norm(x))

    def moe_blocks(self) -> Iterator[MoELayer]:
        """The MoE feed-forward blocks (dense layers excluded)."""
        return (layer.ffn for layer in self.layers if isinstance(layer.ffn, MoELayer))

    def aux_loss(self) -> Tensor:
        """Sum of the load-balancing losses of every MoE block's last forward (0-d)."""
        losses = [block.stats.aux_loss for block in self.moe_blocks() if block.stats is not None]
        return torch.stack(losses).sum() if losses else self.lm_head.weight.new_zeros(())

    @functools.cached_property
    def num_active_params(self) -> int:
        """Parameters touched per token (top_k of num_experts experts), embeddings excluded; for FLOPs estimates.

        Cached: the throughput monitor asks for FLOPs every batch, and parameter shapes never change.
        """
        c = self.config
        total = 0
        for name, p in self.named_parameters():
            if name.startswith(("embed.", "lm_head.")):
                continue
            scale = c.top_k / c.num_experts if ".experts." in name else 1.0
            total += int(p.numel() * scale)
        return total + c.hidden_size * c.vocab_size  # the LM head matmul

    def flops_per_batch(self, lengths: list[int]) -> int:
        """Training FLOPs (forward + backward) of one batch whose sequences have the given lengths.

        6 FLOPs per active parameter per token, plus causal attention ``12 * L * hd * nh * sum(len^2) / 2``.
        """
        c = self.config
        tokens = sum(lengths)
        attention = 6 * c.n_layers * c.head_dim * c.n_heads * sum(n * n for n in lengths)
        return 6 * self.num_active_params * tokens + attention


def _check_inputs(input_ids: Tensor, position_ids: Tensor | None) -> None:
    """Shapes and dtypes of :meth:`MoEGPT.forward`'s inputs only: free, no device read."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in _ID_DTYPES:
        got = _describe(input_ids)
        raise DataError(f"input_ids: must be a (B, T) int64 or int32 tensor of token ids, got {got}")
    if input_ids.device.type == "meta":
        raise DataError("input_ids: a meta-device tensor holds no token ids; move the batch to a real device")
    b, t = input_ids.shape
    if position_ids is not None and (
        not isinstance(position_ids, Tensor)
        or position_ids.shape not in ((b, t), (1, t))  # (1, T): the same positions for every row, as in HF
        or position_ids.dtype not in _POSITION_DTYPES
    ):
        shapes = f"{(b, t)}" if b == 1 else f"{(b, t)} (or (1, {t}))"
        got = _describe(position_ids)
        raise MetadataError(f"position_ids: must be an integer tensor of input_ids' shape {shapes}, got {got}")


def _describe(value: object) -> str:
    return f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
