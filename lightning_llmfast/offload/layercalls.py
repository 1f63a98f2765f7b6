"""The hooks an offloader installs: on the layers (their calls), on autograd nodes (a layer's backward begins) and
the saved-tensor hooks. Each holds the offloader weakly, and each tells apart what a layer call saves.

Every saved tensor's record in the autograd graph holds the hooks it was packed with, and a node holds its pre-hooks;
a graph kept past its step (a model keeping its last routing plan for a loss) would otherwise hold the offloader, its
layers and the model through C++, where the garbage collector cannot see the cycle.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_llmfast._autograd import in_backward
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Recipe, Saved, Segment, kept

__all__ = ["LayerCalls", "layer_post", "layer_pre", "saved_tensor_hooks"]


class LayerCalls:
    """What the offloader does when a tracked layer's forward begins and ends; the attributes are its state."""

    layers: list[torch.nn.Module]
    _copier: Copier | None
    _packing: bool
    _hot: bool
    _unsharding: bool
    _param_ptrs: set[int]
    _shared_inputs: set[int]
    _autocast_caches: bool
    _planned: int | None
    _partial: int
    _measuring: bool
    _segments: list[Segment]
    _current: Segment | None
    _offload_calls: set[int]
    _unassigned: list[Saved]
    _pending_sources: list[Any]
    _counters: dict[str, int]
    _weak_self: weakref.ref[Any]
    config: Any

    def _layer_begins(self, index: int, inputs: Any) -> None:
        if not self._packing or in_backward():
            return
        if self._unsharding:  # FSDP2 unsharded this layer's parameters in its own pre-hook, registered earlier
            self._param_ptrs.update(p.untyped_storage().data_ptr() for p in self.layers[index].parameters())
        # Inputs that need no grad (RoPE tables, masks, ids) are shared by every layer and alive outside it:
        # offloading them would copy them once per layer and free nothing.
        self._shared_inputs = {t.untyped_storage().data_ptr() for t in _tensors(inputs) if not t.requires_grad}
        self._autocast_caches = self._copier is not None and (
            torch.is_autocast_cache_enabled() and torch.is_autocast_enabled(self._copier.device.type)
        )
        planned = self._planned if self._copier is not None else None
        partial = planned is not None and index == planned and self._partial > 0
        seg = Segment(
            index=len(self._segments),
            layer_index=index,
            offload=planned is not None and (index < planned or partial),
            budget=self._partial if partial else None,
        )
        seg.keeps = not seg.offload and not self._measuring
        self._segments.append(seg)
        self._counters["segments"] += 1
        self._current = seg
        if seg.offload:
            self._offload_calls.add(index)
        self._hot = self._wants_pack(seg)
        for saved in self._unassigned:
            assert saved.tensor is not None
            if saved.tensor.untyped_storage().data_ptr() in self._shared_inputs:
                continue
            if seg.offload:
                self._offload(saved, seg)  # over a partial layer's budget it stays on the device
            elif self._measuring:
                self._measure(saved.tensor, seg)
        self._unassigned.clear()
        if self._measuring:
            assert self._copier is not None
            seg.started = self._copier.timestamp()

    def _layer_ends(self, output: Any) -> None:
        seg = self._current
        if seg is None or in_backward():
            return
        self._current = None
        self._shared_inputs = set()
        if self._measuring:
            assert self._copier is not None
            seg.ended = self._copier.timestamp()
        self._send(seg)
        self._hot = self._wants_pack(None)
        # Dedup entries are only valid while this layer's sources are referenced; after it, an address could be
        # reused by a new tensor, so the map is dropped and the sources become releasable.
        seg.dedup.clear()
        # Likewise the rebuild map (read while packing only): the handles own their Shared from here, so a rebuilt
        # tensor that one op never reads back dies with that op's node, not at the end of the step.
        seg.rebuilt.clear()
        self._pending_sources.extend(b for b in seg.blocks if b.source is not None)
        self._release_sources()
        grad_fn = next((t.grad_fn for t in _tensors(output) if t.grad_fn is not None), None)
        if grad_fn is not None:
            grad_fn.register_prehook(functools.partial(_backward_begins, self._weak_self, seg.index))

    def _wants_pack(self, seg: Segment | None) -> bool:
        """Whether saved tensors need a look now: inside any layer call (offloading, measuring, or rebuilding) or
        between layers before the last offloading call (checkpoint inputs).

        Every other saved tensor (the embedding, the head and loss) returns from the pack hook at once: on a
        launch-bound forward the hook's cost is step time.
        """
        if self._copier is None or not self._packing:
            return False
        if seg is not None:
            return seg.offload or self._measuring or self.config.rebuild is not None
        return len(self._offload_calls) < (self._planned or 0) + (1 if self._partial else 0)


def saved_tensor_hooks(offloader: weakref.ref[Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``(pack, unpack)`` saved-tensor hooks of an offloader, holding it weakly."""

    def pack(t: torch.Tensor) -> Any:
        live = offloader()
        return live._pack(t) if live is not None else kept(t)

    def unpack(saved: Any) -> torch.Tensor:
        live = offloader()
        if live is not None:
            return live._unpack(saved)
        if isinstance(saved, Recipe):
            return saved.unpack(dict.fromkeys(("rebuilds",), 0))
        if isinstance(saved, Saved):
            if saved.tensor is None:
                raise OffloadError("ActivationOffloader: a saved activation was unpacked after its offloader was freed")
            return saved.tensor
        return saved

    return pack, unpack


def layer_pre(offloader: weakref.ref[Any], index: int, _module: Any, args: Any, kwargs: Any) -> None:
    live = offloader()
    if live is not None:
        live._layer_begins(index, (args, kwargs))


def layer_post(offloader: weakref.ref[Any], _module: Any, _args: Any, output: Any) -> None:
    live = offloader()
    if live is not None:
        live._layer_ends(output)


def _backward_begins(offloader: weakref.ref[Any], seg_index: int, _grads: Any) -> None:
    # Held weakly: the hook lives on an autograd node, which a graph kept past the step (a model that keeps its last
    # routing plan) keeps alive; through C++, where the garbage collector cannot see a cycle back to the layers.
    live = offloader()
    if live is not None:
        live._backward_begins(seg_index)


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module output (tensor, tuple/list, dict)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
