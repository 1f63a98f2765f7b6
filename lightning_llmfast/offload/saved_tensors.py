"""The packer: for each tensor autograd saves inside the tracked layers, decide what is kept, offloaded, recast
from a parameter or rebuilt in backward, and return the handle (:mod:`~lightning_llmfast.offload.handles`).

It owns what a pack decision reads besides the running layer call: the resident tensors (parameters, buffers), the
inputs the running call shares with the others, whether autocast caches its weight copies, and its counters.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor as _DTensor

from lightning_llmfast._autograd import in_backward
from lightning_llmfast._rebuild import RebuildRecord, rebuild_origin, rebuild_record
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Block, Rebuilt, Recast, Saved, Segment, Shared, kept, view_of
from lightning_llmfast.offload.layercalls import LayerCalls, tensors_in
from lightning_llmfast.offload.nvme import NvmeTier
from lightning_llmfast.offload.pool import PinnedBufferPool
from lightning_llmfast.offload.residents import Residents

__all__ = ["Packer"]

_COUNTERS = (
    "offloaded_bytes",
    "offloaded_tensors",
    "dedup_hits",
    "kept_casts",
    "recast_casts",
    "recast_bytes",
    "rebuilt_tensors",
    "rebuilt_bytes",
)


class Packer:
    """What the pack hook decides for each saved tensor.

    Args:
        config: the settings.
        calls: the layer-call policy (which call runs, whether it offloads or measures).
        pool: host buffers for what is offloaded.
        residents: the layers' parameters and buffers (never offloaded).
        pack_hook: the hook installed for the offloader: a Function's tensors packed by it may be rebuilt.
    """

    def __init__(
        self, config: OffloadConfig, calls: LayerCalls, pool: PinnedBufferPool, residents: Residents, pack_hook: Any
    ) -> None:
        self.config = config
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._calls = calls
        self._pool = pool
        self._residents = residents
        self._pack_hook = pack_hook
        self._copier: Copier | None = None
        self.nvme: NvmeTier | None = None  # the NVMe tier, set by the offloader with `nvme_dir`
        self._param_ptrs: set[int] = set()
        self._param_shapes: set[torch.Size] = set()
        # Whether the layers' parameters are swapped for unsharded ones in forward (FSDP2): then each layer call
        # reads them again, so that the unsharded storages are never offloaded.
        self._unsharding = False
        # Nested FSDP2 groups (an expert-parallel MoE block's) unshard inside the layer call, after enter_layer: a
        # forward pre-hook notes their gathered storages, which FSDP2 frees again at the group's end, before the
        # layer's copies are issued (copying them would read freed memory). Layers scanned, and the hooks.
        self._scanned: set[int] = set()
        self._nested_hooks: list[Any] = []
        self._shared_inputs: set[int] = set()
        # Whether autocast caches its weight copies in the running layer call (read at the call: the pack hook runs
        # below the autocast dispatch key, where autocast always reads as disabled).
        self._autocast_caches = False

    def begin_step(self, copier: Copier | None) -> None:
        """Read the resident tensors again and reset the counters."""
        self._copier = copier
        resident = self._residents.tensors()
        # Parameters, buffers and views of them (W.t() saved by mm) are never offloaded: they stay resident anyway.
        # Their storages are read every step: `.to()` and `param.data = ...` move them without registering anything.
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in resident if type(t) is not _DTensor}
        # A cheap first test for "a copy of a parameter" (reading a cast's source node costs a wrapper object).
        self._param_shapes = {t.shape for t in resident}
        self._unsharding = any(type(t) is _DTensor for t in resident)
        self.counters = dict.fromkeys(self.counters, 0)

    def enter_layer(self, layer: torch.nn.Module, inputs: Any) -> None:
        """A layer call starts with ``inputs``: note what it shares with other calls, and FSDP2's unsharded weights."""
        if self._unsharding:  # FSDP2 unsharded this layer's parameters in its own pre-hook, registered earlier
            # (a nested group, e.g. an expert-parallel MoE block's, is still sharded here: noted by its own pre-hook)
            self._note_gathered(layer)
            if id(layer) not in self._scanned:
                self._scanned.add(id(layer))
                nested = [m for m in layer.modules() if m is not layer and isinstance(m, FSDPModule)]
                # FSDP2's own pre-hook is prepended: these run after it, on the unsharded parameters.
                self._nested_hooks += [m.register_forward_pre_hook(self._note_gathered) for m in nested]
        # Inputs that need no grad (RoPE tables, masks, ids) are shared by every layer and alive outside it:
        # offloading them would copy them once per layer and free nothing.
        self._shared_inputs = {t.untyped_storage().data_ptr() for t in tensors_in(inputs) if not t.requires_grad}
        self._autocast_caches = self._copier is not None and (
            torch.is_autocast_cache_enabled() and torch.is_autocast_enabled(self._copier.device.type)
        )

    def _note_gathered(self, module: torch.nn.Module, *_: Any) -> None:
        # Expert parameters stay DTensors when gathered (FSDP2 over "edp" unshards to Shard(0) over "ep"): their local
        # tensor holds the storage. A group not gathered yet adds its resident shards, which are never offloaded.
        with torch.no_grad():  # to_local() would record an autograd node per parameter
            local = [p.to_local() if type(p) is _DTensor else p for p in module.parameters()]
        self._param_ptrs.update(t.untyped_storage().data_ptr() for t in local)

    def close(self) -> None:
        """Remove the hooks on nested FSDP2 groups."""
        for handle in self._nested_hooks:
            handle.remove()
        self._nested_hooks, self._scanned = [], set()

    def place(self, waiting: list[Saved], seg: Segment) -> None:
        """Tensors saved between the previous layer call and ``seg``: offloaded (or measured) with ``seg``."""
        for saved in waiting:
            assert saved.tensor is not None
            if saved.tensor.untyped_storage().data_ptr() in self._shared_inputs:
                continue
            if seg.offload:
                self._offload_or_keep(saved, seg)
            elif self._calls.counts():
                self.measure(saved.tensor, seg)

    def leave_layer(self) -> None:
        self._shared_inputs = set()

    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook's handle for ``t``: ``t`` itself (kept) or a :class:`Saved`/:class:`Recipe`."""
        calls = self._calls
        if not calls.hot:
            return kept(t)
        base = t._base  # read once: 0.3 us, for each of the ~50 tensors a layer saves
        if base is None:
            base = t
        fn = base.grad_fn
        source = None  # a cast's input, read once: (node, output_nr)
        cast = fn is not None and fn.name() == "ToCopyBackward0"
        if cast:
            inputs = fn.next_functions
            source = inputs[0] if inputs else None
        rebuilds = self.config.rebuild is not None
        copies_param = rebuilds and source is not None and base.shape in self._param_shapes  # _cast_source decides
        origin = rebuild_origin(fn, source) if rebuilds and fn is not None and not copies_param else None
        seg = calls.current
        if seg is not None and seg.keeps and not copies_param:
            # A layer that keeps what it saves drops only parameters' copies and marked Functions' outputs (and
            # copies of them), GEMM outputs only where asked to; everything else returns here, before the checks
            # below: half the host time per tensor in a CPU forward, and a launch-bound GPU forward pays host time
            # as step time.
            if origin is None or (_record(origin).gemm and not self.config.rebuilds_gemms(seg.layer_index)):
                return kept(t)
        if (
            self._copier is None
            or in_backward()
            or type(t) is not torch.Tensor  # parameters, tensor subclasses (fake/functional/distributed)
            or t.layout != torch.strided
            or t.device != self._copier.device
        ):
            return kept(t)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() < self.config.min_offload_bytes or ptr in self._param_ptrs or ptr in self._shared_inputs:
            return kept(t)
        if seg is None and not calls.segments:
            return kept(t)  # before the first layer: outside the layers
        # A view that reinterprets its base (view_as_complex) cannot be rebuilt with as_strided: kept or offloaded.
        if fn is not None and t.dtype == base.dtype:
            param = self._cast_source(base, source) if copies_param else None
            if param is not None:
                return self._keep_or_recast(t, base, param)
            if copies_param:
                origin = rebuild_origin(fn, source)  # a copy of something else of a parameter's shape
            if seg is not None and origin is not None:
                rebuilt = self._rebuildable(t, base, origin, cast, seg)
                if rebuilt is not None:
                    return rebuilt
        if seg is not None and not seg.offload:
            if calls.counts():
                self.measure(t, seg)
            return kept(t)  # a layer that keeps what it saves
        saved = Saved(tensor=kept(t))
        if seg is None:
            calls.unassigned.append(saved)  # between layers: decided when the next one starts (kept after the last)
        elif not self._offload_or_keep(saved, seg):
            return kept(t)
        return saved

    def _offload_or_keep(self, saved: Saved, seg: Segment) -> bool:
        """Offload ``saved`` into ``seg``, or (over the layer's byte budget, or the NVMe tier failed) leave it on the
        device, counted as kept where layer calls count what they keep."""
        if self.offload(saved, seg):
            return True
        if self._calls.counts():
            assert saved.tensor is not None
            self.measure(saved.tensor, seg)
        return False

    def _cast_source(self, base: torch.Tensor, source: tuple[Any, int]) -> torch.Tensor | None:
        """The parameter of the layers that ``base`` (made by a ``ToCopyBackward0`` whose input comes from
        ``source``, a ``(node, output_nr)`` pair; of a parameter's shape) is a copy of, such as autocast's bf16 weight.

        Only a contiguous copy of a contiguous parameter counts (what ``param.to(dtype)`` gives), so that the rebuilt
        copy is the same tensor; one with another memory format stays an ordinary activation.
        """
        if base._version:
            return None  # changed in place since the cast: a recast would give other bits
        leaf = getattr(source[0], "variable", None)  # AccumulateGrad of the cast's source
        if leaf is None or leaf.device != base.device or leaf.untyped_storage().data_ptr() not in self._param_ptrs:
            return None  # a parameter kept elsewhere (host) would be copied over the bus again: not cheaper
        if base.shape != leaf.shape or not (base.is_contiguous() and leaf.is_contiguous()) or base.storage_offset():
            return None
        return leaf

    def _rebuildable(
        self, t: torch.Tensor, base: torch.Tensor, origin: tuple[Any, int], cast: bool, seg: Segment
    ) -> Rebuilt | None:
        """A recipe for ``t`` (a view of ``base``; ``cast``: ``base`` is a ``ToCopyBackward0``'s copy) if ``origin``
        (the node that made ``base``, or the output it copied) can rebuild it.

        Only whole contiguous outputs count, so that ``as_strided`` on the rebuilt tensor gives back the very view.
        """
        if not base.is_contiguous() or base.storage_offset():
            return None
        if cast and base._version:
            return None  # the copy changed in place since it was made: a rebuild would give the values before
        node, output_nr = origin
        if not cast:
            output_nr = base.output_nr
        record = _record(origin)
        if not record.packed_by(self._pack_hook):
            return None  # its saved tensors belong to other hooks (checkpoint: one unpack only)
        if record.gemm and not self.config.rebuilds_gemms(seg.layer_index):
            return None  # a GEMM's output: kept unless rebuilding GEMMs was asked for (it costs backward time)
        output = record.output()
        if output is None or output.output_nr != output_nr:
            return None  # gone (so unknown), or another output of the Function than the one its rebuild gives
        if output._version != record.output_version:
            return None  # changed in place since forward: a rebuild would give the values before the change
        self.counters["rebuilt_tensors"] += 1
        shared, new_storage = self._share(base, seg)
        if new_storage:
            self.counters["rebuilt_bytes"] += base.untyped_storage().nbytes()
        return Rebuilt(
            node=weakref.ref(node),
            function=record.rebuild,
            copy_to=(base.device, base.dtype) if cast else None,
            shape=tuple(base.shape),
            view=view_of(t, base),
            shared=shared,
        )

    @staticmethod
    def _share(base: torch.Tensor, seg: Segment) -> tuple[Shared, bool]:
        """The :class:`Shared` of the handles on the very tensor ``base`` in ``seg`` (the layer call, while it runs),
        counting one more handle; and whether ``base``'s (storage address, version) was unknown in ``seg`` or its
        entry dead (then its bytes count as new)."""
        storage = base.untyped_storage()
        key = (storage.data_ptr(), base._version)
        entry = seg.rebuilt.get(key)
        known = entry[0]() if entry is not None else None  # None: a dead entry, the address freed and reused since
        if known is base:
            shared = entry[1]
        else:
            # Only the very tensor is shared: another one on the storage (an alias) may want another recipe.
            shared = Shared()
            if known is None:
                seg.rebuilt[key] = (weakref.ref(base), shared)
        shared.pending += 1
        return shared, known is None

    def _keep_or_recast(self, t: torch.Tensor, base: torch.Tensor, param: torch.Tensor) -> torch.Tensor | Recast:
        """Keep a parameter's saved copy (``t``, a view of ``base``) while autocast's cache holds it, else rebuild it
        in backward.

        With the cache (``torch.autocast``'s default) the copy lives until the autocast region ends, after the
        forward: dropping or copying it frees nothing at the forward's peak. Without it (Lightning's mixed precision
        uses ``cache_enabled=False``) the saved copy is the only reference, so rebuilding it in backward frees it at
        once (23.4% of what a reference-model layer saves at hidden 1024 under bf16) for one cast kernel and no copy.
        """
        if self._autocast_caches:
            self.counters["kept_casts"] += 1
            return kept(t)
        self.counters["recast_casts"] += 1
        self.counters["recast_bytes"] += t.untyped_storage().nbytes()
        return Recast(param=param, version=param._version, dtype=t.dtype, view=view_of(t, base))

    def measure(self, t: torch.Tensor, seg: Segment) -> None:
        """Count ``t`` as kept by ``seg``: the measuring step counts what offloading would copy, deduplicated as
        `offload` does (what recomputation would keep is counted beside it, :mod:`.must_save`); a memory plan's steps
        count what each layer keeps."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)
        known = seg.seen.get(key)
        if known is None or known() is None:
            seg.seen[key] = weakref.ref(storage)
            seg.candidate_bytes += storage.nbytes()
            seg.candidate_sizes.append(storage.nbytes())

    def count_stored(self, t: torch.Tensor) -> None:
        """Count an output a recomputed layer stores for its backward (not through the pack hook) as kept by the
        running layer call, when layer calls count what they keep."""
        seg = self._calls.current
        if seg is not None and self._calls.counts() and t.untyped_storage().nbytes() >= self.config.min_offload_bytes:
            self.measure(t, seg)

    def offload(self, saved: Saved, seg: Segment) -> bool:
        """Offload ``saved`` into ``seg``; ``False`` (and nothing changes) when it would exceed ``seg``'s budget."""
        t = saved.tensor
        assert t is not None and self._copier is not None
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)
        block = seg.dedup.get(key)
        if block is None:
            nbytes = storage.nbytes()
            if seg.budget is not None and seg.offloaded + nbytes > seg.budget:
                return False
            spill = self.spills(nbytes, seg)
            if spill is None:
                return False  # the NVMe tier failed in this step: kept on the device
            seg.offloaded += nbytes
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = None if spill else self._pool.acquire(nbytes)
            block = Block(nbytes=nbytes, segment=seg.index, host=host, source=source, to_nvme=spill)
            seg.blocks.append(block)
            seg.unsent.append(block)
            seg.dedup[key] = block
            self.counters["offloaded_bytes"] += nbytes
        else:
            self.counters["dedup_hits"] += 1
        self.counters["offloaded_tensors"] += 1
        saved.block = block
        saved.dtype = t.dtype
        saved.size = tuple(t.shape)
        saved.stride = t.stride()
        saved.storage_offset = t.storage_offset()
        saved.tensor = None
        return True

    def spills(self, nbytes: int, seg: Segment) -> bool | None:
        """Whether ``nbytes`` more of ``seg`` go to the NVMe tier (the plan sends ``seg`` there, or the pinned pool
        would pass its budget); ``None``: they would, but the tier failed in this step, so they stay on the device."""
        budget = self.config.pinned_budget_bytes
        if self.nvme is None or budget is None:
            return False
        if not seg.to_nvme and self._pool.out_bytes + nbytes <= budget:
            return False
        return None if self.nvme.full else True


def _record(origin: tuple[Any, int]) -> RebuildRecord:
    record = rebuild_record(origin[0])
    assert record is not None  # rebuild_origin only returns nodes with a record
    return record
