"""The one place that asks torch whether code runs inside the autograd engine (backward)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

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


def mark_rebuildable(ctx: Any, output: torch.Tensor) -> None:
    """Record, in a custom Function's ``forward``, what a rebuild of ``output`` from its saved tensors must check.

    A Function that declares ``llmfast_rebuild(ctx, *saved_tensors)`` calls this after ``save_for_backward``:
    :class:`~lightning_llmfast.offload.ActivationOffloader` rebuilds the output only if the offloader's own hooks
    packed those saved tensors (not ``torch.utils.checkpoint``'s, whose tensors may be unpacked once only) and the
    output has not been changed in place (a rebuild would give the values before the change).

    Example::

        ctx.save_for_backward(x, weight, rstd)
        out = normalize(x, weight, rstd)
        mark_rebuildable(ctx, out)
        return out
    """
    if torch.compiler.is_compiling():
        return  # traced: the compiled graph saves for backward its own way (and Dynamo cannot trace the query below)
    # Private but stable since torch 2.0 (torch.utils.checkpoint uses it); without it nothing is ever rebuilt.
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):
        hooks = None
    ctx.llmfast_pack_hook = hooks[0] if hooks else None
    ctx.llmfast_output = weakref.ref(output)
