"""The CPU grouped GEMM into pooled buffers: the same bits as ``F.grouped_mm``, no host sync, buffers reused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.bench.counters import OpCounter, SyncCounter
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.kernels import host_memory
from lightning_llmfast.moe.kernels.host_gemm import grouped_mm

# (rows, K, N, group sizes): empty groups, one group with every row, prime row counts, a single row, padding rows
# past the last end (left unwritten, as by F.grouped_mm). K and N are multiples of 4: ATen's grouped_mm, the
# reference, takes strides of 16 bytes only.
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # float32 results against float64
GROUPS = [
    (13, 8, 12, [0, 5, 0, 8]),
    (17, 4, 4, [17]),
    (1, 4, 8, [0, 1, 0]),
    (29, 8, 16, [3, 0, 0, 19, 7]),
    (20, 4, 12, [6, 0, 9]),  # rows 15..19 are padding
]


@pytest.fixture
def pool_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "MIN_POOLED_BYTES", 1)


@pytest.mark.parametrize(("rows", "k", "n", "sizes"), GROUPS)
def test_host_loop_has_the_bits_of_grouped_mm_in_both_layouts(rows, k, n, sizes, pool_everything) -> None:
    g = torch.Generator().manual_seed(rows * 7 + k)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    used = int(ends[-1])
    a, b = torch.randn(rows, k, generator=g), torch.randn(len(sizes), k, n, generator=g)
    grad = torch.randn(rows, n, generator=g)
    with OpCounter() as ops:
        out = grouped_mm(a, b, ends)
        weight_grad = grouped_mm(a.t(), grad, ends)
    assert ops.counts["host_grouped_mm"] == 2, "the host loop did not run"
    torch.testing.assert_close(out[:used], F.grouped_mm(a, b, offs=ends)[:used], rtol=0, atol=0)
    torch.testing.assert_close(weight_grad, F.grouped_mm(a.t(), grad, offs=ends), rtol=0, atol=0)
    # And against a loop written from the definition, in float64.
    start = 0
    for group, end in enumerate(ends.tolist()):
        torch.testing.assert_close(out[start:end].double(), a[start:end].double() @ b[group].double(), **FP32)
        expected = a[start:end].double().t() @ grad[start:end].double()
        torch.testing.assert_close(weight_grad[group].double(), expected, **FP32)
        start = end


def test_grouped_mm_is_aten_s_below_the_threshold_with_the_pool_off_and_where_autograd_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = torch.randn(8, 4), torch.randn(2, 4, 8)
    ends = torch.tensor([3, 8], dtype=torch.int32)
    with OpCounter() as ops:
        grouped_mm(a, b, ends)  # far below 32 MiB
    assert ops.counts["_grouped_mm"] == 1 and not ops.counts["host_grouped_mm"]
    monkeypatch.setattr(host_memory, "MIN_POOLED_BYTES", 1)
    with OpCounter() as ops, host_memory.pooling(False):
        grouped_mm(a, b, ends)
    assert ops.counts["_grouped_mm"] == 1 and not ops.counts["host_grouped_mm"]
    out = grouped_mm(a, b.requires_grad_(), ends)
    assert out.grad_fn is not None  # differentiable: ATen's op, which autograd knows


def test_block_on_the_pooled_path_has_the_same_bits_no_sync_and_reuses_its_buffers(pool_everything) -> None:
    """Every buffer of the block pooled: output and all gradients bit-identical to the unpooled block, zero host
    syncs, and from the second step on no new buffer (the pool holds the same bytes for 6 steps)."""
    torch.manual_seed(0)
    for capacity_factor in (None, 1.0):
        block = MoEBlock(MoEConfig.build(32, 48, 5, 2, capacity_factor=capacity_factor))
        x = torch.randn(37, 32, requires_grad=True)
        grads = []
        for pooled in (False, True):
            block.zero_grad(set_to_none=True)
            x.grad = None
            with host_memory.pooling(pooled):
                out = block(x)
                out.backward(torch.ones_like(out))
            grads.append([out.detach(), x.grad, *(p.grad for p in block.parameters())])
        for unpooled, pooled in zip(*grads):
            torch.testing.assert_close(pooled, unpooled, rtol=0, atol=0)
        held = []
        for _ in range(6):
            block.zero_grad(set_to_none=True)
            with SyncCounter() as sc:
                block(x).sum().backward()
            assert sc.num_syncs == 0, sc.syncs
            held.append(host_memory.held_bytes())
        assert held[0] > 0 and len(set(held[1:])) == 1, held
    host_memory.release()
