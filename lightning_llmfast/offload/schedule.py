"""Planning the ``"auto"`` offload schedule: pure functions over measured per-layer numbers.

Given each layer's forward and backward time, the bytes it would offload, the copy bandwidth and the memory backward
frees, :func:`plan_offload` picks how many leading layers offload and how far ahead backward prefetches so that the
copies hide behind compute and prefetched layers fit in memory backward has already freed; :func:`plan_partial_bytes`
says how much of the next layer can offload as well. Nothing here touches a tensor.

Example::

    n, depth = plan_offload([3.0] * 12, [10_000] * 12, 1_000.0, margin=0.0)  # (3, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import OffloadError

__all__ = ["AUTO_MARGIN", "plan_offload", "plan_offload_layers", "plan_partial_bytes"]

# Backward of a transformer block costs about twice its forward (two matmuls per forward matmul): the estimate when
# no backward time is given (the "auto" plan measures both).
_BACKWARD_PER_FORWARD = 2.0
# Copy times are padded by this fraction in the "auto" plan: bandwidth and compute vary from step to step.
AUTO_MARGIN = 0.2


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
