"""Grouped GEMM without host syncs in every dtype the precision plugins produce: padded grouped_mm and Triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.experts import expert_swiglu, grouped_mm_supported
from lightning_llmfast.moe.grouped_fallback import grouped_gemm_triton, triton_grouped_swiglu
from lightning_llmfast.moe.kernels import triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(torch.device("cpu")), reason="the Triton kernels need TRITON_INTERPRET=1 on CPU"
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def _offsets(sizes: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _reference(x: torch.Tensor, sizes: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The per-expert loop in float64 (rows after sum(sizes) are padding: zeros)."""
    out, start = torch.zeros(x.shape[0], down.shape[-1], dtype=torch.float64, device=x.device), 0
    for e, n in enumerate(sizes):
        gate, up = (x[start : start + n].double() @ gate_up[e].double()).chunk(2, -1)
        out[start : start + n] = (F.silu(gate) * up) @ down[e].double()
        start += n
    return out


def _inputs(sizes: list[int], hidden: int, ffn: int, dtype: torch.dtype, pad: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(sum(sizes) * 31 + hidden + ffn)
    x = torch.randn(sum(sizes) + pad, hidden, generator=gen).to(device, dtype).requires_grad_()
    gate_up = (0.5 * torch.randn(len(sizes), hidden, 2 * ffn, generator=gen)).to(device, dtype).requires_grad_()
    down = (0.5 * torch.randn(len(sizes), ffn, hidden, generator=gen)).to(device, dtype).requires_grad_()
    return x, gate_up, down


def _check(fn, sizes: list[int], hidden: int, ffn: int, dtype: torch.dtype, pad: int = 0, device: str = "cpu"):
    """Outputs and gradients of ``fn(x, offsets, gate_up, down)`` equal the float64 loop's; 0 host syncs."""
    x, gate_up, down = _inputs(sizes, hidden, ffn, dtype, pad, device)
    offsets = _offsets(sizes, device)
    grad = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    with SyncCounter(device=device) as sc:
        y = fn(x, offsets, gate_up, down)
        y.backward(grad)
    assert sc.num_syncs == 0, sc.syncs
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_up, down)]
    expected = _reference(leaves[0], sizes, leaves[1], leaves[2])
    expected.backward(grad.double())
    tol = TOL[dtype]
    # 16-bit results round the intermediate activations: the tolerance scales with the largest value
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * max(1.0, float(expected.abs().max())))
    for got, want in zip((x, gate_up, down), leaves):
        scale = max(1.0, float(want.grad.abs().max()))
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol, atol=tol * scale)
    assert torch.equal(y[sum(sizes) :].double(), torch.zeros(pad, hidden, dtype=torch.float64, device=device))


SHAPES = [([3, 0, 5, 1], 12, 10), ([0, 0, 7], 6, 5), ([1], 3, 7), ([2, 2, 13], 12, 12), ([0, 0, 0], 10, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("sizes", "hidden", "ffn"), SHAPES)
def test_unaligned_sizes_go_through_padded_grouped_mm_without_syncs(sizes, hidden, ffn, dtype) -> None:
    x, gate_up, down = _inputs(sizes, hidden, ffn, dtype)
    if hidden % (16 // x.element_size()) or ffn % (16 // x.element_size()):
        assert not grouped_mm_supported(x, gate_up, down)  # the case the padding exists for

    def experts(x, offsets, gate_up, down):
        return expert_swiglu(ExpertRows(x, offsets, True, "torch"), gate_up, down)

    _check(experts, sizes, hidden, ffn, dtype, pad=3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("sizes", "hidden", "ffn"), [([3, 0, 40, 1], 12, 10), ([0, 0, 7], 33, 5), ([0, 0], 4, 4)])
def test_triton_grouped_swiglu_matches_the_loop_without_syncs(sizes, hidden, ffn, dtype) -> None:
    _check(lambda x, o, g, d: triton_grouped_swiglu(x, o, g, d, F.silu), sizes, hidden, ffn, dtype, pad=2)


@needs_triton
def test_triton_grouped_gemm_takes_transposed_weights_and_any_offset_dtype() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5, generator=gen)
    w = torch.randn(2, 17, 5, generator=gen).transpose(1, 2)  # (E, K=5, N=17), not contiguous
    for dtype in (torch.int32, torch.int64):
        y = grouped_gemm_triton(x, w, torch.tensor([0, 4, 9], dtype=dtype))
        torch.testing.assert_close(y, torch.cat([x[:4] @ w[0], x[4:] @ w[1]]), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_grouped_swiglu_every_precision_is_sync_free(dtype: torch.dtype, cuda_device: torch.device) -> None:
    def experts(x, offsets, gate_up, down):
        return expert_swiglu(ExpertRows(x, offsets, True, "triton"), gate_up, down)

    device = str(cuda_device)
    x, gate_up, down = _inputs([2, 3], 12, 10, dtype, device=device)
    experts(x, _offsets([2, 3], device), gate_up, down)  # lazy CUDA/Triton initialisation may read the device
    _check(experts, [37, 0, 250, 5], 64, 96, dtype, pad=11, device=device)
    _check(experts, [3, 0, 5, 1], 12, 10, dtype, pad=3, device=device)
