"""The ``"auto"`` plans of an :class:`~lightning_llmfast.offload.ActivationOffloader`, made from its measuring steps.

``offload_layers="auto"``: one measuring step, then :func:`~.measure.auto_plan` (as many leading layers as the copies
hide). ``plan="auto"``: a warm-up step (which also counts what recomputing each layer would keep), then
``profile_steps`` profiled steps (alternating, where copies do not overlap compute and ``profile_steps >=
PROBE_STEPS``, with as many probe steps that offload every eligible layer, and then the warm-up step offloads too),
then :func:`~.measure.memory_plan`. A step whose layers ran no backward (a forward under ``no_grad``, an evaluation
pass) measured nothing: the next step measures again. Either plan is adopted by the layer-call policy and sizes the
pinned pool before its first step; without a plan the first step that offloads sizes it.

Example::

    planner = Planner(config, calls, pool, reloader, packer, num_layers=12)
    planner.measured(segments, copier)  # at the end of a measuring step
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_llmfast.offload import measure
from lightning_llmfast.offload.config import OffloadConfig
from lightning_llmfast.offload.copier import Copier
from lightning_llmfast.offload.handles import Segment
from lightning_llmfast.offload.layercalls import LayerCalls
from lightning_llmfast.offload.memory_plan import MemoryPlan
from lightning_llmfast.offload.pool import PinnedBufferPool
from lightning_llmfast.offload.profile import MemoryProfile
from lightning_llmfast.offload.reload import Reloader
from lightning_llmfast.offload.saved_tensors import Packer

log = logging.getLogger(__name__)

__all__ = ["PROBE_STEPS", "Planner"]

PROBE_STEPS = 3  # the fewest profiled steps with which probe steps run (their median resolves the host time)


class Planner:
    """Makes and adopts the offloader's ``"auto"`` plan from its measuring steps.

    Args:
        config: the settings.
        calls: the layer-call policy that adopts the plan (and marks the probe steps).
        pool: the pinned pool the plan sizes.
        reloader: whose prefetch depth the ``offload_layers="auto"`` plan sets.
        packer: the NVMe tier's owner.
        num_layers: how many layers are tracked.

    Attributes:
        auto_plan: the ``offload_layers="auto"`` plan, once made.
        memory_plan: the ``plan="auto"`` plan, once made.
    """

    def __init__(
        self,
        config: OffloadConfig,
        calls: LayerCalls,
        pool: PinnedBufferPool,
        reloader: Reloader,
        packer: Packer,
        num_layers: int,
    ) -> None:
        self.config = config
        self._calls, self._pool, self._reloader, self._packer = calls, pool, reloader, packer
        self._num_layers = num_layers
        self.auto_plan: dict[str, Any] | None = None
        self.memory_plan: MemoryPlan | None = None
        self._sized = False
        # plan="auto": the first measuring step only warms up: its times carry one-time costs (first calls of each
        # op, lazily built caches) of several times a step
        self._warm_up = True
        # what selective recomputation of each layer call keeps (must_save.py), counted in the warm-up step only: the
        # counter is a dispatch mode whose per-op Python cost would inflate the profiled steps' times (on the
        # 12-layer reference model at hidden 64, their layers ran 1.3x to 1.4x as long as the planned steps')
        self._recompute_keeps: list[int] = []
        self._profiles: list[MemoryProfile] = []  # the profiled steps so far that kept everything
        self._probes: list[MemoryProfile] = []  # and those that offloaded every eligible layer

    def begin_step(self, copier: Copier | None) -> None:
        """A step begins: a memory plan's warm-up step offloads every eligible layer where probe steps will (so that
        the first probe does not pay the pool's allocation and the offload path's first calls)."""
        if self.config.plan == "auto" and self._warm_up and copier is not None:
            self._calls.probing = self._probes_wanted(copier)

    @property
    def counting_keeps(self) -> bool:
        """Whether this step's layer calls count what recomputing them keeps: a memory plan's warm-up step."""
        return self.config.plan == "auto" and self._warm_up

    def _probes_wanted(self, copier: Copier) -> bool:
        # The host time per storage is a small difference of two step times: on a shared host one pair of steps
        # cannot resolve it, so probes need a median (at least PROBE_STEPS profiled steps).
        steps = self.config.profile_steps
        return not copier.is_cuda and self._packer.nvme is None and steps >= PROBE_STEPS

    def measured(self, segments: list[Segment], copier: Copier) -> None:
        """A measuring step ended with ``segments``: warm up, profile, or make and adopt the plan."""
        if not any(seg.backward_started is not None for seg in segments):
            return
        if self.config.plan == "auto" and self._warm_up:
            self._warm_up = self._calls.probing = False
            self._recompute_keeps = [seg.recompute_keeps for seg in segments]
        elif self.config.plan == "auto":
            self._profile_step(segments, copier)
        else:
            self._adopt_plan(segments, copier)

    def size_pool(self) -> None:
        """A step that offloaded under the final plan ended: the first one sizes the pool, if no plan did."""
        if not self._sized:
            self._pool.reserve_measured()
            self._sized = True

    def _adopt_plan(self, segments: list[Segment], copier: Copier) -> None:
        """Make and adopt the ``"auto"`` plan from the measuring step (see :func:`~.measure.auto_plan`)."""
        # With recomputation, layer N recomputes instead: keeping what a partial budget leaves would hold more.
        partial = self.config.recompute is None
        plan = measure.auto_plan(segments, self._num_layers, copier, eligible=self._calls.eligible, partial=partial,
                                 pinned=self._pool.pinned, backward_end=copier.timestamp())  # fmt: skip
        self._calls.adopt(plan["offload_layers"], plan["partial_bytes"])
        self._reloader.set_depth(plan["prefetch_layers"])
        # Sized from the plan before its first step: what the planned layers offload (a partial layer: its budget, at
        # most what it saves), within the pinned budget.
        sizes, planned = plan["bytes_per_layer"], plan["offload_layers"]
        partial_bytes = min(plan["partial_bytes"], sizes[planned]) if planned < len(sizes) else 0
        self._reserve(sum(sizes[:planned]) + partial_bytes)
        self.auto_plan = plan

    def _reserve(self, nbytes: int) -> None:
        self._pool.reserve(min(nbytes, self.config.pinned_budget_bytes or nbytes))
        self._sized = True

    def _profile_step(self, segments: list[Segment], copier: Copier) -> None:
        """Profile a measuring step (:func:`~.measure.measure_profile`); after ``config.profile_steps`` of them, plan
        every layer for the budget from their medians (:func:`~.measure.memory_plan`), log the plan as a table, and
        adopt it from the next step.

        Where copies do not overlap compute (CPU) and there is no NVMe tier, as many probe steps alternate with them,
        in which every eligible layer offloads: their time against the keeping steps' gives the host time per
        offloaded storage (:func:`~.measure.fit_storage_ms`), which bandwidth alone does not predict.
        """
        end = copier.timestamp()
        profile = measure.measure_profile(
            segments, self._num_layers, copier, pinned=self._pool.pinned, backward_end=end,
            recompute_keeps=self._recompute_keeps,
        )  # fmt: skip
        (self._probes if self._calls.probing else self._profiles).append(profile)
        steps = self.config.profile_steps
        probes = steps if self._probes_wanted(copier) else 0
        if len(self._profiles) < steps or len(self._probes) < probes:
            self._calls.probing = len(self._probes) < min(len(self._profiles), probes)
            return
        depth, nvme = self._reloader.prefetch_layers, self._packer.nvme
        plan = measure.memory_plan(self._profiles, copier, self.config, depth, nvme, probes=self._probes,
                                   eligible=self._calls.eligible)  # fmt: skip
        self._profiles, self._probes = [], []
        offloading = plan.layers("offload")
        self._calls.adopt_layers(offloading | plan.layers("nvme"), plan.layers("nvme"), plan.offload_budgets())
        if probes and not self._pool.out_bytes:
            self._pool.clear()  # sized for the probes' offloads: the plan's need less
        self._reserve(sum(plan.freed_bytes[i] for i in offloading))
        self.memory_plan = plan
        log.info("ActivationOffloader memory plan:\n%s", plan.table())
