"""``eager_custom_op`` falls back to the registered op (with a debug log) when torch lacks an internal it reads."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_llmfast import _autograd
from lightning_llmfast._autograd import eager_custom_op


@torch.library.custom_op("llmfast_test::cube_sum", mutates_args=())
def _cube_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.pow(3) + y


@_cube_sum.register_fake
def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: object, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return 3 * x.square() * grad, grad


_cube_sum.register_autograd(_backward, setup_context=_setup)


def _check_values_and_grads(fn: object) -> None:
    """``fn`` against the formula in float64 on fresh awkward shapes: value x^3 + y, gradients 3 x^2 and 1."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 3, generator=g, requires_grad=True)
    y = torch.randn(7, 3, generator=g, requires_grad=True)
    out = fn(x, y)  # type: ignore[operator]
    out.mul(torch.arange(21.0).view(7, 3)).sum().backward()
    weight = torch.arange(21.0, dtype=torch.float64).view(7, 3)
    xd = x.detach().double()
    torch.testing.assert_close(out.detach().double(), xd.pow(3) + y.detach().double())
    torch.testing.assert_close(x.grad.double(), 3 * xd.square() * weight)
    torch.testing.assert_close(y.grad.double(), weight)


def test_this_torch_has_every_internal_and_the_fast_path_is_taken() -> None:
    assert _autograd._missing_torch_state() == []
    fast = eager_custom_op(_cube_sum)
    assert fast is not _cube_sum and fast.op is _cube_sum  # type: ignore[attr-defined]
    _check_values_and_grads(fast)


@pytest.mark.parametrize(
    ("module", "name"), [(torch._C, "_len_torch_dispatch_stack"), (torch.autograd.forward_ad, "_current_level")]
)
def test_a_missing_torch_global_falls_back_to_the_registered_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, module: object, name: str
) -> None:
    monkeypatch.delattr(module, name)
    missing = _autograd._missing_torch_state()  # what the import-time check finds on such a torch
    assert len(missing) == 1 and missing[0].endswith(f".{name}")
    monkeypatch.setattr(_autograd, "_MISSING_TORCH_STATE", missing)
    with caplog.at_level(logging.DEBUG, logger="lightning_llmfast._autograd"):
        wrapped = eager_custom_op(_cube_sum)
    assert wrapped is _cube_sum
    assert name in caplog.text and "stays the registered op" in caplog.text
    monkeypatch.undo()  # the registered op runs with torch whole again
    _check_values_and_grads(wrapped)


@pytest.mark.parametrize("name", ["_init_fn", "_vmap_fn", "_backend_fns", "_disabled_kernel"])
def test_a_missing_custom_op_attribute_falls_back_to_the_registered_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    @torch.library.custom_op(f"llmfast_test::square{name}", mutates_args=())
    def square(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.pow(3) + y

    square.register_autograd(_backward, setup_context=_setup)
    monkeypatch.delattr(square, name)
    with caplog.at_level(logging.DEBUG, logger="lightning_llmfast._autograd"):
        wrapped = eager_custom_op(square)
    assert wrapped is square
    assert name in caplog.text
    monkeypatch.undo()
    _check_values_and_grads(wrapped)
