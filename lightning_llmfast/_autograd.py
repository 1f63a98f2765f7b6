"""The one place that asks torch whether code runs inside the autograd engine (backward)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["eager_custom_op", "in_backward"]

_log = logging.getLogger(__name__)


def in_backward() -> bool:
    """Whether the caller runs inside backward: activation recomputation, ``create_graph`` or a backward hook.

    Module forwards run there when ``torch.utils.checkpoint`` replays them; side effects of a forward (an expert-bias
    update, offload bookkeeping, another checkpoint) must not run twice.

    Example::

        if not in_backward():
            update_running_state()
    """
    return torch._C._current_autograd_node() is not None


def eager_custom_op(op: Any) -> Callable[..., Any]:
    """``op`` (a ``torch.library.custom_op``) callable at less host cost in plain eager mode, with the same results.

    A custom op reaches its Python implementation through the dispatcher, twice when it has a Python autograd
    kernel. In plain eager mode the returned function calls the same implementation, ``setup_context`` and backward
    through an ``autograd.Function``, or, when no input needs a gradient, the implementation alone: 12 us instead of
    26 us per call with autograd, 5.5 us instead of 12 us without (a small op on CPU, torch 2.13; on a launch-bound
    GPU that is step time). Whenever anything but plain eager execution would see the call, it calls ``op`` itself
    (see :func:`_seen_by_more_than_eager`): ``torch.compile`` and other tracers keep the opaque op with its
    registered fake and autograd (why these are custom ops at all). So does an op given a kernel, autocast, vmap or
    dispatch rule after it was wrapped, and a call with keyword arguments. ``op`` stays reachable as the returned
    function's ``op``. On a torch that lacks one of the private attributes this reads (``_TORCH_STATE``,
    ``_OP_STATE``), ``op`` itself is returned and a debug message names what is missing.

    Example::

        swiglu_down = eager_custom_op(swiglu_down)  # after its registrations: same arguments, outputs and gradients
    """
    missing = _MISSING_TORCH_STATE or [name for name in _OP_STATE if not hasattr(op, name)]
    if missing:  # a torch that renamed these internals: the dispatcher path, unchanged
        _log.debug("eager_custom_op: %r stays the registered op (torch lacks %s)", op, ", ".join(missing))
        return op
    kernels = dict(op._backend_fns)  # as wrapped: the default kernel (key None) that runs `impl`

    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs or _registered_since(op, kernels) or _seen_by_more_than_eager(args):
            return op(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            function = _autograd_function(op)
            return op(*args) if function is None else function.apply(*args)
        return op._init_fn(*args)

    functools.update_wrapper(call, op._init_fn)
    call.op = op  # type: ignore[attr-defined]
    return call


# The private torch state eager_custom_op reads (stable since torch 2.4): global switches, and the attributes of a
# ``torch.library.CustomOpDef``. Checked once (globals at import, an op's attributes when it is wrapped); where any is
# missing the op is returned as registered, so a torch release that renames one costs speed, not a broken import.
_TORCH_STATE: tuple[tuple[str, str], ...] = (
    ("torch._C", "_len_torch_dispatch_stack"),
    ("torch._C", "_is_torch_function_mode_enabled"),
    ("torch._C._functorch", "peek_interpreter_stack"),
    ("torch._C._autograd", "_profiler_enabled"),
    ("torch.autograd.forward_ad", "_current_level"),
)
_OP_STATE: tuple[str, ...] = (
    "_init_fn",
    "_setup_context_fn",
    "_backward_fn",
    "_backend_fns",
    "_torch_dispatch_fns",
    "_vmap_fn",
    "_autocast_dtype",
    "_disabled_kernel",
    "_namespace",
    "_name",
)


def _missing_torch_state() -> list[str]:
    """The entries of ``_TORCH_STATE`` this torch lacks, as ``"module.name"`` (empty: the fast path is usable)."""
    missing = []
    for module_name, name in _TORCH_STATE:
        module: Any = torch
        for part in module_name.split(".")[1:]:
            module = getattr(module, part, None)
        if not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    return missing


_MISSING_TORCH_STATE = _missing_torch_state()


def _seen_by_more_than_eager(args: tuple[Any, ...]) -> bool:
    """Whether anything but plain eager execution would see a call with ``args``: ``torch.compile``, JIT or FX
    tracing, a dispatch mode (fake tensors, op counters, ``make_fx``) or a function mode (also
    ``torch.set_default_device``'s), a functorch transform (``vmap``, ``grad``), forward-mode AD, the profiler (whose
    trace should name the op), or an argument with ``__torch_function__`` (tensor subclasses, FX proxies) or on the
    meta device."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd.forward_ad._current_level >= 0
        or torch._C._autograd._profiler_enabled()
        or torch.jit.is_tracing()
        or torch.overrides.has_torch_function(args)
        or any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    )


def _registered_since(op: Any, kernels: dict[Any, Any]) -> bool:
    """Whether ``op`` got a kernel (``kernels``: those it had when wrapped), a dispatch, vmap or autocast rule, or a
    disabled kernel: the dispatcher would then run something other than its default implementation."""
    return op._backend_fns != kernels or bool(
        op._torch_dispatch_fns or op._vmap_fn or op._autocast_dtype or op._disabled_kernel
    )


def _autograd_function(op: Any) -> type[torch.autograd.Function] | None:
    """An ``autograd.Function`` running ``op``'s current implementation, ``setup_context`` and backward (``None``:
    ``op`` has no autograd registered). Rebuilt when they change, so a later ``register_autograd`` is followed."""
    key = (op._init_fn, op._setup_context_fn, op._backward_fn)
    if key[1] is None or key[2] is None:
        return None
    cached = _FUNCTIONS.get(id(op))
    if cached is not None and cached[0] == key:
        return cached[1]
    impl, setup, backward = key

    def forward(ctx: Any, *args: Any) -> Any:
        output = impl(*args)
        setup(ctx, args, output)
        return output

    def run_backward(ctx: Any, *grads: Any) -> Any:
        return backward(ctx, *grads)

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(run_backward)}
    function = type(f"{op._namespace}_{op._name}_eager", (torch.autograd.Function,), namespace)
    _FUNCTIONS[id(op)] = (key, function)
    return function


# id(op) -> ((impl, setup_context, backward), Function); custom ops live as long as the process.
_FUNCTIONS: dict[int, tuple[tuple[Any, Any, Any], type[torch.autograd.Function]]] = {}
