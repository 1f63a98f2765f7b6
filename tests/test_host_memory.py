"""Large CPU buffers of the references on huge pages: advised only from 32 MiB, only whole pages inside the buffer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_llmfast.moe.kernels import host_memory
from lightning_llmfast.moe.kernels.host_memory import empty_rows

MIB = 1 << 20


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` in this process."""
    region, huge = None, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            low, high = (int(v, 16) for v in fields[0].split("-"))
            region = low <= address < high
        elif region and fields[0] == "AnonHugePages:":
            huge += int(fields[1])
    return huge


def test_only_large_cpu_buffers_are_advised_and_only_their_own_whole_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    small = empty_rows(32 * MIB // 4 - 1, dtype=torch.float32, device=torch.device("cpu"))
    assert not calls and small.shape == (32 * MIB // 4 - 1,) and small.dtype == torch.float32
    large = empty_rows(8193, 1024, dtype=torch.float32, device=torch.device("cpu"))
    assert large.shape == (8193, 1024) and large.dtype == torch.float32 and large.is_contiguous()
    ((start, length, advice),) = calls
    page = host_memory.mmap.PAGESIZE
    end = large.data_ptr() + large.numel() * large.element_size()
    assert advice == 14 and start % page == 0 and length % page == 0
    assert large.data_ptr() <= start < start + length <= end and end - (start + length) < page
    assert start - large.data_ptr() < page


def test_a_large_buffer_is_backed_by_huge_pages_where_the_kernel_offers_them() -> None:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are not available on this machine")
    buffer = empty_rows(64 * MIB // 4, dtype=torch.float32, device=torch.device("cpu"))
    buffer.fill_(1.0)  # faulted in now
    assert _huge_kib(buffer.data_ptr() + 32 * MIB) >= 2048, "no huge page behind a 64 MiB buffer advised MADV_HUGEPAGE"
    assert float(buffer.sum()) == buffer.numel()
