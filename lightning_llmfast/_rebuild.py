"""The rebuild protocol: how a custom ``autograd.Function`` tells the offloader that an output can be rebuilt.

A Function whose output is cheap to compute again from the tensors it saves calls :func:`mark_rebuildable` in its
forward. That puts one typed :class:`RebuildRecord` on its ``ctx``; when a later op saves that output (or an autocast
copy of it), :class:`~lightning_llmfast.offload.ActivationOffloader` keeps a recipe instead of the tensor and runs
``record.rebuild(ctx, *ctx.saved_tensors)`` in backward.

The record holds nothing strongly but the rebuild function: the output and the saved-tensor hooks that were active
are weak references, so a graph that outlives its step never keeps the offloader, and through it the model, alive.

Example::

    ctx.save_for_backward(x, weight, rstd)
    out = normalize(x, weight, rstd)
    mark_rebuildable(ctx, out)  # RMSNormFunction.llmfast_rebuild(ctx, x, weight, rstd) gives `out` again
    return out
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_llmfast.errors import OffloadError

__all__ = ["RebuildRecord", "mark_rebuildable", "rebuild_origin", "rebuild_record"]

# The attribute of a Function's ctx that holds its record (the one name the protocol adds to a ctx).
_ATTRIBUTE = "llmfast_rebuild_record"
# Autograd nodes of reshapes (row-major order kept) allowed between a rebuildable output and its saved copy.
_RESHAPES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})


@dataclass(frozen=True, eq=False)
class RebuildRecord:
    """What :func:`mark_rebuildable` recorded about a Function's rebuildable output.

    Attributes:
        rebuild: ``(ctx, *saved_tensors) -> output``, with the forward's bits.
        output: weak reference to the output.
        output_version: the output's version counter at the end of the forward (not always 0: kernels that write
            their output in parts bump it).
        pack_hook: weak reference to the saved-tensor pack hook active when the Function saved its tensors
            (``None``: there was none); only tensors packed by the offloader's own hook may be unpacked for a rebuild
            (``torch.utils.checkpoint``'s may be unpacked once only).
        gemm: the rebuild runs a matrix multiplication, so it costs backward time (only rebuilt when asked for).
    """

    rebuild: Callable[..., torch.Tensor]
    output: weakref.ref[torch.Tensor]
    output_version: int
    pack_hook: Callable[[], Any] | None
    gemm: bool

    def packed_by(self, hook: Any) -> bool:
        """Whether ``hook`` was the active pack hook when the Function saved its tensors."""
        return self.pack_hook is not None and self.pack_hook() == hook


def mark_rebuildable(
    ctx: Any, output: torch.Tensor, rebuild: Callable[..., torch.Tensor] | None = None, *, gemm: bool = False
) -> None:
    """Record, in a custom Function's ``forward`` (or a custom op's ``setup_context``), that ``output`` can be rebuilt
    from the tensors it saved.

    :class:`~lightning_llmfast.offload.ActivationOffloader` then drops saved copies of ``output`` and calls
    ``rebuild(ctx, *saved_tensors)`` in backward instead; only if the offloader's own hooks packed those saved tensors
    and the output has not been changed in place (a rebuild would give the values before the change). The rebuild
    must give the same bits as the forward.

    Args:
        ctx: the Function's context, after ``save_for_backward``.
        output: the output that ``rebuild`` gives (of a Function with several, the others are never rebuilt).
        rebuild: ``(ctx, *saved_tensors) -> output``; ``None``: the Function's ``llmfast_rebuild`` static method.
        gemm: the rebuild runs a matrix multiplication (not an elementwise pass): the offloader only runs it when
            asked to (``rebuild="norms+gemms"``), as it costs compute time in backward.

    Raises:
        OffloadError: ``rebuild`` is ``None`` and the Function declares no ``llmfast_rebuild``.

    Example::

        ctx.save_for_backward(x, weight, rstd)
        out = normalize(x, weight, rstd)
        mark_rebuildable(ctx, out)
        return out
    """
    if torch.compiler.is_compiling():
        return  # traced: the compiled graph saves for backward its own way (and Dynamo cannot trace the query below)
    if output.is_inference():
        return  # made under inference_mode (Trainer.validate/test/predict): no backward, and no version counter
    if rebuild is None:
        rebuild = getattr(getattr(type(ctx), "_forward_cls", None), "llmfast_rebuild", None)
        if rebuild is None:
            raise OffloadError(
                "mark_rebuildable: pass rebuild=(ctx, *saved_tensors) -> output, or declare llmfast_rebuild on the "
                f"Function ({type(ctx).__name__} has none)"
            )
    record = RebuildRecord(
        rebuild=rebuild,
        output=weakref.ref(output),
        output_version=output._version,
        pack_hook=_weak(_active_pack_hook()),
        gemm=gemm,
    )
    setattr(ctx, _ATTRIBUTE, record)


def rebuild_record(node: Any) -> RebuildRecord | None:
    """The :class:`RebuildRecord` of an autograd node (a custom Function's ctx), or ``None``."""
    return getattr(node, _ATTRIBUTE, None)


def rebuild_origin(fn: Any, source: tuple[Any, int] | None) -> tuple[Any, int] | None:
    """The ``(node, output_nr)`` whose record could give a saved tensor back, or ``None``.

    ``fn`` made the tensor's base; ``source``: the input of ``fn`` if it is a cast (``ToCopyBackward0``). A cast's
    origin is the output it copied, through reshapes (MoE blocks flatten tokens before the router: a reshape keeps the
    row-major order, so the rebuilt output reshaped to the copy's shape has the same values). For a non-cast the
    output number is the base's (``-1`` here).
    """
    if source is None:
        node, output_nr = fn, -1
    else:
        node, output_nr = source
        while node is not None and node.name() in _RESHAPES and node.next_functions:
            node, output_nr = node.next_functions[0]
    return (node, output_nr) if getattr(node, _ATTRIBUTE, None) is not None else None


def _active_pack_hook() -> Any:
    # Private but stable since torch 2.0 (torch.utils.checkpoint uses it); without it nothing is ever rebuilt.
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):
        return None
    return hooks[0] if hooks else None


def _weak(hook: Any) -> Callable[[], Any] | None:
    """A weak reference to ``hook`` (a bound method needs :class:`weakref.WeakMethod`: it is made anew per access)."""
    if hook is None:
        return None
    if inspect.ismethod(hook):
        return weakref.WeakMethod(hook)
    try:
        return weakref.ref(hook)
    except TypeError:  # a builtin: lives as long as the process anyway
        return lambda: hook
