"""Kernel backend selection: Triton (compiled on CUDA, interpreted on CPU under ``TRITON_INTERPRET=1``) or the
PyTorch reference.

Example::

    backend = resolve_backend("auto", logits.device)  # "triton" on CUDA with Triton installed, else "torch"
"""

from __future__ import annotations

import os

import torch

from lightning_llmfast.errors import RoutingError

try:  # Triton is optional: without it every backend="auto" call takes the PyTorch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None
    tl = None

# Decorating is harmless without Triton (the kernels are then never launched), and keeps the kernels at module
# level where Triton can read their source. Triton decides at decoration time whether a kernel is interpreted.
_jit = triton.jit if triton is not None else (lambda fn: fn)


__all__ = ["BACKENDS", "is_triton", "resolve_backend", "triton_available"]

BACKENDS: frozenset[str] = frozenset({"auto", "torch", "triton"})


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
    """Turns ``"auto"`` into ``"triton"`` (CUDA with Triton installed) or ``"torch"``, and checks the choice.

    Raises:
        RoutingError: for an unknown backend, or ``"triton"`` where the kernels cannot run.

    Example::

        resolve_backend("auto", torch.device("cpu"))  # "torch"
    """
    if backend not in BACKENDS:
        raise RoutingError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if backend == "triton" and not triton_available(device):
        why = "Triton is not installed" if triton is None else "set TRITON_INTERPRET=1 to run the kernels on CPU"
        raise RoutingError(f"backend='triton' cannot run on {device.type} tensors: {why}")
    return backend


@_jit
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
