"""Hardware-independent counters: host syncs and ATen ops, counted with a ``TorchDispatchMode``.

These are the numbers our tests assert on (zero syncs in the hot path, one metadata build per step),
because unlike timings they do not depend on the machine or its load.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReadCounter", "OpCounter", "SyncCounter", "SYNC_OPS"]

# ATen ops that force the host to wait for the device (or, on CPU, that would on an accelerator):
# they produce data-dependent shapes or read a device value into Python.
SYNC_OPS: frozenset[str] = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), bool(t), `if t:`
        "nonzero",  # also torch.where(cond) with one argument, boolean-mask indexing
        "nonzero_static",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "masked_select",
        "bincount",
        "repeat_interleave",  # without output_size its output shape is data dependent
        "_assert_async",
        "equal",
        "is_nonzero",
    }
)


def _op_name(func: Any) -> str:
    # func is an OpOverload such as aten.nonzero.default; its packet name is "nonzero".
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _is_boolean_mask_index(name: str, args: tuple[Any, ...]) -> bool:
    # x[mask] and x[mask] = v dispatch as index/index_put_ with a bool index; the kernel turns the mask into
    # indices with a nonzero internally, so the output size (or the write) waits on the device.
    if name not in _INDEX_OPS or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


def _is_device_to_host_copy(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # A blocking copy from an accelerator to the host waits for the device; a non_blocking one (into pinned memory,
    # as the activation offloader does on its copy stream) does not.
    if name not in {"_to_copy", "copy_"}:
        return False
    if name == "copy_":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return (
            not non_blocking and isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
        )
    src, device = args[0], kwargs.get("device")
    return (
        not kwargs.get("non_blocking", False)
        and isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
        and device is not None
        and torch.device(device).type == "cpu"
    )


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched inside the context.

    Attributes:
        counts: ``Counter`` of op packet names (``"mm"``, ``"nonzero"``...).

    Example::

        with OpCounter() as ops:
            model(x).sum().backward()
        print(ops.total, ops.counts.most_common(5))
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        """Number of ATen ops dispatched so far."""
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._record(_op_name(func), args, kwargs)
        return func(*args, **kwargs)

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.counts[name] += 1


class SyncCounter(OpCounter):
    """Counts ops that force a device-to-host synchronisation (see :data:`SYNC_OPS`).

    Counting happens on CPU too, so a zero-sync guarantee can be tested without a GPU: an op that would
    block the host on CUDA is counted wherever it runs.

    Attributes:
        syncs: ``Counter`` of the sync-forcing op names seen (``"device_to_host_copy"`` for explicit copies).

    Example::

        with SyncCounter() as sc:
            plan = route(logits, top_k=2, validate=False)
        assert sc.num_syncs == 0, sc.syncs
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()

    @property
    def num_syncs(self) -> int:
        """Number of sync-forcing ops seen."""
        return sum(self.syncs.values())

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super()._record(name, args, kwargs)
        if name in SYNC_OPS:
            self.syncs[name] += 1
        elif _is_boolean_mask_index(name, args):
            self.syncs["boolean_mask_index"] += 1
        elif _is_device_to_host_copy(name, args, kwargs):
            self.syncs["device_to_host_copy"] += 1


class HostReadCounter:
    """Counts ``Tensor.tolist()`` and ``Tensor.item()`` calls inside the context, on any device.

    On CPU tensors both read the data directly, without an ATen op that :class:`SyncCounter` could see; on an
    accelerator each is a device-to-host sync. Pair the two to prove that a code path reads nothing on the host.

    Attributes:
        count: calls seen so far.

    Example::

        with HostReadCounter() as reads, SyncCounter() as syncs:
            block(x).sum().backward()
        assert reads.count == syncs.num_syncs == 0
    """

    _METHODS = ("tolist", "item")

    def __enter__(self) -> HostReadCounter:
        self.count = 0
        self._saved = {name: getattr(torch.Tensor, name) for name in self._METHODS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def _counted(self, original: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any) -> Any:
            self.count += 1
            return original(tensor, *args)

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
