"""Context-parallel attention: all-gather K and V over the cp group, attend each query piece to its document's keys.

A context-parallel shard (``PackedBatch.context_shard``) holds *pieces* of documents: piece ``j`` holds the queries
``[o_j, o_j + n_j)`` of its document and attends that document's keys ``[0, o_j + n_j)``: a causal diagonal aligned
*bottom-right* (the last query sees every key). :func:`gather_keys` all-gathers each layer's K and V (after RoPE,
one collective of ``[K | V]``, differentiable: its backward reduce-scatters the gradients) and lays out every piece's
keys with one ``index_select`` planned on the host (``ContextShard.key_index``). Then

- on CUDA, FlashAttention varlen takes ``cu_seqlens_q != cu_seqlens_k`` directly (its causal mask is bottom-right);
- on the CPU, pieces that start their document (``o_j == 0``) go through the exact packed paths of
  :mod:`~lightning_llmfast.seqmeta.attention`, and each other piece through :func:`offset_causal_attention`: SDPA's
  CPU flash kernel over the strictly earlier keys (no mask) and over the diagonal block (``is_causal``, whose
  top-left alignment is right for a square block), merged by log-sum-exp. Its backward calls the kernel's backward
  per block with the merged output and log-sum-exp, so only the queries, keys, values, output and log-sum-exp are
  saved: memory linear in tokens, no (queries x keys) mask or score tensor.

:data:`CONTEXT_STATS` counts the gathers and the bytes of the gathered K/V buffers (``cp`` times the local K and V,
per layer call), for benchmarks; in eager mode only (not inside a ``torch.compile``'d region).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

from lightning_llmfast.data.context import ContextShard
from lightning_llmfast.errors import ConfigError

__all__ = ["CONTEXT_STATS", "ContextStats", "gather_keys", "offset_causal_attention", "start_gather"]

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class ContextStats:
    """Counters of the context-parallel K/V all-gathers in this process.

    Attributes:
        gathers: all-gathers run (one per attention call on a shard).
        gathered_bytes: bytes of the gathered ``[K | V]`` buffers (``cp`` x the local K and V, every call).

    Example::

        CONTEXT_STATS.reset()
        loss = model(shard).loss
        per_layer = CONTEXT_STATS.gathered_bytes / CONTEXT_STATS.gathers
    """

    gathers: int = 0
    gathered_bytes: int = 0

    def reset(self) -> None:
        """Sets every counter to 0."""
        self.gathers = 0
        self.gathered_bytes = 0


CONTEXT_STATS = ContextStats()


def gather_keys(k: Tensor, v: Tensor, shard: ContextShard, key_index: Tensor) -> tuple[Tensor, Tensor]:
    """All-gathers ``k`` and ``v`` over the shard's group and returns every piece's keys and values, piece after piece.

    Args:
        k: ``(local tokens, kv_heads, head_dim)`` keys (after RoPE).
        v: ``(local tokens, kv_heads, v_dim)`` values.
        shard: the rank's plan (``group``, ``size``).
        key_index: ``shard.key_index`` on ``k``'s device.

    Returns:
        ``(num_keys, kv_heads, head_dim)`` and ``(num_keys, kv_heads, v_dim)``: the rows ``cu_seqlens_k`` ranges
        over. Differentiable: gradients are reduce-scattered back to the ranks that hold the positions.

    Raises:
        ConfigError: the group's size is not the shard's.

    Example::

        keys, values = gather_keys(k, v, meta.context, key_index)
    """
    return start_gather(k, v, shard, key_index)()


def start_gather(k: Tensor, v: Tensor, shard: ContextShard, key_index: Tensor) -> Callable[[], tuple[Tensor, Tensor]]:
    """:func:`gather_keys` in two halves: starts the all-gather and returns the function that waits for it and lays
    out the keys, so that compute between the two (a layer's query projection) overlaps the exchange.

    Example::

        finish = start_gather(k, v, meta.context, key_index)
        q = project_queries(x)       # while the keys and values travel
        keys, values = finish()
    """
    group = shard.group if shard.group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != shard.size:
        raise ConfigError(
            f"context parallelism: the shard was planned for {shard.size} ranks but its group has {size}; pass the "
            "cp group to PackedBatch.context_shard"
        )
    split = k.shape[-1]
    kv = torch.cat([k, v], dim=-1)  # one collective for both; the group's timeout bounds it
    pending = all_gather_single_autograd(kv, 0, group)

    def finish() -> tuple[Tensor, Tensor]:
        gathered = wait_tensor(pending)
        if not torch.compiler.is_compiling():  # host counters: traced, they would be guarded on (a graph per value)
            CONTEXT_STATS.gathers += 1
            CONTEXT_STATS.gathered_bytes += gathered.numel() * gathered.element_size()
        keys = gathered.index_select(0, key_index)
        return keys[..., :split], keys[..., split:]

    return finish


def _layout(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens, heads, dim)`` inputs as the CPU flash kernel's ``(1, heads, tokens, dim)``, with the kv heads
    repeated to the query heads and the head dims padded with zeros to one size (zeros change no score)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dim = max(q.shape[-1], v.shape[-1])
    q, k, v = (torch.nn.functional.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))
    return q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]


class _OffsetCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        earlier = k.shape[0] - q.shape[0]
        ql, kl, vl = _layout(q, k, v)
        o1, l1 = _flash_cpu(ql, kl[:, :, :earlier], vl[:, :, :earlier], 0.0, False, scale=scale)
        o2, l2 = _flash_cpu(ql, kl[:, :, earlier:], vl[:, :, earlier:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse)[..., None].to(o1.dtype) + o2 * torch.exp(l2 - lse)[..., None].to(o2.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out[0, :, :, : v.shape[-1]].transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        earlier = k.shape[0] - q.shape[0]
        ql, kl, vl = _layout(q, k, v)
        g = torch.nn.functional.pad(grad, (0, out.shape[-1] - grad.shape[-1])).transpose(0, 1)[None]
        # Each block's share of the gradient, from the merged output and log-sum-exp (as ring attention does).
        dq1, dk1, dv1 = _flash_cpu_backward(
            g, ql, kl[:, :, :earlier], vl[:, :, :earlier], out, lse, 0.0, False, scale=ctx.scale
        )
        dq2, dk2, dv2 = _flash_cpu_backward(
            g, ql, kl[:, :, earlier:], vl[:, :, earlier:], out, lse, 0.0, True, scale=ctx.scale
        )
        dq = (dq1 + dq2)[0].transpose(0, 1)[..., : q.shape[-1]]
        dk = torch.cat([dk1, dk2], dim=2)[0].transpose(0, 1)[..., : k.shape[-1]]
        dv = torch.cat([dv1, dv2], dim=2)[0].transpose(0, 1)[..., : v.shape[-1]]
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # the repeated heads' gradients summed back into their kv head
            dk = dk.reshape(k.shape[0], k.shape[1], rep, -1).sum(2)
            dv = dv.reshape(v.shape[0], v.shape[1], rep, -1).sum(2)
        return dq, dk, dv, None


def offset_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Exact causal attention of the *last* ``len(q)`` positions of a document against its first ``len(k)`` keys.

    Query ``i`` attends keys ``[0, len(k) - len(q) + i]`` (the causal diagonal aligned bottom-right). Computed as the
    CPU flash kernel over the strictly earlier keys and over the square diagonal block, merged by log-sum-exp; saves
    only the inputs, the output and the log-sum-exp for backward (no (queries x keys) tensor).

    Args:
        q: ``(n, heads, head_dim)`` queries, on the CPU.
        k: ``(m, kv_heads, head_dim)`` keys with ``m > n``; ``kv_heads`` divides ``heads``.
        v: ``(m, kv_heads, v_dim)`` values (``v_dim`` may differ from ``head_dim``).
        scale: the softmax scale.

    Returns:
        ``(n, heads, v_dim)``.

    Example::

        out = offset_causal_attention(q[10:14], k[:14], v[:14], scale=0.125)  # queries 10..13 of one document
    """
    return _OffsetCausal.apply(q, k, v, scale)
