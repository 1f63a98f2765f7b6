"""``OffloadConfig``: every activation-offload setting in one frozen, self-validating record.

:class:`~lightning_llmfast.offload.ActivationOffloader`, the
:class:`~lightning_llmfast.callbacks.ActivationOffload` callback and
:class:`~lightning_llmfast.LLMFastStrategy` all take one: it is their only configuration.

Example::

    config = OffloadConfig(offload_layers="auto", rebuild="norms+gemms")
    rebuild_only = OffloadConfig(offload_layers=0)  # copies nothing; norms and weight copies are still rebuilt
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.offload.pool import MAX_HEADROOM
from lightning_llmfast.offload.profile import parse_budget
from lightning_llmfast.offload.recompute import RECOMPUTE_MODES

__all__ = ["REBUILD_MODES", "OffloadConfig"]

REBUILD_MODES = (None, "norms", "norms+gemms")


@dataclass(frozen=True)
class OffloadConfig:
    """Activation-offload settings, checked at construction.

    Args:
        min_offload_bytes: storages smaller than this stay on the device.
        keep_last_layers: the last this many layers are not offloaded (their backward runs first).
        prefetch_layers: how many layers ahead backward prefetches; ``prefetch_layers + 1`` device buffer sets.
        pool_headroom: the pinned host pool is sized after the first offloading step to its peak need times this,
            and grows by this factor when a later step needs more (1 to 16).
        force: run the mechanism on CPU too (synchronous copies, plain memory if pinning is unavailable).
        offload_layers: which layers copy their saved activations to the host. ``None``: all but the last
            ``keep_last_layers``; an int ``N``: only the first ``N`` of those (``0``: nothing is copied);
            ``"auto"``: measure the first step, then offload as many leading layers as the copies can hide behind
            compute (:func:`~lightning_llmfast.offload.plan_offload`).
        recompute: ``None``, or ``"selective"``: every layer that does not offload keeps only matmul, attention and
            routing outputs and recomputes the cheap rest in backward (:mod:`~lightning_llmfast.offload.recompute`).
        rebuild: what is dropped in forward and rebuilt in backward in every layer, whether or not it offloads:
            ``"norms"`` (saved low-precision weight copies and outputs of Functions marked with
            :func:`~lightning_llmfast.offload.mark_rebuildable`, such as the RMSNorm's), ``"norms+gemms"`` (also
            outputs marked as a GEMM's: the routed experts' gate/up projection, one more grouped GEMM per layer in
            backward), or ``None`` (nothing; kept or offloaded like any activation).
        rebuild_gemm_layers: with ``"norms+gemms"``, only the first this many layers rebuild GEMM outputs (each takes
            the same share off the forward's peak, so it trades memory for backward time linearly); ``None``: all.
        plan: ``"auto"``: profile ``profile_steps`` steps after a warm-up step (all of them keep everything), then
            keep, recompute or offload each layer so that the saved activations fit ``budget`` at the least predicted
            time (:func:`~lightning_llmfast.offload.plan_memory`); the plan is logged as a table and kept as
            ``ActivationOffloader.memory_plan``. ``None``: the fixed settings above.
        budget: with ``plan="auto"``, the most bytes of saved activations the layers may keep: bytes (int), a size
            (``"40GiB"``) or a fraction of the device's memory (float ``<= 1``).
        profile_steps: with ``plan="auto"``, how many steps are profiled; the plan uses each layer's median times
            over them (one step's times vary by tens of percent on a shared host) and the largest bytes. From 3 on,
            where copies do not overlap compute (CPU), as many probe steps measure the host time per offloaded
            storage (:mod:`~lightning_llmfast.offload.planner`).
        nvme_dir: a local directory (an NVMe drive) for the NVMe tier: offloaded storages that would take the pinned
            pool past ``pinned_budget`` go to files there instead (:mod:`~lightning_llmfast.offload.nvme`).
        pinned_budget: with ``nvme_dir``, the most bytes of the pinned pool a step may use: bytes (int) or a size
            (``"8GiB"``).

    Raises:
        OffloadError: naming the field, the rule and the value.

    Example::

        OffloadConfig(min_offload_bytes=1 << 20, offload_layers=4, rebuild="norms+gemms", rebuild_gemm_layers=2)
    """

    min_offload_bytes: int = 1 << 20
    keep_last_layers: int = 1
    prefetch_layers: int = 1
    pool_headroom: float = 1.5
    force: bool = False
    offload_layers: int | Literal["auto"] | None = None
    recompute: Literal["selective"] | None = None
    rebuild: Literal["norms", "norms+gemms"] | None = "norms"
    rebuild_gemm_layers: int | None = None
    plan: Literal["auto"] | None = None
    budget: int | float | str | None = None
    profile_steps: int = 3
    nvme_dir: str | None = None
    pinned_budget: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("min_offload_bytes", "keep_last_layers", "prefetch_layers"):
            check_int(f"OffloadConfig: {name}", getattr(self, name), low=0, error=OffloadError)
        check_number("OffloadConfig: pool_headroom", self.pool_headroom, low=1, high=MAX_HEADROOM, error=OffloadError)
        check_int("OffloadConfig: profile_steps", self.profile_steps, low=1, error=OffloadError)
        check_bool("OffloadConfig: force", self.force, error=OffloadError)
        layers = self.offload_layers
        if (
            layers is not None
            and layers != "auto"
            and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0)
        ):
            raise OffloadError(f"OffloadConfig: offload_layers must be None, an int >= 0 or 'auto', got {layers!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise OffloadError(f"OffloadConfig: recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.rebuild not in REBUILD_MODES:
            raise OffloadError(f"OffloadConfig: rebuild must be one of {REBUILD_MODES}, got {self.rebuild!r}")
        if self.plan not in (None, "auto"):
            raise OffloadError(f"OffloadConfig: plan must be None or 'auto', got {self.plan!r}")
        if (self.plan is None) != (self.budget is None):
            raise OffloadError(
                f"OffloadConfig: plan='auto' and budget go together, got plan={self.plan!r}, budget={self.budget!r}"
            )
        if self.budget is not None:
            parse_budget(self.budget)
            if self.offload_layers is not None or self.recompute is not None:
                raise OffloadError(
                    "OffloadConfig: plan='auto' chooses offload_layers and recompute per layer; "
                    f"got offload_layers={self.offload_layers!r}, recompute={self.recompute!r}"
                )
        if (self.nvme_dir is None) != (self.pinned_budget is None):
            raise OffloadError(
                "OffloadConfig: nvme_dir and pinned_budget go together (the pool spills to nvme_dir past "
                f"pinned_budget), got nvme_dir={self.nvme_dir!r}, pinned_budget={self.pinned_budget!r}"
            )
        if self.nvme_dir is not None and (not isinstance(self.nvme_dir, str) or not self.nvme_dir):
            raise OffloadError(f"OffloadConfig: nvme_dir must be a directory path (str), got {self.nvme_dir!r}")
        if self.pinned_budget is not None and (
            isinstance(self.pinned_budget, float) or not isinstance(parse_budget(self.pinned_budget), int)
        ):
            raise OffloadError(f"OffloadConfig: pinned_budget must be bytes or a size, got {self.pinned_budget!r}")
        if self.rebuild_gemm_layers is not None:
            check_int("OffloadConfig: rebuild_gemm_layers", self.rebuild_gemm_layers, low=0, error=OffloadError)
            if self.rebuild != "norms+gemms":
                raise OffloadError(
                    f"OffloadConfig: rebuild_gemm_layers={self.rebuild_gemm_layers} needs rebuild='norms+gemms', "
                    f"got rebuild={self.rebuild!r}"
                )

    @property
    def pinned_budget_bytes(self) -> int | None:
        """``pinned_budget`` in bytes (``None``: the pool has no budget)."""
        return None if self.pinned_budget is None else int(parse_budget(self.pinned_budget))

    def rebuilds_gemms(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` rebuilds GEMM outputs."""
        if self.rebuild != "norms+gemms":
            return False
        return self.rebuild_gemm_layers is None or layer_index < self.rebuild_gemm_layers

    @property
    def copies(self) -> bool:
        """Whether any layer may copy to the host (``offload_layers`` is not 0)."""
        return self.offload_layers != 0
