"""Double-buffered activation offload through ``saved_tensors_hooks`` (plain PyTorch, no Lightning): the lifecycle.

Forward: every tensor autograd saves inside one of the tracked layers (except parameters, buffers, tensors under
``min_offload_bytes`` and the last ``keep_last_layers`` layers) is copied, one copy per *storage* (views and tensors
sharing a storage are deduplicated), into a pooled pinned host buffer on a device-to-host stream. The source stays
referenced until that copy's event has completed, so the caching allocator can never hand its memory to another
kernel while the copy still reads it.

Backward: when layer ``i``'s backward starts (a pre-hook on the grad_fn of the layer's output), the host-to-device
copies of layers ``i - 1 ... i - prefetch_layers`` are issued into one of ``prefetch_layers + 1`` device buffer sets
used round-robin, so they overlap layer ``i``'s compute. Each unpack makes the compute stream wait on its own copy
event; a tensor unpacked before its prefetch was issued is reloaded lazily (``stats["lazy_reloads"]``).

Rebuilds (``rebuild="norms"``, independent of copying): a saved low-precision copy of a parameter is cast again in
backward, and a saved output of a Function marked with :func:`~lightning_llmfast.offload.mark_rebuildable` (or a
copy of one) is rebuilt from what that Function saved; with ``"norms+gemms"`` GEMM outputs too.

The parts: :mod:`.config` (settings), :mod:`.plan` and :mod:`.measure` (the ``"auto"`` schedule), :mod:`.copier`
(CUDA streams or synchronous CPU copies), :mod:`.packing` and :mod:`.handles` (the pack hook and what it returns),
:mod:`.reload` (copies, prefetch, unpack, release), :mod:`.rebuild` (the protocol with Functions), :mod:`.pool`.

On CPU (``force=True``) there are no streams: the same bookkeeping runs with synchronous copies, which is how the
tests prove bit-identical gradients, deduplication, pool reuse and prefetch ordering without a GPU.

Example::

    offloader = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True))
    with offloader:
        model(x).sum().backward()
    print(offloader.stats["offloaded_bytes"])
    offloader.close()
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor as _DTensor

from lightning_llmfast._layers import LayersSpec
from lightning_llmfast._layers import resolve_layers as _resolve
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload import measure
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier, make_copier
from lightning_llmfast.offload.handles import Block, Saved, Segment
from lightning_llmfast.offload.layercalls import LayerCalls, layer_post, layer_pre, saved_tensor_hooks
from lightning_llmfast.offload.packing import Packer
from lightning_llmfast.offload.pool import PinnedBufferPool
from lightning_llmfast.offload.recompute import RecomputeHandle, recompute_layer
from lightning_llmfast.offload.reload import Reloader
from lightning_llmfast.offload.residents import Residents

__all__ = ["ActivationOffloader", "resolve_layers"]

_COUNTERS = (
    "offloaded_bytes",
    "offloaded_tensors",
    "dedup_hits",
    "prefetch_hits",
    "lazy_reloads",
    "segments",
    "recompute_layers",
    "kept_casts",
    "recast_casts",
    "recast_bytes",
    "rebuilt_tensors",
    "rebuilt_bytes",
    "rebuilds",
)


def resolve_layers(root: nn.Module, layers: LayersSpec) -> list[nn.Module]:
    """The layer stack whose activations are offloaded: ``None`` (the largest ``nn.ModuleList`` of identical
    blocks), an attribute path such as ``"model.layers"``, or the modules (one module is a stack of one).

    Raises:
        OffloadError: when nothing matches.

    Example::

        layers = resolve_layers(model, "layers")
    """
    return _resolve(root, layers, error=OffloadError, single=True)


class ActivationOffloader(LayerCalls, Packer, Reloader):
    """Offload saved activations of a layer stack to pinned host memory and prefetch them in backward.

    Use it as a context manager around forward *and* backward of one step, or call :meth:`begin_step`,
    :meth:`forward_context` and :meth:`end_step` yourself; :meth:`close` releases everything.

    Args:
        layers: the blocks, in execution order (e.g. ``model.layers``). Tensors saved inside a block call belong
            to it; tensors saved between two block calls (e.g. ``torch.utils.checkpoint`` inputs saved just before
            the block runs) belong to the next block; tensors saved before the first or after the last block stay
            on the device, and so do a block's inputs that need no grad (RoPE tables, masks: shared by all blocks).
        config: the settings (:class:`~lightning_llmfast.offload.OffloadConfig`).
        **settings: instead of ``config``, its fields as keyword arguments (and ``rebuild_gemms``, the older
            spelling of ``rebuild="norms+gemms"``).

    Raises:
        OffloadError: on a bad setting (see :class:`~lightning_llmfast.offload.OffloadConfig`), both a config and
            keyword arguments, or an empty layer list.

    Example::

        off = ActivationOffloader(model.layers, min_offload_bytes=1 << 20, offload_layers="auto")
        for x in loader:
            with off:
                model(x).mean().backward()
            opt.step()
        off.close()
    """

    def __init__(
        self, layers: Sequence[nn.Module] | nn.Module, config: OffloadConfig | None = None, **settings: Any
    ) -> None:
        self.config = OffloadConfig.from_kwargs(config, owner="ActivationOffloader", **settings)
        if layers is None or isinstance(layers, str):
            raise OffloadError(
                f"ActivationOffloader: layers must be the modules (e.g. model.layers), got {layers!r}; "
                "resolve names with resolve_layers(model, ...)"
            )
        self.layers = resolve_layers(nn.Module(), layers)
        self.prefetch_layers = self.config.prefetch_layers
        eligible = max(len(self.layers) - self.config.keep_last_layers, 0)
        offload_layers = self.config.offload_layers
        # How many leading layers offload; None until the "auto" plan is made after its measuring step.
        self._planned: int | None = None
        if offload_layers != "auto":
            self._planned = eligible if offload_layers is None else min(offload_layers, eligible)
        self._partial = 0  # bytes layer `_planned` offloads too ("auto": what whole layers left of the budget)
        self._measuring = False
        self._sized = False
        self.auto_plan: dict[str, Any] | None = None
        self.pool = PinnedBufferPool(headroom=float(self.config.pool_headroom))
        self._num_sets = self.prefetch_layers + 1
        self._sets: list[torch.Tensor | None] = [None] * self._num_sets
        self._last_set_bytes = 0
        self._set_owner: list[int] = [-1] * self._num_sets
        self._copier: Copier | None = None
        self._recomputed: list[RecomputeHandle] = []
        self._residents = Residents(self.layers)
        self._packing = False
        self._hot = False  # whether the pack hook looks at saved tensors at all (see _wants_pack)
        self._offload_calls: set[int] = set()  # offloading layers called in this forward
        self._in_step = False
        self._steps_done = 0
        self._segments: list[Segment] = []
        self._current: Segment | None = None
        self._unassigned: list[Saved] = []
        self._pending_sources: list[Block] = []
        self._retired: list[Block] = []
        self._param_ptrs: set[int] = set()
        self._param_shapes: set[torch.Size] = set()
        # Whether the layers' parameters are swapped for unsharded ones in forward (FSDP2): then each layer call
        # reads them again, so that the unsharded storages are never offloaded.
        self._unsharding = False
        self._shared_inputs: set[int] = set()
        # Whether autocast caches its weight copies in the running layer call (read at the call: the pack hook runs
        # below the autocast dispatch key, where autocast always reads as disabled).
        self._autocast_caches = False
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._weak_self = weakref.ref(self)
        self._pack_hook, self._unpack_hook = saved_tensor_hooks(self._weak_self)
        self._handles = [h for i, layer in enumerate(self.layers) for h in self._hook_layer(i, layer)]

    # The older attribute names, read by callers of the keyword-argument constructor.
    @property
    def min_offload_bytes(self) -> int:
        """``config.min_offload_bytes``."""
        return self.config.min_offload_bytes

    @property
    def keep_last_layers(self) -> int:
        """``config.keep_last_layers``."""
        return self.config.keep_last_layers

    @property
    def force(self) -> bool:
        """``config.force``."""
        return self.config.force

    @property
    def in_step(self) -> bool:
        """Whether a step has begun and not ended."""
        return self._in_step

    @property
    def enabled(self) -> bool:
        """Whether this step offloads: on CUDA always, on CPU only with ``force=True``."""
        return self._copier is not None

    # ------------------------------------------------------------------ lifecycle
    def _hook_layer(self, index: int, layer: nn.Module) -> list[Any]:
        # The hooks hold the offloader weakly: an offloader dropped without close() is not kept alive by the model.
        return [
            layer.register_forward_pre_hook(functools.partial(layer_pre, self._weak_self, index), with_kwargs=True),
            layer.register_forward_hook(functools.partial(layer_post, self._weak_self), always_call=True),
        ]

    def _device(self) -> torch.device:
        for layer in self.layers:
            for p in layer.parameters():
                return p.device
        return torch.device("cpu")

    @staticmethod
    def _make_copier(device: torch.device) -> Copier:
        # A seam for tests: they substitute a copier that defers every copy until something waits for it.
        return make_copier(device)

    def begin_step(self) -> None:
        """Start a step: release the previous step's buffers and reset the per-step counters."""
        self._release_all()
        device = self._device()
        if device.type == "cuda" or self.config.force:
            if self._copier is None or self._copier.device != device:
                self._copier = self._make_copier(device)
                self._sets = [None] * self._num_sets
        else:
            self._copier = None
        resident = self._residents.tensors()
        # Parameters, buffers and views of them (W.t() saved by mm) are never offloaded: they stay resident anyway.
        # Their storages are read every step: `.to()` and `param.data = ...` move them without registering anything.
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in resident if type(t) is not _DTensor}
        # A cheap first test for "a copy of a parameter" (reading a cast's source node costs a wrapper object).
        self._param_shapes = {t.shape for t in resident}
        self._unsharding = any(type(t) is _DTensor for t in resident)
        self._counters = dict.fromkeys(self._counters, 0)
        self._measuring = self._copier is not None and self._planned is None
        self._set_owner = [-1] * self._num_sets
        self._apply_recompute()
        self.pool.reset_peak()
        self._in_step = True

    def _apply_recompute(self) -> None:
        """Wrap the layers that recompute this step: with ``recompute`` set and a plan, those not offloaded.

        The wrapping lasts one step (:meth:`end_step` removes it), so the user's modules are only changed while the
        offloader runs them, and two offloaders over the same layers never stack wrappers.
        """
        self._remove_recompute()
        if self.config.recompute is not None and self._copier is not None and self._planned is not None:
            self._recomputed = [recompute_layer(layer) for layer in self.layers[self._planned :]]
        self._counters["recompute_layers"] = len(self._recomputed)

    def _remove_recompute(self) -> None:
        for handle in self._recomputed:
            handle.remove()
        self._recomputed = []

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Install the pack/unpack hooks for the forward of the current step (between begin/end_step)."""
        if not self._in_step:
            self.begin_step()
        self._packing = True
        self._offload_calls = set()
        self._hot = self._wants_pack(None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook):
                yield
        finally:
            self._packing = False
            self._hot = False
            self._current = None
            self._unassigned.clear()  # saved after the last layer: they stay on the device

    def end_step(self, failed: bool = False) -> None:
        """Finish a step; the first successful step that offloads sizes the pool (with ``"auto"``: the second).

        Args:
            failed: the step raised; every buffer is waited for and returned to the pool at once (an ``"auto"``
                measuring step is then repeated).
        """
        self._packing = False
        self._hot = False
        self._in_step = False
        self._current = None
        self._unassigned.clear()
        self._remove_recompute()  # the autograd graph keeps what recomputation needs; the wrapper is not
        self._retired.extend(b for seg in self._segments for b in seg.blocks)
        segments, self._segments = self._segments, []
        measured, self._measuring = self._measuring, False
        # Device buffer sets live for one backward: between steps (and at the next forward's memory peak) they are
        # free memory. Blocks still reading them keep them alive until their copies are released.
        self._last_set_bytes = sum(t.numel() for t in self._sets if t is not None)
        self._sets = [None] * self._num_sets
        if failed:
            self._release_all()
            return
        self._release_done()
        self._steps_done += 1
        if measured:
            # A step whose layers ran no backward (a forward under no_grad, an evaluation pass) measured nothing to
            # plan from: the next step measures again.
            if any(seg.backward_started is not None for seg in segments):
                self._adopt_plan(segments)
        elif not self._sized and self._copier is not None:
            self.pool.reserve_measured()  # the first step that offloaded under the final plan sizes the pool
            self._sized = True

    def _adopt_plan(self, segments: list[Segment]) -> None:
        """Make and adopt the ``"auto"`` plan from the measuring step (see :func:`~.measure.auto_plan`)."""
        copier = self._copier
        assert copier is not None
        plan = measure.auto_plan(
            segments,
            len(self.layers),
            copier,
            eligible=max(len(self.layers) - self.config.keep_last_layers, 0),
            # With recomputation, layer N recomputes instead: keeping what a partial budget leaves would hold more.
            partial=self.config.recompute is None,
            pinned=self.pool.pinned,
            backward_end=copier.timestamp(),
        )
        self._planned, self._partial = plan["offload_layers"], plan["partial_bytes"]
        self.prefetch_layers = plan["prefetch_layers"]
        self._num_sets = self.prefetch_layers + 1
        self._sets = [None] * self._num_sets
        self._set_owner = [-1] * self._num_sets
        self.auto_plan = plan

    def synchronize(self) -> None:
        """Wait for every outstanding copy and return all host buffers to the pool."""
        self._release_all()

    def close(self) -> None:
        """Remove the layer hooks and the global registration hooks, free the pool and the device buffer sets, and
        warn once if the pool grew after it was sized (with the total growth)."""
        self.end_step(failed=True)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._residents.close()
        self.pool.warn_growth(owner="ActivationOffloader")
        self.pool.clear()
        self._sets = [None] * self._num_sets
        self._copier = None

    def __enter__(self) -> ActivationOffloader:
        self.begin_step()
        self._ctx = self.forward_context()
        self._ctx.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._ctx.__exit__(None, None, None)
        del self._ctx
        self.end_step(failed=exc_type is not None)

    @property
    def stats(self) -> dict[str, int | bool]:
        """Counters of the last step and of the pool.

        ``offloaded_bytes`` (storages copied to the host in the last step), ``offloaded_tensors``,
        ``dedup_hits`` (saved views served by an already offloaded storage), ``prefetch_hits``/``lazy_reloads``
        (unpacks served by a prefetch / by a fallback reload), ``segments`` (layer calls), ``kept_casts``
        (saved low-precision weight copies left on the device because autocast's cache holds them anyway),
        ``recast_casts``/``recast_bytes`` (saved weight copies dropped and rebuilt from the parameter in backward),
        ``rebuilt_tensors``/``rebuilt_bytes`` (saved outputs of rebuildable Functions, or copies of them, dropped and
        rebuilt; bytes once per storage), ``rebuilds`` (rebuilds run), ``pool_bytes``, ``checked_out`` (host buffers
        in use now), ``peak_inflight`` (most host bytes in use at once during the last step), ``pool_buffers``,
        ``pool_grow_events``, ``pool_grown_bytes``, ``pinned``, ``device_set_bytes``, ``offload_layers`` (leading
        layers that offload; 0 during an ``"auto"`` measuring step and when offload is off),
        ``partial_offload_bytes`` (the ``"auto"`` plan's budget for the layer after them), ``recompute_layers``.
        """
        return {
            **self._counters,
            **self.pool.stats(),
            "offload_layers": (self._planned or 0) if self.enabled else 0,
            "partial_offload_bytes": self._partial if self.enabled else 0,
            "peak_inflight": self.pool.peak_out_bytes,
            "device_set_bytes": self._last_set_bytes,
        }
