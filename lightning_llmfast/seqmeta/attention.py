"""Attention over packed sequences that never mixes documents, driven by a :class:`SequenceMetadata`.

On CUDA with fp16/bf16 the work goes to ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen) with the
cached ``cu_seqlens``/``max_seqlen``. Elsewhere three exact implementations exist, all planned on the host from
``cu_seqlens_cpu`` (so none reads the device) and memoised on the metadata (so every layer reuses the plan):

- ``"masked"``: one SDPA call over all ``N`` positions with a block-diagonal (causal) boolean mask. Cost ``O(N^2)``
  whatever the packing, but a single call.
- ``"per_document"``: one SDPA call per sequence on its slice. Cost ``O(sum L_i^2)`` plus a call per document.
- ``"bucketed"``: sequences grouped by their length rounded up to a power of two, each group gathered into a padded
  ``[docs, heads, L_bucket, head_dim]`` batch and run in one SDPA call. Cost ``O(sum bucket(L_i)^2)`` (at most 4x the
  exact work for sequences of 16 tokens or more) in ``O(log max_seqlen)`` calls.

``impl="auto"`` chooses by the rule measured and written down beside ``_MASKED_MAX_TOKENS`` below; under
``torch.compile`` (outside FlashAttention) it takes ``"masked"``, the one plan that holds no host-side lengths.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lightning_llmfast._checks import check_bool, check_number
from lightning_llmfast.errors import ConfigError, MetadataError
from lightning_llmfast.seqmeta.buckets import bucket_plan
from lightning_llmfast.seqmeta.context import offset_causal_attention, start_gather
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["context_attention", "context_keys", "dense_block_causal_mask", "start_context_keys", "varlen_attention"]

Impl = Literal["auto", "masked", "per_document", "bucketed", "flash"]

# Measured on this project's shared 2-core CPU machine (torch 2.13, fp32, 4 heads / 2 kv heads x 32 dims, one
# thread, forward+backward, median of 5 interleaved repeats, random cut points;
# `python benchmarks/bench_metadata.py --attention`). Time relative to "bucketed" (lower is better; the machine was
# loaded by other jobs, so single cells are noisy and only the trends count):
#
#   N tokens  docs  masked  per_document  bucketed ms     N tokens  docs  masked  per_document  bucketed ms
#   128       16    0.61    14.3          1.0            1024      4     1.01    0.54          40
#   128       64    0.11    3.55          7.6            1024      16    2.74    1.07          15
#   256       16    6.83    4.76          1.4            1024      64    4.10    2.67          9.0
#   256       256   0.31    2.86          46             2048      2     1.39    0.52          251
#   512       16    1.85    1.08          15             2048      16    3.09    0.82          111
#   512       256   0.38    3.46          48             2048      256   7.27    8.80          36
#
# Rule: the dense mask wins only while its O(N^2) work is cheaper than the extra calls: N <= 128, or N <= 512 packed
# with very short documents (mean length under 4). Per-document calls win (exact work, no padding) with a few long
# documents: up to 4, or up to 16 of 128+ tokens on average. Everywhere else length-bucketing wins (2-7x over the
# mask, 1.5-14x over per-document calls at 64+ documents).
_MASKED_MAX_TOKENS = 128
_MASKED_SHORT_DOCS_MAX_TOKENS = 512
_MASKED_SHORT_DOCS_MEAN_LEN = 4
_PER_DOCUMENT_MAX_DOCS = 4
_PER_DOCUMENT_LONG_DOCS_MAX_DOCS = 16
_PER_DOCUMENT_LONG_DOCS_MEAN_LEN = 128


def dense_block_causal_mask(metadata: SequenceMetadata, *, causal: bool = True) -> torch.Tensor:
    """Returns the block-diagonal (causal) mask of the packed positions, memoised on ``metadata``.

    Args:
        metadata: the packing.
        causal: also forbid attending to later positions of the same sequence.

    Returns:
        ``(num_tokens, num_tokens)`` bool on ``metadata.device``; ``True`` where query ``i`` may attend to key ``j``.
        Built with sync-free ops from ``metadata.document_ids``.

    Raises:
        MetadataError: ``metadata`` is not a :class:`SequenceMetadata`.
        ConfigError: ``causal`` is not a bool.

    Example::

        mask = dense_block_causal_mask(SequenceMetadata.from_lengths([2, 1]))
        # [[True, False, False], [True, True, False], [False, False, True]]
    """

    _check_metadata(metadata)
    check_bool("causal", causal)

    def build() -> torch.Tensor:
        doc = metadata.document_ids
        mask = doc[:, None] == doc[None, :]
        if causal:
            mask = torch.tril(mask)
        return mask

    return metadata.memo(("dense_mask", causal), build)


def _check_metadata(metadata: object) -> None:
    if not isinstance(metadata, SequenceMetadata):
        raise MetadataError(
            f"metadata: must be a SequenceMetadata (SequenceMetadata.from_cu_seqlens, from_lengths or from_batch), "
            f"got {type(metadata).__name__}"
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    # q: (batch, heads, L, D); k/v: (batch, kv_heads, L, D). Always 4-D: with 3-D inputs the CPU dispatcher skips the
    # flash kernel for the O(L^2)-memory math path (measured 2-6x slower). enable_gqa broadcasts the kv heads.
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)


def _masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: Any
) -> torch.Tensor:
    mask = dense_block_causal_mask(meta, causal=causal)
    out = _sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)  # a view in backward too (indexing [0] would copy the gradient)


def _per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: Any
) -> torch.Tensor:
    # One split per input: its backward is one concatenation, where a slice per sequence would write each slice's
    # gradient into a zero tensor of the whole input and sum them (3 * 2 kernels per sequence instead of 3 in all).
    lengths = list(meta.lengths)
    outs = []
    for length, *qkv in zip(lengths, *(t.split(lengths) for t in (q, k, v))):
        if length == 0:
            continue
        o = _sdpa(*(t.transpose(0, 1)[None] for t in qkv), is_causal=causal, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _bucketed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: Any
) -> torch.Tensor:
    buckets, row_of_token = bucket_plan(meta)
    heads, kv_heads, dim, vdim = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    # One gather per input for every bucket, split into the buckets' padded batches: its backward is one
    # concatenation and one scatter-add per input, not one scatter-add (and a sum) per bucket.
    gather = meta.memo("bucket_gather", lambda: torch.cat([bucket.gather for bucket in buckets]))
    sizes = [bucket.gather.numel() for bucket in buckets]
    packed = [t.index_select(0, gather).split(sizes) for t in (q, k, v)]
    outs = []
    for bucket, bq, bk, bv in zip(buckets, *packed):
        blen = bucket.length

        def pack(x: torch.Tensor, h: int, d: int, blen: int = blen) -> torch.Tensor:
            # (docs * length, h, d) -> (docs, h, length, d), padded by repeating each sequence's first token
            return x.view(-1, blen, h, d).transpose(1, 2)

        kwargs: dict[str, Any] = {"is_causal": True} if causal else {}
        if not causal:
            # Without causality, real queries would see the padding keys: mask them (keys only, per sequence).
            offsets = torch.arange(blen, device=q.device)
            kwargs["attn_mask"] = (offsets < bucket.lengths).view(-1, 1, 1, blen)
        o = _sdpa(pack(bq, heads, dim), pack(bk, kv_heads, dim), pack(bv, kv_heads, vdim), scale=scale, **kwargs)
        outs.append(o.transpose(1, 2).reshape(-1, heads, vdim))
    return torch.cat(outs, dim=0).index_select(0, row_of_token)


def _find_flash_varlen() -> tuple[Any, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch builds without varlen attention: callers fall back to the exact CPU paths
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# Looked up once at import: a constant to torch.compile (an lru_cache'd call inside traced code makes Dynamo warn).
_FLASH_VARLEN = _find_flash_varlen()


# Whether a varlen_attn without an `enable_gqa` argument (torch <= 2.11) takes fewer key/value heads than query heads:
# its FlashAttention kernels do grouped-query attention natively, and only newer wrappers ask for the flag. None until
# the first grouped call answers it; False: the kernel refused, so k and v are repeated to the query heads (and then
# saved for backward at that size: 2x the bytes at 16/8 heads, 4x at 32/8).
_native_gqa: bool | None = None


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: Any
) -> torch.Tensor:
    cu = meta.cu_seqlens
    return _flash_varlen(q, k, v, (cu, cu, meta.max_seqlen, meta.max_seqlen), causal, scale)


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: tuple[torch.Tensor, torch.Tensor, int, int],
    causal: bool,
    scale: Any,
) -> torch.Tensor:
    """FlashAttention varlen over ``lengths = (cu_seqlens_q, cu_seqlens_k, max_q, max_k)``; with fewer queries than
    keys in a sequence, its causal diagonal is aligned bottom-right (the last query sees every key)."""
    global _native_gqa
    found = _FLASH_VARLEN
    assert found is not None
    varlen_attn, params = found
    kwargs: dict[str, Any] = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale * math.sqrt(q.shape[-1]) != 1.0:
        # Older builds have no scale argument and use 1/sqrt(head_dim): fold the requested scale into q.
        q = q * (scale * math.sqrt(q.shape[-1]))
    if "is_causal" in params:  # torch <= 2.11 spelling
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attn(q, k, v, *lengths, **kwargs)

    if k.shape[1] == q.shape[1]:
        return attend(k, v)
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
        return attend(k, v)
    refused = False
    # Traced code cannot catch the kernel's refusal (the fake kernel never refuses): it follows the eager answer,
    # and repeats while there is none.
    if _native_gqa or (_native_gqa is None and not torch.compiler.is_compiling()):
        try:
            out = attend(k, v)
        except (RuntimeError, ValueError) as err:
            # Whatever a build's wording, one repeated call tells: if it works, the head counts were refused (anything
            # else fails it the same way, and is raised). Out of memory is raised at once: repeating needs more.
            if isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err):
                raise
            refused = True
        else:
            _native_gqa = True
            return out
    # An int repeat count keeps the output shape static (no sync), unlike a tensor of repeats.
    rep = q.shape[1] // k.shape[1]
    out = attend(k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
    if refused:
        _native_gqa = False  # only now: the refusal was about the head counts, as the repeated call shows
    return out


_IMPLS = {"masked": _masked, "per_document": _per_document, "bucketed": _bucketed, "flash": _flash}


def _flash_unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why FlashAttention varlen cannot take these inputs (``None``: it can)."""
    if _FLASH_VARLEN is None:
        return "needs torch.nn.attention.varlen.varlen_attn, missing in this torch build"
    dim = q.shape[2]
    if v.shape[2] != dim or dim % 8 or dim > 256:
        return f"needs one head_dim for q, k and v, a multiple of 8 and at most 256, got {dim} and v_dim {v.shape[2]}"
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs CUDA fp16/bf16 inputs, got {q.device.type} {q.dtype}"
    return None


def _auto_impl(q: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata) -> str:
    if _flash_unsupported(q, v) is None:
        return "flash"
    if torch.compiler.is_compiling():
        # One call whose plan is a tensor: the other plans read per-sequence host lengths, which Dynamo would
        # specialise on (a recompilation for every new packing).
        return "masked"
    n, docs = meta.num_tokens, meta.num_sequences
    if n <= _MASKED_MAX_TOKENS or (n <= _MASKED_SHORT_DOCS_MAX_TOKENS and n < _MASKED_SHORT_DOCS_MEAN_LEN * docs):
        return "masked"
    if docs <= _PER_DOCUMENT_MAX_DOCS or (
        docs <= _PER_DOCUMENT_LONG_DOCS_MAX_DOCS and n >= _PER_DOCUMENT_LONG_DOCS_MEAN_LEN * docs
    ):
        return "per_document"
    return "bucketed"


def _checked_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, causal: Any, scale: Any, impl: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``varlen_attention``'s argument checks (shapes, dtypes and devices only: nothing here reads the device);
    returns ``q, k, v`` in autocast's dtype when they differ under autocast."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ConfigError(f"q, k, v: must be tensors, got {', '.join(type(t).__name__ for t in (q, k, v))}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ConfigError(
            f"q, k, v: must be (num_tokens, heads, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ConfigError(f"q, k, v: must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise ConfigError(f"q, k, v: must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        # Under autocast, attention computes in its dtype, as torch's SDPA would (e.g. q, k in float32 after RoPE).
        if not torch.is_autocast_enabled(q.device.type):
            raise ConfigError(f"q, k, v: must share one dtype outside autocast, got {q.dtype}, {k.dtype}, {v.dtype}")
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    _check_metadata(metadata)
    check_bool("causal", causal)
    if scale is not None:
        check_number("scale", scale)
    if not (q.shape[0] == k.shape[0] == v.shape[0] == metadata.num_tokens):
        raise MetadataError(
            f"num_tokens: q/k/v hold {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens but the metadata describes "
            f"{metadata.num_tokens}; stale or mismatched metadata"
        )
    if q.shape[1] == 0:
        raise ConfigError(f"heads: q must have at least one head, got shape {tuple(q.shape)}")
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ConfigError(
            f"kv_heads: k has {k.shape[1]} heads and v {v.shape[1]}; they must match and divide q's {q.shape[1]} heads"
        )
    if q.shape[2] != k.shape[2]:
        raise ConfigError(f"head_dim: q has {q.shape[2]} and k has {k.shape[2]}; they must match")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ConfigError(f"head_dim: q/k and v must have at least one dim per head, got {q.shape[2]} and {v.shape[2]}")
    if impl not in ("auto", *_IMPLS):
        raise ConfigError(f"impl: must be one of 'auto', {', '.join(map(repr, _IMPLS))}; got {impl!r}")
    return q, k, v


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: SequenceMetadata,
    *,
    causal: bool = True,
    scale: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of packed sequences, each attending only to itself; equals per-document (causal) attention.

    Args:
        q: ``(num_tokens, heads, head_dim)`` queries.
        k: ``(num_tokens, kv_heads, head_dim)`` keys; ``kv_heads`` must divide ``heads`` (grouped-query attention).
        v: ``(num_tokens, kv_heads, v_dim)`` values.
        metadata: the packing, with ``metadata.num_tokens == num_tokens``.
        causal: causal attention inside each sequence.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        impl: ``"auto"`` (FlashAttention varlen on CUDA fp16/bf16, otherwise the measured rule), or force
            ``"masked"``, ``"per_document"``, ``"bucketed"`` or ``"flash"``.

    Returns:
        ``(num_tokens, heads, v_dim)`` attention output. No host sync: every shape comes from ``cu_seqlens_cpu``.
        With no tokens, an empty output that still has a gradient path to ``q``, ``k`` and ``v`` (zero gradients).

    Raises:
        MetadataError: ``metadata`` is not a :class:`SequenceMetadata`, or describes another number of tokens.
        ConfigError: ``q``/``k``/``v`` are not 3-D floating-point tensors on one device, of one dtype outside
            autocast (under it they attend in its dtype), with matching heads and dims (every size at least 1),
            ``causal`` is not a bool, ``scale`` not a finite number, or ``impl`` is unknown or cannot take these
            inputs.

    Example::

        meta = SequenceMetadata.from_lengths([3, 5])
        q = torch.randn(8, 4, 16); k = v = torch.randn(8, 2, 16)
        out = varlen_attention(q, k, v, meta)  # (8, 4, 16)
    """
    q, k, v = _checked_inputs(q, k, v, metadata, causal, scale, impl)
    if metadata.device != q.device:
        metadata = metadata.to(q.device)
    chosen = _auto_impl(q, v, metadata) if impl == "auto" else impl
    if impl == "flash" and (reason := _flash_unsupported(q, v)) is not None:  # "auto" picks it only where it fits
        raise ConfigError(f"impl: 'flash' {reason}")
    if q.shape[0] == 0:
        # A 0-d zero built from every input: the empty output keeps a gradient path (zero gradients) to q, k and v.
        link = q.sum() + k.sum() + v.sum()
        return q.new_zeros(0, q.shape[1], v.shape[2]) + link
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[2])
    shard = metadata.context
    if shard is not None and shard.size > 1:
        return _context_parallel(q, k, v, metadata, causal, scale, impl)
    return _run(chosen, q, k, v, metadata, causal, scale)


def _run(
    impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: float
) -> torch.Tensor:
    """``_IMPLS[impl]``; outside FlashAttention, with the head dims of q/k and v padded with zeros to one size (no
    score changes), so that SDPA keeps its flash kernel (O(tokens) saved) instead of the math one, which saves the
    (queries x keys) probabilities when the value dim differs (MLA)."""
    dim, v_dim = q.shape[2], v.shape[2]
    if impl == "flash" or dim == v_dim:
        return _IMPLS[impl](q, k, v, meta, causal, scale)
    width = max(dim, v_dim)
    q, k, v = (F.pad(t, (0, width - t.shape[2])) if t.shape[2] < width else t for t in (q, k, v))
    return _IMPLS[impl](q, k, v, meta, causal, scale)[..., :v_dim]


def _context_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMetadata, causal: bool, scale: float, impl: Impl
) -> torch.Tensor:
    """A context-parallel shard's attention (:mod:`lightning_llmfast.seqmeta.context`): gather, then attend."""
    if not causal:
        raise ConfigError("causal: context-parallel attention is causal (a piece attends its document's earlier keys)")
    keys, values = context_keys(k, v, meta)
    return _attend_shard(q, keys, values, meta, scale, impl)


def _shard_of(metadata: Any) -> Any:
    _check_metadata(metadata)
    shard = metadata.context
    if shard is None:
        raise MetadataError(
            "metadata: not a context-parallel shard's (metadata.context is None); build it from "
            "PackedBatch.context_shard's batch with SequenceMetadata.from_batch"
        )
    return shard


def _key_plan(meta: SequenceMetadata, device: torch.device) -> torch.Tensor:
    """The shard's gather order on ``device`` (memoised on the metadata: once per batch; not while tracing, where
    a memo filled by the first layer would give the later layers another graph)."""
    shard = meta.context
    assert shard is not None
    if torch.compiler.is_compiling():
        return shard.key_index.to(device, non_blocking=True)
    return meta.memo(("cp_keys", device), lambda: shard.key_index.to(device, non_blocking=True))


def context_keys(k: torch.Tensor, v: torch.Tensor, metadata: SequenceMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers a context-parallel shard's per-token ``k`` and ``v`` over its group and lays out every piece's keys.

    What :func:`varlen_attention` does inside on a shard, for a module that gathers something other than its
    attention's K and V: multi-head latent attention (DeepSeek-V3) gathers the compressed latent and the rope key,
    ``kv_lora_rank + qk_rope_head_dim`` values a token, and up-projects the gathered rows to per-head keys and values
    itself before :func:`context_attention`.

    Args:
        k: ``(local tokens, heads, dim)``: any per-token tensor (after RoPE).
        v: ``(local tokens, heads, v_dim)``: a second one, gathered in the same collective.
        metadata: the shard's metadata (``metadata.context`` set, ``num_tokens`` local tokens).

    Returns:
        ``(num_keys, heads, dim)`` and ``(num_keys, heads, v_dim)``: the rows ``context.cu_seqlens_k`` ranges over,
        piece after piece. Differentiable (the backward reduce-scatters the gradients); counted in
        :data:`~lightning_llmfast.seqmeta.CONTEXT_STATS`.

    Raises:
        MetadataError: ``metadata`` is not a shard's, or describes another number of tokens.
        ConfigError: the shard's group does not have the shard's size.

    Example::

        latent, rope = context_keys(kv_latent[:, None], k_rope[:, None], meta)  # (num_keys, 1, rank), (num_keys, 1, r)
    """
    return start_context_keys(k, v, metadata)()


def start_context_keys(
    k: torch.Tensor, v: torch.Tensor, metadata: SequenceMetadata
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`context_keys` in two halves: starts the all-gather and returns the function that waits for it, so that a
    module can compute between them (its query projection, while the keys and values travel).

    Raises:
        MetadataError: as :func:`context_keys`.

    Example::

        finish = start_context_keys(k, v, meta)
        q = rope(project_queries(x))
        out = context_attention(q, *finish(), meta)
    """
    shard = _shard_of(metadata)
    if k.shape[0] != metadata.num_tokens or v.shape[0] != metadata.num_tokens:
        raise MetadataError(
            f"num_tokens: k/v hold {k.shape[0]}/{v.shape[0]} tokens but the metadata describes {metadata.num_tokens}"
        )
    return start_gather(k, v, shard, _key_plan(metadata, k.device))


def context_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    metadata: SequenceMetadata,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention of a context-parallel shard's queries against keys and values already gathered.

    Each piece ``j`` of the shard (``metadata.cu_seqlens``) attends the rows ``context.cu_seqlens_k[j]:[j + 1]`` of
    ``keys``/``values``, its document's keys up to the piece's end, with the causal diagonal aligned bottom-right: the
    layout :func:`context_keys` returns. The paths are :func:`varlen_attention`'s on a shard (FlashAttention varlen
    on CUDA fp16/bf16; on the CPU the packed paths for pieces that start their document and
    :func:`~lightning_llmfast.seqmeta.offset_causal_attention` for the others).

    Args:
        q: ``(local tokens, heads, head_dim)`` queries.
        keys: ``(num_keys, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``.
        values: ``(num_keys, kv_heads, v_dim)``.
        metadata: the shard's metadata.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        impl: as :func:`varlen_attention`'s (for the pieces that start their document on the CPU).

    Returns:
        ``(local tokens, heads, v_dim)``.

    Raises:
        MetadataError: ``metadata`` is not a shard's, or ``q``/``keys`` do not have its token and key counts.
        ConfigError: as :func:`varlen_attention`.

    Example::

        keys, values = context_keys(k, v, meta)
        out = context_attention(q, keys, values, meta)  # == varlen_attention(q, k, v, meta)
    """
    shard = _shard_of(metadata)
    num_keys = shard.num_keys if not torch.compiler.is_compiling() else keys.shape[0]  # a host read, eager only
    if keys.shape[0] != num_keys or values.shape[0] != num_keys:
        raise MetadataError(
            f"num_keys: keys/values hold {keys.shape[0]}/{values.shape[0]} rows but the shard's pieces attend "
            f"{num_keys}; gather them with context_keys(k, v, metadata)"
        )
    # The token-count, head and dtype checks of varlen_attention, on the queries against the first rows.
    n = q.shape[0]
    q, _, _ = _checked_inputs(q, keys[:n], values[:n], metadata, True, scale, impl)
    if metadata.device != q.device:
        metadata = metadata.to(q.device)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    return _attend_shard(q, keys, values, metadata, scale if scale is not None else q.shape[2] ** -0.5, impl)


def _attend_shard(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: SequenceMetadata, scale: float, impl: Impl
) -> torch.Tensor:
    """A shard's attention of its queries against its pieces' gathered keys; under ``torch.compile`` one opaque op
    (:func:`_context_attend`), whose plan arrives as host tensors, so that a new document layout is not a new graph."""
    shard = meta.context
    assert shard is not None
    if impl == "flash" and (reason := _flash_unsupported(q, values)) is not None:
        raise ConfigError(f"impl: 'flash' {reason}")
    if torch.compiler.is_compiling():
        return _context_attend(q, keys, values, shard.cu_seqlens_k, shard.offsets, scale, impl)
    return _attend_gathered(q, keys, values, meta, shard.cu_seqlens_k, shard.offsets, shard.max_seqlen_k, scale, impl)


def _attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: SequenceMetadata,
    cu_k: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    impl: str,
) -> torch.Tensor:
    """Each piece of ``meta`` (its sequences) against its keys ``cu_k`` (host), starting ``offsets`` (host) into its
    document; the plans are memoised on ``meta``."""
    if impl in ("auto", "flash") and _flash_unsupported(q, values) is None:
        cu_k_device = meta.memo(("cp_cu_k", q.device), lambda: cu_k.to(q.device, non_blocking=True))
        lengths = (meta.cu_seqlens, cu_k_device, meta.max_seqlen, max_seqlen_k)
        return _flash_varlen(q, keys, values, lengths, True, scale)
    plan = meta.memo("cp_pieces", lambda: _piece_plan(meta, cu_k, offsets))
    outs = []
    if plan.starting is not None:
        # Pieces that start their document attend exactly their own positions: the packed paths, batched.
        sub = plan.starting
        rows, krows = plan.start_rows, plan.start_keys
        q_s, k_s, v_s = q.index_select(0, rows), keys.index_select(0, krows), values.index_select(0, krows)
        chosen = _auto_impl(q_s, v_s, sub) if impl == "auto" else impl
        outs.append(_run(chosen, q_s, k_s, v_s, sub, True, scale))
    for q_lo, q_hi, k_lo, k_hi in plan.inner:
        outs.append(offset_causal_attention(q[q_lo:q_hi], keys[k_lo:k_hi], values[k_lo:k_hi], scale))
    return torch.cat(outs).index_select(0, plan.unpermute)


class _PiecePlan(NamedTuple):
    starting: SequenceMetadata | None  # the pieces at offset 0, packed
    start_rows: torch.Tensor  # their query rows
    start_keys: torch.Tensor  # their key rows (in the gathered per-piece key buffer)
    inner: list[tuple[int, int, int, int]]  # every other piece: query rows [lo, hi), key rows [lo, hi)
    unpermute: torch.Tensor  # the local row of each output row, in the order the outputs are concatenated


def _piece_plan(meta: SequenceMetadata, cu_k_host: torch.Tensor, offsets: torch.Tensor) -> _PiecePlan:
    """Host plan of the CPU path over a shard's pieces (built once per batch, memoised on the metadata)."""
    cu_q = meta.cu_seqlens_cpu.numpy().astype(np.int64)
    cu_k = cu_k_host.numpy().astype(np.int64)
    lengths = np.diff(cu_q)
    first = offsets.numpy() == 0

    def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        base = np.repeat(starts - np.cumsum(counts) + counts, counts)
        return base + np.arange(int(counts.sum()), dtype=np.int64)

    start_rows = ranges(cu_q[:-1][first], lengths[first])
    inner = [(int(cu_q[j]), int(cu_q[j + 1]), int(cu_k[j]), int(cu_k[j + 1])) for j in np.flatnonzero(~first)]
    order = np.concatenate([start_rows, ranges(cu_q[:-1][~first], lengths[~first])])
    unpermute = np.empty_like(order)
    unpermute[order] = np.arange(order.size, dtype=np.int64)
    device = meta.device

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return _PiecePlan(
        starting=SequenceMetadata.from_lengths(lengths[first], device=device) if first.any() else None,
        start_rows=to_device(start_rows),
        start_keys=to_device(ranges(cu_k[:-1][first], lengths[first])),
        inner=inner,
        unpermute=to_device(unpermute),
    )


# ------------------------------------------------------------------------------------- under torch.compile
# The shard's attention as one custom op: its plan (per-piece lengths, offsets) is host data that changes with every
# batch's document layout. Traced, it would be specialised on (a recompilation per layout, and int reads of tensors
# Dynamo cannot trace); as op inputs the plan's tensors only change sizes, and context_shard_plan marks those sizes
# dynamic (with the gather order's), so one graph serves every layout. The op's backward recomputes the attention's
# forward (autograd cannot see inside the op) and takes its gradients: exact, at the cost of one more attention
# forward per layer under compile.
_OP_METADATA: dict[tuple[Any, ...], SequenceMetadata] = {}


def _pieces_metadata(cu_k: torch.Tensor, offsets: torch.Tensor, device: torch.device) -> SequenceMetadata:
    """The pieces' metadata on ``device``, built once per plan (every layer of a batch passes the same host tensors;
    one entry, keyed by the plan's contents): piece ``j`` holds ``keys_j - offsets[j]`` queries."""
    key = (device, cu_k.numpy().tobytes(), offsets.numpy().tobytes())
    meta = _OP_METADATA.get(key)
    if meta is None:
        _OP_METADATA.clear()
        queries = (cu_k[1:] - cu_k[:-1]).to(torch.int64) - offsets
        meta = _OP_METADATA[key] = SequenceMetadata.from_lengths(queries, device=device)
    return meta


def _attend_pieces(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor, offsets: torch.Tensor, scale: float,
    impl: str,
) -> torch.Tensor:  # fmt: skip
    meta = _pieces_metadata(cu_k, offsets, q.device)
    max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    return _attend_gathered(q, keys, values, meta, cu_k, offsets, max_seqlen_k, scale, impl)


@torch.library.custom_op("lightning_llmfast::context_attend", mutates_args=())
def _context_attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor, offsets: torch.Tensor, scale: float,
    impl: str,
) -> torch.Tensor:  # fmt: skip
    """A shard's attention (:func:`_attend_gathered`) from its host plan tensors: ``cu_k`` (the pieces' key
    boundaries) and ``offsets`` (their first positions in their documents)."""
    with torch.no_grad():
        return _attend_pieces(q, keys, values, cu_k, offsets, scale, impl)


@_context_attend.register_fake
def _context_attend_fake(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor, offsets: torch.Tensor, scale: float,
    impl: str,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], values.shape[2])


@torch.library.custom_op("lightning_llmfast::context_attend_backward", mutates_args=())
def _context_attend_backward(
    grad: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor,
    offsets: torch.Tensor, scale: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of :func:`_context_attend` with respect to ``q``, ``keys`` and ``values`` (forward recomputed)."""
    # An op's implementation runs below autograd (its dispatch keys excluded): let the recomputation record again.
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, keys, values)]
        out = _attend_pieces(*leaves, cu_k, offsets, scale, impl)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq, dk, dv


@_context_attend_backward.register_fake
def _context_attend_backward_fake(
    grad: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor,
    offsets: torch.Tensor, scale: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)


def _context_attend_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, keys, values, cu_k, offsets, scale, impl = inputs
    ctx.save_for_backward(q, keys, values, cu_k, offsets)
    ctx.scale, ctx.impl = scale, impl


def _context_attend_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, keys, values, cu_k, offsets = ctx.saved_tensors
    dq, dk, dv = _context_attend_backward(grad.contiguous(), q, keys, values, cu_k, offsets, ctx.scale, ctx.impl)
    return dq, dk, dv, None, None, None, None


_context_attend.register_autograd(_context_attend_grad, setup_context=_context_attend_setup)
