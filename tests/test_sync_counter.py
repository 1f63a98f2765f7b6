"""SyncCounter sees a host sync by every route: Python reads, sync ops, blocking copies, synchronize calls."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import lightning_llmfast.moe.routing as routing
from lightning_llmfast.bench.counters import HOST_READ_METHODS, SyncCounter
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.routing import route

# (route, workload on a 1-D float tensor, expected counted names): each reads the device once on an accelerator.
READS: list[tuple[str, Any, dict[str, int]]] = [
    ("tolist", lambda x: x.tolist(), {"tolist": 1}),
    ("numpy", lambda x: x.numpy(), {"numpy": 1}),
    ("np.asarray", lambda x: np.asarray(x), {"numpy": 1}),
    ("cpu", lambda x: x.cpu(), {"cpu": 1}),
    ("item", lambda x: x[0].item(), {"_local_scalar_dense": 1}),
    ("bool", lambda x: bool(x[0] > 0), {"_local_scalar_dense": 1}),
    ("int", lambda x: int(x[0]), {"_local_scalar_dense": 1}),
    ("float", lambda x: float(x[0]), {"_local_scalar_dense": 1}),
    ("index", lambda x: [0, 1][(x[0] > 9).long()], {"_local_scalar_dense": 1}),
    ("format", lambda x: f"{x[0]:.3f}", {"_local_scalar_dense": 1}),
    ("nonzero", lambda x: (x > 0).nonzero(), {"nonzero": 1}),
    ("unique", lambda x: x.round().unique(), {"_unique2": 1}),
    ("masked_select", lambda x: x.masked_select(x > 0), {"masked_select": 1}),
]


@pytest.mark.parametrize(("name", "workload", "expected"), READS, ids=[r[0] for r in READS])
def test_each_host_read_route_is_counted_once(name: str, workload: Any, expected: dict[str, int]) -> None:
    x = torch.randn(7)
    with SyncCounter() as sc:
        workload(x)
    assert dict(sc.syncs) == expected, name
    for method in HOST_READ_METHODS:  # the patches are gone afterwards
        assert getattr(torch.Tensor, method) is getattr(torch._C.TensorBase, method)


def test_host_tensors_and_what_is_computed_from_them_are_not_device_reads() -> None:
    host, device = torch.tensor([0, 3, 5, 9]), torch.randn(5)
    with SyncCounter(host={"cu_seqlens": host, "rows": [host[1:]]}) as sc:
        lengths = host[1:] - host[:-1]  # computed from host data only: still host data
        lengths.tolist(), host.numpy(), host[2].item(), host.cpu()
        torch.from_numpy(np.arange(4)).tolist()  # NumPy data is host data
    assert sc.num_syncs == 0, sc.syncs
    with SyncCounter(host=host) as sc:
        (device[:3] + host[:3]).tolist()  # mixed with a device tensor: a device read
    assert dict(sc.syncs) == {"tolist": 1}
    with SyncCounter(device="cuda") as sc:  # measuring CUDA code: CPU tensors are host tensors
        device.tolist(), device.sum().item(), device.nonzero()
    assert sc.num_syncs == 0, sc.syncs


def test_nested_counters_both_count_and_other_threads_are_not_counted() -> None:
    x = torch.randn(4)
    with SyncCounter() as outer:
        with SyncCounter() as inner:
            x.tolist()
        thread = threading.Thread(target=lambda: x.tolist())
        thread.start()
        thread.join()
    assert outer.syncs == inner.syncs == {"tolist": 1}


def test_blocking_host_to_device_copies_are_counted_with_meta_as_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(6)
    with SyncCounter() as sc:
        x.to("meta")  # pageable source: blocks
        x.to("meta", non_blocking=True)  # non_blocking from pageable memory: the driver still stages it synchronously
        torch.empty(6, device="meta").copy_(x)
        torch.tensor([1, 2, 3], device=x.device)  # Python data put on "the device" (device=x.device on CPU)
        torch.as_tensor(np.arange(3), device="meta")
        torch.tensor([1, 2, 3])  # no device: host data, no copy
    assert dict(sc.syncs) == {"host_to_device_copy": 5}
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)  # a pinned source (faked on CPU)
    with SyncCounter() as sc:
        x.to("meta", non_blocking=True)
        torch.empty(6, device="meta").copy_(x, non_blocking=True)
    assert sc.num_syncs == 0, sc.syncs
    with SyncCounter() as sc:
        x.to("meta")  # pinned but blocking
    assert dict(sc.syncs) == {"host_to_device_copy": 1}


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waited = 0

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        self.waited += 1


class _FakeStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> _FakeEvent:
        return torch.cuda.Event()


def test_event_stream_and_device_synchronize_are_counted_with_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    stream = torch.cuda.Stream()
    with SyncCounter() as sc:
        event = stream.record_event()
        event.synchronize()  # what a release that waits for its copy does
        stream.synchronize()
        torch.cuda.synchronize()
        event.record()  # recording and waiting on the device do not block the host
    assert dict(sc.syncs) == {"event_synchronize": 1, "stream_synchronize": 1, "device_synchronize": 1}
    assert event.waited == 1  # the original method still ran
    assert torch.cuda.Event.synchronize is _FakeEvent.synchronize  # restored


def _plant_tolist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adds ``tokens_per_expert.tolist()`` inside ``route()``: its counting pass's counts read on the host."""
    original = routing.routing_plan

    def counting_pass_then_read(*args: Any, **kwargs: Any) -> Any:
        plan = original(*args, **kwargs)
        plan.tokens_per_expert.tolist()
        return plan

    monkeypatch.setattr(routing, "routing_plan", counting_pass_then_read)


def test_a_tolist_planted_in_route_turns_the_no_sync_checks_red(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(33, 8, requires_grad=True)
    block = MoEBlock(MoEConfig.build(8, 12, 4, 2, backend="torch"))
    x = torch.randn(2, 5, 8)

    def step() -> SyncCounter:
        with SyncCounter() as sc:
            plan = route(logits, 2, validate=False)
            (plan.weights.sum() + plan.aux_loss).backward()
            block(x).sum().backward()
        return sc

    assert step().num_syncs == 0  # what every "no host sync" test asserts
    _plant_tolist(monkeypatch)
    planted = step()
    assert dict(planted.syncs) == {"tolist": 2}, planted.syncs  # once in route(), once in the block's route()
