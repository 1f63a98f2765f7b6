"""The one place that asks torch whether code runs inside the autograd engine (backward)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_llmfast.errors import OffloadError

__all__ = ["in_backward", "mark_rebuildable"]


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
