"""The CPU buffer pool of the MoE references: reused only once no tensor uses the memory, bounded, switchable."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_llmfast.moe.kernels import host_memory
from lightning_llmfast.moe.kernels.host_memory import empty_rows, pooling

CPU = torch.device("cpu")
KIB = 1 << 10


@pytest.fixture(autouse=True)
def _small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool from 64 KiB, and an empty pool for each test."""
    monkeypatch.setattr(host_memory, "MIN_POOLED_BYTES", 64 * KIB)
    host_memory.release()
    yield
    host_memory.release()


def _rows(n: int = 64) -> torch.Tensor:
    return empty_rows(n, 256, dtype=torch.float32, device=CPU)  # n KiB


def test_only_buffers_from_the_threshold_come_from_the_pool() -> None:
    small = _rows(63)
    assert host_memory.held_bytes() == 0 and small.shape == (63, 256)
    large = _rows(64)
    assert large.shape == (64, 256) and large.dtype == torch.float32 and large.is_contiguous()
    assert host_memory.held_bytes() == 64 * KIB
    assert empty_rows(64, 256, dtype=torch.float32, device=torch.device("meta")).device.type == "meta"
    assert host_memory.held_bytes() == 64 * KIB


def test_a_buffer_is_handed_out_again_only_when_no_view_of_it_lives() -> None:
    first = _rows()
    first.fill_(3.0)
    address = first.data_ptr()
    view = first[5:].t()  # the base tensor dies, a view keeps its memory
    del first
    second = _rows()
    assert second.data_ptr() != address
    assert bool((view == 3.0).all()), "a buffer still viewed was written over"
    del view
    third = _rows()
    assert third.data_ptr() == address
    assert host_memory.held_bytes() == 2 * 64 * KIB


def test_a_buffer_saved_for_backward_stays_in_use_until_backward_frees_it() -> None:
    weight = torch.randn(64, 256, requires_grad=True)
    saved = _rows().copy_(torch.randn(64, 256))
    expected = saved.clone()
    address = saved.data_ptr()
    loss = (weight * saved).sum()  # mul saves `saved` for the weight's gradient
    del saved
    assert _rows().data_ptr() != address
    loss.backward()
    torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)
    del loss
    assert _rows().data_ptr() == address


def test_buffers_are_matched_by_size_and_idle_bytes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "MAX_IDLE_BYTES", 3 * 64 * KIB)
    buffers = [_rows(64 * (i + 1)) for i in range(3)]  # 64, 128, 192 KiB
    assert host_memory.held_bytes() == 6 * 64 * KIB
    addresses = [b.data_ptr() for b in buffers]
    del buffers
    # A new size: the oldest idle buffers are unmapped until at most 3 x 64 KiB stay idle.
    fresh = _rows(64 * 5)
    assert host_memory.held_bytes() == (3 + 5) * 64 * KIB  # the 192 KiB buffer idle, 320 KiB in use
    again = _rows(64 * 3)
    assert again.data_ptr() == addresses[2] and fresh.data_ptr() not in addresses


def test_release_unmaps_idle_buffers_and_keeps_those_in_use() -> None:
    kept = _rows().fill_(1.5)
    dropped = _rows()
    del dropped
    assert host_memory.release() == 1
    assert host_memory.held_bytes() == 64 * KIB and bool((kept == 1.5).all())


def test_pooling_off_gives_fresh_buffers_in_this_thread_only() -> None:
    other_thread: list[torch.Tensor] = []
    with pooling(False):
        off = _rows()
        assert host_memory.held_bytes() == 0 and not host_memory.pooled((64, 256), torch.float32)
        thread = threading.Thread(target=lambda: other_thread.append(_rows()))
        thread.start()
        thread.join()
        assert host_memory.held_bytes() == 64 * KIB  # the other thread still pools
        with pooling(True):
            inner = _rows()
            assert host_memory.held_bytes() == 2 * 64 * KIB
        assert not host_memory.pooled((64, 256), torch.float32)  # restored on exit
    assert host_memory.pooled((64, 256), torch.float32) and off.shape == inner.shape == other_thread[0].shape


def test_the_combine_sums_come_from_the_pool_at_the_threshold() -> None:
    from lightning_llmfast.moe.kernels import combine_rows_reference

    rows = torch.randn(6, 4096)  # 16 KiB a row; not from the pool (torch.randn)
    positions = torch.tensor([[0, 3], [1, 4], [2, 5]])
    for tokens, pooled in ((3, False), (4, True)):  # sums of 16 KiB a token: 48 KiB (below 64 KiB), then 64 KiB
        host_memory.release()
        index = positions[torch.arange(tokens) % 3]
        out = combine_rows_reference(rows, index, torch.full(index.shape, 0.5))
        assert (host_memory.held_bytes() == 64 * KIB) == pooled
        torch.testing.assert_close(out, 0.5 * (rows[index[:, 0]] + rows[index[:, 1]]), rtol=0, atol=0)
