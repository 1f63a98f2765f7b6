"""Context-parallel attention on gloo processes: a shard's ``varlen_attention`` (K/V all-gathered inside) equals one
process's and a float64 per-document loop, in outputs and q/k/v gradients; the CPU path saves memory linear in tokens
and no (queries x keys) tensor; the shard's metadata flows through ``PackedBatch`` and the cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast.data import PackedBatch
from lightning_llmfast.data.context import context_shard_plan
from lightning_llmfast.errors import MetadataError
from lightning_llmfast.seqmeta import (
    SequenceMetadata,
    SequenceMetadataCache,
    active_cache,
    context_attention,
    context_split,
    varlen_attention,
)
from lightning_llmfast.seqmeta.context import CONTEXT_STATS, offset_causal_attention

# Awkward batches over 96 positions (divisible by 2 and 4): one document across every rank; length-1 documents
# among others; [B=3, T=32] rows with a document of exactly T and padding tails; prime lengths.
BATCHES = {
    "one_document": [96],
    "length_one": [1, 1, 40, 1, 1, 1, 17, 1, 33],
    "rows_of_T": [32, 5, 20, 7, 29, 3],
    "primes": [2, 3, 5, 7, 11, 13, 17, 19, 19],
}
HEADS, KV_HEADS, DIM, V_DIM = 4, 2, 8, 12  # grouped-query heads, a value dim unlike the key dim (MLA)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Float64 causal attention computed one document at a time, with its explicit (L x L) causal mask."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for qd, kd, vd in zip(*(t.double().split(lengths) for t in (q, k, v))):
        kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        causal = torch.ones(len(qd), len(qd), dtype=torch.bool).tril()
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, -math.inf).softmax(-1), vd))
    return torch.cat(outs)


def _inputs(total: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, V_DIM, generator=gen)
    weight = torch.randn(total, HEADS, V_DIM, generator=gen)
    return q, k, v, weight


def _grads(q, k, v, weight, attend) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    (out * weight).sum().backward()
    return (out.detach(), *(t.grad for t in leaves))


def _check_batch(rank: int, world: int, name: str, lengths: list[int]) -> None:
    scale = 1.0 / math.sqrt(DIM)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q, k, v, weight = _inputs(total)
    whole = SequenceMetadata.from_cu_seqlens(cu)
    one_process = _grads(q, k, v, weight, lambda a, b, c: varlen_attention(a, b, c, whole))
    reference = _grads(*(t.double() for t in (q, k, v, weight)), lambda a, b, c: _reference(a, b, c, lengths, scale))
    shard, cu_q = context_shard_plan(cu, rank, world, dist.group.WORLD)
    meta = SequenceMetadata(cu_q, context=shard)
    held = shard.positions
    CONTEXT_STATS.reset()
    got = _grads(*(t[held] for t in (q, k, v, weight)), lambda a, b, c: varlen_attention(a, b, c, meta))
    assert CONTEXT_STATS.gathers == 1
    assert CONTEXT_STATS.gathered_bytes == total * KV_HEADS * (DIM + V_DIM) * 4
    for what, mine, ours, exact in zip(("out", "dq", "dk", "dv"), got, one_process, reference):
        torch.testing.assert_close(mine, ours[held], atol=1e-5, rtol=1e-5, msg=f"{name} {what} against cp=1")
        torch.testing.assert_close(mine.double(), exact[held], atol=1e-5, rtol=1e-5, msg=f"{name} {what} vs float64")
    # RoPE positions: each held position's place in its document.
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths))
    assert torch.equal(meta.position_ids, held - starts[held])


def _attention_worker(rank: int, world: int) -> None:
    for name, lengths in BATCHES.items():
        _check_batch(rank, world, name, lengths)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_equals_one_process(world: int) -> None:
    run_distributed(_attention_worker, world, timeout=120)


def _saved_bytes(fn) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Bytes of the distinct storages autograd saves during ``fn()``, and the largest saved tensor's elements."""
    storages: dict[int, int] = {}
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values()), largest


def _saved_by_shard(rank: int, world: int, total: int) -> int:
    cu = torch.tensor([0, total], dtype=torch.int32)  # one document across every rank
    shard, cu_q = context_shard_plan(cu, rank, world, None)
    meta = SequenceMetadata(cu_q, context=shard)
    q, k, v, _ = (t[shard.positions].requires_grad_() for t in _inputs(total))
    size, largest = _saved_bytes(lambda: varlen_attention(q, k, v, meta))
    assert largest < q.shape[0] * shard.num_keys  # no (queries x keys) mask or score tensor
    return size


def _memory_worker(rank: int, world: int) -> None:
    small, large = _saved_by_shard(rank, world, 512), _saved_by_shard(rank, world, 2048)
    assert large <= 4.6 * small, (small, large)  # linear in tokens (quadratic would be 16x)


def test_context_parallel_cpu_path_saves_linear_memory() -> None:
    run_distributed(_memory_worker, 2, timeout=120)


def _flow_worker(rank: int, world: int) -> None:
    batch = PackedBatch(
        input_ids=torch.arange(64).view(2, 32),
        labels=torch.arange(64).view(2, 32),
        position_ids=torch.cat([torch.arange(32), torch.arange(20), torch.arange(12)]).view(2, 32),
        cu_seqlens=torch.tensor([0, 32, 52, 64], dtype=torch.int32),
        max_seqlen=32,
        num_tokens=52,
        documents=[0, 1, -1],
    )
    shard = batch.context_shard(rank, world, dist.group.WORLD)
    assert shard.input_ids.shape == (1, 32)
    assert shard.num_tokens == 32 - int((shard.context.positions >= 52).sum())  # the padding segment [52, 64)
    cache = SequenceMetadataCache()
    with cache.batch(shard):
        meta = active_cache().get(torch.zeros(1, 32, 4))
        assert meta.context is shard.context
        assert torch.equal(meta.position_ids.view(1, -1), shard.position_ids)
        q = torch.randn(32, 2, 8)
        out = varlen_attention(q, q[:, :1], q[:, :1], meta)
        assert out.shape == (32, 2, 8)
    with torch.inference_mode():  # Lightning's evaluation loops: the gather runs without autograd too
        same = varlen_attention(q, q[:, :1], q[:, :1], SequenceMetadata.from_batch(shard))
    torch.testing.assert_close(same, out)


def test_shard_metadata_flows_through_the_cache() -> None:
    run_distributed(_flow_worker, 2, timeout=120)


def test_offset_causal_attention_against_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(5, 4, 8, generator=gen), torch.randn(13, 2, 8, generator=gen), torch.randn(13, 2, 6)
    weight = torch.randn(5, 4, 6, generator=gen)
    got = _grads(q, k, v, weight, lambda a, b, c: offset_causal_attention(a, b, c, scale=0.3))
    # Queries 8..12 of a 13-position document: the reference runs all 13 queries, the first 8 weighted by zero.
    early = torch.randn(8, 4, 8, generator=gen)
    pad = torch.cat([torch.zeros(8, 4, 6), weight])
    expected = _grads(
        torch.cat([early, q]).double(),
        k.double(),
        v.double(),
        pad.double(),
        lambda a, b, c: _reference(a, b, c, [13], 0.3),
    )
    torch.testing.assert_close(got[0].double(), expected[0][8:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1].double(), expected[1][8:], atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(got[2:], expected[2:]):
        torch.testing.assert_close(mine.double(), theirs, atol=1e-6, rtol=1e-6)


def test_compiled_path_op_against_float64() -> None:
    """The custom op a compiled layer calls (its plan as host tensors; backward by recomputation) on every rank's
    pieces, the gather simulated in one process: outputs and q/k/v gradients against the float64 loop; and its
    contract (fake shapes, autograd, no aliasing) by ``torch.library.opcheck``."""
    from lightning_llmfast.seqmeta.attention import _context_attend

    scale, cp = 0.3, 4
    for name, lengths in BATCHES.items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, weight = _inputs(int(cu[-1]))
        exact = (t.double() for t in (q, k, v, weight))
        expected = _grads(*exact, lambda a, b, c, n=lengths: _reference(a, b, c, n, scale))
        order = torch.cat(context_split(cu, cp))  # the gathered order: every rank's positions, rank after rank
        dk, dv = torch.zeros_like(k, dtype=torch.float64), torch.zeros_like(v, dtype=torch.float64)
        for rank in range(cp):
            shard, _ = context_shard_plan(cu, rank, cp)
            held, rows = shard.positions, order[shard.key_index]
            q_r, k_r, v_r = (t.detach().clone().requires_grad_() for t in (q[held], k[rows], v[rows]))
            args = (shard.cu_seqlens_k, shard.offsets, scale, "auto")
            out = _context_attend(q_r, k_r, v_r, *args)
            (out * weight[held]).sum().backward()
            torch.testing.assert_close(out.double(), expected[0][held], atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(q_r.grad.double(), expected[1][held], atol=1e-5, rtol=1e-5, msg=name)
            dk.index_add_(0, rows, k_r.grad.double())
            dv.index_add_(0, rows, v_r.grad.double())
            if rank == 0 and name == "length_one":  # starting and inner pieces
                torch.library.opcheck(_context_attend, (q_r, k_r, v_r, *args))
        # Each key's gradient summed over the pieces that attend it (the gather's reduce-scatter).
        torch.testing.assert_close(dk, expected[2], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(dv, expected[3], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
@pytest.mark.parametrize("cp", [2, 4])
def test_flash_varlen_pieces_against_float64(cp: int) -> None:
    # The gather simulated in one process: every rank's keys, rank after rank, then each piece's by key_index.
    from lightning_llmfast.seqmeta.attention import _flash_unsupported, _flash_varlen

    gen = torch.Generator().manual_seed(cp)
    for lengths in BATCHES.values():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        q, k, v = (torch.randn(total, h, 64, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
        expected = _reference(q, k, v, lengths, 0.125)
        order = torch.cat(context_split(cu, cp))
        for rank in range(cp):
            shard, cu_q = context_shard_plan(cu, rank, cp)
            held = shard.positions
            keys, values = (t[order][shard.key_index].cuda().bfloat16() for t in (k, v))
            local = q[held].cuda().bfloat16()
            assert _flash_unsupported(local, values) is None
            sizes = (cu_q.cuda(), shard.cu_seqlens_k.cuda(), int(cu_q.diff().max()), shard.max_seqlen_k)
            out = _flash_varlen(local, keys, values, sizes, True, 0.125)
            torch.testing.assert_close(out.double().cpu(), expected[held], atol=3e-2, rtol=3e-2)


_DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_on_gathered_keys_against_float64(cp: int, device: str) -> None:
    """``context_attention`` of every rank's queries against its pieces' keys laid out as ``context_keys`` gathers
    them (simulated in one process: every rank's rows, rank after rank, then ``key_index``), outputs and gradients
    against the float64 per-document loop; bf16 FlashAttention varlen on CUDA."""
    dtype, tol = (torch.bfloat16, 3e-2) if device == "cuda" else (torch.float32, 1e-5)
    dim = 64 if device == "cuda" else DIM  # FlashAttention: one head dim for q, k and v, a multiple of 8
    for lengths in BATCHES.values():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        gen = torch.Generator().manual_seed(total + cp)
        q, k = torch.randn(total, HEADS, dim, generator=gen), torch.randn(total, KV_HEADS, dim, generator=gen)
        v = torch.randn(total, KV_HEADS, dim if device == "cuda" else V_DIM, generator=gen)
        weight = torch.randn(total, HEADS, v.shape[-1], generator=gen)
        exact = _grads(*(t.double() for t in (q, k, v, weight)), lambda a, b, c, n=lengths: _reference(a, b, c, n, 0.3))
        order = torch.cat(context_split(cu, cp))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rank in range(cp):
            shard, cu_q = context_shard_plan(cu, rank, cp)
            meta = SequenceMetadata(cu_q, context=shard, device=device)
            held, rows = shard.positions, order[shard.key_index]
            leaves = [t.to(device, dtype).requires_grad_() for t in (q[held], k[rows], v[rows])]
            out = context_attention(*leaves, meta, scale=0.3)
            (out * weight[held].to(device, dtype)).sum().backward()
            torch.testing.assert_close(out.double().cpu(), exact[0][held], atol=tol, rtol=tol)
            dq[held] += leaves[0].grad.float().cpu()
            dk.index_add_(0, rows, leaves[1].grad.float().cpu())  # the gather's backward: sums onto the owners
            dv.index_add_(0, rows, leaves[2].grad.float().cpu())
        for mine, theirs in zip((dq, dk, dv), exact[1:]):
            torch.testing.assert_close(mine.double(), theirs, atol=tol * 4, rtol=tol)
    with pytest.raises(MetadataError, match="num_keys"):
        context_attention(leaves[0], leaves[1][:-1], leaves[2][:-1], meta)
    with pytest.raises(MetadataError, match="context-parallel shard"):
        context_attention(q, k, v, SequenceMetadata.from_cu_seqlens(cu))


def _overlap_worker(rank: int, world: int) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_llmfast.data import pack_documents
    from lightning_llmfast.models import MoEGPT, MoEGPTConfig
    from lightning_llmfast.seqmeta import SequenceMetadata

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_size=16,
                                num_experts=2, top_k=1))  # fmt: skip
    batch = next(pack_documents([list(range(1, 12)), [3, 4, 5]], 8, 2, vocab_size=32, lookahead=2))
    shard = batch.context_shard(rank, world, dist.group.WORLD)
    x = model.embed(shard.input_ids)
    attention = model.layers[0].attn
    from lightning_llmfast.models.model import rope_tables

    rope = rope_tables(shard.position_ids, model.config.head_dim, model.config.rope_theta)
    with Ops() as ops:
        attention(x, rope, shard.position_ids, SequenceMetadata.from_batch(shard))
    names = ops.names
    start = next(i for i, n in enumerate(names) if n.startswith("all_gather"))
    wait = next(i for i, n in enumerate(names) if n.startswith("wait_tensor"))
    # The key/value projection before the gather starts, the query projection while it is in flight.
    assert any(n in ("mm.default", "addmm.default", "bmm.default") for n in names[:start]), names[:start]
    assert any(n in ("mm.default", "addmm.default", "bmm.default") for n in names[start:wait]), names[start:wait]


def test_moegpt_query_projection_overlaps_the_key_gather() -> None:
    run_distributed(_overlap_worker, 2, timeout=120)
