"""A launch counter that does not depend on the machine: the kernels a step would launch on a GPU.

Kernels = ATen ops that launch a device kernel + Triton kernel launches. Counted on any machine, the CPU included
(Triton under ``TRITON_INTERPRET=1``: each ``kernel[grid](...)`` is one launch, and the ATen ops the interpreter
runs to emulate it are its own work, not counted). The ops that launch nothing are listed in
:data:`NON_KERNEL_OPS`: views, reshapes that alias, ``detach`` and other aliasing or metadata-only ops, and bare
allocations (``empty``: the caching allocator hands out memory without a kernel). ``_local_scalar_dense`` (``.item()``)
is a device-to-host memcpy, counted by :class:`~lightning_llmfast.bench.counters.SyncCounter` as a sync, not here.
This package's custom ops (namespace ``lightning_llmfast``) are opened: the ATen ops and Triton launches inside them
are the kernels, not the op itself (an opaque op wraps a gather and a GEMM, or one Triton kernel).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from torch._library.custom_ops import OPDEFS

from lightning_llmfast.bench.counters import PatchingCounter

try:
    from triton.runtime.jit import KernelInterface
except ImportError:  # pragma: no cover - Triton is optional
    KernelInterface = None

__all__ = ["NON_KERNEL_OPS", "KernelCounter"]

NON_KERNEL_OPS: frozenset[str] = frozenset(
    {
        # views and reshapes that alias their input (a reshape that must copy dispatches clone, which counts)
        "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "as_strided", "alias", "expand", "expand_as",
        "permute", "transpose", "t", "mT", "squeeze", "unsqueeze", "select", "slice", "narrow", "diagonal", "unfold",
        "unbind", "split", "split_with_sizes", "chunk", "tensor_split", "view_as_real", "view_as_complex",
        "real", "imag", "_conj", "_neg_view", "movedim", "swapaxes", "swapdims", "flatten", "unflatten",
        # in-place metadata changes and autograd aliasing
        "detach", "detach_", "squeeze_", "unsqueeze_", "transpose_", "t_", "as_strided_", "resize_", "set_",
        "_fw_primal", "_make_dual", "_unpack_dual", "lift_fresh",
        # bare allocations: no kernel until something writes them
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
        # a device-to-host memcpy, counted as a host sync instead
        "_local_scalar_dense",
        # metadata queries
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_contiguous", "size", "stride",
    }
)  # fmt: skip
"""ATen op packet names that launch no kernel on a GPU."""

_OPENED_NAMESPACE = "lightning_llmfast"
_ACTIVE: list[PatchingCounter] = []
_STATE = threading.local()  # .launching: inside a Triton launch (the interpreter's own ATen ops are not kernels)
_SAVED: dict[str, Any] = {}


class KernelCounter(PatchingCounter):
    """Counts the kernels the code inside the context would launch on a GPU: ATen ops that launch one, and Triton.

    Attributes:
        counts: every ATen op dispatched (as :class:`~lightning_llmfast.bench.counters.OpCounter`), the
            interpreter's work inside Triton launches excluded.
        kernel_ops: ``Counter`` of the ATen ops that launch a kernel.
        triton_launches: ``Counter`` of Triton kernel names launched.

    Example::

        with KernelCounter() as kc:
            block(x).sum().backward()
        print(kc.kernels, kc.kernel_ops.most_common(5), dict(kc.triton_launches))
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernel_ops: Counter[str] = Counter()
        self.triton_launches: Counter[str] = Counter()
        self._thread = threading.get_ident()

    @property
    def kernels(self) -> int:
        """Kernel launches so far: ATen kernel ops plus Triton launches."""
        return sum(self.kernel_ops.values()) + sum(self.triton_launches.values())

    @staticmethod
    def _active() -> list[PatchingCounter]:
        return _ACTIVE

    @staticmethod
    def _install() -> None:
        if KernelInterface is not None:
            _SAVED["getitem"] = KernelInterface.__getitem__
            KernelInterface.__getitem__ = _counted_launch

    @staticmethod
    def _remove() -> None:
        if "getitem" in _SAVED:
            KernelInterface.__getitem__ = _SAVED.pop("getitem")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace == _OPENED_NAMESPACE and not getattr(_STATE, "launching", False):
            with self:  # the implementation's own ATen ops and Triton launches are the kernels
                return OPDEFS[f"{func.namespace}::{name}"]._init_fn(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "to":
            # Reaches the mode whole inside opened custom ops: a copy only when it returns a new tensor.
            out = func(*args, **(kwargs or {}))
            if out is not args[0]:
                self._record("_to_copy", args, kwargs or {})
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if getattr(_STATE, "launching", False):
            return
        super()._record(name, args, kwargs)
        if name not in NON_KERNEL_OPS:
            self.kernel_ops[name] += 1


def _kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)  # autotuners and heuristics wrap the JIT function
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", type(kernel).__name__)


def _counted_launch(kernel: Any, grid: Any) -> Any:
    launch = _SAVED["getitem"](kernel, grid)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if getattr(_STATE, "launching", False):
            return launch(*args, **kwargs)
        me = threading.get_ident()
        for counter in dict.fromkeys(_ACTIVE):  # a counter re-entered to open a custom op is listed twice
            if counter._thread == me and isinstance(counter, KernelCounter):
                counter.triton_launches[_kernel_name(kernel)] += 1
        _STATE.launching = True
        try:
            return launch(*args, **kwargs)
        finally:
            _STATE.launching = False

    return counted
