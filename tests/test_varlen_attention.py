"""varlen_attention against a float64 per-document reference (forward and gradients), syncs and torch.compile."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_llmfast import ConfigError, MetadataError
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache, dense_block_causal_mask, varlen_attention
from lightning_llmfast.seqmeta.attention import _auto_impl

EXACT_IMPLS = ("masked", "per_document", "bucketed")
IMPLS = (*EXACT_IMPLS, "auto")


def reference_attention(q, k, v, lengths, causal: bool, scale: float | None):
    """float64, one document at a time, explicit softmax; kv heads repeated for grouped-query attention."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))  # (heads, n, d)
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def _inputs(n: int, heads: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, h, dim, generator=gen, dtype=torch.float32).requires_grad_() for h in (heads, kv_heads, kv_heads)
    ]


def _check(lengths: list[int], heads: int, kv_heads: int, dim: int, causal: bool, scale, seed: int, impls=EXACT_IMPLS):
    meta = SequenceMetadata.from_lengths(lengths)
    q, k, v = _inputs(meta.num_tokens, heads, kv_heads, dim, seed)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves64, lengths, causal, scale)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out) if ref.numel() else None
    for impl in impls:
        out = varlen_attention(q, k, v, meta, causal=causal, scale=scale, impl=impl)
        assert out.shape == (meta.num_tokens, heads, dim) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=lambda m, impl=impl: f"{impl}: {m}")
        if ref_grads is not None:
            grads = torch.autograd.grad(out, (q, k, v), grad_out.float())
            for name, g, r in zip("qkv", grads, ref_grads):
                torch.testing.assert_close(
                    g.double(), r, atol=5e-5, rtol=1e-4, msg=lambda m, impl=impl, name=name: f"{impl} d{name}: {m}"
                )


# Packings: arbitrary, single-token documents only, one document filling the row, many tiny ones.
packings = st.one_of(
    st.lists(st.integers(1, 13), min_size=1, max_size=7),
    st.integers(1, 24).map(lambda n: [1] * n),
    st.integers(1, 40).map(lambda n: [n]),
    st.lists(st.integers(1, 3), min_size=5, max_size=20),
    st.lists(st.integers(0, 5), min_size=1, max_size=6),  # empty segments too
)
heads_kv = st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)])


@settings(max_examples=200, deadline=None)
@given(
    lengths=packings,
    heads=heads_kv,
    dim=st.sampled_from([2, 4, 8]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_per_document_reference(lengths, heads, dim, causal, scale, seed) -> None:
    _check(lengths, heads[0], heads[1], dim, causal, scale, seed)


@pytest.mark.parametrize(
    "lengths",
    [
        [600],  # one document: per_document
        [17, 1, 300, 64, 65, 2, 150],  # several buckets: bucketed
        [1] * 130,  # short documents in a small batch: masked
    ],
)
def test_auto_paths_on_larger_packings(lengths: list[int]) -> None:
    _check(lengths, 4, 2, 8, causal=True, scale=None, seed=len(lengths), impls=("auto",))


def test_auto_rule() -> None:
    q = torch.zeros(1, 1, 1)
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([64, 64])) == "masked"
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([2] * 200)) == "masked"
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([1000, 24])) == "per_document"
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([300] * 10)) == "per_document"
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([100] * 10)) == "bucketed"
    assert _auto_impl(q, q, SequenceMetadata.from_lengths([300] * 20)) == "bucketed"


def test_empty_and_errors() -> None:
    meta = SequenceMetadata.from_lengths([])
    q, k, v = _inputs(0, 2, 1, 4, 0)
    assert varlen_attention(q, k, v, meta).shape == (0, 2, 4)
    meta = SequenceMetadata.from_lengths([3, 2])
    q, k, v = _inputs(6, 2, 1, 4, 0)
    with pytest.raises(MetadataError, match=r"num_tokens: q/k/v hold 6/6/6 tokens but the metadata describes 5"):
        varlen_attention(q, k, v, meta)
    q, k, v = _inputs(5, 3, 2, 4, 0)
    with pytest.raises(ConfigError, match=r"kv_heads"):
        varlen_attention(q, k, v, meta)
    with pytest.raises(ConfigError, match=r"must be \(num_tokens, heads, head_dim\)"):
        varlen_attention(q[None], k, v, meta)
    q, k, v = _inputs(5, 2, 2, 4, 0)
    with pytest.raises(ConfigError, match=r"impl: must be one of"):
        varlen_attention(q, k, v, meta, impl="nope")  # type: ignore[arg-type]


_META = SequenceMetadata.from_lengths([3, 2])
_Q, _K, _V = torch.randn(5, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((torch.randn(5, 2, 0), torch.randn(5, 1, 0), _V, _META), {}, ConfigError, r"head_dim: .*got 0 and 4"),
        ((_Q, _K, torch.randn(5, 1, 0), _META), {}, ConfigError, r"head_dim: .*got 4 and 0"),
        ((torch.randn(5, 0, 4), _K, _V, _META), {}, ConfigError, r"heads: q must have at least one head"),
        ((_Q.long(), _K.long(), _V.long(), _META), {}, ConfigError, r"must be floating point, got torch.int64"),
        ((_Q, _K.double(), _V.double(), _META), {}, ConfigError, r"one dtype outside autocast, .*float32.*float64"),
        ((_Q, _K, _V.half(), _META), {}, ConfigError, r"one dtype outside autocast"),
        ((_Q, _K, [[0.0]], _META), {}, ConfigError, r"q, k, v: must be tensors, got Tensor, Tensor, list"),
        ((_Q, _K, _V, [0, 3, 5]), {}, MetadataError, r"metadata: must be a SequenceMetadata .*got list"),
        ((_Q, _K, _V, None), {}, MetadataError, r"metadata: must be a SequenceMetadata .*got NoneType"),
        ((_Q, _K, _V, _META), {"scale": float("nan")}, ConfigError, r"scale must be a finite number, got nan"),
        ((_Q, _K, _V, _META), {"scale": "0.5"}, ConfigError, r"scale must be a finite number"),
        ((_Q, _K, _V, _META), {"causal": None}, ConfigError, r"causal must be True or False, got None"),
        ((_Q, _K, _V, _META), {"causal": 1}, ConfigError, r"causal must be True or False, got 1"),
    ],
)
def test_rejects_bad_inputs_with_our_errors(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        varlen_attention(*args, **kwargs)


def test_dense_block_causal_mask_rejects_non_metadata() -> None:
    with pytest.raises(MetadataError, match=r"metadata: must be a SequenceMetadata .*got list"):
        dense_block_causal_mask([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"causal must be True or False, got 'yes'"):
        dense_block_causal_mask(_META, causal="yes")  # type: ignore[arg-type]


def test_zero_scale_is_accepted() -> None:
    out = varlen_attention(_Q, _K, _V, _META, scale=0.0, causal=False)
    expected = reference_attention(_Q, _K, _V, [3, 2], causal=False, scale=0.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", EXACT_IMPLS)
def test_no_tokens_keeps_a_gradient_path(impl: str) -> None:
    q = torch.randn(0, 2, 4, requires_grad=True)
    k, v = torch.randn(0, 1, 4, requires_grad=True), torch.randn(0, 1, 3, requires_grad=True)
    out = varlen_attention(q, k, v, SequenceMetadata.from_lengths([]), impl=impl)
    assert out.shape == (0, 2, 3) and out.dtype == q.dtype and out.grad_fn is not None
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
    no_grad = varlen_attention(q.detach(), k.detach(), v.detach(), SequenceMetadata.from_lengths([0, 0]))
    assert no_grad.shape == (0, 2, 3) and not no_grad.requires_grad


@pytest.mark.parametrize("impl", IMPLS)
def test_no_host_syncs_forward_backward(impl: str) -> None:
    batch = {"cu_seqlens": torch.tensor([0, 5, 6, 30, 33, 64], dtype=torch.int32), "max_seqlen": 31}
    batch["cu_seqlens_cpu"] = batch["cu_seqlens"].clone()  # the collator's host copy (cu_seqlens stands for the device)
    cache = SequenceMetadataCache()
    q, k, v = _inputs(64, 4, 2, 8, 1)
    with SyncCounter(host=batch["cu_seqlens_cpu"]) as sc, cache.batch(batch):
        for _ in range(3):  # three "layers" share one metadata
            meta = cache.get(q.flatten(1))  # hidden states are (..., hidden_dim)
            varlen_attention(q, k, v, meta, impl=impl).sum().backward()
    assert sc.num_syncs == 0, sc.syncs
    assert cache.stats["builds"] == 1


@pytest.mark.parametrize(
    ("impl", "few", "many"),
    [
        # per_document: 3 and 9 sequences (and an empty one each); bucketed: 3 and 5 buckets (16 to 256 tokens).
        ("per_document", [7, 0, 30, 27], [5, 11, 0, 3, 9, 13, 1, 8, 6, 8]),
        ("bucketed", [20, 3, 41], [20, 3, 41, 100, 200, 66, 130, 1]),
    ],
)
def test_only_the_attention_kernels_grow_with_sequences_and_buckets(impl: str, few: list[int], many: list[int]) -> None:
    """Forward+backward kernels (KernelCounter): one SDPA forward and backward per sequence (per bucket), and the
    gathers, splits and concatenations around them a constant number, however many sequences or buckets."""

    def kernels(lengths: list[int]) -> tuple[int, int]:
        meta = SequenceMetadata.from_lengths(lengths)
        q, k, v = _inputs(sum(lengths), 4, 2, 8, 0)
        varlen_attention(q, k, v, meta, impl=impl)  # the memoised plan is built once per metadata, not per layer
        with KernelCounter() as counter:
            out = varlen_attention(q, k, v, meta, impl=impl)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        calls = sum(n for name, n in counter.kernel_ops.items() if "scaled_dot_product" in name)
        return calls, counter.kernels - calls

    (calls_few, rest_few), (calls_many, rest_many) = kernels(few), kernels(many)
    assert calls_many > calls_few > 0
    assert rest_many == rest_few


class _TinyAttentionLayer(nn.Module):
    def __init__(self, impl: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.impl = impl

    def forward(self, x: torch.Tensor, meta: SequenceMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, 4, 4).unbind(1)
        return varlen_attention(q, k, v, meta, impl=self.impl).reshape(x.shape)


@pytest.mark.parametrize("impl", ["auto", "bucketed"])
def test_torch_compile_fullgraph_with_cached_metadata(impl: str) -> None:
    torch._dynamo.reset()
    layer = _TinyAttentionLayer(impl)
    compiled = torch.compile(layer, fullgraph=True)
    cache = SequenceMetadataCache()
    x = torch.randn(16, 16, requires_grad=True)
    with cache.batch({"cu_seqlens": [0, 3, 10, 11, 16], "max_seqlen": 7}):
        meta = cache.get(x)  # fresh: the mask / gather plan is built inside the compiled graph
        out = compiled(x, meta)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
    ref = layer(x, meta)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cuda_flash_varlen_matches_reference(dtype: torch.dtype, kv_heads: int) -> None:
    lengths = [1, 37, 128, 5, 200, 63]
    meta = SequenceMetadata.from_lengths(lengths, device="cuda")
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_() for t in _inputs(meta.num_tokens, 4, kv_heads, 64, 3))
    with SyncCounter() as sc:
        out = varlen_attention(q, k, v, meta)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert sc.counts["_local_scalar_dense"] == 0 and sc.counts["nonzero"] == 0, sc.syncs
    qc, kc, vc = (t.detach().cpu().float().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qc, kc, vc, lengths, True, None)
    ref_grads = torch.autograd.grad(ref.square().sum(), (qc, kc, vc))
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(out.double().cpu(), ref.double(), atol=tol, rtol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double().cpu(), r.double(), atol=5 * tol, rtol=5 * tol)


# ---------------------------------------------------------------------------------------------- the flash wrapper
class _FakeVarlen:
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` of a given torch generation, recording calls.

    ``old``: torch <= 2.11 (``is_causal``, no ``scale``: always ``1 / sqrt(head_dim)``, no ``enable_gqa``); its
    kernel either does grouped-query attention natively (``native_gqa``) or checks the head counts. ``new``: ``scale``,
    ``window_size`` and ``enable_gqa``.
    """

    def __init__(self, kind: str, native_gqa: bool = True, error: str | None = None) -> None:
        self.kind, self.native_gqa, self.error = kind, native_gqa, error
        self.calls: list[tuple[torch.Tensor, int]] = []  # (query, key heads) per call

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        self.calls.append((query, key.shape[1]))
        if self.error is not None:
            raise RuntimeError(self.error)
        grouped = key.shape[1] != query.shape[1]
        if grouped and self.kind == "new" and not kwargs.get("enable_gqa"):
            raise ValueError("Expect query and key/value to have the same number of heads")
        if grouped and self.kind == "old" and not self.native_gqa:
            raise RuntimeError("Number of heads in key/value must match number of heads in query")
        causal = kwargs["is_causal"] if self.kind == "old" else kwargs.get("window_size") == (-1, 0)
        lengths = cu_q.diff().tolist()
        return reference_attention(query, key, value, lengths, causal, kwargs.get("scale")).to(query.dtype)

    def params(self) -> frozenset[str]:
        common = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux"}
        return frozenset(common | ({"is_causal"} if self.kind == "old" else {"scale", "window_size", "enable_gqa"}))


@pytest.mark.parametrize(
    ("kind", "native_gqa", "key_heads"),
    [("old", True, [2, 2]), ("old", False, [2, 4, 4]), ("new", True, [2, 2])],
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_flash_wrapper_passes_kv_heads_natively_where_the_kernel_takes_them(
    monkeypatch: pytest.MonkeyPatch, kind: str, native_gqa: bool, key_heads: list[int], scale: float | None
) -> None:
    """Grouped-query attention without repeating k and v (which the kernel would then save at the query heads) on
    every torch generation whose kernel takes it; a kernel that checks the head counts gets repeated k and v, once
    asked. Values and gradients against the float64 reference either way; q is scaled only when the build has no
    ``scale`` argument and the scale is not its default."""
    from lightning_llmfast.seqmeta import attention

    fake = _FakeVarlen(kind, native_gqa)
    monkeypatch.setattr(attention, "_FLASH_VARLEN", (fake, fake.params()))
    monkeypatch.setattr(attention, "_native_gqa", None)
    lengths = [1, 7, 3]
    meta = SequenceMetadata.from_lengths(lengths)
    for step in range(2):
        q, k, v = _inputs(meta.num_tokens, 4, 2, 8, seed=step)
        out = attention._flash(q, k, v, meta, True, scale if scale is not None else 1 / math.sqrt(8))
        ref = reference_attention(q, k, v, lengths, True, scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        assert (fake.calls[-1][0] is q) == (kind == "new" or scale is None)  # no multiply by 1.0
    assert [heads for _, heads in fake.calls] == key_heads  # the refusal is asked once, not per call


@pytest.mark.parametrize(
    ("error", "calls"),
    [("CUDA out of memory. Tried to allocate 2.00 GiB", 1), ("FlashAttention supports head dimension at most 256", 2)],
)
def test_flash_wrapper_does_not_take_other_errors_for_a_head_count_refusal(
    monkeypatch: pytest.MonkeyPatch, error: str, calls: int
) -> None:
    """Out of memory is raised at once; another error gets one repeated call, which fails the same way: raised, and
    the process does not switch to repeating k and v."""
    from lightning_llmfast.seqmeta import attention

    fake = _FakeVarlen("old", error=error)
    monkeypatch.setattr(attention, "_FLASH_VARLEN", (fake, fake.params()))
    monkeypatch.setattr(attention, "_native_gqa", None)
    meta = SequenceMetadata.from_lengths([3, 5])
    with pytest.raises(RuntimeError, match=error.split(".")[0]):
        attention._flash(*_inputs(8, 4, 2, 8, seed=0), meta, True, 1 / math.sqrt(8))
    assert attention._native_gqa is None and len(fake.calls) == calls


@pytest.mark.parametrize(("known", "key_heads"), [(None, [4]), (True, [2]), (False, [4])])
def test_flash_wrapper_under_tracing_follows_the_eager_answer(
    monkeypatch: pytest.MonkeyPatch, known: bool | None, key_heads: list[int]
) -> None:
    """Traced code cannot catch a kernel's refusal (its fake kernel never refuses): it passes grouped k/v natively
    only once an eager call has shown that the kernel takes them, and repeats them otherwise."""
    from lightning_llmfast.seqmeta import attention

    fake = _FakeVarlen("old", native_gqa=known is not False)
    monkeypatch.setattr(attention, "_FLASH_VARLEN", (fake, fake.params()))
    monkeypatch.setattr(attention, "_native_gqa", known)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    meta = SequenceMetadata.from_lengths([3, 5])
    q, k, v = _inputs(8, 4, 2, 8, seed=0)
    out = attention._flash(q, k, v, meta, True, 1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, [3, 5], True, None), atol=1e-5, rtol=1e-5)
    assert [heads for _, heads in fake.calls] == key_heads and attention._native_gqa is known


def test_flash_impl_names_what_it_needs() -> None:
    meta = SequenceMetadata.from_lengths([3, 5])
    q, k, v = _inputs(8, 4, 2, 8, seed=0)
    with pytest.raises(ConfigError, match=r"CUDA fp16/bf16|missing in this torch build"):
        varlen_attention(q, k, v, meta, impl="flash")
    with pytest.raises(ConfigError, match=r"head_dim|missing in this torch build"):
        varlen_attention(q, k, torch.randn(8, 2, 16), meta, impl="flash")


def test_mixed_dtypes_compute_in_the_autocast_dtype_and_are_refused_outside_autocast() -> None:
    """Under autocast, q and k in float32 (after RoPE) next to a bf16 v attend in bf16, as torch's SDPA would."""
    meta = SequenceMetadata.from_lengths([3, 4])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = varlen_attention(q, k, v.bfloat16(), meta)
    same = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, same)
    with pytest.raises(ConfigError, match="must share one dtype outside autocast"):
        varlen_attention(q, k, v.bfloat16(), meta)
