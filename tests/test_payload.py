"""Quantized all-to-all payloads: the e4m3 per-row bound, bf16 exactness, gradients, bytes on the wire, no host sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast import ConfigError
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.expert_parallel.payload import (
    DispatchPayload,
    dequantize_rows,
    exchange,
    quantize_rows,
    wire_row_bytes,
)


def _e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 ulp: 2**-4 relative for normals, 2**-10 * scale for subnormals (plus fp32 rounding slack)."""
    return torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale[:, None]) * (1 + 2.0**-20)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (0, 5), (3, 0), (31, 64)])
def test_fp8_rows_come_back_within_half_an_e4m3_ulp_of_the_row_scale(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64).float()
    if shape[0] >= 3 and shape[1]:
        x[0] = 0.0  # an all-zero row
        x[1] *= 1e-30  # tiny values: the scale follows the row, so they keep e4m3's relative precision
        x[2, 0] = 1e4  # one outlier: the rest of its row falls to e4m3's subnormals
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (shape[0],) and scale.dtype == torch.float32
    back = dequantize_rows(q, scale, torch.float32)
    # reference: the row's max maps to 448 exactly, and every element rounds to the nearest e4m3 value
    amax = x.double().abs().amax(dim=1) if shape[1] else torch.zeros(shape[0], dtype=torch.float64)
    assert torch.allclose(scale.double(), torch.where(amax > 0, amax / 448, 1.0), rtol=2**-23, atol=0)
    assert ((back - x).abs() <= _e4m3_bound(x, scale)).all()
    if shape[0] >= 3 and shape[1]:
        assert torch.equal(back[0], x[0]) and back[2, 0] == x[2, 0]  # zeros and the row max are exact


@pytest.mark.parametrize(
    ("wire", "hidden", "dtype", "expected"),
    [(None, 64, torch.float32, 256), ("bf16", 64, torch.float32, 128), ("fp8", 64, torch.float32, 68),
     (None, 8, torch.bfloat16, 16), ("fp8", 8, torch.bfloat16, 12)],
)  # fmt: skip
def test_wire_row_bytes(wire: str | None, hidden: int, dtype: torch.dtype, expected: int) -> None:
    assert wire_row_bytes(wire, hidden, dtype) == expected


def test_payload_config() -> None:
    assert DispatchPayload("fp8").combine == "bf16" and DispatchPayload().combine is None
    assert DispatchPayload("bf16", combine="fp32").combine is None
    for bad in ({"dispatch": "fp16"}, {"dispatch": "fp8", "combine": "fp8"}):
        with pytest.raises(ConfigError):
            DispatchPayload(**bad)


def _spy_all_to_all(sent: list[int]) -> Any:
    original = dist.all_to_all_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(inp.numel() * inp.element_size())
        return original(out, inp, *args, **kwargs)

    return spy


def _exchange_worker(rank: int, world: int) -> None:
    hidden = 24
    # uneven splits, and rank 1 sends nothing to rank 0 (so rank 0 receives from itself only)
    in_splits = [[3, 2], [0, 5]][rank]
    out_splits = [[3, 0], [2, 5]][rank]
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(sum(in_splits), hidden, generator=g) * torch.logspace(-3, 3, sum(in_splits))[:, None]
    x.requires_grad_(True)
    group = dist.group.WORLD
    plain = exchange(x.detach(), out_splits, in_splits, group, wire=None, grad_wire=None)
    sent: list[int] = []
    dist.all_to_all_single = _spy_all_to_all(sent)  # type: ignore[assignment]
    with SyncCounter() as counter:
        fp8 = exchange(x, out_splits, in_splits, group, wire="fp8", grad_wire="bf16")
        bf16 = exchange(x, out_splits, in_splits, group, wire="bf16", grad_wire="bf16")
    assert counter.num_syncs == 0, counter.syncs
    rows = sum(in_splits)
    assert sent == [rows * (hidden + 4), rows * 2 * hidden]  # fp8 + its scales: (H + 4) / 2H of bf16's bytes
    assert torch.equal(bf16, plain.bfloat16().float())  # bf16: exactly the rounded rows
    _, scale = quantize_rows(plain)
    assert ((fp8 - plain).abs() <= _e4m3_bound(plain, scale)).all()
    # gradients come back by the reverse exchange, in bf16
    weight = torch.randn(fp8.shape, generator=g)
    (fp8 * weight).sum().backward()
    expected = exchange(weight.bfloat16().float(), in_splits, out_splits, group, wire=None, grad_wire=None)
    assert torch.equal(x.grad, expected)


@pytest.mark.slow
def test_quantized_exchange_on_two_ranks() -> None:
    run_distributed(_exchange_worker, 2)
