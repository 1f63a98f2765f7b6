"""The pinned pool: slices of a few power-of-two chunks, sized by bytes (plan or first step), steady over a run whose
batch shapes vary, real pinned bytes counted, one warning when pinning fails; and the step's release of host
buffers never blocks the host (no ``event.synchronize()``, proven with fake events)."""

from __future__ import annotations

import gc
import logging
import os
import random
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig, PinnedBufferPool
from lightning_llmfast.offload.copier import CpuCopier
from lightning_llmfast.offload.pool import pinned_bytes

VOCAB = 32


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.numel() and b.data_ptr() < a.data_ptr() + a.numel()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slices_never_overlap_are_aligned_and_a_sized_pool_serves_any_mix_of_the_same_total(seed: int) -> None:
    rng = random.Random(seed)
    pool = PinnedBufferPool(headroom=1.5, pin_memory=False)
    first = [rng.choice([1, 255, 257, 4099, 70_001, 1 << 20]) for _ in range(40)]
    bufs = [pool.acquire(n) for n in first]
    assert all(b.numel() >= n and b.data_ptr() % 64 == 0 for b, n in zip(bufs, first))  # as a fresh allocation
    assert not any(_overlaps(a, b) for i, a in enumerate(bufs) for b in bufs[i + 1 :])
    for b in bufs:
        pool.release(b)
    pool.reserve_measured()
    size = pool.pool_bytes
    total = sum(-(-n // 256) * 256 for n in first)
    assert pool.capacity() >= 1.5 * total and pool.checked_out == 0
    for _ in range(20):  # other sizes, shuffled, the same or a smaller total: never grows
        sizes = first[:]
        rng.shuffle(sizes)
        sizes = [max(1, n - rng.randrange(0, 200)) for n in sizes]
        bufs = [pool.acquire(n) for n in sizes]
        assert not any(_overlaps(a, b) for i, a in enumerate(bufs) for b in bufs[i + 1 :])
        for b in bufs:
            pool.release(b)
    assert pool.pool_bytes == size and pool.grow_events == 0


def test_growth_after_sizing_is_logged_with_its_cause_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    pool = PinnedBufferPool(headroom=1.25, pin_memory=False)
    pool.release(pool.acquire(3 << 20))
    pool.reserve_measured()
    size = pool.pool_bytes
    with caplog.at_level(logging.WARNING, logger="lightning_llmfast.offload.pool"):
        bufs = [pool.acquire(3 << 20), pool.acquire(3 << 20)]  # twice the sized step
    assert pool.grow_events == 1 and pool.pool_bytes > size
    assert any("grew by" in r.message and "a step needed 6291456 bytes at once" in r.message for r in caplog.records)
    with pytest.warns(RuntimeWarning, match="grew 1 times"):
        assert pool.warn_growth()
    assert not pool.warn_growth()
    for b in bufs:
        pool.release(b)
    size = pool.pool_bytes
    bufs = [pool.acquire(3 << 20), pool.acquire(3 << 20)]  # the grown pool holds that step from now on
    assert pool.pool_bytes == size and pool.grow_events == 0


def test_chunks_are_powers_of_two_so_pool_bytes_are_the_real_pinned_bytes() -> None:
    for n in (1, 1 << 20, (1 << 20) + 1, 5_000_000, 3 << 30):
        assert pinned_bytes(n) >= n and pinned_bytes(n) & (pinned_bytes(n) - 1) == 0 and pinned_bytes(n) < 2 * n + 2
    pool = PinnedBufferPool(pin_memory=False)
    for n in (5_000_000, 3_000_000, 700_000):
        pool.acquire(n)
    chunks = [c.numel() for c in pool._chunks]
    assert all(c & (c - 1) == 0 for c in chunks) and pool.pool_bytes == sum(chunks)


def test_failed_pinning_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty

    def no_pinning(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if pin_memory:
            raise RuntimeError("cannot pin: no driver")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    pool = PinnedBufferPool(pin_memory=True)
    with pytest.warns(RuntimeWarning, match="pinning .* failed .*no driver.*synchronous") as caught:
        pool.acquire(3 << 20)
        pool.acquire(16 << 20)  # a second chunk: no second warning
    assert len([w for w in caught if "pinning" in str(w.message)]) == 1
    assert pool.stats()["pinned"] is False and pool.stats()["pool_buffers"] == 2


def test_reserve_sizes_by_bytes_and_rejects_bad_input() -> None:
    pool = PinnedBufferPool(headroom=2.0, pin_memory=False)
    pool.reserve(3 << 20)
    assert pool.capacity() >= 6 << 20 and pool.grow_events == 0
    pool.reserve(1 << 20)  # never shrinks, never adds when it fits
    assert pool.stats()["pool_buffers"] == 1
    with pytest.raises(OffloadError, match="nbytes"):
        pool.reserve(-1)


# ---------------------------------------------------------------------------------------------- release never blocks
class _Event:
    """A copy event that never completes on its own and counts host waits on it."""

    synchronized = 0

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        type(self).synchronized += 1


class _AsyncCopier(CpuCopier):
    """CPU copies that report CUDA-like events: ``done`` asks the event, ``wait_host`` synchronizes it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.device_waits = 0

    def copy(self, pairs: Any, to_host: bool, after: Any = ()) -> _Event:
        super().copy(pairs, to_host, after)
        return _Event()

    def mark_compute(self) -> _Event:
        return _Event()

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            self.device_waits += 1

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def _config(hidden: int = 16) -> MoEGPTConfig:
    return MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=hidden, n_layers=3, n_heads=2, n_kv_heads=1, ffn_size=2 * hidden, num_experts=4
    )


def _train(model: MoEGPT, off: ActivationOffloader | None, lengths: list[int], steps: int) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, lengths[step % len(lengths)]), generator=g)
        model.zero_grad(set_to_none=True)
        with off if off is not None else torch.enable_grad():
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
            loss.backward()
        out.append(([p.grad.clone() for p in model.parameters()], dict(off.stats) if off is not None else None))
    return out


@pytest.mark.parametrize("offload_layers", [None, "auto"])
def test_step_release_never_synchronizes_and_gradients_stay_bit_identical(offload_layers: Any) -> None:
    torch.manual_seed(0)
    model = MoEGPT(_config())
    expected = _train(model, None, [17, 5, 23], 4)
    torch.manual_seed(0)
    model = MoEGPT(_config())
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, force=True, offload_layers=offload_layers)
    )
    copiers: list[_AsyncCopier] = []
    off._make_copier = lambda device: copiers.append(_AsyncCopier(device)) or copiers[-1]  # type: ignore[method-assign]
    _Event.synchronized = 0
    got = _train(model, off, [17, 5, 23], 4)
    assert _Event.synchronized == 0  # no host wait in any step, although no event ever reports completion
    for (g_ref, _), (g_off, stats) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g_off))
        assert stats["checked_out"] == 0  # every host buffer is back at the step's end, ordered by device waits
    assert got[-1][1]["offloaded_bytes"] > 0 and copiers[0].device_waits > 0
    off.close()  # teardown may wait
    assert _Event.synchronized == 0  # nothing was left to wait for


# ---------------------------------------------------------------------------------------------- steady over a run
MODES: dict[str, dict[str, Any]] = {
    "all": {},
    "first_layer": {"offload_layers": 1},
    "auto": {"offload_layers": "auto"},
    "rebuild_gemms": {"rebuild": "norms+gemms"},
    "selective": {"offload_layers": 1, "recompute": "selective"},
}
# One epoch: the distinct batch shapes, in the order a shuffled loader might give them.
EPOCH = [24, 9, 31, 16, 27, 12]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _steady_run(mode: str, steps: int, hidden: int) -> tuple[list[int], dict[int, int], list[logging.LogRecord]]:
    torch.manual_seed(0)
    model = MoEGPT(_config(hidden))
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, **MODES[mode]))
    g = torch.Generator().manual_seed(1)
    sizes, rss = [], {}
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("lightning_llmfast.offload.pool").addHandler(handler)
    try:
        for step in range(steps):
            ids = torch.randint(0, VOCAB, (2, EPOCH[step % len(EPOCH)]), generator=g)
            with off:
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
                loss.backward()
            del loss
            model.zero_grad(set_to_none=True)
            sizes.append(off.stats["pool_bytes"])
            if step in (2 * len(EPOCH) - 1, steps - 1):
                gc.collect()
                rss[step] = _rss_bytes()
    finally:
        logging.getLogger("lightning_llmfast.offload.pool").removeHandler(handler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            off.close()
    return sizes, rss, records


@pytest.mark.parametrize("mode", list(MODES))
def test_pool_is_steady_after_the_first_epochs_shapes(mode: str) -> None:
    sizes, _, records = _steady_run(mode, 2 * len(EPOCH) + 1, hidden=16)
    first = len(EPOCH) + (1 if mode == "auto" else 0)  # "auto" measures in its first step
    assert sizes[first - 1] > 0 and len(set(sizes[first - 1 :])) == 1, sizes
    assert all("a step needed" in r.getMessage() for r in records)  # any growth said why


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_pool_and_rss_are_flat_over_400_steps(mode: str) -> None:
    sizes, rss, _ = _steady_run(mode, 400, hidden=64)
    first = len(EPOCH) + (1 if mode == "auto" else 0)
    assert len(set(sizes[first - 1 :])) == 1, sorted(set(sizes))
    steps = sorted(rss)
    grown = rss[steps[1]] - rss[steps[0]]
    assert grown < 8 << 20, f"RSS grew by {grown / 2**20:.1f} MiB after the first two epochs"
