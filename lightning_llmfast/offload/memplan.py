"""``plan_memory``: per layer keep, recompute or offload, so that the saved bytes fit a budget at the least added time.

The model, per layer ``i`` of a :class:`~lightning_llmfast.offload.MemoryProfile` (saved bytes ``s_i``, of which
``r_i`` are outputs of cheap ops; forward ``f_i`` and backward ``b_i`` ms; recompute cost ``c_i``; link bandwidth
``w``):

- keep: frees nothing, costs nothing;
- recompute (selective): frees ``r_i``, costs ``c_i`` in backward;
- offload to pinned host memory: frees ``s_i``; its copy ``d_i = s_i / w * (1 + margin)`` overlaps the next layer's
  forward (device to host) and, prefetched one layer ahead, the next layer's backward (host to device), so it costs
  ``max(0, d_i - f_{i+1}) + max(0, d_i - b_{i+1})`` (the last layer hides nothing).

The predicted peak of saved bytes is what the layers keep, ``sum(s_i - freed_i)``, and the predicted step time the
measured one plus the costs. The optimiser is exact: a multiple-choice knapsack over the layers, solved by dynamic
programming over the Pareto frontier of (bytes freed, capped at the need; added time), layer by layer. Greedy by cost
per byte is not optimal with a few large items (a dozen layers), and the frontier stays small (at most the number of
distinct freed sums that are cheaper than every larger one), so the exact answer costs milliseconds.

Example::

    plan = plan_memory(profile, budget_bytes=int(0.7 * profile.saved_bytes))
    print(plan.table())
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.plan import AUTO_MARGIN
from lightning_llmfast.offload.profile import MemoryProfile

__all__ = ["MECHANISMS", "MemoryPlan", "mechanism_cost", "plan_memory"]

MECHANISMS = ("keep", "recompute", "offload")
TIERS = ("pinned",)


@dataclass(frozen=True)
class MemoryPlan:
    """A mechanism per layer with its prediction.

    Attributes:
        choices: per layer, one of :data:`MECHANISMS`.
        freed_bytes: per layer, the bytes its mechanism removes.
        cost_ms: per layer, the time its mechanism adds.
        budget_bytes: the budget planned for.
        predicted_peak: saved bytes kept at the end of the forward.
        predicted_ms: the measured step time plus the added costs.
        profile: what it was planned from.
    """

    choices: tuple[str, ...]
    freed_bytes: tuple[int, ...]
    cost_ms: tuple[float, ...]
    budget_bytes: int
    predicted_peak: int
    predicted_ms: float
    profile: MemoryProfile

    def layers(self, mechanism: str) -> frozenset[int]:
        """The layers planned with ``mechanism``."""
        return frozenset(i for i, c in enumerate(self.choices) if c == mechanism)

    def table(self) -> str:
        """The plan as a text table: per layer its bytes, mechanism, freed bytes and added time; then the totals."""
        rows = [f"{'layer':>5} {'saved MB':>9} {'mechanism':>10} {'freed MB':>9} {'+ms':>7}"]
        for i, layer in enumerate(self.profile.layers):
            rows.append(
                f"{i:>5} {layer.saved_bytes / 1e6:>9.2f} {self.choices[i]:>10} "
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
        from lightning_llmfast.offload.memplot import plot_plan

        plot_plan(self, path)


def mechanism_cost(
    profile: MemoryProfile, index: int, mechanism: str, margin: float = AUTO_MARGIN
) -> tuple[int, float]:
    """``(freed bytes, added ms)`` of ``mechanism`` on layer ``index`` under the model above."""
    layers = profile.layers
    layer = layers[index]
    if mechanism == "keep":
        return 0, 0.0
    if mechanism == "recompute":
        return layer.recompute_bytes, layer.recompute_ms
    if mechanism != "offload":
        raise OffloadError(f"plan_memory: unknown mechanism {mechanism!r}; one of {MECHANISMS}")
    copy_ms = layer.saved_bytes / profile.bandwidth_bytes_per_ms * (1.0 + margin)
    after = layers[index + 1] if index + 1 < len(layers) else None
    forward, backward = (after.forward_ms, after.backward_ms) if after is not None else (0.0, 0.0)
    return layer.saved_bytes, max(0.0, copy_ms - forward) + max(0.0, copy_ms - backward)


def plan_memory(
    profile: MemoryProfile, budget_bytes: int, tiers: Sequence[str] = TIERS, *, margin: float = AUTO_MARGIN
) -> MemoryPlan:
    """The plan of least predicted step time whose saved bytes fit ``budget_bytes``.

    Args:
        profile: the measured step.
        budget_bytes: the most saved-activation bytes the layers may keep at once.
        tiers: where offloaded bytes may go; ``("pinned",)`` (pinned host memory); ``()``: no offload.
        margin: fraction added to every copy time.

    Raises:
        OffloadError: an unknown tier, a budget below 1, or one that no plan meets (with the least it could reach).
    """
    check_int("plan_memory: budget_bytes", budget_bytes, low=1, error=OffloadError)
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise OffloadError(f"plan_memory: unknown tiers {unknown}; available: {list(TIERS)}")
    mechanisms = [m for m in MECHANISMS if m != "offload" or tiers]
    options = [[(m, *mechanism_cost(profile, i, m, margin)) for m in mechanisms] for i in range(len(profile.layers))]
    total = profile.saved_bytes
    need = max(total - budget_bytes, 0)
    # (bytes freed so far, capped at `need`) -> (least added ms, choices), Pareto-pruned after every layer.
    frontier: dict[int, tuple[float, tuple[str, ...]]] = {0: (0.0, ())}
    for layer_options in options:
        grown: dict[int, tuple[float, tuple[str, ...]]] = {}
        for freed_so_far, (cost, chosen) in frontier.items():
            for name, freed, added in layer_options:
                key = min(need, freed_so_far + freed)
                if key not in grown or cost + added < grown[key][0]:
                    grown[key] = (cost + added, (*chosen, name))
        frontier, cheapest = {}, math.inf
        for key in sorted(grown, reverse=True):  # kept only if cheaper than every state freeing more
            if grown[key][0] < cheapest:
                frontier[key], cheapest = grown[key], grown[key][0]
    if need not in frontier:
        most = sum(max(o[1] for o in layer_options) for layer_options in options)
        raise OffloadError(
            f"plan_memory: no plan keeps the saved bytes under budget_bytes={budget_bytes}: the layers save {total} "
            f"bytes and {mechanisms} remove at most {most}"
        )
    choices = frontier[need][1]
    costs = [mechanism_cost(profile, i, c, margin) for i, c in enumerate(choices)]
    freed = tuple(f for f, _ in costs)
    return MemoryPlan(
        choices=choices,
        freed_bytes=freed,
        cost_ms=tuple(c for _, c in costs),
        budget_bytes=budget_bytes,
        predicted_peak=total - sum(freed),
        predicted_ms=profile.step_ms + sum(c for _, c in costs),
        profile=profile,
    )
