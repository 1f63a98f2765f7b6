"""The SwiGLU activation kernels (forward with the routing weight, backward with the gate/up gradient, the product
again and the weights' gradient): Triton and the PyTorch reference against float64 autograd of the formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.moe.kernels import swiglu, triton_available
from lightning_llmfast.moe.kernels.swiglu import swiglu_backward, swiglu_forward

BACKENDS = ["torch"] + (["triton"] if triton_available(torch.device("cpu")) else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("rows", "ffn"), [(0, 4), (1, 1), (7, 13), (130, 64), (33, 257)])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_forward_and_backward_match_float64_autograd(backend, rows, ffn, scaled, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + ffn)
    gate_up = (torch.randn(rows, 2 * ffn, generator=gen) * 3).to(dtype)
    scale = torch.rand(rows, generator=gen) if scaled else None
    if scaled and rows > 2:
        scale[1] = 0  # a dropped pair's weight
    grad = torch.randn(rows, ffn, generator=gen).to(dtype)
    leaf = gate_up.double().requires_grad_()
    scale64 = None if scale is None else scale.double().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    product = F.silu(gate) * up
    expected = product if scale64 is None else product * scale64[:, None]
    expected.backward(grad.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    out = swiglu_forward(gate_up, scale, backend=backend)
    assert out.dtype == dtype and out.shape == (rows, ffn)
    torch.testing.assert_close(out.double(), expected.detach(), **tol)
    grad_gate_up, again, dots = swiglu_backward(grad, gate_up, scale, backend=backend)
    assert grad_gate_up.dtype == dtype and grad_gate_up.is_contiguous()
    torch.testing.assert_close(grad_gate_up.double(), leaf.grad, **tol)
    torch.testing.assert_close(again.double(), expected.detach(), **tol)
    assert dots.dtype == torch.float32 and dots.shape == (rows,)
    expected_dots = (product * grad.double()).sum(-1).detach()  # the weights' gradient
    # a sum over ffn of rounded products: the tolerance grows with its magnitude
    width = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 0.05 * ffn**0.5}
    torch.testing.assert_close(dots.double(), expected_dots, **width)
    if scale64 is not None:
        torch.testing.assert_close(dots.double(), scale64.grad, **width)
    skipped = swiglu_backward(grad, gate_up, scale, need_product=False, need_dots=False, backend=backend)
    assert skipped[1] is None and skipped[2] is None
    torch.testing.assert_close(skipped[0], grad_gate_up, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_reads_strided_gate_up(backend):
    gate_up = torch.randn(9, 40)[:, :24]  # rows with a stride of 40
    out = swiglu_forward(gate_up, backend=backend)
    gate, up = gate_up.contiguous().chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_down_passes_opcheck(backend):
    """Schema, fake implementation and autograd (also as a compiled backward traces it) of the op that uses them."""
    import lightning_llmfast.moe.experts  # noqa: F401  (registers the op)

    gate_up, down = torch.randn(7, 16, requires_grad=True), torch.randn(2, 8, 8, requires_grad=True)
    scale, ends = torch.rand(7, requires_grad=True), torch.tensor([3, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lightning_llmfast.swiglu_down.default, (gate_up, down, ends, scale, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("rows", "ffn"), [(1, 1), (7, 13), (130, 64)])
@pytest.mark.parametrize("scaled", [False, True])
def test_product_written_over_the_gradient_matches_a_fresh_product(backend, rows, ffn, scaled):
    """``product_in_grad``: the product, gate/up gradient and dots of a new buffer, the product left in ``grad``."""
    gen = torch.Generator().manual_seed(rows + ffn)
    gate_up = torch.randn(rows, 2 * ffn, generator=gen) * 3
    scale = torch.rand(rows, generator=gen) if scaled else None
    grad = torch.randn(rows, ffn, generator=gen)
    expected = swiglu_backward(grad, gate_up, scale, backend=backend)
    scratch = grad.clone()
    got = swiglu_backward(scratch, gate_up, scale, backend=backend, product_in_grad=True)
    assert got[1] is scratch
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Through the opaque op: the caller's gradient is left alone unless it is declared scratch.
    kept = grad.clone()
    via_op = swiglu.swiglu_grads(kept, gate_up, scale, need_product=True, need_dots=True, backend=backend)
    assert torch.equal(kept, grad) and via_op[1] is not kept
    for a, b in zip(via_op, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
