"""Host-side split sizes reach the device from pinned memory without blocking the host (expert_parallel/exchange.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.expert_parallel.exchange import stage_to_device


class _Copies(TorchDispatchMode):
    """Records ``(source device, destination device, non_blocking)`` of every ``_to_copy``."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ == "_to_copy" and "device" in kwargs:
            dst = torch.device(kwargs["device"]).type
            self.copies.append((args[0].device.type, dst, bool(kwargs.get("non_blocking"))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("values", [[0], [3, 1, 4, 1, 5, 9, 2, 6], [2**40, -1]])
def test_staged_values_arrive_with_one_non_blocking_copy(values: list[int]) -> None:
    with _Copies() as spy:
        staged = stage_to_device(values, torch.device("meta"))  # meta stands for the accelerator here
    assert staged.device.type == "meta" and staged.dtype == torch.int64 and staged.shape == (len(values),)
    assert spy.copies == [("cpu", "meta", True)]
    on_host = stage_to_device(values, torch.device("cpu"))
    assert on_host.tolist() == values and on_host.dtype == torch.int64


@pytest.mark.cuda
def test_staging_does_not_block_the_host_where_a_plain_tensor_does() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    with SyncCounter(device=device) as staged:
        out = stage_to_device([5, 7, 11], device)
    with SyncCounter(device=device) as plain:
        torch.tensor([5, 7, 11], dtype=torch.int64, device=device)
    assert staged.num_syncs == 0, staged.syncs
    assert plain.num_syncs >= 1
    assert out.cpu().tolist() == [5, 7, 11]
