"""Selective activation recomputation: keep what is expensive to recompute, recompute the rest in backward.

A transformer layer saves far more for backward than its expensive ops produce: norms, RoPE, SwiGLU, residual adds,
routing gathers and autocast's bf16 copies of every weight are cheap, memory-bound work whose outputs autograd keeps
alive until backward. :func:`recompute_policy` keeps only the outputs of matmuls, grouped GEMMs, attention kernels and
the router's ``topk``; everything else is recomputed during the layer's backward from those and the layer's input
(``torch.utils.checkpoint`` with selective-checkpoint contexts). On the reference model this cuts what a layer holds
for backward by 40% (CPU, bf16 autocast: 15.0 MB to 9.0 MB per layer at ``T=1024, H=256``; the layer itself already
keeps no permuted expert rows, see :mod:`lightning_llmfast.moe.experts`; before that, 51% of peak activation memory
on an H200), with bit-identical gradients. The price is the replay: in eager mode every op of the
layer goes through Python dispatch twice, which cost 2.6x step time on an H200 at hidden 1024, where the forward is
launch-bound. Use it when memory, not speed, is the limit.

:class:`~lightning_llmfast.offload.ActivationOffloader` (``recompute="selective"``) applies it to the layers it does not
offload: copies over PCIe hide behind compute for only a few layers, and recomputation covers the others.

Caveat (as for any activation checkpointing): a layer's forward runs twice, so side effects in it run twice.
Module hooks of the wrapped layer itself do not run again; hooks of its submodules do. Routing decisions are saved,
so a router whose state changes in forward (an expert bias) recomputes the same assignment.

Example::

    handle = recompute_layer(model.layers[3])
    model(x).sum().backward()  # layer 3 keeps matmul/attention outputs only and recomputes the rest
    handle.remove()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_llmfast._autograd import in_backward
from lightning_llmfast.seqmeta.cache import activate_cache, active_cache

__all__ = [
    "RECOMPUTE_MODES",
    "RecomputeHandle",
    "recompute_layer",
    "recompute_policy",
    "saved_by_policy",
]

RECOMPUTE_MODES = (None, "selective")

# Ops whose outputs are kept: recomputing them would cost real FLOPs (matmuls, grouped expert GEMMs).
# `swiglu_down` and `permute_grouped_mm` are the experts' down and gate/up GEMMs with their activation or gather fused
# in (lightning_llmfast.moe.expert_ops).
_SAVED_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "grouped_mm", "_scaled_mm", "swiglu_down", "permute_grouped_mm"}
)
# Routing decisions are kept too (small: (T, k)), so recomputation can never pick other experts than the forward did
# (an expert bias updated in forward, or ties broken differently).
_ROUTING_OPS = frozenset({"topk"})


def _op_name(op: Any) -> str:
    return str(getattr(op, "overloadpacket", op)).rsplit(".", 1)[-1]


def recompute_policy(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save matmul, grouped GEMM, attention and ``topk`` outputs; recompute the rest.

    Attention kernels are recognised by name (``*attention*``/``*attn*`` forward ops: SDPA's flash, efficient and
    cuDNN kernels and ``torch.nn.attention.varlen``'s op), so new backends are covered without a list of each.

    Example::

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        ctx = functools.partial(create_selective_checkpoint_contexts, recompute_policy)
        y = checkpoint(layer, x, use_reentrant=False, context_fn=ctx)
    """
    return _policy_for(op)


def saved_by_policy(op: Any) -> bool:
    """Whether :func:`recompute_policy` saves ``op``'s outputs (instead of recomputing them).

    Example::

        saved_by_policy(torch.ops.aten.mm.default), saved_by_policy(torch.ops.aten.mul.Tensor)  # (True, False)
    """
    return _policy_for(op) == CheckpointPolicy.MUST_SAVE


@functools.lru_cache(maxsize=4096)
def _policy_for(op: Any) -> CheckpointPolicy:
    # Called for every op of a recomputed layer's forward: decided once per op overload.
    name = _op_name(op)
    attention = ("attention" in name or "attn" in name) and "backward" not in name
    if attention or name in _SAVED_OPS or name in _ROUTING_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeContext:
    """The recomputation's context: the selective-checkpoint mode plus the forward's metadata cache.

    CUDA backward runs on the autograd engine's thread, where the forward's thread-local metadata cache is not
    active: the recomputed attention must see the same cache (still open: its version ends after the step). Entered
    once per recomputation: a second backward over a retained graph recomputes again (a generator-based context
    manager can be entered only once).
    """

    def __init__(self, recompute: contextlib.AbstractContextManager[Any], cache: Any) -> None:
        self._recompute = recompute
        self._cache = cache
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self._recompute)
        stack.enter_context(activate_cache(self._cache))
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def _stored_policy(on_stored: Callable[[torch.Tensor], None], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`recompute_policy`, handing each output it keeps in the forward to ``on_stored``."""
    policy = _policy_for(op)
    if policy == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
        for out in tree_leaves(getattr(ctx, "op_output", None)):
            if isinstance(out, torch.Tensor):
                on_stored(out)
    return policy


def _contexts(cache: Any, on_stored: Callable[[torch.Tensor], None] | None) -> tuple[Any, Any]:
    policy = recompute_policy if on_stored is None else functools.partial(_stored_policy, on_stored)
    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, _RecomputeContext(recompute, cache)


class RecomputeHandle:
    """Undo :func:`recompute_layer`: ``remove()`` restores the layer's own ``forward``."""

    def __init__(self, layer: nn.Module, previous: Callable[..., Any] | None) -> None:
        self._layer: nn.Module | None = layer
        self._previous = previous

    def remove(self) -> None:
        """Restore the layer (idempotent)."""
        layer, self._layer = self._layer, None
        if layer is None:
            return
        if self._previous is None:
            del layer.forward
        else:
            layer.forward = self._previous  # type: ignore[method-assign]


def recompute_layer(layer: nn.Module, on_stored: Callable[[torch.Tensor], None] | None = None) -> RecomputeHandle:
    """Run ``layer`` under selective recomputation (:func:`recompute_policy`) whenever it runs with grad enabled.

    The layer keeps its class, parameters, state-dict keys and hooks: only its ``forward`` attribute is replaced
    on the instance, and :meth:`RecomputeHandle.remove` puts it back.

    Args:
        layer: one transformer block (any ``nn.Module``).
        on_stored: called in forward with each output the policy keeps for backward (the offloader counts them).

    Returns:
        A handle whose ``remove()`` undoes the wrapping.

    Example::

        handles = [recompute_layer(block) for block in model.layers[:-1]]
        ...
        for h in handles:
            h.remove()
    """
    previous = layer.__dict__.get("forward")
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or in_backward():
            return inner(*args, **kwargs)  # eval, or already inside a recomputation / create_graph backward
        context_fn = functools.partial(_contexts, active_cache(), on_stored)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    layer.forward = forward  # type: ignore[method-assign]
    return RecomputeHandle(layer, previous)
