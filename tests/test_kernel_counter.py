"""KernelCounter: ATen ops that launch a kernel plus Triton launches, the interpreter's own work left out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_llmfast.bench.kernels import NON_KERNEL_OPS, KernelCounter
from lightning_llmfast.moe.grouped_fallback import grouped_gemm_triton
from lightning_llmfast.moe.kernels import triton_available

# (case, workload on a (4, 6) tensor, expected kernel ops)
KNOWN: list[tuple[str, Any, dict[str, int]]] = [
    ("views and aliases", lambda x: (x.view(2, 12), x.t(), x[1:], x[:, None], x.expand(2, 4, 6), x.detach()), {}),
    ("splits", lambda x: (x.unbind(0), x.chunk(2, 1), x.narrow(0, 0, 2), x.transpose(0, 1), x.permute(1, 0)), {}),
    ("contiguous reshape", lambda x: x.reshape(24), {}),
    ("bare allocations", lambda x: (torch.empty(3), torch.empty_like(x), x.new_empty(5)), {}),
    ("copying reshape", lambda x: x.t().reshape(24), {"clone": 1}),
    ("matmul and pointwise", lambda x: (x @ x.t()).relu() + 1, {"mm": 1, "relu": 1, "add": 1}),
    (
        "fills",
        lambda x: (torch.zeros(3), torch.ones_like(x), torch.full((2,), 1.0)),
        {"zeros": 1, "ones_like": 1, "full": 1},
    ),
    ("cast and gather", lambda x: x.double().index_select(0, torch.tensor([2, 0])), {"_to_copy": 1, "index_select": 1}),
]


@pytest.mark.parametrize(("case", "workload", "expected"), KNOWN, ids=[k[0] for k in KNOWN])
def test_kernel_ops_on_known_ops(case: str, workload: Any, expected: dict[str, int]) -> None:
    x = torch.randn(4, 6)
    with KernelCounter() as kc:
        workload(x)
    assert dict(kc.kernel_ops) == expected, case
    assert kc.kernels == sum(expected.values()) and not kc.triton_launches
    assert set(kc.counts) - set(kc.kernel_ops) <= NON_KERNEL_OPS


def test_backward_kernels_are_counted() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    with KernelCounter() as kc:
        (x * 2).sum().backward()
    # forward mul and sum; backward: the seed (ones_like), sum's expand (a view), mul's grad, the accumulation
    assert kc.kernel_ops["mul"] == 2 and kc.kernel_ops["sum"] == 1 and kc.kernel_ops["ones_like"] == 1
    assert "expand" not in kc.kernel_ops and kc.counts["expand"] == 1


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="Triton kernels need TRITON_INTERPRET=1 on CPU")
def test_triton_launches_count_once_and_the_interpreter_work_not_at_all() -> None:
    x, w = torch.randn(9, 5), torch.randn(3, 5, 7)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    with KernelCounter() as kc:
        y = grouped_gemm_triton(x, w, offsets)
    assert dict(kc.triton_launches) == {"_grouped_gemm_kernel": 1}
    assert dict(kc.kernel_ops) == {"new_zeros": 1}  # the output buffer; the interpreter's copies are not kernels
    assert kc.kernels == 2
    with KernelCounter() as outer, KernelCounter() as inner:
        grouped_gemm_triton(x.requires_grad_(), w.requires_grad_(), offsets).sum().backward()
    expected = {"_grouped_gemm_kernel": 2, "_grouped_wgrad_kernel": 1}  # forward, input grad, weight grad
    assert dict(outer.triton_launches) == dict(inner.triton_launches) == expected
    torch.testing.assert_close(y, torch.cat([x[:4] @ w[0], x[4:] @ w[2]]).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="Triton kernels need TRITON_INTERPRET=1 on CPU")
def test_custom_ops_are_opened_and_their_triton_launches_counted_once() -> None:
    from lightning_llmfast.moe.token_rows import permute_rows

    x, tokens = torch.randn(5, 4), torch.tensor([4, 0, 0, 2])
    positions = torch.tensor([[1, 2], [0, 0], [3, 3], [0, 0], [0, 0]])
    with KernelCounter() as kc:
        rows = permute_rows.op(x, tokens, None, positions, None, "triton")  # the registered custom op
    assert dict(kc.triton_launches) == {"_gather_rows_kernel": 1}
    assert "permute_rows" not in kc.kernel_ops and kc.kernels == 1
    torch.testing.assert_close(rows, x[tokens], rtol=0, atol=0)


def test_the_grouped_mm_custom_op_counts_as_the_one_aten_grouped_mm_it_wraps() -> None:
    from lightning_llmfast.moe.expert_ops import grouped_mm

    x, w = torch.randn(9, 8), torch.randn(3, 8, 4)
    ends = torch.tensor([4, 4, 9], dtype=torch.int32)
    with KernelCounter() as kc:
        y = grouped_mm(x, w, ends)
    assert dict(kc.kernel_ops) == {"_grouped_mm": 1}
    torch.testing.assert_close(y, torch.cat([x[:4] @ w[0], x[4:] @ w[2]]), rtol=1e-6, atol=1e-6)
