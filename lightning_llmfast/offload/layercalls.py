"""The layer-call policy: which call of which layer is running, and what it does with what it saves (offload, measure
for the ``"auto"`` plan, or keep); plus the hooks an offloader installs, each holding it weakly.

Every saved tensor's record in the autograd graph holds the hooks it was packed with, and a node holds its pre-hooks;
a graph kept past its step (a model keeping its last routing plan for a loss) would otherwise hold the offloader, its
layers and the model through C++, where the garbage collector cannot see the cycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Recipe, Saved, Segment, kept

__all__ = [
    "LayerCalls",
    "backward_begins",
    "layer_post",
    "layer_pre",
    "saved_tensor_hooks",
    "tensors_in",
]


class LayerCalls:
    """The policy over layer calls: the plan (how many leading layers offload, and a partial budget for the next),
    this step's calls (:class:`~.handles.Segment`) and the one running now.

    Args:
        config: the settings; ``offload_layers`` and ``keep_last_layers`` give the plan (``"auto"``: none until
            :meth:`adopt`).
        num_layers: how many layers are tracked.

    Example::

        calls = LayerCalls(OffloadConfig(offload_layers=2), num_layers=4)
        calls.begin_step(copier)
        seg, waiting = calls.enter(0)  # seg.offload is True
    """

    def __init__(self, config: OffloadConfig, num_layers: int) -> None:
        self.config = config
        self.eligible = max(num_layers - config.keep_last_layers, 0)
        layers = config.offload_layers
        # How many leading layers offload; None until an "auto" plan is made after its measuring step.
        self.planned: int | None = None
        if layers != "auto" and config.plan is None:
            self.planned = self.eligible if layers is None else min(layers, self.eligible)
        self.partial = 0  # bytes layer `planned` offloads too ("auto": what whole layers left of the budget)
        self.chosen: frozenset[int] | None = None  # a memory plan's offloading layers (then `planned` counts them)
        self.nvme: frozenset[int] = frozenset()  # of those, the ones it sends to the NVMe tier
        self.budgets: dict[int, int] = {}  # of those, the ones that offload only their first bytes: how many
        self.measuring = False
        self.probing = False  # a measuring step in which every eligible layer offloads (its times are the probe's)
        # A memory plan compares what its steps keep with its prediction: every layer call counts what it keeps.
        self.accounting = config.plan == "auto"
        self.packing = False  # inside the forward of a step
        self.hot = False  # whether the pack hook looks at saved tensors at all (see wants_pack)
        self.segments: list[Segment] = []
        self.current: Segment | None = None
        self.unassigned: list[Saved] = []  # saved between two layer calls: placed when the next one starts
        self.calls = 0  # layer calls in this step
        self._copier: Copier | None = None
        self._offload_calls: set[int] = set()  # offloading layers called in this forward

    def begin_step(self, copier: Copier | None) -> None:
        """A new step: copies go through ``copier`` (``None``: offload is off); measure if there is no plan yet."""
        self._copier = copier
        self.measuring = copier is not None and self.planned is None
        self.calls = 0

    def adopt(self, planned: int, partial: int) -> None:
        """Adopt a plan: the first ``planned`` layers offload, and layer ``planned`` its first ``partial`` bytes."""
        self.planned, self.partial = planned, partial

    def adopt_layers(
        self, layers: frozenset[int], nvme: frozenset[int] = frozenset(), budgets: dict[int, int] | None = None
    ) -> None:
        """Adopt a memory plan: exactly ``layers`` offload, those in ``nvme`` to the NVMe tier, those in ``budgets``
        only their first that many bytes (their first storages in save order)."""
        self.chosen, self.planned, self.partial, self.nvme = layers, len(layers), 0, nvme
        self.budgets, self.probing = dict(budgets or {}), False

    def spilling(self, index: int) -> bool:
        """Whether layer ``index``'s offloads may go to the NVMe tier this step: a memory plan sends it there, or,
        without one, it offloads and the pinned budget decides (used once the tier has failed in a step)."""
        if self.chosen is not None:
            return index in self.nvme
        return self.planned is not None and (index < self.planned or (index == self.planned and self.partial > 0))

    def offload_layers(self) -> int:
        """How many leading layers offload under the plan (0 while measuring)."""
        return self.planned or 0

    def begin_forward(self) -> None:
        self.packing = True
        self._offload_calls = set()
        self.hot = self.wants_pack(None)

    def end_forward(self) -> None:
        """Leave the forward; what was saved after the last layer stays on the device."""
        self.packing = False
        self.hot = False
        self.current = None
        self.unassigned.clear()

    def take(self) -> list[Segment]:
        """End the step's forward and hand over its layer calls (the step keeps none after this)."""
        self.end_forward()
        segments, self.segments = self.segments, []
        return segments

    def enter(self, index: int) -> tuple[Segment, list[Saved]]:
        """Layer ``index`` starts: its call, and the tensors saved since the previous call (now the caller's)."""
        planned = self.planned if self._copier is not None else None
        partial = planned is not None and index == planned and self.partial > 0
        probe = self.probing and self.measuring and index < self.eligible
        seg = Segment(
            index=len(self.segments),
            layer_index=index,
            offload=probe
            or (
                planned is not None
                and (index in self.chosen if self.chosen is not None else index < planned or partial)
            ),
            budget=self.partial if partial else self.budgets.get(index),
        )
        seg.keeps = not seg.offload and not self.measuring and not self.accounting
        seg.to_nvme = seg.offload and index in self.nvme
        self.segments.append(seg)
        self.calls += 1
        self.current = seg
        if seg.offload:
            self._offload_calls.add(index)
        self.hot = self.wants_pack(seg)
        waiting, self.unassigned = self.unassigned, []
        return seg, waiting

    def started(self, seg: Segment) -> None:
        """Timestamp the start of ``seg``'s forward (measuring steps only)."""
        if self.measuring:
            assert self._copier is not None
            seg.started = self._copier.timestamp()

    def leave(self) -> Segment | None:
        """The running layer call ends: it, or ``None`` when none runs."""
        seg, self.current = self.current, None
        self.hot = self.wants_pack(None)
        return seg

    def ended(self, seg: Segment) -> None:
        """Timestamp the end of ``seg``'s forward, after the offloader's work on it (measuring steps only)."""
        if self.measuring:
            assert self._copier is not None
            seg.ended = self._copier.timestamp()

    def backward_started(self, seg_index: int) -> None:
        """Layer call ``seg_index``'s backward starts (measuring steps record when and the memory then)."""
        seg = self.segments[seg_index]
        if self.measuring and seg.backward_started is None:
            assert self._copier is not None
            seg.backward_started = self._copier.timestamp()
            seg.backward_allocated = self._copier.allocated()

    def counts(self) -> bool:
        """Whether layer calls that keep what they save count it (the measuring step, and steps of a memory plan)."""
        return self.measuring or self.accounting

    def wants_pack(self, seg: Segment | None) -> bool:
        """Whether saved tensors need a look now: inside any layer call (offloading, measuring, counting, rebuilding) or
        between layers before the last offloading call (checkpoint inputs).

        Every other saved tensor (the embedding, the head and loss) returns from the pack hook at once: on a
        launch-bound forward the hook's cost is step time.
        """
        if self._copier is None or not self.packing:
            return False
        if seg is not None:
            return seg.offload or self.measuring or self.accounting or self.config.rebuild is not None
        return len(self._offload_calls) < (self.planned or 0) + (1 if self.partial else 0)


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


def backward_begins(offloader: weakref.ref[Any], seg_index: int, _grads: Any) -> None:
    # Held weakly: the hook lives on an autograd node, which a graph kept past the step (a model that keeps its last
    # routing plan) keeps alive; through C++, where the garbage collector cannot see a cycle back to the layers.
    live = offloader()
    if live is not None:
        live._backward_begins(seg_index)


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module output or inputs (tensor, tuple/list, dict)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors_in(item)
