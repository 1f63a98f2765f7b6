"""Memory-lean RMSNorm: forward and both gradients against a float64 reference; what it saves for backward."""

from __future__ import annotations

import pytest
import torch

from lightning_llmfast.models.rmsnorm import rms_norm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5, 13), (2, 31, 64), (97, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(*shape, generator=g).to(dtype)
    y = rms_norm(x, w, 1e-5)
    gx, gw = torch.autograd.grad(y, (x, w), upstream)
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y_ref = _reference(x_ref, w_ref, 1e-5)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), upstream.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(gx.double(), gx_ref, **tol)
    torch.testing.assert_close(gw.double(), gw_ref, **tol)


def test_bf16_input_keeps_fp32_statistics_and_dtype() -> None:
    x = (torch.randn(4, 33) * 50).bfloat16().requires_grad_()
    w = torch.ones(33, dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _reference(x.detach(), w.detach(), 1e-5), rtol=1e-2, atol=1e-2)
    gx, gw = torch.autograd.grad(y.float().sum(), (x, w))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16 and torch.isfinite(gx.float()).all()


def test_saves_the_input_and_inverse_rms_only() -> None:
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, w, 1e-5)
    # x itself (a parameter-like leaf here), the weight and the (64, 1) inverse RMS: no (64, 128) normalised copy
    assert sorted(saved.values()) == sorted([64 * 128 * 4, 128 * 4, 64 * 4])
