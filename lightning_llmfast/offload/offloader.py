"""Double-buffered activation offload through ``saved_tensors_hooks`` (plain PyTorch, no Lightning).

Forward: every tensor autograd saves inside one of the tracked layers (except parameters, buffers, tensors
under ``min_offload_bytes`` and the last ``keep_last_layers`` layers) is copied, one copy per *storage* (views
and tensors sharing a storage are deduplicated), into a pooled pinned host buffer on a device-to-host stream.
The source stays referenced until that copy's event has completed, so the caching allocator can never hand its
memory to another kernel while the copy still reads it.

Backward: when layer ``i``'s backward starts (a pre-hook on the grad_fn of the layer's output), the
host-to-device copies of layers ``i - 1 ... i - prefetch_layers`` are issued on a host-to-device stream into one
of ``prefetch_layers + 1`` device buffer sets used round-robin (two sets, i.e. double buffering, by default), so
they overlap layer ``i``'s compute. Each unpack makes the compute stream wait on its own copy event. A tensor
unpacked before its prefetch was issued is reloaded lazily (counted in ``stats["lazy_reloads"]``).

Weight copies: a saved low-precision copy of one of the layers' parameters (autocast's bf16 weight) is neither kept
nor copied but rebuilt from the parameter in backward, in every layer call, offloading or not (except under selective
recomputation, whose checkpoint owns what its layers save); without autocast's cache (Lightning's mixed precision
disables it) that frees it right after its forward use. Under the cache it stays.

Rebuildable outputs: likewise a saved output of an ``autograd.Function`` that declares ``llmfast_rebuild(ctx,
*saved_tensors)`` and marks its forward with :func:`~lightning_llmfast.offload.mark_rebuildable` (the reference
model's RMSNorm), or a dtype/device copy of one (autocast's bf16 input of the next matmul), is rebuilt in backward
from the tensors that Function saved anyway: one elementwise pass instead of keeping or copying it (rebuilt once for
all of a layer call's reads in backward, held from the first read to the last). Not when those
tensors belong to ``torch.utils.checkpoint`` or the output was changed in place before it was saved. Outputs marked
as a GEMM's (the routed experts' gate/up projection, the largest tensor an MoE layer saves) are rebuilt only with
``rebuild_gemms`` (``True``, or the first ``N`` layers): one more GEMM per layer in backward, no bus traffic.

Schedule: ``offload_layers`` limits offloading to the first ``N`` layers (their activations live longest);
``"auto"`` measures the first step (each layer's forward and backward time, bytes, copy bandwidth, and on CUDA the
memory backward frees) and picks ``N`` and the prefetch depth with :func:`plan_offload` so that the copies hide
behind compute and prefetched layers fit in memory that backward has already freed (offloading every layer costs
throughput once copies outlast compute); layer ``N`` then offloads what :func:`plan_partial_bytes` still allows.
Device buffer sets are allocated in backward and dropped at the end of the step, so they never add to the forward's
memory peak.

On CPU (``force=True``) there are no streams: the same bookkeeping runs with synchronous copies, which is how
the tests prove bit-identical gradients, deduplication, pool reuse and prefetch ordering without a GPU.

Example::

    offloader = ActivationOffloader(model.layers, min_offload_bytes=0, keep_last_layers=1, force=True)
    with offloader:
        loss = model(x).sum()
        loss.backward()
    print(offloader.stats["offloaded_bytes"])
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_llmfast._autograd import in_backward
from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.pool import MAX_HEADROOM, PinnedBufferPool
from lightning_llmfast.offload.recompute import RECOMPUTE_MODES, RecomputeHandle, recompute_layer

__all__ = [
    "ActivationOffloader",
    "plan_offload",
    "plan_offload_layers",
    "plan_partial_bytes",
    "resolve_layers",
    "validate_offload_config",
]

# Device-side offsets are aligned so that every reloaded dtype view is aligned like a fresh allocation (vectorised
# CPU kernels and MKL pick their code path by alignment; a different path could change rounding).
_ALIGN = 256


# Backward of a transformer block costs about twice its forward (two matmuls per forward matmul): the estimate when
# no backward time is given (the "auto" plan measures both).
_BACKWARD_PER_FORWARD = 2.0
# Copy times are padded by this fraction in the "auto" plan: bandwidth and compute vary from step to step.
AUTO_MARGIN = 0.2
# The "auto" bandwidth probe copies the largest layer's bytes, within these bounds (long enough to time, short).
_PROBE_MIN_BYTES = 1 << 20
_PROBE_MAX_BYTES = 64 << 20
# (size, stride, storage_offset) of a saved view of a dropped tensor, for ``as_strided``.
_View = tuple[tuple[int, ...], tuple[int, ...], int]


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_offload_layers(
    compute_ms: Sequence[float],
    bytes_per_layer: Sequence[int],
    bandwidth_bytes_per_ms: float,
    *,
    margin: float,
    prefetch_layers: int = 1,
    backward_ms: Sequence[float] | None = None,
    freed_bytes: Sequence[int] | None = None,
) -> int:
    """Choose how many leading layers to offload so that their copies hide behind compute and save memory.

    The rule, for ``L`` layers with forward compute ``c_i``, backward compute ``b_i`` (ms), bytes ``s_i`` and padded
    copy time ``d_i = s_i / bandwidth * (1 + margin)`` (one copy stream per direction, copies run in issue order):

    - Forward: layer ``i``'s device-to-host copy may start when its forward ends, at ``F_i = c_0 + ... + c_i``,
      and must end by the end of the forward ``F_{L-1}``: a copy still running then keeps its source alive at the
      memory peak, so it saves nothing. With ``e_{-1} = 0``: ``e_i = max(e_{i-1}, F_i) + d_i <= F_{L-1}``.
    - Backward: the backward runs ``L-1 .. 0``, so layer ``j`` starts it at ``B_j = b_{j+1} + ... + b_{L-1}``.
      Layer ``i``'s prefetch is issued when layer ``k = min(i + p, L - 1)`` starts its backward (``p`` =
      ``prefetch_layers``) and must end before layer ``i``'s starts: ``h_i = max(h, B_k) + d_i <= B_i``.
    - Memory: prefetched layers must fit in what backward has freed, or the peak moves into backward. When layer
      ``k`` starts its backward, the offloaded layers ``max(k-p, 0) .. k`` are on the device again, and backward has
      freed ``f_k`` (``freed_bytes``; by default ``s_{k+1} + ... + s_{L-1}``), of which the offloaded layers after
      ``k`` were never on the device at the peak: ``sum(s[k-p .. min(k, N-1)]) <= f_k - sum(s[k+1 .. N-1])``.

    ``N`` grows from 0 while layers ``0 .. N-1`` satisfy all three; the first ``N`` that does not stops the search.

    Args:
        compute_ms: ``(L,)`` forward time of each layer in milliseconds.
        bytes_per_layer: ``(L,)`` bytes each layer would offload.
        bandwidth_bytes_per_ms: copy bandwidth (the slower direction), bytes per millisecond, ``> 0``.
        margin: fraction added to every copy time (``>= 0``), e.g. ``0.2``.
        prefetch_layers: how many layers ahead backward prefetches (``>= 1`` for any hiding in backward).
        backward_ms: ``(L,)`` measured backward time of each layer; ``None``: twice the forward (two matmuls per
            forward matmul).
        freed_bytes: ``(L,)`` device memory freed from the start of the backward until layer ``k``'s backward
            starts, measured without offload (it counts the weight gradients backward allocates meanwhile); ``None``:
            the saved bytes of the later layers.

    Returns:
        ``N`` in ``[0, L]``: offload layers ``0 .. N-1``.

    Raises:
        OffloadError: on lengths that differ, negative times or bytes, a bandwidth ``<= 0`` or a negative margin.

    Example::

        plan_offload_layers([1.0] * 4, [1] * 4, 1.0, margin=0.0)  # 2: a third prefetch would outgrow freed memory
    """
    depths = (check_int("plan_offload_layers: prefetch_layers", prefetch_layers, low=0, error=OffloadError),)
    return _plan(compute_ms, bytes_per_layer, bandwidth_bytes_per_ms, margin, depths, backward_ms, freed_bytes)[0]


def plan_offload(
    compute_ms: Sequence[float],
    bytes_per_layer: Sequence[int],
    bandwidth_bytes_per_ms: float,
    *,
    margin: float,
    backward_ms: Sequence[float] | None = None,
    freed_bytes: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Like :func:`plan_offload_layers`, choosing the prefetch depth too: the most layers, then the shallowest depth.

    A narrow layer's backward is shorter than its host-to-device copy, so prefetching one layer ahead hides
    nothing; issuing prefetches several layers ahead gives each copy several layers of backward, as long as the
    memory rule still holds.

    Returns:
        ``(N, prefetch_layers)``; ``prefetch_layers`` is 1 when ``N`` is 0.

    Example::

        n, depth = plan_offload([3.0] * 12, [10_000] * 12, 1_000.0, margin=0.0)  # (3, 3)
    """
    depths = tuple(range(1, max(len(compute_ms), 2)))
    return _plan(compute_ms, bytes_per_layer, bandwidth_bytes_per_ms, margin, depths, backward_ms, freed_bytes)


def plan_partial_bytes(
    compute_ms: Sequence[float],
    bytes_per_layer: Sequence[int],
    bandwidth_bytes_per_ms: float,
    *,
    margin: float,
    offload_layers: int,
    prefetch_layers: int,
    backward_ms: Sequence[float] | None = None,
    freed_bytes: Sequence[int] | None = None,
) -> int:
    """How many bytes of layer ``offload_layers`` can offload as well, after the whole layers before it.

    Whole layers leave the copy streams and the freed memory partly unused: the rules of
    :func:`plan_offload_layers` still hold when layer ``N = offload_layers`` offloads its first ``b`` saved bytes
    (``b < s_N``), and every rule tightens as ``b`` grows, so the largest such ``b`` is found by bisection.

    Returns:
        ``b`` in ``[0, s_N]`` (0 when ``N`` is past the last layer or nothing more fits).

    Raises:
        OffloadError: on a negative ``offload_layers``, a ``prefetch_layers`` below 1, or the inputs that
            :func:`plan_offload_layers` rejects.

    Example::

        plan_partial_bytes([3.0] * 12, [10_000] * 12, 1_000.0, margin=0.0, offload_layers=3, prefetch_layers=3)
    """
    check_int("plan_partial_bytes: offload_layers", offload_layers, low=0, error=OffloadError)
    check_int("plan_partial_bytes: prefetch_layers", prefetch_layers, low=1, error=OffloadError)
    _rules(compute_ms, bytes_per_layer, bandwidth_bytes_per_ms, margin, backward_ms, freed_bytes)  # validates
    if offload_layers >= len(compute_ms):
        return 0
    sizes = list(bytes_per_layer)
    # Backward still frees all of layer N's saved bytes; only the offloaded part of it changes.
    freed = _freed_or_later_bytes(sizes, freed_bytes)

    def fits(nbytes: int) -> bool:
        trial = [*sizes[:offload_layers], nbytes, *sizes[offload_layers + 1 :]]
        rules = _rules(compute_ms, trial, bandwidth_bytes_per_ms, margin, backward_ms, freed)
        return rules(offload_layers + 1, prefetch_layers)

    low, high = 0, sizes[offload_layers]
    while low < high:  # the largest nbytes that fits; nothing extra (low = 0) always does
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _freed_or_later_bytes(sizes: list[int], freed_bytes: Sequence[int] | None) -> list[int]:
    """``freed_bytes``, or by default what every layer after ``k`` saved (backward frees it before layer ``k``)."""
    return [sum(sizes[k + 1 :]) for k in range(len(sizes))] if freed_bytes is None else list(freed_bytes)


def _rules(
    compute_ms: Sequence[float],
    bytes_per_layer: Sequence[int],
    bandwidth_bytes_per_ms: float,
    margin: float,
    backward_ms: Sequence[float] | None,
    freed_bytes: Sequence[int] | None,
) -> Callable[[int, int], bool]:
    """Validate the inputs and return ``fits(n, depth)``: the three rules of :func:`plan_offload_layers`."""
    given = {"compute_ms": compute_ms, "bytes_per_layer": bytes_per_layer}
    given.update({"backward_ms": backward_ms} if backward_ms is not None else {})
    given.update({"freed_bytes": freed_bytes} if freed_bytes is not None else {})
    lengths = {name: len(values) for name, values in given.items()}
    if len(set(lengths.values())) > 1:
        raise OffloadError(f"plan_offload_layers: the per-layer inputs differ in length: {lengths}")
    for name, values in given.items():
        for i, value in enumerate(values):
            check_number(f"plan_offload_layers: {name}[{i}]", value, low=0, error=OffloadError)
    num = len(compute_ms)
    sizes = list(bytes_per_layer)
    backward = [_BACKWARD_PER_FORWARD * c for c in compute_ms] if backward_ms is None else list(backward_ms)
    freed = _freed_or_later_bytes(sizes, freed_bytes)
    check_number(
        "plan_offload_layers: bandwidth_bytes_per_ms", bandwidth_bytes_per_ms, low=0, low_open=True, error=OffloadError
    )
    check_number("plan_offload_layers: margin", margin, low=0, error=OffloadError)
    copy_ms = [b / bandwidth_bytes_per_ms * (1.0 + margin) for b in sizes]
    forward_ends = [sum(compute_ms[: i + 1]) for i in range(num)]
    backward_starts = [sum(backward[j + 1 :]) for j in range(num)]

    def fits(n: int, depth: int) -> bool:
        end = 0.0
        for i in range(n):
            end = max(end, forward_ends[i]) + copy_ms[i]
            if end > forward_ends[-1]:
                return False
        end = 0.0
        for i in range(n - 1, -1, -1):
            end = max(end, backward_starts[min(i + depth, num - 1)]) + copy_ms[i]
            if end > backward_starts[i]:
                return False
        for k in range(num):
            resident = sum(sizes[max(k - depth, 0) : min(k, n - 1) + 1])
            if resident > freed[k] - sum(sizes[k + 1 : n]):
                return False
        return True

    return fits


def _plan(
    compute_ms: Sequence[float],
    bytes_per_layer: Sequence[int],
    bandwidth_bytes_per_ms: float,
    margin: float,
    depths: Sequence[int],
    backward_ms: Sequence[float] | None,
    freed_bytes: Sequence[int] | None,
) -> tuple[int, int]:
    fits = _rules(compute_ms, bytes_per_layer, bandwidth_bytes_per_ms, margin, backward_ms, freed_bytes)
    num = len(compute_ms)
    chosen, chosen_depth = 0, depths[0]
    while chosen < num:
        depth = next((d for d in depths if fits(chosen + 1, d)), None)
        if depth is None:
            break
        chosen, chosen_depth = chosen + 1, depth
    return chosen, chosen_depth


def validate_offload_config(
    *,
    min_offload_bytes: Any,
    keep_last_layers: Any,
    prefetch_layers: Any,
    pool_headroom: Any,
    owner: str,
    offload_layers: Any = None,
    recompute: Any = None,
    rebuild_gemms: Any = False,
    force: Any = False,
) -> None:
    """Check offload settings; shared by :class:`ActivationOffloader` and the strategy so both fail at construction.

    Raises:
        OffloadError: naming the field, the rule and the value (negative sizes or counts, a headroom outside
            ``[1, 16]``, ``offload_layers`` other than ``None``, an int ``>= 0`` or ``"auto"``, ``recompute`` other
            than ``None`` or ``"selective"``, ``rebuild_gemms`` neither a bool nor an int ``>= 0``, ``force`` not a
            bool).
    """
    if not isinstance(rebuild_gemms, int) or rebuild_gemms < 0:  # (a bool is an int)
        raise OffloadError(f"{owner}: rebuild_gemms must be a bool or an int >= 0, got {rebuild_gemms!r}")
    if recompute not in RECOMPUTE_MODES:
        raise OffloadError(f"{owner}: recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if offload_layers is not None and offload_layers != "auto":
        if isinstance(offload_layers, bool) or not isinstance(offload_layers, int) or offload_layers < 0:
            raise OffloadError(f"{owner}: offload_layers must be None, an int >= 0 or 'auto', got {offload_layers!r}")
    counts = {
        "min_offload_bytes": min_offload_bytes,
        "keep_last_layers": keep_last_layers,
        "prefetch_layers": prefetch_layers,
    }
    for name, value in counts.items():
        check_int(f"{owner}: {name}", value, low=0, error=OffloadError)
    check_number(f"{owner}: pool_headroom", pool_headroom, low=1, high=MAX_HEADROOM, error=OffloadError)
    check_bool(f"{owner}: force", force, error=OffloadError)


def resolve_layers(root: nn.Module, layers: Sequence[nn.Module] | nn.Module | str | None) -> list[nn.Module]:
    """Find the layer stack whose activations are offloaded.

    Args:
        root: the model.
        layers: ``None`` (the largest ``nn.ModuleList`` whose children all have the same type), an attribute path
            such as ``"model.layers"``, or the modules themselves (a ``ModuleList``/``Sequential`` or a list).

    Returns:
        The layers in execution order.

    Raises:
        OffloadError: when nothing matches (no such attribute, no ``ModuleList`` of identical blocks, empty list).

    Example::

        layers = resolve_layers(model, "layers")
    """
    if layers is None:
        candidates = [
            (len(m), name)
            for name, m in root.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
        ]
        if not candidates:
            raise OffloadError(
                f"layers=None: {type(root).__name__} has no nn.ModuleList of identical blocks; pass layers= "
                "(an attribute path such as 'model.layers' or the modules)"
            )
        _, name = max(candidates, key=lambda c: c[0])  # largest; first one on ties
        found: Any = root.get_submodule(name)
    elif isinstance(layers, str):
        found = root
        for part in layers.split("."):
            if not hasattr(found, part):
                raise OffloadError(f"layers={layers!r}: {type(found).__name__} has no attribute {part!r}")
            found = getattr(found, part)
    else:
        found = layers
    if isinstance(found, nn.Module) and not isinstance(found, (nn.ModuleList, nn.Sequential)):
        found = [found]
    try:
        result = list(found)
    except TypeError as err:
        raise OffloadError(f"layers={layers!r} resolved to {type(found).__name__}, not a list of modules") from err
    if not result or not all(isinstance(m, nn.Module) for m in result):
        raise OffloadError(f"layers={layers!r} matched no modules (got {len(result)} entries)")
    return result


class _Copier:
    """The only place where CUDA (side streams, events) and the CPU path (synchronous copies) differ.

    ``copy`` returns an event on CUDA and ``None`` on CPU, where a copy has completed when it returns.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.is_cuda else None
        self.h2d = torch.cuda.Stream(device) if self.is_cuda else None

    def mark_compute(self) -> torch.cuda.Event | None:
        """Event on the compute (current) stream: copies issued after waiting on it see all prior compute."""
        return torch.cuda.current_stream(self.device).record_event() if self.is_cuda else None

    def copy(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        to_host: bool,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> torch.cuda.Event | None:
        """Copy every ``(dst, src)`` in order on one stream after ``after``; one event marks them all done.

        One layer's copies go in one call: a stream switch, one wait per event and one event per layer instead of
        per tensor (each is a driver call on a forward that is often launch-bound).
        """
        if not self.is_cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream = self.d2h if to_host else self.h2d
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def compute_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event: torch.cuda.Event | None) -> bool:
        # event.query() asks the driver without blocking; it is not a host sync.
        return event is None or event.query()

    def wait_host(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()  # NOTE: host sync; only at step boundaries and on error/teardown paths.

    def timestamp(self) -> torch.cuda.Event | float:
        """A point on the compute stream (a timing event on CUDA, ``perf_counter`` on CPU) for the "auto" plan."""
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def allocated(self) -> int | None:
        """Bytes the caching allocator has handed out on the device now (a host-side counter, no sync); ``None`` on
        CPU, which keeps no such count."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else None

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.is_cuda:
            return (end - start) * 1e3
        end.synchronize()  # NOTE: host sync; once, when the "auto" plan is made after the first step.
        return float(start.elapsed_time(end))

    def bandwidth(self, nbytes: int, host: torch.Tensor) -> float:
        """Copy bandwidth in bytes/ms of the slower direction between the device and ``host`` (``(>= nbytes,)``).

        Best of four timed copies per direction (the first one doubles as the warm-up).
        """
        device_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        best = {True: float("inf"), False: float("inf")}
        for to_host in (True, False, True, False, True, False, True, False):
            dst, src = (host[:nbytes], device_buf) if to_host else (device_buf, host[:nbytes])
            stream = self.d2h if to_host else self.h2d
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                start = self.timestamp()
                dst.copy_(src, non_blocking=self.is_cuda)
                best[to_host] = min(best[to_host], self.elapsed_ms(start, self.timestamp()))
        # A copy too short for the clock would read as infinitely fast; floor it at one microsecond.
        return nbytes / max(max(best.values()), 1e-3)


@dataclass(eq=False)
class _Block:
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


@dataclass(eq=False)
class _Saved:
    """Handle returned by the pack hook: either the tensor itself (kept) or a view recipe into a block."""

    tensor: torch.Tensor | None
    block: _Block | None = None
    dtype: torch.dtype = torch.float32
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    storage_offset: int = 0


@dataclass(eq=False)
class _Shared:
    """One dropped tensor (a rebuildable output or a copy of one) that several saved handles of a layer call view:
    rebuilt once in backward and held from the first read in backward (a saver's, or another handle's rebuild's)
    until each handle's saver has read it, or the handles are freed.

    Two ops can save the same copy: the router's matmul and the experts' grouped GEMM both keep the normalised
    tokens' bf16 copy, which was rebuilt (a norm) once for each, and once more for the gate/up output's rebuild.
    """

    pending: int = 0  # handles on this storage whose consumer has not unpacked them yet
    tensor: torch.Tensor | None = None  # the rebuilt storage's tensor while `pending`
    version: int = 0  # its version when rebuilt: a consumer that changed it in place makes the next unpack rebuild


class _Recipe:
    """A saved tensor dropped in forward and rebuilt in backward: a base tensor that :meth:`base` rebuilds, or a view
    (``view``) of it; rebuilt outputs are shared with the other handles on that very tensor in its layer call
    (:class:`_Shared`)."""

    shared: _Shared | None  # None: rebuilt on every read (weight copies: one cast each)
    consumed: bool  # whether its saver has read it (handles with a _Shared only)
    # (size, stride, storage_offset) of the saved view; None: the base itself, returned without an as_strided (most
    # reads: one dispatch less for 84 of the 132 per backward of bench_offload's 12-layer "host" model, rebuild_gemms)
    view: _View | None

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
        # GEMM's backward reads next; rebuilding it again is a norm, several launches of a backward that is host time
        # at hidden 1024). Never from a read outside backward (grad_fn._saved_*): that would add to forward's memory.
        if in_backward():
            if not self.consumed and not getattr(_REBUILDING, "ids", None):
                self.consumed = True
                shared.pending -= 1
            shared.tensor = base if shared.pending > 0 else None
        return self._viewed(base)

    def _viewed(self, base: torch.Tensor) -> torch.Tensor:
        return base if self.view is None else base.as_strided(*self.view)


@dataclass(eq=False)
class _Recast(_Recipe):
    """Handle returned by the pack hook for a saved low-precision copy of a parameter (autocast's cast).

    Backward casts the parameter again instead of keeping the copy: the same ``_to_copy`` of the same values gives the
    same bits, costs one elementwise kernel, and neither device memory nor bus time. That needs the parameter unchanged
    until backward: an in-place change raises (its version counter moved); a write through ``.data``, which moves no
    counter, cannot be seen.
    """

    param: torch.Tensor
    version: int
    dtype: torch.dtype
    view: _View | None
    # Never shared: each matmul saves the copy it made (autocast without its cache casts per call), and a copy is one
    # cast kernel, so it is rebuilt for each read rather than held. (Held from a gate/up output's rebuild to the
    # experts' backward, their weight copy raised a 4-layer model's backward peak by 46 MB at hidden 1024, 8192
    # tokens, CPU.)
    shared: None = None

    def base(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise OffloadError(
                "ActivationOffloader: a parameter was modified in place between forward and backward; its "
                "low-precision copy saved for backward can no longer be rebuilt (step the optimizer after backward)"
            )
        # Not detached: under create_graph the rebuilt copy keeps the cast's path to the parameter.
        return self.param.to(self.dtype)


# Rebuilds in progress on this thread (ids of _Rebuilt handles): a rebuild that needs itself is a contract violation.
_REBUILDING = threading.local()
# Autograd nodes of reshapes (row-major order kept) allowed between a rebuildable output and its saved copy.
_RESHAPES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})


@dataclass(eq=False)
class _Rebuilt(_Recipe):
    """Handle returned by the pack hook for a saved output of a Function that can rebuild it (``llmfast_rebuild``),
    or for a dtype/device copy of such an output (autocast's bf16 input of the next matmul).

    Backward asks that Function's node for its saved tensors (through the offloader's own unpack, so an offloaded
    input is reloaded first) and runs the rebuild: the same ops on the same values, so the same bits. Only outputs
    whose Function marked itself (:func:`~lightning_llmfast.offload.mark_rebuildable`) with this offloader's hooks
    active and that were not changed in place before being saved are rebuilt. Limits: as for every saved tensor
    under these hooks, an in-place change of the Function's saved inputs between forward and backward is not
    detected (autograd skips its version check for hooked tensors); and the rebuild needs the Function's saved
    tensors, so a backward that runs only the consumer after the Function's own backward freed them raises.
    """

    node: Any  # the Function's backward node (its ctx): saved tensors and attributes
    function: Callable[..., torch.Tensor]  # the Function's llmfast_rebuild
    copy_to: tuple[torch.device, torch.dtype] | None  # the copy's device and dtype; None: the output itself
    shape: tuple[int, ...]  # of the saved tensor's base: the output's, or a reshape of it
    view: _View | None
    shared: _Shared
    consumed: bool = False

    def base(self) -> torch.Tensor:
        busy = _REBUILDING.__dict__.setdefault("ids", set())  # per thread: backward may run on several at once
        if id(self) in busy:  # the Function saved its own output: rebuilding it would need itself
            raise OffloadError(
                f"ActivationOffloader: {type(self.node).__name__} saves its own output, so it cannot declare "
                "llmfast_rebuild (the rebuild would need the tensor it rebuilds)"
            )
        busy.add(id(self))
        try:
            out = self.function(self.node, *self.node.saved_tensors)
        finally:
            busy.discard(id(self))
        if self.copy_to is not None:
            out = out.to(*self.copy_to)
        # Row-major, as the saved copy was: a non-contiguous output (a norm of a transpose) keeps its strides in .to().
        return out.contiguous().reshape(self.shape)


@dataclass(eq=False)
class _Segment:
    """One call of one tracked layer in this step's forward."""

    index: int
    layer_index: int
    offload: bool
    budget: int | None = None  # bytes this call may offload (the "auto" plan's partial layer); None: all
    keeps: bool = False  # neither offloads nor measures: only parameter copies and rebuildable outputs are dropped
    offloaded: int = 0
    blocks: list[_Block] = field(default_factory=list)
    dedup: dict[tuple[int, int], _Block] = field(default_factory=dict)  # (storage ptr, version) -> block
    unsent: list[_Block] = field(default_factory=list)  # offloaded in this call, device-to-host copy not issued yet
    prefetched: bool = False
    # "auto" measuring step only: what this call would offload and when its forward started and ended.
    seen: set[tuple[int, int]] = field(default_factory=set)
    # (storage ptr, version) of a dropped storage -> (weakref of the tensor its handles rebuild, their _Shared)
    rebuilt: dict[tuple[int, int], tuple[Any, _Shared]] = field(default_factory=dict)
    candidate_bytes: int = 0
    started: Any = None
    ended: Any = None
    backward_started: Any = None
    backward_allocated: int | None = None  # device bytes allocated when this call's backward started


class ActivationOffloader:
    """Offload saved activations of a layer stack to pinned host memory and prefetch them in backward.

    Use it as a context manager around forward *and* backward of one step (or call :meth:`begin_step`,
    :meth:`forward_context`, :meth:`end_step` yourself, as :class:`~lightning_llmfast.LLMFastStrategy` does).

    Args:
        layers: the blocks, in execution order (e.g. ``model.layers``). Tensors saved inside a block call belong
            to it; tensors saved between two block calls (e.g. ``torch.utils.checkpoint`` inputs saved just before
            the block runs) belong to the next block; tensors saved before the first or after the last block stay
            on the device, and so do a block's inputs that need no grad (RoPE tables, masks: shared by all blocks).
        min_offload_bytes: storages smaller than this stay on the device.
        keep_last_layers: the last this many layers are not offloaded (their backward runs first).
        prefetch_layers: how many layers ahead backward prefetches; ``prefetch_layers + 1`` device buffer sets.
        pool_headroom: the host pool is sized after the first offloading step to its peak need times this (1 to 16).
        force: run the whole mechanism on CPU too (synchronous copies, plain memory if pinning is unavailable).
        offload_layers: which layers offload. ``None``: all but the last ``keep_last_layers``. An int ``N``: only
            the first ``N`` of those (the earliest layers: their activations live longest). ``"auto"``: the first
            step offloads nothing and measures each layer's forward and backward time (CUDA events;
            ``perf_counter`` on CPU), the bytes each layer would offload and the copy bandwidth (a probe copy through
            pinned memory); from then on the first ``N`` layers offload with the prefetch depth that
            :func:`plan_offload` chose (copy times padded by ``AUTO_MARGIN``; it replaces ``prefetch_layers``),
            and layer ``N`` offloads its saved storages, in the order they are saved, while each fits in the bytes
            that :func:`plan_partial_bytes` leaves. ``stats["offload_layers"]`` and ``stats["partial_offload_bytes"]``
            are the numbers in effect.
        recompute: ``None``, or ``"selective"``: every layer that does not offload (once the plan is known) runs
            under :func:`~lightning_llmfast.offload.recompute.recompute_layer`: it keeps matmul, grouped GEMM,
            attention and routing outputs and recomputes the cheap rest in backward. Copies hide behind compute for
            only a few layers when layers are narrow; recomputation cuts the memory of the others, at the price of
            replaying their cheap ops, which in eager mode go through Python dispatch (2.6x step time on an H200 at
            hidden 1024: opt in when memory, not speed, is the limit). ``stats["recompute_layers"]`` is the number
            in effect. With ``"auto"`` the plan is measured without recomputation, so its memory rule counts the
            recomputing layers' backward as freeing what they saved without it: prefetches can then hold up to those
            layers' savings more than the forward's peak.
        rebuild_gemms: also rebuild saved outputs that their Function marked as a GEMM's
            (:func:`~lightning_llmfast.offload.mark_rebuildable` with ``gemm=True``): the routed experts' gate/up
            projection (:func:`~lightning_llmfast.moe.routed_swiglu`), ``(T * top_k, 2 * ffn)`` per MoE layer, 29%
            of what a reference layer saves at hidden 1024 under bf16, recomputed in its backward by one gather and
            grouped GEMM (the rebuild reads the op's saved tensors: the gate/up weight's bf16 copy is cast once
            more, and the experts' rebuilt input is held until their GEMM's backward reads it). ``True``: in every
            layer call, offloading or not; an int ``N``: in the first ``N`` layers only (each takes the same share
            off the forward's peak, so ``N`` trades memory for backward time linearly). Not in layers under
            ``recompute="selective"``, whose saved tensors belong to the checkpoint. The ``"auto"`` plan measures
            with it.

    The layers' modules are walked once, and again only after some module registers a parameter, buffer or submodule
    (the first offloader installs ``torch.nn`` global registration hooks that count them); their parameter and buffer
    dicts are read every step, so ``.to()``, ``.double()``, ``to_empty()``, ``del`` and ``param.data = ...`` are seen.

    Raises:
        OffloadError: on negative sizes or counts, headroom below 1, an ``offload_layers`` that is not ``None``,
            an int ``>= 0`` or ``"auto"``, a ``recompute`` that is not ``None`` or ``"selective"``, a
            ``rebuild_gemms`` that is neither a bool nor an int ``>= 0``, or an empty layer list.

    Example::

        off = ActivationOffloader(model.layers, min_offload_bytes=1 << 20, keep_last_layers=1,
                                  prefetch_layers=1, pool_headroom=1.5)
        for x in loader:
            with off:
                model(x).mean().backward()
            opt.step()
        off.close()
    """

    def __init__(
        self,
        layers: Sequence[nn.Module] | nn.Module,
        *,
        min_offload_bytes: int = 1 << 20,
        keep_last_layers: int = 1,
        prefetch_layers: int = 1,
        pool_headroom: float = 1.5,
        force: bool = False,
        offload_layers: int | str | None = None,
        recompute: str | None = None,
        rebuild_gemms: bool | int = False,
    ) -> None:
        validate_offload_config(
            min_offload_bytes=min_offload_bytes,
            keep_last_layers=keep_last_layers,
            prefetch_layers=prefetch_layers,
            pool_headroom=pool_headroom,
            owner="ActivationOffloader",
            offload_layers=offload_layers,
            recompute=recompute,
            rebuild_gemms=rebuild_gemms,
            force=force,
        )
        self.min_offload_bytes = min_offload_bytes
        self.keep_last_layers = keep_last_layers
        self.prefetch_layers = prefetch_layers
        if layers is None or isinstance(layers, str):
            raise OffloadError(
                f"ActivationOffloader: layers must be the modules (e.g. model.layers), got {layers!r}; "
                "resolve names with resolve_layers(model, ...)"
            )
        self.layers = resolve_layers(nn.Module(), layers)
        self.force = force
        self.offload_layers = offload_layers
        self.recompute = recompute
        self.rebuild_gemms = rebuild_gemms
        self._recomputed: list[RecomputeHandle] = []
        eligible = max(len(self.layers) - keep_last_layers, 0)
        # How many leading layers offload; None until the "auto" plan is made after its measuring step.
        self._planned: int | None = None
        self._partial = 0  # bytes layer `_planned` offloads too ("auto": what whole layers left of the budget)
        if offload_layers != "auto":
            self._planned = eligible if offload_layers is None else min(int(offload_layers), eligible)
        self._measuring = False
        self._sized = False
        self.auto_plan: dict[str, Any] | None = None
        self.pool = PinnedBufferPool(headroom=float(pool_headroom))
        self._num_sets = self.prefetch_layers + 1
        self._sets: list[torch.Tensor | None] = [None] * self._num_sets
        self._last_set_bytes = 0
        self._set_owner: list[int] = [-1] * self._num_sets
        self._copier: _Copier | None = None
        self._handles = [h for i, layer in enumerate(self.layers) for h in self._hook_layer(i, layer)]
        self._packing = False
        self._hot = False  # whether the pack hook looks at saved tensors at all (see _wants_pack)
        self._offload_calls: set[int] = set()  # offloading layers called in this forward
        self._in_step = False
        self._steps_done = 0
        self._segments: list[_Segment] = []
        self._current: _Segment | None = None
        self._unassigned: list[_Saved] = []
        self._pending_sources: list[_Block] = []
        self._retired: list[_Block] = []
        self._param_ptrs: set[int] = set()
        self._param_shapes: set[torch.Size] = set()
        _watch_module_registrations()
        self._resident_modules: list[weakref.ref[nn.Module]] | None = None
        self._resident_epoch = -1
        self._shared_inputs: set[int] = set()
        # Whether autocast caches its weight copies in the running layer call (read at the call: the pack hook runs
        # below the autocast dispatch key, where autocast always reads as disabled).
        self._autocast_caches = False
        self._counters = dict.fromkeys(
            (
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
            ),
            0,
        )

    # ------------------------------------------------------------------ lifecycle
    def _hook_layer(self, index: int, layer: nn.Module) -> list[Any]:
        def pre(_module: nn.Module, args: Any, kwargs: Any) -> None:
            self._layer_begins(index, (args, kwargs))

        def post(_module: nn.Module, _args: Any, output: Any) -> None:
            self._layer_ends(output)

        return [
            layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.register_forward_hook(post, always_call=True),
        ]

    def _device(self) -> torch.device:
        for layer in self.layers:
            for p in layer.parameters():
                return p.device
        return torch.device("cpu")

    @staticmethod
    def _make_copier(device: torch.device) -> _Copier:
        # A seam for tests: they substitute a copier that defers every copy until something waits for it.
        return _Copier(device)

    @property
    def enabled(self) -> bool:
        """Whether this step offloads: on CUDA always, on CPU only with ``force=True``."""
        return self._copier is not None

    def begin_step(self) -> None:
        """Start a step: release the previous step's buffers and reset the per-step counters."""
        self._release_all()
        device = self._device()
        if device.type == "cuda" or self.force:
            if self._copier is None or self._copier.device != device:
                self._copier = self._make_copier(device)
                self._sets = [None] * self._num_sets
        else:
            self._copier = None
        resident = self._resident_tensors()
        # Parameters, buffers and views of them (W.t() saved by mm) are never offloaded: they stay resident anyway.
        # Their storages are read every step: `.to()` and `param.data = ...` move them without registering anything.
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in resident}
        # A cheap first test for "a copy of a parameter" (reading a cast's source node costs a wrapper object).
        self._param_shapes = {t.shape for t in resident}
        self._counters = dict.fromkeys(self._counters, 0)
        self._measuring = self._copier is not None and self._planned is None
        self._set_owner = [-1] * self._num_sets
        self._apply_recompute()
        self.pool.reset_peak()
        self._in_step = True

    def _resident_tensors(self) -> list[torch.Tensor]:
        """The layers' parameters and buffers.

        The layers' modules are walked again only after some module registered a parameter, buffer or submodule
        since the last walk (12 reference layers' walk took 0.2 ms of host time per step on CPU). Their parameter
        and buffer dicts are read every step: ``.to()``, ``.double()``, ``to_empty()`` and ``del`` change those in
        place without registering anything. Modules are held weakly: a deleted submodule is not kept alive.
        """
        if self._resident_modules is None or self._resident_epoch != _MODULE_EPOCH[0]:
            self._resident_epoch = _MODULE_EPOCH[0]
            self._resident_modules = [weakref.ref(m) for layer in self.layers for m in layer.modules()]
        modules = [m for m in (ref() for ref in self._resident_modules) if m is not None]
        return [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]

    def _apply_recompute(self) -> None:
        """Wrap the layers that recompute this step: with ``recompute`` set and a plan, those not offloaded.

        The wrapping lasts one step (:meth:`end_step` removes it), so the user's modules are only changed while the
        offloader runs them, and two offloaders over the same layers (the benchmark's modes) never stack wrappers.
        """
        self._remove_recompute()
        if self.recompute is not None and self._copier is not None and self._planned is not None:
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
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
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
            assert self._copier is not None
            # A step whose layers ran no backward (a forward under no_grad, an evaluation pass) measured nothing to
            # plan from: the next step measures again.
            if any(seg.backward_started is not None for seg in segments):
                self._plan(segments, backward_end=self._copier.timestamp())
        elif not self._sized and self._copier is not None:
            self.pool.reserve_measured()  # the first step that offloaded under the final plan sizes the pool
            self._sized = True

    def _plan(self, segments: list[_Segment], backward_end: Any) -> None:
        """Make the ``"auto"`` plan from the measuring step (see :func:`plan_offload`)."""
        copier = self._copier
        assert copier is not None
        compute_ms = [0.0] * len(self.layers)
        backward: list[float] | None = [0.0] * len(self.layers)
        bytes_per_layer = [0] * len(self.layers)
        for seg in segments:  # a layer called several times adds up its calls
            if seg.ended is not None:
                compute_ms[seg.layer_index] += copier.elapsed_ms(seg.started, seg.ended)
            bytes_per_layer[seg.layer_index] += seg.candidate_bytes
            # A call's backward runs from its start until the previous call's backward starts (the step's end for
            # the first call); a call whose output needed no grad leaves the estimate to the forward times.
            after = segments[seg.index - 1].backward_started if seg.index > 0 else backward_end
            if backward is not None and seg.backward_started is not None and after is not None:
                backward[seg.layer_index] += copier.elapsed_ms(seg.backward_started, after)
            else:
                backward = None
        freed = _measured_freed(segments, len(self.layers))
        probe = min(max(max(bytes_per_layer), _PROBE_MIN_BYTES), _PROBE_MAX_BYTES)
        # A temporary buffer, pinned like the pool's: through the pool it would count towards the pool's sizing.
        bandwidth = copier.bandwidth(probe, torch.empty(probe, dtype=torch.uint8, pin_memory=self.pool.pinned))
        eligible = max(len(self.layers) - self.keep_last_layers, 0)
        chosen, depth = plan_offload(
            compute_ms, bytes_per_layer, bandwidth, margin=AUTO_MARGIN, backward_ms=backward, freed_bytes=freed
        )
        self._planned = min(chosen, eligible)
        self._partial = 0
        # With recomputation, layer N recomputes instead: keeping what a partial budget leaves would hold more.
        if self._planned < eligible and self.recompute is None:
            self._partial = plan_partial_bytes(
                compute_ms,
                bytes_per_layer,
                bandwidth,
                margin=AUTO_MARGIN,
                offload_layers=self._planned,
                prefetch_layers=depth,
                backward_ms=backward,
                freed_bytes=freed,
            )
        self.prefetch_layers = depth
        self._num_sets = depth + 1
        self._sets = [None] * self._num_sets
        self._set_owner = [-1] * self._num_sets
        self.auto_plan = {
            "compute_ms": compute_ms,
            "backward_ms": backward,
            "bytes_per_layer": bytes_per_layer,
            "freed_bytes": freed,
            "bandwidth_bytes_per_ms": bandwidth,
            "margin": AUTO_MARGIN,
            "offload_layers": self._planned,
            "partial_bytes": self._partial,
            "prefetch_layers": depth,
        }

    def synchronize(self) -> None:
        """Wait for every outstanding copy and return all host buffers to the pool."""
        self._release_all()

    def close(self) -> None:
        """Remove the layer hooks and free the pool and device buffer sets."""
        self.end_step(failed=True)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.pool.clear()
        self._sets = [None] * self._num_sets
        self._copier = None
        self._resident_modules = None

    def __enter__(self) -> ActivationOffloader:
        self.begin_step()
        self._ctx = self.forward_context()
        self._ctx.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._ctx.__exit__(None, None, None)
        self.end_step(failed=exc_type is not None)

    @property
    def stats(self) -> dict[str, int | bool]:
        """Counters of the last step and of the pool.

        ``offloaded_bytes`` (storages copied to the host in the last step), ``offloaded_tensors``,
        ``dedup_hits`` (saved views served by an already offloaded storage), ``prefetch_hits``/``lazy_reloads``
        (unpacks served by a prefetch / by a fallback reload), ``segments`` (layer calls), ``kept_casts``
        (saved low-precision weight copies left on the device because autocast's cache holds them anyway),
        ``recast_casts``/``recast_bytes`` (saved weight copies dropped and rebuilt from the parameter in backward),
        ``rebuilt_tensors``/``rebuilt_bytes`` (saved outputs of rebuildable Functions, such as the RMSNorm output or
        its bf16 copy, dropped and rebuilt from that Function's saved tensors; bytes once per storage),
        ``rebuilds`` (rebuilds run: a rebuilt output that several reads of one layer call's backward need, its
        savers' and another rebuild's, is rebuilt once; a weight copy is cast again for each read; a read outside
        backward rebuilds again),
        ``pool_bytes``,
        ``checked_out`` (host buffers in use now), ``peak_inflight`` (most host bytes in use at once during the
        last step), ``pool_buffers``, ``pool_grow_events``, ``pinned``, ``device_set_bytes``,
        ``offload_layers`` (leading layers that offload; 0 during an ``"auto"`` measuring step and when offload is off),
        ``partial_offload_bytes`` (the ``"auto"`` plan's budget for the layer after them),
        ``recompute_layers`` (layers under selective recomputation in the last step).
        """
        return {
            **self._counters,
            **self.pool.stats(),
            "offload_layers": (self._planned or 0) if self.enabled else 0,
            "partial_offload_bytes": self._partial if self.enabled else 0,
            "peak_inflight": self.pool.peak_out_bytes,
            "device_set_bytes": self._last_set_bytes,
        }

    # ------------------------------------------------------------------ forward
    def _layer_begins(self, index: int, inputs: Any) -> None:
        if not self._packing or in_backward():
            return
        # Inputs that need no grad (RoPE tables, masks, ids) are shared by every layer and alive outside it:
        # offloading them would copy them once per layer and free nothing.
        self._shared_inputs = {t.untyped_storage().data_ptr() for t in _tensors(inputs) if not t.requires_grad}
        self._autocast_caches = self._copier is not None and (
            torch.is_autocast_cache_enabled() and torch.is_autocast_enabled(self._copier.device.type)
        )
        planned = self._planned if self._copier is not None else None
        partial = planned is not None and index == planned and self._partial > 0
        seg = _Segment(
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
        # Likewise the rebuild map (read while packing only): the handles own their _Shared from here, so a rebuilt
        # tensor that one op never reads back dies with that op's node, not at the end of the step.
        seg.rebuilt.clear()
        self._pending_sources.extend(b for b in seg.blocks if b.source is not None)
        self._release_sources()
        grad_fn = next((t.grad_fn for t in _tensors(output) if t.grad_fn is not None), None)
        if grad_fn is not None:
            grad_fn.register_prehook(lambda _grads, i=seg.index: self._backward_begins(i))

    def _send(self, seg: _Segment) -> None:
        """Issue the device-to-host copies of what ``seg`` offloaded, once its forward has ended.

        Autograd never lets a saved tensor change before backward, so copying at the layer's end reads what was
        saved; the sources stay referenced until the copy's event has completed.
        """
        if not seg.unsent:
            return
        copier = self._copier
        assert copier is not None
        # Unsent blocks belong to the running step: their host buffer and source are set until the step's release.
        pairs = [(b.host[: b.nbytes], b.source) for b in seg.unsent]
        event = copier.copy(pairs, to_host=True, after=(copier.mark_compute(),))
        for block in seg.unsent:
            block.d2h_event = event
        seg.unsent.clear()

    def _wants_pack(self, seg: _Segment | None) -> bool:
        """Whether saved tensors need a look now: inside any layer call (offloading, measuring, or rebuilding
        parameter copies) or between layers before the last offloading call (checkpoint inputs).

        Every other saved tensor (the embedding, the head and loss) returns from the pack hook at once: on a
        launch-bound forward the hook's cost is step time.
        """
        if self._copier is None or not self._packing:
            return False
        if seg is not None:
            return True
        return len(self._offload_calls) < (self._planned or 0) + (1 if self._partial else 0)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._hot:
            return t
        base = t._base  # read once: 0.3 us, for each of the ~50 tensors a layer saves
        if base is None:
            base = t
        fn = base.grad_fn
        source = None  # a cast's input, read once: (node, output_nr)
        cast = fn is not None and fn.name() == "ToCopyBackward0"
        if cast:
            inputs = fn.next_functions
            source = inputs[0] if inputs else None
        copies_param = source is not None and base.shape in self._param_shapes  # may be: _cast_source decides
        origin = _rebuild_origin(fn, source) if fn is not None and not copies_param else None
        seg = self._current
        if seg is not None and seg.keeps and not copies_param:
            # A layer that keeps what it saves drops only parameters' copies and marked Functions' outputs (and
            # copies of them), GEMM outputs only where asked to; everything else returns here, before the checks
            # below: half the host time per tensor in a CPU forward, and a launch-bound GPU forward pays host time
            # as step time.
            if origin is None or (origin[0].llmfast_gemm and not self._rebuilds_gemms(seg.layer_index)):
                return t
        if (
            self._copier is None
            or in_backward()
            or type(t) is not torch.Tensor  # parameters, tensor subclasses (fake/functional/distributed)
            or t.layout != torch.strided
            or t.device != self._copier.device
        ):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() < self.min_offload_bytes or ptr in self._param_ptrs or ptr in self._shared_inputs:
            return t
        if seg is None and not self._segments:
            return t  # before the first layer: outside the layers
        # A view that reinterprets its base (view_as_complex) cannot be rebuilt with as_strided: kept or offloaded.
        if fn is not None and t.dtype == base.dtype:
            param = self._cast_source(base, source) if copies_param else None
            if param is not None:
                return self._keep_or_recast(t, base, param)
            if copies_param:
                origin = _rebuild_origin(fn, source)  # a copy of something else of a parameter's shape
            if seg is not None and origin is not None:
                rebuilt = self._rebuildable(t, base, origin, cast, seg)
                if rebuilt is not None:
                    return rebuilt
        if seg is not None and not seg.offload:
            if self._measuring:
                self._measure(t, seg)
            return t  # a layer that keeps what it saves
        saved = _Saved(tensor=t)
        if seg is None:
            self._unassigned.append(saved)  # between layers: decided when the next one starts (kept after the last)
        elif not self._offload(saved, seg):
            return t  # over the partial layer's budget: stays on the device
        return saved

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
        self, t: torch.Tensor, base: torch.Tensor, origin: tuple[Any, int], cast: bool, seg: _Segment
    ) -> _Rebuilt | None:
        """A recipe for ``t`` (a view of ``base``; ``cast``: ``base`` is a ``ToCopyBackward0``'s copy) if ``origin``
        (:func:`_rebuild_origin`: the node that made ``base``, or the output it copied) can rebuild it.

        Only whole contiguous outputs count, so that ``as_strided`` on the rebuilt tensor gives back the very view.
        """
        if not base.is_contiguous() or base.storage_offset():
            return None
        if cast and base._version:
            return None  # the copy changed in place since it was made: a rebuild would give the values before
        node, output_nr = origin
        if not cast:
            output_nr = base.output_nr
        if getattr(node, "llmfast_pack_hook", None) != self._pack:
            return None  # its saved tensors belong to other hooks (checkpoint: one unpack only)
        if node.llmfast_gemm and not self._rebuilds_gemms(seg.layer_index):
            return None  # a GEMM's output: kept unless rebuilding GEMMs was asked for (it costs backward time)
        output = node.llmfast_output()
        if output is None or output.output_nr != output_nr:
            return None  # gone (so unknown), or another output of the Function than the one its rebuild gives
        if output._version != node.llmfast_output_version:
            return None  # changed in place since forward: a rebuild would give the values before the change
        self._counters["rebuilt_tensors"] += 1
        shared, new_storage = self._share(base, seg)
        if new_storage:
            self._counters["rebuilt_bytes"] += base.untyped_storage().nbytes()
        return _Rebuilt(
            node=node,
            function=node.llmfast_rebuild,
            copy_to=(base.device, base.dtype) if cast else None,
            shape=tuple(base.shape),
            view=_view_of(t, base),
            shared=shared,
        )

    @staticmethod
    def _share(base: torch.Tensor, seg: _Segment) -> tuple[_Shared, bool]:
        """The :class:`_Shared` of the handles on the very tensor ``base`` in ``seg`` (the layer call, while it runs),
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
            shared = _Shared()
            if known is None:
                seg.rebuilt[key] = (weakref.ref(base), shared)
        shared.pending += 1
        return shared, known is None

    def _rebuilds_gemms(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` rebuilds GEMM outputs: ``rebuild_gemms`` is a bool (all layers) or a count."""
        if isinstance(self.rebuild_gemms, bool):  # first: True is also the int 1
            return self.rebuild_gemms
        return layer_index < self.rebuild_gemms

    def _keep_or_recast(self, t: torch.Tensor, base: torch.Tensor, param: torch.Tensor) -> torch.Tensor | _Recast:
        """Keep a parameter's saved copy (``t``, a view of ``base``) while autocast's cache holds it, else rebuild it
        in backward.

        With the cache (``torch.autocast``'s default) the copy lives until the autocast region ends, after the
        forward: dropping or copying it frees nothing at the forward's peak. Without it (Lightning's mixed precision
        uses ``cache_enabled=False``) the saved copy is the only reference, so rebuilding it in backward frees it at
        once (23.4% of what a reference-model layer saves at hidden 1024 under bf16, 36.5% at hidden 4096 with 4
        experts) for one cast kernel and no copy.
        """
        if self._autocast_caches:
            self._counters["kept_casts"] += 1
            return t
        self._counters["recast_casts"] += 1
        self._counters["recast_bytes"] += t.untyped_storage().nbytes()
        return _Recast(
            param=param,
            version=param._version,
            dtype=t.dtype,
            view=_view_of(t, base),
        )

    @staticmethod
    def _measure(t: torch.Tensor, seg: _Segment) -> None:
        # The "auto" measuring step counts what offloading would copy, deduplicated as `_offload` does.
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)
        if key not in seg.seen:
            seg.seen.add(key)
            seg.candidate_bytes += storage.nbytes()

    def _offload(self, saved: _Saved, seg: _Segment) -> bool:
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
            seg.offloaded += nbytes
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            block = _Block(nbytes=nbytes, segment=seg.index, host=self.pool.acquire(nbytes), source=source)
            seg.blocks.append(block)
            seg.unsent.append(block)
            seg.dedup[key] = block
            self._counters["offloaded_bytes"] += nbytes
        else:
            self._counters["dedup_hits"] += 1
        self._counters["offloaded_tensors"] += 1
        saved.block = block
        saved.dtype = t.dtype
        saved.size = tuple(t.shape)
        saved.stride = t.stride()
        saved.storage_offset = t.storage_offset()
        saved.tensor = None
        return True

    def _release_sources(self) -> None:
        if self._copier is None:
            return  # nothing was offloaded
        still = []
        for block in self._pending_sources:
            if self._copier.done(block.d2h_event):
                block.source = None
            else:
                still.append(block)
        self._pending_sources = still

    # ------------------------------------------------------------------ backward
    def _backward_begins(self, seg_index: int) -> None:
        if not self._segments:
            return  # the step already ended (graph retained past it)
        if self._measuring and self._segments[seg_index].backward_started is None:
            assert self._copier is not None
            self._segments[seg_index].backward_started = self._copier.timestamp()
            self._segments[seg_index].backward_allocated = self._copier.allocated()
        self._release_sources()
        for j in range(seg_index, max(seg_index - self.prefetch_layers, 0) - 1, -1):
            seg = self._segments[j]
            if seg.offload and not seg.prefetched and seg.blocks:
                self._prefetch(seg)

    def _prefetch(self, seg: _Segment) -> None:
        copier = self._copier
        assert copier is not None
        s = seg.index % self._num_sets
        previous = self._set_owner[s]
        if previous >= 0:
            # That layer's backward is over: its views of the set are gone, and a set that grows below frees the
            # old buffer instead of holding it to the step's end (a partial layer's smaller set would).
            for block in self._segments[previous].blocks:
                block.flat = None
        total = sum(_aligned(b.nbytes) for b in seg.blocks)
        flat = self._sets[s]
        if flat is None or flat.numel() < total:
            # Grows to the largest layer (MoE layers differ per step, a partial layer is smaller).
            flat = self._sets[s] = torch.empty(total, dtype=torch.uint8, device=copier.device)
            if copier.h2d is not None:
                # Written on the copy stream: the allocator must not reuse it before those copies are done.
                flat.record_stream(copier.h2d)
        # The set was last used by a layer whose backward has finished; copies wait for that compute.
        compute_done = copier.mark_compute()
        pairs = []
        offset = 0
        for block in seg.blocks:
            assert block.host is not None
            block.flat, block.offset, block.set_index = flat, offset, s
            pairs.append((flat[offset : offset + block.nbytes], block.host[: block.nbytes]))
            offset += _aligned(block.nbytes)
        d2h = {id(b.d2h_event): b.d2h_event for b in seg.blocks}  # one per layer call
        event = copier.copy(pairs, to_host=False, after=(compute_done, *d2h.values()))
        for block in seg.blocks:
            block.h2d_event = event
            block.reads.append(event)
        seg.prefetched = True
        self._set_owner[s] = seg.index

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            return saved.unpack(self._counters)
        if not isinstance(saved, _Saved):
            return saved
        if saved.tensor is not None:
            return saved.tensor
        block = saved.block
        copier = self._copier
        assert block is not None and copier is not None
        if block.host is None:
            raise OffloadError(
                "ActivationOffloader: a saved activation was unpacked after its step ended; run backward inside "
                "the step (retain_graph across steps is not supported with offloading)"
            )
        if block.flat is not None and self._set_owner[block.set_index] == block.segment:
            copier.compute_waits(block.h2d_event)
            flat, offset = block.flat, block.offset
            self._counters["prefetch_hits"] += 1
        else:
            # Fallback: unpacked before its prefetch was issued, or after its buffer set was reused.
            flat = torch.empty(_aligned(block.nbytes), dtype=torch.uint8, device=copier.device)
            copier.compute_waits(block.d2h_event)
            flat[: block.nbytes].copy_(block.host[: block.nbytes], non_blocking=copier.is_cuda)
            block.reads.append(copier.mark_compute())
            offset = 0
            self._counters["lazy_reloads"] += 1
        # Sets and fallback buffers are multiples of _ALIGN bytes, so every dtype view of them is exact.
        typed = flat.view(saved.dtype)
        return torch.as_strided(typed, saved.size, saved.stride, offset // saved.dtype.itemsize + saved.storage_offset)

    # ------------------------------------------------------------------ release
    def _release_done(self) -> None:
        copier = self._copier
        if copier is None:
            return  # nothing was offloaded
        still = []
        for block in self._retired:
            if all(copier.done(e) for e in (block.d2h_event, *block.reads)):
                self._give_back(block)
            else:
                still.append(block)
        self._retired = still

    def _release_all(self) -> None:
        self._retired.extend(b for seg in self._segments for b in seg.blocks)
        self._segments = []
        self._current = None
        self._unassigned.clear()
        for block in self._retired:
            if self._copier is not None:
                for event in (block.d2h_event, *block.reads):
                    self._copier.wait_host(event)
            self._give_back(block)
        self._retired = []
        self._pending_sources = []

    def _give_back(self, block: _Block) -> None:
        if block.host is not None:
            self.pool.release(block.host)
        block.host = block.source = block.flat = None
        block.reads.clear()


def _measured_freed(segments: list[_Segment], num_layers: int) -> list[int] | None:
    """``(L,)`` device bytes freed between the start of the backward and the start of each layer's backward, from
    the allocator's counts in the "auto" measuring step; ``None`` unless every layer ran once and was counted.

    Backward frees saved activations but also allocates the weight gradients meanwhile, so this can be much less
    than what the later layers saved.
    """
    if len(segments) != num_layers or any(s.backward_allocated is None for s in segments):
        return None
    top = segments[-1].backward_allocated  # the last call's backward starts first
    assert top is not None
    freed = [0] * num_layers
    for seg in segments:
        assert seg.backward_allocated is not None
        freed[seg.layer_index] = max(top - seg.backward_allocated, 0)
    return freed


# Bumped whenever any module registers a parameter, buffer or submodule (global registration hooks, installed once,
# by the first offloader): the layers' resident tensors are walked again only then.
_MODULE_EPOCH = [0]
_WATCHING: list[bool] = []  # one entry once the hooks are installed
_WATCH_LOCK = threading.Lock()


def _bump_module_epoch(*_args: Any) -> None:
    _MODULE_EPOCH[0] += 1


def _watch_module_registrations() -> None:
    with _WATCH_LOCK:
        if not _WATCHING:
            nn.modules.module.register_module_parameter_registration_hook(_bump_module_epoch)
            nn.modules.module.register_module_buffer_registration_hook(_bump_module_epoch)
            nn.modules.module.register_module_module_registration_hook(_bump_module_epoch)
            _WATCHING.append(True)


def _rebuild_origin(fn: Any, source: tuple[Any, int] | None) -> tuple[Any, int] | None:
    """The ``(node, output_nr)`` whose ``llmfast_rebuild`` could give a saved tensor back, or ``None``.

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
    return (node, output_nr) if getattr(node, "llmfast_rebuild", None) is not None else None


def _view_of(t: torch.Tensor, base: torch.Tensor) -> _View | None:
    """What ``as_strided`` on ``base`` gives ``t`` back; ``None`` when ``t`` is ``base``."""
    return None if t is base else (tuple(t.shape), t.stride(), t.storage_offset())


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module output (tensor, tuple/list, dict or dataclass-like with tensor fields)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
