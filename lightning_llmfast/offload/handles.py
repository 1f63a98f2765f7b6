"""Saved-tensor handles: what the offloader's pack hook returns instead of a tensor, and how each gives it back.

- :class:`Saved`: a tensor kept on the device, or a view recipe into an offloaded :class:`Block` (one per storage).
- :class:`Recast`: a parameter's low-precision copy (autocast's bf16 weight), cast again in backward.
- :class:`Rebuilt`: an output of a Function that declared a rebuild (:mod:`~lightning_llmfast._rebuild`), or
  a dtype/device copy of one, rebuilt once for all reads of one layer call's backward (:class:`Shared`).

No handle holds a tensor with its ``grad_fn`` or an autograd node strongly (see :func:`kept`): a graph whose backward
never runs is then freed like any other.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_llmfast._autograd import in_backward
from lightning_llmfast.errors import OffloadError

__all__ = ["Block", "Recast", "Rebuilt", "Recipe", "Saved", "Segment", "Shared", "View", "kept", "view_of"]

# (size, stride, storage_offset) of a saved view of a dropped tensor, for ``as_strided``.
View = tuple[tuple[int, ...], tuple[int, ...], int]
# Rebuilds in progress on this thread (ids of Rebuilt handles): a rebuild that needs itself is a contract violation.
_REBUILDING = threading.local()


def kept(t: torch.Tensor) -> torch.Tensor:
    """What the pack hook returns for a tensor that stays on the device: ``t`` without its ``grad_fn``.

    Under saved-tensor hooks autograd gives the unpacked tensor its graph edge from its own records, so the packed
    object needs only the data. ``t`` itself would let a node that saves its own output (``exp``, ``sigmoid``, most
    custom Functions) own itself through ``t.grad_fn``: a cycle through C++ that the garbage collector cannot see,
    broken only when that node's backward runs. A node whose backward never runs (an output that does not reach the
    loss, a backward that raised) would then keep its whole graph alive, and through it every earlier node.
    """
    return t if t.grad_fn is None else t.detach()


def view_of(t: torch.Tensor, base: torch.Tensor) -> View | None:
    """What ``as_strided`` on ``base`` gives ``t`` back; ``None`` when ``t`` is ``base``."""
    return None if t is base else (tuple(t.shape), t.stride(), t.storage_offset())


@dataclass(eq=False)
class Block:
    """One offloaded storage: host copy, its events, and where it was reloaded on the device."""

    nbytes: int
    segment: int
    host: torch.Tensor | None = None  # pooled (capacity,) uint8 buffer
    source: torch.Tensor | None = None  # (nbytes,) uint8 device view, alive until the device-to-host copy is done
    d2h_event: Any = None
    flat: torch.Tensor | None = None  # device buffer set it was prefetched into
    offset: int = 0
    set_index: int = -1
    h2d_event: Any = None
    reads: list[Any] = field(default_factory=list)  # events of every host-to-device copy from `host`
    to_nvme: bool = False  # spilled to the NVMe tier instead of a host buffer (`host` stays None)
    spill: Any = None  # its file (nvme.Spill) once the write was issued


@dataclass(eq=False)
class Shared:
    """One dropped tensor (a rebuildable output or a copy of one) that several saved handles of a layer call view:
    rebuilt once in backward and held from the first read in backward (a saver's, or another handle's rebuild's)
    until each handle's saver has read it, or the handles are freed.

    Two ops can save the same copy: the router's matmul and the experts' grouped GEMM both keep the normalised
    tokens' bf16 copy, which is rebuilt (a norm) once for both, and for the gate/up output's rebuild.
    """

    pending: int = 0  # handles on this storage whose consumer has not unpacked them yet
    tensor: torch.Tensor | None = None  # the rebuilt storage's tensor while `pending`
    version: int = 0  # its version when rebuilt: a consumer that changed it in place makes the next unpack rebuild


@dataclass(eq=False)
class Segment:
    """One call of one tracked layer in this step's forward: its handles' blocks and, when measuring, its numbers."""

    index: int
    layer_index: int
    offload: bool
    budget: int | None = None  # bytes this call may offload (the "auto" plan's partial layer); None: all
    keeps: bool = False  # neither offloads nor measures: only parameter copies and rebuildable outputs are dropped
    to_nvme: bool = False  # a memory plan sends what it offloads to the NVMe tier
    offloaded: int = 0
    blocks: list[Block] = field(default_factory=list)
    dedup: dict[tuple[int, int], Block] = field(default_factory=dict)  # (storage ptr, version) -> block
    unsent: list[Block] = field(default_factory=list)  # offloaded in this call, device-to-host copy not issued yet
    prefetched: bool = False
    # "auto" measuring step only: what this call would offload and when its forward started and ended.
    # (storage ptr, version) -> weakref of that storage: an address freed and reused since is a new storage
    seen: dict[tuple[int, int], Any] = field(default_factory=dict)
    # (storage ptr, version) of a dropped storage -> (weakref of the tensor its handles rebuild, their Shared)
    rebuilt: dict[tuple[int, int], tuple[Any, Shared]] = field(default_factory=dict)
    candidate_bytes: int = 0
    candidate_sizes: list[int] = field(default_factory=list)  # the bytes of each storage counted, in order
    must_save: Any = None  # a MustSaveCounter while this call's forward runs in a memory plan's warm-up step
    recompute_keeps: int = 0  # what selective recomputation of this call would keep (must_save.py)
    started: Any = None
    ended: Any = None
    backward_started: Any = None
    backward_allocated: int | None = None  # device bytes allocated when this call's backward started


@dataclass(eq=False)
class Saved:
    """Handle returned by the pack hook: either the tensor itself (kept) or a view recipe into a block."""

    tensor: torch.Tensor | None
    block: Block | None = None
    dtype: torch.dtype = torch.float32
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    storage_offset: int = 0


class Recipe:
    """A saved tensor dropped in forward and rebuilt in backward: a base tensor that :meth:`base` rebuilds, or a view
    (``view``) of it; rebuilt outputs are shared with the other handles on that very tensor in its layer call."""

    shared: Shared | None  # None: rebuilt on every read (weight copies: one cast each)
    consumed: bool  # whether its saver has read it (handles with a Shared only)
    # (size, stride, storage_offset) of the saved view; None: the base itself, returned without an as_strided (most
    # reads: one dispatch less)
    view: View | None

    def base(self) -> torch.Tensor:
        """The whole saved tensor that the handle views, rebuilt."""
        raise NotImplementedError

    def unpack(self, counters: dict[str, int]) -> torch.Tensor:
        shared = self.shared
        if shared is None:  # a handle of its own
            counters["rebuilds"] += 1
            return self._viewed(self.base())
        base = shared.tensor
        if base is None or base._version != shared.version:
            base = self.base()
            shared.version = base._version
            counters["rebuilds"] += 1
        # Held for the consumers still to read it: from a consumer's read, or from a read by another handle's
        # rebuild, which is not its consumer (the gate/up output's rebuild reads the experts' input, which their
        # GEMM's backward reads next: rebuilding it again is a norm, several launches of a launch-bound backward).
        # Never from a read outside backward (grad_fn._saved_*): that would add to forward's memory.
        if in_backward():
            if not self.consumed and not getattr(_REBUILDING, "ids", None):
                self.consumed = True
                shared.pending -= 1
            shared.tensor = base if shared.pending > 0 else None
        return self._viewed(base)

    def _viewed(self, base: torch.Tensor) -> torch.Tensor:
        return base if self.view is None else base.as_strided(*self.view)


@dataclass(eq=False)
class Recast(Recipe):
    """Handle for a saved low-precision copy of a parameter (autocast's cast).

    Backward casts the parameter again instead of keeping the copy: the same ``_to_copy`` of the same values gives the
    same bits, costs one elementwise kernel, and neither device memory nor bus time. That needs the parameter unchanged
    until backward: an in-place change raises (its version counter moved); a write through ``.data``, which moves no
    counter, cannot be seen.
    """

    param: torch.Tensor
    version: int
    dtype: torch.dtype
    view: View | None
    # Never shared: each matmul saves the copy it made (autocast without its cache casts per call), and a copy is one
    # cast kernel, so it is rebuilt for each read rather than held (held from a gate/up output's rebuild to the
    # experts' backward, it raised the backward peak).
    shared: None = None

    def base(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise OffloadError(
                "ActivationOffloader: a parameter was modified in place between forward and backward; its "
                "low-precision copy saved for backward can no longer be rebuilt (step the optimizer after backward)"
            )
        # Not detached: under create_graph the rebuilt copy keeps the cast's path to the parameter.
        return self.param.to(self.dtype)


@dataclass(eq=False)
class Rebuilt(Recipe):
    """Handle for a saved output of a Function that can rebuild it, or for a dtype/device copy of such an output
    (autocast's bf16 input of the next matmul).

    Backward asks that Function's node for its saved tensors (through the offloader's own unpack, so an offloaded
    input is reloaded first) and runs the rebuild: the same ops on the same values, so the same bits. The node is held
    weakly: the saver's own graph edge keeps it alive as long as the handle can be read. Limits: as for every saved
    tensor under these hooks, an in-place change of the Function's saved inputs between forward and backward is not
    detected (autograd skips its version check for hooked tensors); and the rebuild needs the Function's saved
    tensors, so a backward that runs only the consumer after the Function's own backward freed them raises.
    """

    node: weakref.ref[Any]  # the Function's backward node (its ctx): saved tensors and attributes
    function: Callable[..., torch.Tensor]  # the record's rebuild
    copy_to: tuple[torch.device, torch.dtype] | None  # the copy's device and dtype; None: the output itself
    shape: tuple[int, ...]  # of the saved tensor's base: the output's, or a reshape of it
    view: View | None
    shared: Shared
    consumed: bool = False

    def base(self) -> torch.Tensor:
        node = self.node()
        if node is None:
            raise OffloadError("ActivationOffloader: a rebuilt tensor was read after the graph that made it was freed")
        busy = _REBUILDING.__dict__.setdefault("ids", set())  # per thread: backward may run on several at once
        if id(self) in busy:  # the Function saved its own output: rebuilding it would need itself
            raise OffloadError(
                f"ActivationOffloader: {type(node).__name__} saves its own output, so it cannot declare "
                "llmfast_rebuild (the rebuild would need the tensor it rebuilds)"
            )
        busy.add(id(self))
        try:
            out = self.function(node, *node.saved_tensors)
        finally:
            busy.discard(id(self))
        if self.copy_to is not None:
            out = out.to(*self.copy_to)
        # Row-major, as the saved copy was: a non-contiguous output (a norm of a transpose) keeps its strides in .to().
        return out.contiguous().reshape(self.shape)
