"""Hardware-independent counters: host syncs and ATen ops.

These are the numbers our tests assert on (zero syncs in the hot path, one metadata build per step), because
unlike timings they do not depend on the machine or its load. :class:`SyncCounter` is the one sync counter of the
package: every "no host sync" test and the benchmarks use it. It sees a host sync whatever its route:

- ATen ops that read a device value or produce a data-dependent shape (:data:`SYNC_OPS`, boolean-mask indexing),
  seen by a ``TorchDispatchMode``;
  (``.item()``, ``bool()``, ``int()``, ``float()``, ``operator.index`` and ``if`` on a tensor all dispatch
  ``_local_scalar_dense``);
- reads of tensor data into Python that dispatch no ATen op on the CPU (``.tolist()``, ``.numpy()``, ``.cpu()``),
  seen by patching those ``torch.Tensor`` methods while the counter is active;
- copies between host and device that block the host: device-to-host without ``non_blocking``, host-to-device
  from pageable memory, and ``torch.tensor`` / ``torch.as_tensor`` of host data given a ``device=``;
- ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, ``torch.cuda.Event.synchronize`` and
  ``torch.cuda.Stream.synchronize`` (patched while the counter is active, so fakes installed as ``torch.cuda.Event``
  / ``torch.cuda.Stream`` are counted too).

On a CPU-only machine every tensor is a CPU tensor, so a read cannot tell device from host by itself: the counter
takes the device the measured code computes on. With ``device="cpu"`` (the default, for tests) CPU tensors stand for
device tensors, except those named ``host=`` (the collator's fields, which stay on the host on an accelerator) and
tensors made from NumPy arrays inside the window; with an accelerator device only reads of tensors on it count.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "HOST_READ_METHODS",
    "SYNC_ENTRY_POINTS",
    "SYNC_OPS",
    "OpCounter",
    "PatchingCounter",
    "SyncCounter",
]

# ATen ops that force the host to wait for the device (or, on CPU, that would on an accelerator):
# they produce data-dependent shapes or read a device value into Python.
SYNC_OPS: frozenset[str] = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), bool(t), `if t:`
        "nonzero",  # also torch.where(cond) with one argument, boolean-mask indexing
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

HOST_READ_METHODS: tuple[str, ...] = ("tolist", "numpy", "cpu")
"""``torch.Tensor`` methods that read tensor data into host memory; patched while a :class:`SyncCounter` is active."""

SYNC_ENTRY_POINTS: tuple[tuple[str, str, str], ...] = (
    ("torch.cuda", "synchronize", "device_synchronize"),
    ("torch.accelerator", "synchronize", "device_synchronize"),
    ("torch.cuda.Event", "synchronize", "event_synchronize"),
    ("torch.cuda.Stream", "synchronize", "stream_synchronize"),
)
"""``(owner, attribute, counted name)`` of the Python entry points that block the host until the device is done."""

_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_ACTIVE: list[PatchingCounter] = []  # counters entered and not yet exited, innermost last
_PATCH_LOCK = threading.Lock()
_SAVED: dict[tuple[Any, str], Any] = {}  # (owner, attribute) -> the original, while any counter is active
_DEPTH = threading.local()  # nesting of patched calls: only the outermost one counts


def _op_name(func: Any) -> str:
    # func is an OpOverload such as aten.nonzero.default; its packet name is "nonzero".
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _is_boolean_mask_index(name: str, args: tuple[Any, ...]) -> bool:
    # x[mask] and x[mask] = v dispatch as index/index_put_ with a bool index; the kernel turns the mask into
    # indices with a nonzero internally, so the output size (or the write) waits on the device.
    if name not in _INDEX_OPS or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


def _copy_direction(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, bool, str, bool] | None:
    """``(source device type, source pinned, destination device type, non_blocking)`` of a copy op, else ``None``."""
    if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return args[1].device.type, args[1].is_pinned(), args[0].device.type, non_blocking
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None:
        src = args[0]
        return src.device.type, src.is_pinned(), torch.device(kwargs["device"]).type, bool(kwargs.get("non_blocking"))
    return None


def _blocking_copy(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The counted name of a copy that blocks the host, or ``None``.

    Device-to-host blocks unless ``non_blocking``. Host-to-device blocks unless the source is pinned and the copy
    ``non_blocking``: from pageable memory the driver stages the data through its own buffer before returning.
    """
    copy = _copy_direction(name, args, kwargs)
    if copy is None:
        return None
    src, pinned, dst, non_blocking = copy
    if src != "cpu" and dst == "cpu" and not non_blocking:
        return "device_to_host_copy"
    if src == "cpu" and dst != "cpu" and not (non_blocking and pinned):
        return "host_to_device_copy"
    return None


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor in ``obj``: a tensor, a mapping, a dataclass, or a list/tuple of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for field in fields(obj):
            yield from _tensors(getattr(obj, field.name))
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


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


class PatchingCounter(OpCounter):
    """An :class:`OpCounter` that also patches Python entry points while any counter of its kind is active.

    Subclasses say where their active counters are listed (:meth:`_active`) and how to install and remove their
    patches; the first counter entered installs them, the last one to exit removes them. Patched calls are counted
    only in the thread that entered (dispatch modes are per thread too).
    """

    def __enter__(self) -> PatchingCounter:
        self._thread = threading.get_ident()
        with _PATCH_LOCK:
            if not self._active():
                self._install()
            self._active().append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            with _PATCH_LOCK:
                self._active().remove(self)
                if not self._active():
                    self._remove()

    @staticmethod
    def _active() -> list[PatchingCounter]:
        raise NotImplementedError

    @staticmethod
    def _install() -> None:
        raise NotImplementedError

    @staticmethod
    def _remove() -> None:
        raise NotImplementedError


class SyncCounter(PatchingCounter):
    """Counts host syncs by every route (see the module docstring) and every ATen op.

    Counting happens on CPU too, so a zero-sync guarantee can be tested without a GPU: a read that would block the
    host on an accelerator is counted wherever it runs.

    Args:
        device: where the measured code computes. ``"cpu"`` (tests on a CPU machine): CPU tensors stand for device
            tensors. An accelerator: reads of CPU tensors are host reads and not counted.
        host: tensors (or mappings, dataclasses, lists holding them) that live on the host even on an accelerator,
            such as a collator's batch before it is moved: reading them, views of them or what is computed from
            them alone is no sync.

    Attributes:
        syncs: ``Counter`` of the syncs seen, by name: the ATen op (``"nonzero"``, ``"_local_scalar_dense"``), the
            ``torch.Tensor`` method (``"tolist"``, ``"numpy"``, ``"cpu"``), ``"device_to_host_copy"``,
            ``"host_to_device_copy"``, ``"event_synchronize"``, ``"stream_synchronize"``, ``"device_synchronize"``.

    Example::

        with SyncCounter() as sc:
            plan = route(logits, top_k=2, validate=False)
        assert sc.num_syncs == 0, sc.syncs
    """

    def __init__(self, device: torch.device | str = "cpu", host: Any = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.syncs: Counter[str] = Counter()
        self._host = list(_tensors(host))  # held, so their storages cannot be freed and reused meanwhile
        self._host_ptrs = {t.untyped_storage().data_ptr() for t in self._host if t.numel()}
        self._thread = threading.get_ident()

    @property
    def num_syncs(self) -> int:
        """Number of host syncs seen."""
        return sum(self.syncs.values())

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether reading ``tensor`` on the host waits for the device (see ``device`` and ``host``)."""
        if tensor.device.type != "cpu":
            return tensor.device.type != "meta"
        if self.device.type != "cpu" or not tensor.numel():
            return False
        return tensor.untyped_storage().data_ptr() not in self._host_ptrs

    def add_host(self, tensor: torch.Tensor) -> None:
        """Declares ``tensor`` a host tensor for the rest of the window (used for tensors made from NumPy)."""
        if tensor.numel():
            self._host.append(tensor)
            self._host_ptrs.add(tensor.untyped_storage().data_ptr())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._host_ptrs and self.device.type == "cpu":
            # What is computed from host tensors alone (lengths from the collator's boundaries) stays on the host.
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if inputs and not any(self.is_device_tensor(t) for t in inputs):
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        self.add_host(t)
        return out

    @staticmethod
    def _active() -> list[PatchingCounter]:
        return _ACTIVE

    @staticmethod
    def _install() -> None:
        _install_patches()

    @staticmethod
    def _remove() -> None:
        _remove_patches()

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super()._record(name, args, kwargs)
        if getattr(_DEPTH, "value", 0):
            return  # inside a patched read: counted once, by the patch
        if name in SYNC_OPS:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is None or self.is_device_tensor(first):
                self.syncs[name] += 1
        elif _is_boolean_mask_index(name, args):
            self.syncs["boolean_mask_index"] += 1
        else:
            copy = _blocking_copy(name, args, kwargs)
            if copy is not None:
                self.syncs[copy] += 1


def _counters_here() -> list[SyncCounter]:
    me = threading.get_ident()
    return [c for c in _ACTIVE if c._thread == me and isinstance(c, SyncCounter)]


def _counted_read(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "value", 0)
        if not depth:
            for counter in _counters_here():
                if counter.is_device_tensor(tensor):
                    counter.syncs[name] += 1
        _DEPTH.value = depth + 1
        try:
            return original(tensor, *args, **kwargs)
        finally:
            _DEPTH.value = depth

    read.__name__ = name
    return read


def _counted_call(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        for counter in _counters_here():
            counter.syncs[name] += 1
        return original(*args, **kwargs)

    return call


def _new_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    def new_tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Python or NumPy data put on a device: a synchronous copy from pageable memory. With device="cpu" counters
        # an explicit device= (such as device=x.device) stands for the accelerator; without one the tensor is host data.
        device = kwargs.get("device")
        if device is not None and (not isinstance(data, torch.Tensor) or data.device.type == "cpu"):
            target = torch.device(device).type
            for counter in _counters_here():
                if target != "cpu" or counter.device.type == "cpu":
                    counter.syncs["host_to_device_copy"] += 1
        depth = getattr(_DEPTH, "value", 0)
        _DEPTH.value = depth + 1
        try:
            return original(data, *args, **kwargs)
        finally:
            _DEPTH.value = depth

    return new_tensor


def _from_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_numpy(array: Any) -> torch.Tensor:
        tensor = original(array)
        for counter in _counters_here():  # NumPy data is host data on every machine
            counter.add_host(tensor)
        return tensor

    return from_numpy


def _owner(path: str) -> Any:
    obj: Any = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _install_patches() -> None:
    for method in HOST_READ_METHODS:
        _SAVED[(torch.Tensor, method)] = original = getattr(torch.Tensor, method)
        setattr(torch.Tensor, method, _counted_read(method, original))
    for path, attr, counted in SYNC_ENTRY_POINTS:
        owner = _owner(path)
        if owner is not None and (owner, attr) not in _SAVED and hasattr(owner, attr):
            _SAVED[(owner, attr)] = original = getattr(owner, attr)
            setattr(owner, attr, _counted_call(counted, original))
    _SAVED[(torch, "from_numpy")] = original = torch.from_numpy
    torch.from_numpy = _from_numpy(original)
    for name in ("tensor", "as_tensor"):
        _SAVED[(torch, name)] = original = getattr(torch, name)
        setattr(torch, name, _new_tensor(original))


def _remove_patches() -> None:
    for (owner, attr), original in _SAVED.items():
        setattr(owner, attr, original)
    _SAVED.clear()
