"""The MoE custom ops' eager fast path (``eager_custom_op``) against the registered ops it stands in for.

Same outputs and every gradient, bit for bit, on awkward routings (one token, a prime count, no tokens, capacity
drops, one expert taking every token); the implementation alone without grad; the registered op under a dispatch
mode or ``torch.compile``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_llmfast._autograd import _seen_by_more_than_eager, eager_custom_op
from lightning_llmfast.bench import OpCounter
from lightning_llmfast.moe import route
from lightning_llmfast.moe.routing import RoutingPlan

_rows = importlib.import_module("lightning_llmfast.moe.token_rows")
_ops = importlib.import_module("lightning_llmfast.moe.expert_ops")

H, FFN, E, K = 16, 8, 4, 2


def _plan(num_tokens: int, case: str) -> RoutingPlan:
    g = torch.Generator().manual_seed(num_tokens * 7 + len(case))
    logits = torch.randn(num_tokens, E, generator=g)
    if case == "one_expert":
        logits[:, 0] += 100.0  # every token's first choice
    return route(logits, K, capacity_factor=0.5 if case == "capacity" else None, validate=False)


def _cases(plan: RoutingPlan, backend: str) -> list[tuple[Callable[..., Any], str, tuple[Any, ...]]]:
    """(eager callable, registered op name, args) for every op with autograd, as the MoE block calls them."""
    idx = _rows.plan_indices(plan)
    g = torch.Generator().manual_seed(3)
    t, r = plan.num_tokens, plan.num_rows
    x = torch.randn(t, H, generator=g, requires_grad=True)
    rows = torch.randn(r, H, generator=g, requires_grad=True)
    weights = plan.weights.detach().clone().requires_grad_()
    kept = plan.kept if plan.capacity is not None else None
    mask = kept.float() if kept is not None else None
    ends = plan.offsets[1:].to(torch.int32)
    gate_up_w = torch.randn(E, H, 2 * FFN, generator=g, requires_grad=True)
    gate_up = torch.randn(r, 2 * FFN, generator=g, requires_grad=True)
    down = torch.randn(E, FFN, H, generator=g, requires_grad=True)
    scale = torch.rand(r, generator=g, requires_grad=True)
    return [
        (_rows.permute_rows, "permute_rows", (x, idx.tokens, idx.num_valid, idx.positions, mask, backend)),
        (_rows._unpermute_rows, "unpermute_rows", (rows, weights, idx.pairs, idx.tokens, idx.positions, backend)),
        (_rows.sum_rows, "sum_rows", (rows, idx.positions, mask, idx.tokens, idx.num_valid, backend)),
        (_rows.pair_values_to_rows, "pair_values_to_rows", (weights, idx.pairs, idx.positions, kept)),
        (_ops.grouped_mm, "grouped_mm", (rows, gate_up_w, ends)),
        (_ops.silu_glu, "swiglu", (gate_up,)),
        (_ops.swiglu_down, "swiglu_down", (gate_up, down, ends, scale, backend)),
        (
            _ops.gather_grouped_mm,
            "permute_grouped_mm",
            (x, x.detach(), idx.tokens, idx.num_valid, idx.positions, mask, gate_up_w, ends, backend),
        ),
    ]


def _fresh(args: tuple[Any, ...]) -> list[Any]:
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def _output_and_grads(fn: Callable[..., Any], args: list[Any], grad: torch.Tensor | None) -> list[torch.Tensor]:
    out = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out, leaves, out if grad is None else grad, allow_unused=True)
    return [out.detach(), *(torch.zeros(()) if g is None else g for g in grads)]


@pytest.mark.parametrize(
    ("num_tokens", "case"), [(1, "dropless"), (13, "dropless"), (13, "capacity"), (0, "dropless"), (7, "one_expert")]
)
def test_eager_path_gives_the_registered_ops_outputs_and_gradients_bit_for_bit(
    num_tokens: int, case: str, kernel_backend: str
) -> None:
    for eager, name, args in _cases(_plan(num_tokens, case), kernel_backend):
        registered = getattr(torch.ops.lightning_llmfast, name).default
        grad = torch.randn_like(registered(*_fresh(args)))
        expected = _output_and_grads(registered, _fresh(args), grad)
        got_args = _fresh(args)
        assert "eager" in type(eager(*got_args).grad_fn).__name__, name  # the fast path ran, not the dispatcher
        got = _output_and_grads(eager, got_args, grad)
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), name
        with torch.no_grad():
            plain = eager(*args)  # the implementation alone: no autograd node at all
        assert plain.grad_fn is None and torch.equal(plain, expected[0]), name


def test_eager_path_keeps_the_registered_op_under_a_dispatch_mode_and_compile() -> None:
    plan = _plan(5, "dropless")
    _, name, args = next(c for c in _cases(plan, "torch") if c[1] == "sum_rows")
    with OpCounter() as ops:  # a dispatch mode (fake tensors, counters) sees the op as registered
        _rows.sum_rows(*args)
    assert ops.counts.get(name) == 1

    def summed(*inputs: Any) -> torch.Tensor:
        return _rows.sum_rows(*inputs)

    compiled = torch.compile(summed, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*_fresh(args)), torch.ops.lightning_llmfast.sum_rows.default(*_fresh(args)))


def test_eager_custom_op_without_autograd_calls_the_op_when_a_gradient_is_needed() -> None:
    """An op with no registered autograd (here a fresh one) keeps the dispatcher's behaviour: autograd through it
    fails as the registered op does, and without grad it runs the implementation directly."""

    @torch.library.custom_op("lightning_llmfast_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    fast = eager_custom_op(double)
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(fast(x), x * 2)
    with pytest.raises(RuntimeError, match="autograd"):
        fast(x).sum().backward()


def _seen(x: torch.Tensor) -> bool:
    return _seen_by_more_than_eager((x, None, "torch"))


def test_the_registered_op_runs_wherever_more_than_eager_execution_would_see_the_call() -> None:
    """Tracers, transforms, modes and the profiler see the op as registered (an opaque op with its own rules)."""
    x = torch.randn(3)
    assert not _seen(x)
    seen_by: dict[str, bool] = {}
    torch.func.vmap(lambda row: seen_by.setdefault("vmap", _seen(row)) and row)(torch.randn(2, 3))
    torch.func.grad(lambda v: (seen_by.setdefault("func.grad", _seen(v)), v.sum())[1])(x)
    with torch.autograd.forward_ad.dual_level():
        seen_by["forward AD"] = _seen(torch.autograd.forward_ad.make_dual(x, torch.ones(3)))
    with torch.profiler.profile():
        seen_by["profiler"] = _seen(x)
    with OpCounter():
        seen_by["dispatch mode"] = _seen(x)
    with torch.device("cpu"):  # a function mode, as torch.set_default_device installs
        seen_by["function mode"] = _seen(x)
    torch.jit.trace(lambda v: (seen_by.setdefault("jit.trace", _seen(v)), v * 2)[1], (x,))
    seen_by["meta tensor"] = _seen(torch.empty(3, device="meta"))
    seen_by["fx proxy"] = False
    torch.fx.symbolic_trace(lambda v: seen_by.update({"fx proxy": _seen_by_more_than_eager((v,))}) or v)
    assert all(seen_by.values()) and len(seen_by) == 9, seen_by
    assert not _seen(x)


def test_a_registration_after_wrapping_and_keyword_calls_go_to_the_registered_op() -> None:
    @torch.library.custom_op("lightning_llmfast_test::triple", mutates_args=())
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    triple.register_autograd(lambda ctx, grad: grad * 3, setup_context=lambda ctx, inputs, output: None)
    fast = eager_custom_op(triple)
    assert fast.op is triple and fast.__name__ == "triple"
    x = torch.randn(4, requires_grad=True)
    assert "eager" in type(fast(x).grad_fn).__name__
    assert "eager" not in type(fast(x=x).grad_fn).__name__  # keywords: the registered op, which takes them
    triple.register_kernel("cpu")(lambda x: x * 5)  # the dispatcher now runs this kernel on CPU
    assert torch.equal(fast(x), x * 5) and "eager" not in type(fast(x).grad_fn).__name__
