"""The one place that asks torch whether code runs inside the autograd engine (backward)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_llmfast.errors import OffloadError

__all__ = ["eager_custom_op", "in_backward", "mark_rebuildable"]


def in_backward() -> bool:
    """Whether the caller runs inside backward: activation recomputation, ``create_graph`` or a backward hook.

    Module forwards run there when ``torch.utils.checkpoint`` replays them; side effects of a forward (an expert-bias
    update, offload bookkeeping, another checkpoint) must not run twice.

    Example::

        if not in_backward():
            update_running_state()
    """
    return torch._C._current_autograd_node() is not None


def mark_rebuildable(
    ctx: Any, output: torch.Tensor, rebuild: Callable[..., torch.Tensor] | None = None, *, gemm: bool = False
) -> None:
    """Record, in a custom Function's ``forward`` (or a custom op's ``setup_context``), that ``output`` can be rebuilt
    from the tensors it saved, and what such a rebuild must check.

    :class:`~lightning_llmfast.offload.ActivationOffloader` then drops saved copies of ``output`` and calls
    ``rebuild(ctx, *saved_tensors)`` in backward instead; only if the offloader's own hooks packed those saved tensors
    (not ``torch.utils.checkpoint``'s, whose tensors may be unpacked once only) and the output has not been changed
    in place (a rebuild would give the values before the change). The rebuild must give the same bits as the forward.

    Args:
        ctx: the Function's context, after ``save_for_backward``.
        output: the output that ``rebuild`` gives (of a Function with several, the others are never rebuilt).
        rebuild: ``(ctx, *saved_tensors) -> output``; ``None``: the Function's ``llmfast_rebuild`` static method.
        gemm: the rebuild runs a matrix multiplication (not an elementwise pass): the offloader only runs it when
            asked to (``rebuild_gemms``), as it costs compute time in backward.

    Raises:
        OffloadError: ``rebuild`` is ``None`` and the Function declares no ``llmfast_rebuild``.

    Example::

        ctx.save_for_backward(x, weight, rstd)
        out = normalize(x, weight, rstd)
        mark_rebuildable(ctx, out)  # RMSNormFunction.llmfast_rebuild(ctx, x, weight, rstd) gives `out` again
        return out
    """
    if torch.compiler.is_compiling():
        return  # traced: the compiled graph saves for backward its own way (and Dynamo cannot trace the query below)
    if rebuild is None:
        rebuild = getattr(getattr(type(ctx), "_forward_cls", None), "llmfast_rebuild", None)
        if rebuild is None:
            raise OffloadError(
                "mark_rebuildable: pass rebuild=(ctx, *saved_tensors) -> output, or declare llmfast_rebuild on the "
                f"Function ({type(ctx).__name__} has none)"
            )
    # Private but stable since torch 2.0 (torch.utils.checkpoint uses it); without it nothing is ever rebuilt.
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):
        hooks = None
    ctx.llmfast_pack_hook = hooks[0] if hooks else None
    ctx.llmfast_output = weakref.ref(output)
    # Not always 0: kernels that write their output in parts (CPU grouped_mm, one write per group) bump it.
    ctx.llmfast_output_version = output._version
    ctx.llmfast_rebuild = rebuild
    ctx.llmfast_gemm = gemm


def eager_custom_op(op: Any) -> Callable[..., Any]:
    """``op`` (a ``torch.library.custom_op``) callable at less host cost in eager mode, with the same results.

    A custom op reaches its Python implementation through the dispatcher, twice when it has a Python autograd
    kernel: 40-45 us per call with autograd and about 18 us without, on top of the implementation itself (CPU,
    torch 2.13; on a launch-bound GPU that is step time). In plain eager mode the returned function calls the same
    implementation, ``setup_context`` and backward through an ``autograd.Function`` (about 9 us), or, when no input
    needs a gradient, the implementation alone. It calls ``op`` itself under ``torch.compile`` (the graph keeps the
    opaque op with its registered fake and autograd: why these are custom ops at all), under a dispatch mode (fake
    tensors, op counters) and for meta or subclass tensors.

    Example::

        _sum_rows = eager_custom_op(_sum_rows)  # after its registrations: same arguments, outputs and gradients
    """
    impl = getattr(op, "_init_fn", None)
    modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    if impl is None or modes is None:  # a torch without these internals: the dispatcher path, unchanged
        return op
    setup, backward = getattr(op, "_setup_context_fn", None), getattr(op, "_backward_fn", None)
    function = None if setup is None or backward is None else _autograd_function(op._name, impl, setup, backward)

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling() or modes():
            return op(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(type(t) not in _PLAIN or t.is_meta for t in tensors):
            return op(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return op(*args) if function is None else function.apply(*args)
        return impl(*args)

    return call


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _autograd_function(
    name: str, impl: Callable[..., Any], setup: Callable[..., None], backward: Callable[..., Any]
) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` that runs a custom op's implementation, ``setup_context`` and backward."""

    def forward(ctx: Any, *args: Any) -> Any:
        output = impl(*args)
        setup(ctx, args, output)
        return output

    def run_backward(ctx: Any, *grads: Any) -> Any:
        return backward(ctx, *grads)

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(run_backward)}
    return type(f"{name}_eager", (torch.autograd.Function,), namespace)
