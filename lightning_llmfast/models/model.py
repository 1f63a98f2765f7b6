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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import VOCAB_SIZE
from lightning_llmfast.errors import ConfigError, DataError, MetadataError
from lightning_llmfast.models.rmsnorm import RMSNorm
from lightning_llmfast.moe import MoEBlock, NaiveMoEBlock
from lightning_llmfast.seqmeta import SequenceMetadata, active_cache, varlen_attention

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["MoEGPT", "MoEGPTConfig"]

_ATTENTION_METADATA = ("per_layer", "dense", "cached")
_ROUTER_BACKENDS = ("naive", "torch", "triton", "auto")
_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes
_POSITION_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class MoEGPTConfig:
    """Hyper-parameters of :class:`MoEGPT`. The defaults are a small model for CPU runs.

    Every field is checked at construction (:class:`~lightning_llmfast.errors.ConfigError` naming the field): sizes
    are ints >= 1, ``capacity_factor`` and ``rope_theta`` finite numbers > 0, ``norm_eps`` and ``init_std`` finite
    numbers >= 0, ``dense_layers`` layer indices.

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``.
        hidden_size: model width; must split into ``n_heads`` heads of even size.
        n_layers: number of transformer layers.
        n_heads: query heads per attention layer.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_size: hidden width of each expert's (and each dense layer's) SwiGLU feed-forward.
        num_experts: experts per MoE layer.
        top_k: experts each token is routed to; at most ``num_experts``.
        dense_layers: indices of layers that get a dense SwiGLU feed-forward instead of an MoE one.
        capacity_factor: ``null`` for dropless routing, else each expert keeps at most this times its fair share.
        rope_theta: base of the rotary position embedding; > 0.
        norm_eps: epsilon of the RMS norms; >= 0.
        init_std: standard deviation of the weight initialisation; >= 0.
        tie_embeddings: share the input embedding and the output projection.
        attention_metadata: ``cached`` (one metadata per batch, varlen attention), ``dense`` or ``per_layer``.
        router_backend: ``auto``, ``torch`` or ``triton`` (grouped, sync-free), or ``naive`` (the baseline).

    Example::

        config = MoEGPTConfig(n_layers=2, num_experts=4, router_backend="naive")
        model = MoEGPT(config)
    """

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_size: int = 256
    num_experts: int = 8
    top_k: int = 2
    dense_layers: list[int] = field(default_factory=list)
    capacity_factor: float | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True
    attention_metadata: str = "cached"
    router_backend: str = "auto"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_size",
            "num_experts",
            "top_k",
        )
        for name in positive:
            check_int(f"MoEGPTConfig.{name}", getattr(self, name), low=1)
        if self.capacity_factor is not None:
            check_number("MoEGPTConfig.capacity_factor", self.capacity_factor, low=0, low_open=True)
        check_number("MoEGPTConfig.rope_theta", self.rope_theta, low=0, low_open=True)
        check_number("MoEGPTConfig.norm_eps", self.norm_eps, low=0)
        check_number("MoEGPTConfig.init_std", self.init_std, low=0)
        check_bool("MoEGPTConfig.tie_embeddings", self.tie_embeddings)
        if isinstance(self.dense_layers, (str, bytes)) or not isinstance(self.dense_layers, Iterable):
            raise ConfigError(f"MoEGPTConfig.dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        # Any iterable of ints (a range, a NumPy array), kept as a list of Python ints.
        self.dense_layers = [check_int("MoEGPTConfig.dense_layers entry", index) for index in self.dense_layers]
        if self.hidden_size % self.n_heads or (self.hidden_size // self.n_heads) % 2:
            raise ConfigError(
                f"MoEGPTConfig.hidden_size ({self.hidden_size}) must split into n_heads ({self.n_heads}) heads of "
                "even size (RoPE)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"MoEGPTConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoEGPTConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.attention_metadata not in _ATTENTION_METADATA:
            raise ConfigError(
                f"MoEGPTConfig.attention_metadata must be one of {_ATTENTION_METADATA}, got {self.attention_metadata!r}"
            )
        if self.router_backend not in _ROUTER_BACKENDS:
            raise ConfigError(
                f"MoEGPTConfig.router_backend must be one of {_ROUTER_BACKENDS}, got {self.router_backend!r}"
            )
        if self.router_backend == "naive" and self.capacity_factor is not None:
            raise ConfigError(
                "MoEGPTConfig.router_backend='naive' is dropless; capacity_factor needs a grouped backend"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"MoEGPTConfig.dense_layers {bad} out of range for n_layers={self.n_layers}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads


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
            if metadata is None:
                cache = active_cache()
                if cache is None:
                    raise ConfigError("cached attention needs `metadata` or an active SequenceMetadataCache")
                metadata = cache.get(x)
            n = b * t
            out = varlen_attention(
                q.reshape(n, self.n_heads, self.head_dim),
                k.reshape(n, self.n_kv_heads, self.head_dim),
                v.reshape(n, self.n_kv_heads, self.head_dim),
                metadata,
            )
        return self.proj(out.reshape(b, t, self.n_heads * self.head_dim))


class DenseSwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _make_ffn(config: MoEGPTConfig, layer_idx: int) -> nn.Module:
    if layer_idx in config.dense_layers:
        return DenseSwiGLU(config.hidden_size, config.ffn_size)
    args = (config.hidden_size, config.ffn_size, config.num_experts, config.top_k)
    if config.router_backend == "naive":
        if config.capacity_factor is not None:
            raise ConfigError(
                "MoEGPTConfig.router_backend='naive' is dropless; capacity_factor needs a grouped backend"
            )
        return NaiveMoEBlock(*args)
    return MoEBlock(*args, capacity_factor=config.capacity_factor, backend=config.router_backend)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; ``x`` is ``(B, T, H)``."""

    def __init__(self, config: MoEGPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn = _make_ffn(config, layer_idx)

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
        # Shapes and dtypes only: free, no device read.
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in _ID_DTYPES:
            got = (
                f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
                if isinstance(input_ids, Tensor)
                else type(input_ids).__name__
            )
            raise DataError(f"input_ids: must be a (B, T) int64 or int32 tensor of token ids, got {got}")
        if input_ids.device.type == "meta":
            raise DataError("input_ids: a meta-device tensor holds no token ids; move the batch to a real device")
        b, t = input_ids.shape
        if position_ids is not None and (
            not isinstance(position_ids, Tensor)
            or position_ids.shape not in ((b, t), (1, t))  # (1, T): the same positions for every row, as in HF
            or position_ids.dtype not in _POSITION_DTYPES
        ):
            got = (
                f"{position_ids.dtype} of shape {tuple(position_ids.shape)}"
                if isinstance(position_ids, Tensor)
                else type(position_ids).__name__
            )
            shapes = f"{(b, t)}" if b == 1 else f"{(b, t)} (or (1, {t}))"
            raise MetadataError(f"position_ids: must be an integer tensor of input_ids' shape {shapes}, got {got}")
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

    def moe_blocks(self) -> Iterator[nn.Module]:
        """The MoE feed-forward blocks (dense layers excluded)."""
        return (layer.ffn for layer in self.layers if not isinstance(layer.ffn, DenseSwiGLU))

    def aux_loss(self) -> Tensor:
        """Sum of the load-balancing losses of every MoE block's last forward (0-d)."""
        losses = [block.last_aux_loss for block in self.moe_blocks()]
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
