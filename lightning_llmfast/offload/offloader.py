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

Parts that own their state: :class:`~.layercalls.LayerCalls` (the plan, this step's calls), :class:`~.planner.Planner`
(the ``"auto"`` plans from measuring steps), :class:`~.saved_tensors.Packer`
(pack decisions), :class:`~.reload.Reloader` (copies, prefetch, unpack, release), :class:`~.pool.PinnedBufferPool`,
:class:`~.nvme.NvmeTier` (files past the pool's budget), :class:`~.copier.Copier` (CUDA streams or synchronous CPU
copies) and :class:`~.meter.StepMeter` (what a memory plan's step did); the offloader owns the step's lifecycle and
wires the hooks to them. :mod:`.schedule`, :mod:`.memory_plan` and :mod:`.measure` make the plans.

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
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_llmfast._autograd import in_backward
from lightning_llmfast._layers import resolve_layers
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier, make_copier
from lightning_llmfast.offload.layercalls import (
    LayerCalls,
    backward_begins,
    layer_post,
    layer_pre,
    saved_tensor_hooks,
    tensors_in,
)
from lightning_llmfast.offload.memory_plan import MemoryPlan
from lightning_llmfast.offload.meter import StepMeter
from lightning_llmfast.offload.must_save import MustSaveCounter
from lightning_llmfast.offload.nvme import NvmeTier
from lightning_llmfast.offload.planner import Planner
from lightning_llmfast.offload.pool import PinnedBufferPool
from lightning_llmfast.offload.recompute import RecomputeHandle, recompute_layer
from lightning_llmfast.offload.reload import Reloader
from lightning_llmfast.offload.residents import Residents
from lightning_llmfast.offload.saved_tensors import Packer

log = logging.getLogger(__name__)

__all__ = ["ActivationOffloader"]


class ActivationOffloader:
    """Offload saved activations of a layer stack to pinned host memory and prefetch them in backward.

    Use it as a context manager around forward *and* backward of one step, or call :meth:`begin_step`,
    :meth:`forward_context` and :meth:`end_step` yourself; :meth:`close` releases everything.

    Args:
        layers: the blocks, in execution order (e.g. ``model.layers``). Tensors saved inside a block call belong
            to it; tensors saved between two block calls (e.g. ``torch.utils.checkpoint`` inputs saved just before
            the block runs) belong to the next block; tensors saved before the first or after the last block stay
            on the device, and so do a block's inputs that need no grad (RoPE tables, masks: shared by all blocks).
        config: the settings (:class:`~lightning_llmfast.offload.OffloadConfig`; ``None``: its defaults).

    Attributes:
        calls: the layer-call policy (:class:`~lightning_llmfast.offload.layercalls.LayerCalls`).
        packer: the pack hook's decisions (:class:`~lightning_llmfast.offload.saved_tensors.Packer`).
        reloader: copies, prefetch, unpack and release (:class:`~lightning_llmfast.offload.reload.Reloader`).
        pool: the host buffers (:class:`~lightning_llmfast.offload.PinnedBufferPool`).
        time_copies: time the copies of the steps that begin from now on, for ``copy_ms``/``exposed_copy_ms`` in
            :attr:`stats` (``False`` by default: no timestamps per copy; ``SystemMetricsMonitor`` turns it on to log
            ``offload/overlap``).

    Raises:
        OffloadError: ``config`` is not an :class:`~lightning_llmfast.offload.OffloadConfig`, or the layer list is
            empty.

    Example::

        off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=1 << 20, offload_layers="auto"))
        for x in loader:
            with off:
                model(x).mean().backward()
            opt.step()
        off.close()
    """

    def __init__(self, layers: Sequence[nn.Module] | nn.Module, config: OffloadConfig | None = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise OffloadError(f"ActivationOffloader: config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        if layers is None or isinstance(layers, str):
            raise OffloadError(
                f"ActivationOffloader: layers must be the modules (e.g. model.layers), got {layers!r}; "
                "resolve names with resolve_layers(model, ...)"
            )
        self.layers = resolve_layers(nn.Module(), layers, error=OffloadError, single=True)
        self.pool = PinnedBufferPool(headroom=float(config.pool_headroom))
        self.calls = LayerCalls(config, len(self.layers))
        self._residents = Residents(self.layers)
        self._weak_self = weakref.ref(self)
        self._pack_hook, self._unpack_hook = saved_tensor_hooks(self._weak_self)
        self.packer = Packer(config, self.calls, self.pool, self._residents, self._pack_hook)
        self.reloader = Reloader(self.calls, self.pool, config.prefetch_layers)
        self.meter = StepMeter()
        self.planner = Planner(config, self.calls, self.pool, self.reloader, self.packer, len(self.layers))
        self._copier: Copier | None = None
        self.time_copies = False
        self._recomputed: list[RecomputeHandle] = []
        self._fallback: set[int] = set()  # layers recomputing for the rest of the step after the NVMe tier failed
        self._recompute_layers = 0  # layers wrapped in the last step
        self._in_step = False
        self._handles = [h for i, layer in enumerate(self.layers) for h in self._hook_layer(i, layer)]

    @property
    def auto_plan(self) -> dict[str, Any] | None:
        """The ``offload_layers="auto"`` plan (:func:`~.measure.auto_plan`), once made."""
        return self.planner.auto_plan

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The ``plan="auto"`` plan (:class:`~lightning_llmfast.offload.MemoryPlan`), once made."""
        return self.planner.memory_plan

    @property
    def prefetch_layers(self) -> int:
        """How many layers ahead backward prefetches (the ``"auto"`` plan may change it)."""
        return self.reloader.prefetch_layers

    @property
    def in_step(self) -> bool:
        """Whether a step has begun and not ended."""
        return self._in_step

    @property
    def enabled(self) -> bool:
        """Whether this step offloads: on CUDA always, on CPU only with ``force=True``."""
        return self._copier is not None

    # ------------------------------------------------------------------ hooks (called through weak references)
    def _hook_layer(self, index: int, layer: nn.Module) -> list[Any]:
        # The hooks hold the offloader weakly: an offloader dropped without close() is not kept alive by the model.
        return [
            layer.register_forward_pre_hook(functools.partial(layer_pre, self._weak_self, index), with_kwargs=True),
            layer.register_forward_hook(functools.partial(layer_post, self._weak_self), always_call=True),
        ]

    def _pack(self, t: torch.Tensor) -> Any:
        return self.packer.pack(t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        return self.reloader.unpack(saved)

    def _layer_begins(self, index: int, inputs: Any) -> None:
        if not self.calls.packing or in_backward():
            return
        self.packer.enter_layer(self.layers[index], inputs)
        seg, waiting = self.calls.enter(index)
        self.packer.place(waiting, seg)
        if self.calls.measuring and self.planner.counting_keeps:  # what recomputing it keeps (warm-up step only)
            seg.must_save = MustSaveCounter(self.config.min_offload_bytes).__enter__()
            seg.must_save.note_inputs(tensors_in(inputs))
        elif self._recomputed and self.memory_plan is not None and self.memory_plan.choices[index] == "recompute":
            for t in tensors_in(inputs):  # the checkpoint holds the hidden states its replay starts from
                if t.requires_grad:
                    self.packer.count_stored(t)
        self.calls.started(seg)
        if self._metered():
            self.meter.mark("start", self._copier.timestamp(), first=True)  # type: ignore[union-attr]

    def _layer_ends(self, output: Any) -> None:
        if self.calls.current is None or in_backward():
            return
        seg = self.calls.leave()
        assert seg is not None
        if seg.must_save is not None:
            seg.must_save.__exit__(None, None, None)
            seg.recompute_keeps, seg.must_save = seg.must_save.kept_bytes, None
        self.packer.leave_layer()
        self.reloader.send(seg)
        # Dedup entries are only valid while this layer's sources are referenced; after it, an address could be
        # reused by a new tensor, so the map is dropped and the sources become releasable.
        seg.dedup.clear()
        # Likewise the rebuild map (read while packing only): the handles own their Shared from here, so a rebuilt
        # tensor that one op never reads back dies with that op's node, not at the end of the step.
        seg.rebuilt.clear()
        self.reloader.hold_sources(seg)
        if self.packer.nvme is not None and self.packer.nvme.full:
            self._recompute_rest_of_step()
        self.calls.ended(seg)
        if self._metered():
            self.meter.layer_ended(seg.index, seg.candidate_bytes)  # an offloading call counts what it keeps
            self.meter.mark("forward_end", self._copier.timestamp())  # type: ignore[union-attr]
        grad_fn = next((t.grad_fn for t in tensors_in(output) if t.grad_fn is not None), None)
        if grad_fn is not None:
            grad_fn.register_prehook(functools.partial(backward_begins, self._weak_self, seg.index))

    def _backward_begins(self, seg_index: int) -> None:
        if not self.calls.segments:
            return  # the step already ended (graph retained past it)
        self.calls.backward_started(seg_index)
        self.reloader.backward_begins(seg_index)
        if self._metered():
            self.meter.backward_begins(seg_index, sum(t.numel() for t in self.reloader.sets_held()))
            self.meter.mark("backward_start", self._copier.timestamp(), first=True)  # type: ignore[union-attr]

    def _metered(self) -> bool:
        """Whether this step runs a memory plan, whose live saved bytes and time are compared with its prediction."""
        return self.memory_plan is not None and self._copier is not None

    # ------------------------------------------------------------------ lifecycle
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
        """Start a step: release what the previous step still holds (without waiting) and reset the counters."""
        self.reloader.end_step([b for seg in self.calls.take() for b in seg.blocks])
        self.reloader.release_ordered()
        device = self._device()
        if device.type == "cuda" or self.config.force:
            if self._copier is None or self._copier.device != device:
                self._copier = self._make_copier(device)
            if self.config.nvme_dir is not None and self.packer.nvme is None:
                self.packer.nvme = self.reloader.nvme = NvmeTier(self.config.nvme_dir)
        else:
            self._copier = None
        if self._copier is not None:
            self._copier.timed = self.time_copies
        if self.packer.nvme is not None:
            self.packer.nvme.begin_step()
        self.calls.begin_step(self._copier)
        self.planner.begin_step(self._copier)
        self.packer.begin_step(self._copier)
        self.reloader.begin_step(self._copier)
        self._apply_recompute()
        self.pool.reset_peak()
        self.meter.begin_step()
        self._in_step = True

    def _apply_recompute(self) -> None:
        """Wrap the layers that recompute this step: with ``recompute`` set and a plan, those not offloaded.

        The wrapping lasts one step (:meth:`end_step` removes it), so the user's modules are only changed while the
        offloader runs them, and two offloaders over the same layers never stack wrappers.
        """
        self._remove_recompute()
        self._fallback = set()
        planned = self.calls.planned
        if self._copier is not None and self.memory_plan is not None:
            recomputed = sorted(self.memory_plan.layers("recompute"))
            self._recomputed = [recompute_layer(self.layers[i], self.packer.count_stored) for i in recomputed]
        elif self.config.recompute is not None and self._copier is not None and planned is not None:
            self._recomputed = [recompute_layer(layer) for layer in self.layers[planned:]]
        self._recompute_layers = len(self._recomputed)

    def _recompute_rest_of_step(self) -> None:
        """The NVMe tier failed a write in this step (a full disk): the layers not yet run that would spill to it
        recompute instead, for the rest of the step, so their bytes neither go to the tier nor all stay on the
        device. (The storages already saved stay on the device.) The next step spills again."""
        called = {seg.layer_index for seg in self.calls.segments}
        for i, layer in enumerate(self.layers):
            if i not in called and i not in self._fallback and self.calls.spilling(i):
                self._recomputed.append(recompute_layer(layer, self.packer.count_stored))
                self._fallback.add(i)
        self._recompute_layers = len(self._recomputed)

    def _remove_recompute(self) -> None:
        for handle in self._recomputed:
            handle.remove()
        self._recomputed = []

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Install the pack/unpack hooks for the forward of the current step (between begin/end_step)."""
        if not self._in_step:
            self.begin_step()
        self.calls.begin_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook):
                yield
        finally:
            self.calls.end_forward()

    def end_step(self, failed: bool = False) -> None:
        """Finish a step; the first successful step that offloads sizes the pool (with ``"auto"``: the second).

        Args:
            failed: the step raised; every buffer is waited for and returned to the pool at once (an ``"auto"``
                measuring step is then repeated).
        """
        self._in_step = False
        self._remove_recompute()  # the autograd graph keeps what recomputation needs; the wrapper is not
        segments = self.calls.take()
        self.reloader.end_step([b for seg in segments for b in seg.blocks])
        measured, self.calls.measuring = self.calls.measuring, False
        if self._copier is not None:
            if self._metered() and not failed:
                self.meter.end_step(self._copier.timestamp())
            self._copier.end_step()
        if failed:
            self.reloader.release_all()
            return
        self.reloader.release_ordered()
        if measured and self._copier is not None:
            self.planner.measured(segments, self._copier)
        elif self._copier is not None:
            self.planner.size_pool()

    def synchronize(self) -> None:
        """Wait for every outstanding copy and return all host buffers to the pool (blocks the host)."""
        self.reloader.end_step([b for seg in self.calls.take() for b in seg.blocks])
        self.reloader.release_all()

    def close(self) -> None:
        """Remove the layer hooks and the global registration hooks, free the pool and the device buffer sets, and
        warn once if the pool grew after it was sized (with the total growth)."""
        self.end_step(failed=True)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.packer.close()
        self._residents.close()
        self.pool.warn_growth(owner="ActivationOffloader")
        self.pool.clear()
        if self.packer.nvme is not None:
            self.packer.nvme.close()
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

    def step_metrics(self) -> dict[str, float]:
        """The memory plan's prediction against the last step that ran it (:meth:`.meter.StepMeter.metrics`): empty
        without a plan or before a planned step."""
        if self.memory_plan is None or self._copier is None:
            return {}
        return self.meter.metrics(self.memory_plan, self._copier)

    @property
    def stats(self) -> dict[str, int | bool | float]:
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
        ``partial_offload_bytes`` (the ``"auto"`` plan's budget for the layer after them), ``recompute_layers``;
        with ``nvme_dir``: ``spilled_bytes`` (written to the NVMe tier in the last step), ``nvme_files`` (on disk now),
        ``nvme_failures`` (failed writes so far);
        ``copy_ms`` and ``exposed_copy_ms`` (ms the last ended step's copies ran, and ms compute waited on them; see
        :meth:`~.copier.Copier.copy_times`) when :attr:`time_copies` is on, once they can be read without waiting.
        """
        times = self._copier.copy_times() if self._copier is not None else None
        copies = {"copy_ms": times[0], "exposed_copy_ms": times[1]} if times is not None else {}
        nvme = self.packer.nvme
        if nvme is not None:
            copies.update(nvme_files=nvme.files(), nvme_failures=nvme.failures)
        return {
            **copies,
            **self.packer.counters,
            **self.reloader.counters,
            "segments": self.calls.calls,
            "recompute_layers": self._recompute_layers,
            **self.pool.stats(),
            "offload_layers": self.calls.offload_layers() if self.enabled else 0,
            "partial_offload_bytes": self.calls.partial if self.enabled else 0,
            "peak_inflight": self.pool.peak_out_bytes,
            "device_set_bytes": self.reloader.set_bytes,
        }
