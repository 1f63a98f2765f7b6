"""``plan_memory``: per layer and per saved storage keep, recompute or offload, so that the saved bytes fit a budget
at the least added time.

The model, per layer ``i`` of a :class:`~lightning_llmfast.offload.MemoryProfile` (saved bytes ``s_i`` in storages
``t_i1, t_i2, ...`` in save order, of which recomputation would free ``r_i``; forward ``f_i`` and backward ``b_i`` ms;
recompute cost ``c_i``; link bandwidth ``w``; host ms per offloaded storage ``h``):

- keep: frees nothing, costs nothing;
- recompute (selective): frees ``r_i``, costs ``c_i`` in backward;
- offload the first ``k`` storages to pinned host memory: frees their bytes ``p_ik``; its copy
  ``d = p_ik / w * (1 + margin)`` overlaps the next layer's forward (device to host) and, prefetched one layer ahead,
  the next layer's backward (host to device), so it costs ``max(0, d - f_{i+1}) + max(0, d - b_{i+1}) + k h`` (the
  last layer hides nothing); where copies cannot run beside compute (``MemoryProfile.copies_overlap=False``: CPU) it
  costs ``2 d + k h``. Offloading part of a layer pays off on a GPU, where the bytes the neighbouring compute hides
  are free, and on any budget between two layers' sizes.

Granularity: offloading is chosen per saved storage (a view shares its storage's copy), as a prefix in save order: the
pack hook decides when a tensor is saved, before the layer's later tensors exist, so a layer offloads until its byte
budget is spent (:class:`~.handles.Segment` ``budget``); every subset of storages of equal bytes would cost and free the
same, so the prefix loses only which byte totals are reachable. Recomputation stays per layer: selective
recomputation replays the layer's forward, and what it keeps is fixed by the op kinds (measured, in the profile).
Rebuilds (``OffloadConfig.rebuild``) happen before the profile counts a layer's bytes.

The predicted step time is the measured one plus the costs. The predicted peak of live saved bytes follows the step
(:func:`predict_peak`): the forward ends holding what every layer keeps, ``sum(s_i - freed_i)``; in backward each
layer's kept bytes go when its backward is done, while the prefetched layers' bytes come back into
``prefetch_layers + 1`` device buffer sets, each as large as the largest layer it held (:func:`set_bytes`).

The optimiser is exact for this model: dynamic programming over the layers from last to first (the order of backward),
whose states are the largest layer in each buffer set, the kept bytes of the layers whose peak constraint waits for the
prefetch decision, and one number folding every checked constraint (how much the earlier layers may still keep), with
Pareto pruning on (that number, added time). Greedy by cost per byte is not optimal with a few large items (a dozen
layers); a knapsack on the forward's peak alone misses the backward, where buffer sets of late offloaded layers meet
the kept bytes of early ones. The states stay few (layer sizes per set times the Pareto fronts), so the exact answer
costs milliseconds for a dozen layers (brute force agrees in the tests).

Example::

    plan = plan_memory(profile, budget_bytes=int(0.7 * profile.saved_bytes))
    print(plan.table())
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.memory_plan_plot import Bar, plot_steps
from lightning_llmfast.offload.pool import aligned_bytes, size_class
from lightning_llmfast.offload.profile import LayerProfile, MemoryProfile
from lightning_llmfast.offload.schedule import AUTO_MARGIN

__all__ = ["MECHANISMS", "MemoryPlan", "mechanism_cost", "plan_memory", "predict_peak"]

Option = tuple[str, int, int, float]  # (mechanism, storages offloaded, freed bytes, added ms)
ALL_PREFIXES = 4  # a layer saving at most this many storages may offload any prefix of them
PREFIX_STEPS = 4  # else prefixes up to each quarter of its bytes (and where the copy cost's slope changes)

MECHANISMS = ("keep", "recompute", "offload", "nvme")
TIERS = ("pinned", "nvme")
_TIER_MECHANISM = {"pinned": "offload", "nvme": "nvme"}


@dataclass(frozen=True)
class MemoryPlan:
    """A mechanism per layer with its prediction.

    Attributes:
        choices: per layer, one of :data:`MECHANISMS`.
        freed_bytes: per layer, the bytes its mechanism removes (an offloading layer's: the bytes it offloads).
        cost_ms: per layer, the time its mechanism adds.
        budget_bytes: the budget planned for.
        predicted_peak: the most live saved bytes at once over the step (:func:`predict_peak`).
        predicted_ms: the measured step time plus the added costs.
        profile: what it was planned from.
        prefetch_layers: the prefetch depth the peak was predicted for.
        storages: per layer, how many of its saved storages (in save order) it offloads; 0 unless it offloads.
    """

    choices: tuple[str, ...]
    freed_bytes: tuple[int, ...]
    cost_ms: tuple[float, ...]
    budget_bytes: int
    predicted_peak: int
    predicted_ms: float
    profile: MemoryProfile
    prefetch_layers: int = 1
    storages: tuple[int, ...] = ()

    def layers(self, mechanism: str) -> frozenset[int]:
        """The layers planned with ``mechanism``."""
        return frozenset(i for i, c in enumerate(self.choices) if c == mechanism)

    def offload_budgets(self) -> dict[int, int]:
        """Per offloading layer (to either tier) that offloads only part of what it saves, the bytes it offloads."""
        layers = self.profile.layers
        return {
            i: self.freed_bytes[i]
            for i, c in enumerate(self.choices)
            if c in ("offload", "nvme") and self.freed_bytes[i] < layers[i].saved_bytes
        }

    def table(self) -> str:
        """The plan as a text table: per layer its bytes, mechanism, freed bytes and added time; then the totals."""
        rows = [f"{'layer':>5} {'saved MB':>9} {'mechanism':>10} {'storages':>9} {'freed MB':>9} {'+ms':>7}"]
        for i, layer in enumerate(self.profile.layers):
            part = f"{self.storages[i]}/{len(layer.storages)}" if self.storages and self.storages[i] else "-"
            rows.append(
                f"{i:>5} {layer.saved_bytes / 1e6:>9.2f} {self.choices[i]:>10} {part:>9} "
                f"{self.freed_bytes[i] / 1e6:>9.2f} {self.cost_ms[i]:>7.2f}"
            )
        rows.append(
            f"predicted peak {self.predicted_peak / 1e6:.2f} MB of saved activations (budget "
            f"{self.budget_bytes / 1e6:.2f} MB, {self.profile.saved_bytes / 1e6:.2f} MB kept by nothing); predicted "
            f"step {self.predicted_ms:.2f} ms ({self.profile.step_ms:.2f} ms measured without a plan)"
        )
        return "\n".join(rows)

    def plot(self, path: str) -> None:
        """Draw the predicted live saved bytes over the step (forward up, backward down) against the budget, one
        colour per mechanism, into ``path`` (needs matplotlib)."""
        plot_steps(self.step_bars(), self.budget_bytes, path)

    def step_bars(self) -> list[Bar]:
        """The step as bars ``(start ms, width ms, live saved bytes, mechanism)``: each layer's forward adds what its
        mechanism leaves on the device; backward frees it again, last layer first."""
        layers = self.profile.layers
        order = [(i, +1) for i in range(len(layers))] + [(i, -1) for i in reversed(range(len(layers)))]
        bars: list[Bar] = []
        t, live = 0.0, 0
        for i, sign in order:
            width = layers[i].forward_ms if sign > 0 else layers[i].backward_ms + self.cost_ms[i]
            bars.append((t, width, live, self.choices[i]))
            live += sign * (layers[i].saved_bytes - self.freed_bytes[i])
            t += width
        return bars


def mechanism_cost(
    profile: MemoryProfile, index: int, mechanism: str, margin: float = AUTO_MARGIN, storages: int | None = None
) -> tuple[int, float]:
    """``(freed bytes, added ms)`` of ``mechanism`` on layer ``index`` under the model above; an offload mechanism
    offloads the layer's first ``storages`` saved storages (``None``: all)."""
    layers = profile.layers
    layer = layers[index]
    if mechanism == "keep":
        return 0, 0.0
    if mechanism == "recompute":
        return layer.recompute_bytes, layer.recompute_ms
    count = len(layer.storages) if storages is None else storages
    nbytes = sum(layer.storages[:count])
    host_ms = count * profile.storage_ms
    if mechanism == "nvme":
        if profile.nvme_bandwidth_bytes_per_ms is None:
            raise OffloadError("plan_memory: the nvme tier needs MemoryProfile.nvme_bandwidth_bytes_per_ms")
        copy_ms = nbytes / profile.nvme_bandwidth_bytes_per_ms * (1.0 + margin)  # on worker threads
    elif mechanism == "offload":
        copy_ms = nbytes / profile.bandwidth_bytes_per_ms * (1.0 + margin)
        if not profile.copies_overlap:
            return nbytes, 2.0 * copy_ms + host_ms
    else:
        raise OffloadError(f"plan_memory: unknown mechanism {mechanism!r}; one of {MECHANISMS}")
    after = layers[index + 1] if index + 1 < len(layers) else None
    forward, backward = (after.forward_ms, after.backward_ms) if after is not None else (0.0, 0.0)
    return nbytes, max(0.0, copy_ms - forward) + max(0.0, copy_ms - backward) + host_ms


def set_bytes(layer: LayerProfile, freed: int) -> int:
    """Device bytes of the buffer set that brings back ``freed`` offloaded bytes of ``layer``: its first storages, each
    starting at a 256-byte boundary (:func:`~.pool.aligned_bytes`), rounded to a size class (:func:`~.pool.size_class`).

    Example::

        set_bytes(LayerProfile(600, 0, 1.0, 2.0, 1.0, (100, 500)), 600)  # size_class(256 + 512)
    """
    return size_class(_aligned_prefixes(layer.storages).get(freed, freed))


@functools.lru_cache(maxsize=256)
def _aligned_prefixes(storages: tuple[int, ...]) -> dict[int, int]:
    """Bytes of each prefix of ``storages`` -> the same storages' aligned span."""
    spans, raw, aligned = {0: 0}, 0, 0
    for nbytes in storages:
        raw, aligned = raw + nbytes, aligned + aligned_bytes(nbytes)
        spans.setdefault(raw, aligned)
    return spans


def predict_peak(profile: MemoryProfile, choices: Sequence[str], freed: Sequence[int], prefetch_layers: int = 1) -> int:
    """The most live saved bytes at once over a step that runs ``choices`` (see the module's model).

    Example::

        predict_peak(profile, ["offload"] * n, [l.saved_bytes for l in profile.layers])  # two layers' buffer sets

    An offloading layer's buffer set holds what it offloaded (its ``freed`` bytes): :func:`set_bytes`.
    """
    kept = [layer.saved_bytes - f for layer, f in zip(profile.layers, freed)]
    live = peak = sum(kept)
    sets = [0] * (prefetch_layers + 1)
    for j in reversed(range(len(kept))):
        if j + 1 < len(kept):
            live -= kept[j + 1]  # layer j + 1's backward is done when layer j's starts
        for k in range(j, max(j - prefetch_layers, 0) - 1, -1):  # prefetched when layer j's backward starts
            if choices[k] in ("offload", "nvme") and freed[k]:
                s = k % len(sets)
                sets[s] = max(sets[s], set_bytes(profile.layers[k], freed[k]))
        peak = max(peak, live + sum(sets))
    return peak


def _pareto(states: list[tuple[int, float, tuple[int, ...]]]) -> list[tuple[int, float, tuple[int, ...]]]:
    """The states not beaten by one with less need and less cost."""
    kept, cheapest = [], math.inf
    for state in sorted(states, key=lambda st: (st[0], st[1])):
        if state[1] < cheapest:
            kept.append(state)
            cheapest = state[1]
    return kept


def _cheapest(
    profile: MemoryProfile,
    options: list[list[Option]],
    budget: int,
    prefetch_layers: int,
    pinned_bytes: int | None = None,
) -> tuple[int, ...] | None:
    """The least-cost option index per layer whose :func:`predict_peak` fits ``budget`` (``None``: none does).

    Layers are decided last to first (the order of backward). The peak's constraint at layer ``j`` is
    ``K_j + S_j <= budget``: ``K_j`` the bytes layers ``0..j`` keep, ``S_j`` the buffer sets allocated by then (a
    maximum over the offloaded layers ``>= j - prefetch_layers``, known once those are decided). Folding the evaluated
    constraints into ``need = max_i (kept of j..i + S_i)`` leaves one number per state that only ever grows, so a
    state is kept only if no other with the same sets and pending layers has both less need and less cost. With
    ``pinned_bytes``, the bytes offloaded to pinned memory so far are part of the state and stay within it.
    """
    layers, sets = profile.layers, prefetch_layers + 1
    # (largest offload per buffer set, kept bytes of the layers whose constraint is still pending, pinned bytes used)
    # -> Pareto states
    Key = tuple[tuple[int, ...], tuple[int, ...], int]
    states: dict[Key, list[tuple[int, float, tuple[int, ...]]]] = {((0,) * sets, (), 0): [(0, 0.0, ())]}
    for k in reversed(range(len(layers))):
        grown: dict[Key, list[tuple[int, float, tuple[int, ...]]]] = {}
        for (largest, pending, used), front in states.items():
            for o, (name, _, freed, added) in enumerate(options[k]):
                grew, pinned = largest, used
                if name in ("offload", "nvme") and freed:
                    s = k % sets
                    grew = (*largest[:s], max(largest[s], set_bytes(layers[k], freed)), *largest[s + 1 :])
                if name == "offload" and pinned_bytes is not None:
                    pinned += freed
                    if pinned > pinned_bytes:
                        continue
                waiting = (layers[k].saved_bytes - freed, *pending)
                due = len(waiting) > prefetch_layers  # layer k + prefetch_layers' constraint is known now
                key = (grew, waiting[:-1] if due else waiting, pinned)
                for need, cost, chosen in front:
                    if due:
                        need = waiting[-1] + max(need, sum(grew))
                    if need <= budget:
                        grown.setdefault(key, []).append((need, cost + added, (o, *chosen)))
        states = {key: _pareto(front) for key, front in grown.items()}
    best: tuple[float, tuple[int, ...]] | None = None
    for (largest, pending, _), front in states.items():
        for need, cost, chosen in front:
            for kept in reversed(pending):  # the first layers' constraints: every set is allocated by then
                need = kept + max(need, sum(largest))
            if need <= budget and (best is None or cost < best[0]):
                best = (cost, chosen)
    return None if best is None else best[1]


def _options(profile: MemoryProfile, index: int, mechanisms: Sequence[str], margin: float) -> list[Option]:
    """Layer ``index``'s options: keep, recompute, and per offload mechanism the candidate prefixes of its saved
    storages (:func:`_prefixes`)."""
    found: list[Option] = []
    for m in mechanisms:
        counts = [None] if m in ("keep", "recompute") else _prefixes(profile, index, m, margin)
        for count in counts:
            freed, added = mechanism_cost(profile, index, m, margin, count)
            found.append((m, count or 0, freed, added))
    return found


def _prefixes(profile: MemoryProfile, index: int, mechanism: str, margin: float) -> list[int]:
    """How many leading storages layer ``index`` may offload with ``mechanism``: every count up to
    :data:`ALL_PREFIXES` storages; beyond, the largest prefix within each ``j / PREFIX_STEPS`` of the layer's bytes and,
    where copies overlap compute, the largest whose copy the next layer's forward, and its backward, still hide (where
    the cost's slope changes). Counts that add no bytes (a storage of 0 bytes) are left out."""
    storages = profile.layers[index].storages
    counts = range(1, len(storages) + 1)
    if len(storages) > ALL_PREFIXES:
        total, sizes = sum(storages), list(itertools.accumulate(storages))
        limits = [total * j / PREFIX_STEPS for j in range(1, PREFIX_STEPS + 1)]
        after = profile.layers[index + 1] if index + 1 < len(profile.layers) else None
        bandwidth = profile.nvme_bandwidth_bytes_per_ms if mechanism == "nvme" else profile.bandwidth_bytes_per_ms
        if after is not None and profile.copies_overlap and bandwidth:
            limits += [ms * bandwidth / (1.0 + margin) for ms in (after.forward_ms, after.backward_ms)]
        counts = sorted({max(bisect.bisect_right(sizes, limit), 1) for limit in limits} | {len(storages)})
    return [k for k in counts if storages[k - 1]]


def plan_memory(
    profile: MemoryProfile,
    budget_bytes: int,
    tiers: Sequence[str] = ("pinned",),
    *,
    margin: float = AUTO_MARGIN,
    prefetch_layers: int = 1,
    pinned_bytes: int | None = None,
) -> MemoryPlan:
    """The plan of least predicted step time whose saved bytes fit ``budget_bytes`` over the whole step.

    Args:
        profile: the measured step.
        budget_bytes: the most saved-activation bytes the layers may keep at once.
        tiers: where offloaded bytes may go: ``"pinned"`` (pinned host memory, mechanism ``"offload"``) and
            ``"nvme"`` (files, mechanism ``"nvme"``, at ``profile.nvme_bandwidth_bytes_per_ms``); ``()``: no offload.
        margin: fraction added to every copy time.
        prefetch_layers: the offloader's prefetch depth (``prefetch_layers + 1`` device buffer sets in backward).
        pinned_bytes: the most bytes the pinned tier may hold (``OffloadConfig.pinned_budget``); ``None``: no limit.

    Raises:
        OffloadError: an unknown tier, a budget below 1, or one that no plan meets (with the least it could reach).
    """
    check_int("plan_memory: budget_bytes", budget_bytes, low=1, error=OffloadError)
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise OffloadError(f"plan_memory: unknown tiers {unknown}; available: {list(TIERS)}")
    mechanisms = ["keep", "recompute", *(_TIER_MECHANISM[t] for t in TIERS if t in tiers)]
    options = [_options(profile, i, mechanisms, margin) for i in range(len(profile.layers))]
    keep_all = tuple(0 for _ in options)  # keep is every layer's first option; costs nothing, so it wins if it fits
    fits = predict_peak(profile, ["keep"] * len(options), [0] * len(options), prefetch_layers) <= budget_bytes
    picked = keep_all if fits else _cheapest(profile, options, budget_bytes, prefetch_layers, pinned_bytes)
    if picked is None:
        last = [o[-1] for o in options]  # the last mechanism, offloading all (or recompute without a tier)
        least = predict_peak(profile, [o[0] for o in last], [o[2] for o in last], prefetch_layers)
        raise OffloadError(
            f"plan_memory: no plan keeps the saved bytes under budget_bytes={budget_bytes}: the layers save "
            f"{profile.saved_bytes} bytes, and with {mechanisms} and {prefetch_layers + 1} device buffer sets for "
            f"prefetching in backward the least peak is above it (offloading every layer: {least})"
        )
    chosen = [options[i][o] for i, o in enumerate(picked)]
    choices = tuple(c[0] for c in chosen)
    freed = tuple(c[2] for c in chosen)
    return MemoryPlan(
        choices=choices,
        freed_bytes=freed,
        cost_ms=tuple(c[3] for c in chosen),
        budget_bytes=budget_bytes,
        predicted_peak=predict_peak(profile, choices, freed, prefetch_layers),
        predicted_ms=profile.step_ms + sum(c[3] for c in chosen),
        profile=profile,
        prefetch_layers=prefetch_layers,
        storages=tuple(c[1] for c in chosen),
    )
