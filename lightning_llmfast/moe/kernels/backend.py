"""Kernel backend selection: Triton (compiled on CUDA, interpreted on CPU under ``TRITON_INTERPRET=1``) or the
PyTorch reference.

Example::

    backend = resolve_backend("auto", logits.device)  # "triton" on CUDA with Triton installed, else "torch"
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from lightning_llmfast.errors import RoutingError

try:  # Triton is optional: without it every backend="auto" call takes the PyTorch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None
    tl = None

# ``triton.jit`` for the kernel modules: decorating is harmless without Triton (the kernels are then never launched),
# and keeps the kernels at module level where Triton can read their source. Triton decides at decoration time whether
# a kernel is interpreted.
triton_jit = triton.jit if triton is not None else (lambda fn: fn)


__all__ = ["BACKENDS", "cuda_code_path", "is_triton", "resolve_backend", "triton_available", "triton_jit"]

BACKENDS: frozenset[str] = frozenset({"auto", "torch", "triton"})

# True inside cuda_code_path(): "auto" resolves to Triton on a CPU as on CUDA. A plain global (not a context
# variable): torch.compile reads it as a guarded constant, with no graph break.
_AUTO_AS_CUDA = False


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    On CUDA that needs Triton; on CPU it also needs ``TRITON_INTERPRET=1`` (Triton's interpreter, used in CI).

    Example::

        use_triton = triton_available(logits.device)
    """
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    # The interpreter must have been on when this module was imported: Triton picks compiled or interpreted
    # kernels at decoration time, and compiled ones cannot read CPU memory.
    interpreted = type(_probe_kernel).__name__ == "InterpretedFunction"
    return device.type == "cpu" and interpreted and os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turns ``"auto"`` into ``"triton"`` (CUDA with Triton installed; a CPU too inside :func:`cuda_code_path`) or
    ``"torch"``, and checks the choice.

    Raises:
        RoutingError: for an unknown backend, or ``"triton"`` where the kernels cannot run.

    Example::

        resolve_backend("auto", torch.device("cpu"))  # "torch"
    """
    if backend not in BACKENDS:
        raise RoutingError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        on_cuda = device.type == "cuda" or (_AUTO_AS_CUDA and device.type == "cpu")
        return "triton" if on_cuda and triton is not None else "torch"
    if backend == "triton" and not triton_available(device):
        why = "Triton is not installed" if triton is None else "set TRITON_INTERPRET=1 to run the kernels on CPU"
        raise RoutingError(f"backend='triton' cannot run on {device.type} tensors: {why}")
    return backend


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """Inside the block, ``backend="auto"`` resolves on a CPU as on CUDA: to the Triton kernels, run by Triton's
    interpreter. How :mod:`lightning_llmfast.bench` counts the kernels of the CUDA code path on a CPU.

    Raises:
        RoutingError: Triton cannot run on CPU tensors here (not installed, or ``TRITON_INTERPRET=1`` was not set
            when this module was imported).

    Example::

        with cuda_code_path():
            resolve_backend("auto", torch.device("cpu"))  # "triton"
    """
    global _AUTO_AS_CUDA
    if not triton_available(torch.device("cpu")):
        why = "Triton is not installed" if triton is None else "set TRITON_INTERPRET=1 before importing the package"
        raise RoutingError(f"cuda_code_path() needs Triton's interpreter on the CPU: {why}")
    previous, _AUTO_AS_CUDA = _AUTO_AS_CUDA, True
    try:
        yield
    finally:
        _AUTO_AS_CUDA = previous


@triton_jit
def _probe_kernel(x_ptr):  # never launched: its type says whether Triton interprets the kernels
    pass


def is_triton(backend: str) -> bool:
    """Whether an already resolved ``backend`` is ``"triton"``; anything but ``"torch"`` or ``"triton"`` raises."""
    if backend == "triton":
        return True
    if backend != "torch":
        raise RoutingError(
            f"backend must be 'torch' or 'triton' here (resolve_backend turns 'auto' into one), got {backend!r}"
        )
    return False
