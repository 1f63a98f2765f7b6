"""The measured profile a memory plan is made from: per layer, the bytes it saves for backward and which mechanism can
remove them, its forward and backward time and the cost of recomputing it; and the host link's bandwidth.

:func:`~lightning_llmfast.offload.measure.measure_profile` builds one from the offloader's measuring step (plain
numbers, no tensors), :func:`~lightning_llmfast.offload.plan_memory` plans from it, and :func:`resolve_budget` turns
``OffloadConfig.budget`` into bytes.

Example::

    profile = MemoryProfile(layers=(LayerProfile(4 << 20, 1 << 20, 2.0, 4.0, 1.0),) * 12, bandwidth_bytes_per_ms=5e6)
    profile.saved_bytes  # 50331648
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import OffloadError

__all__ = ["LayerProfile", "MemoryProfile", "parse_budget", "resolve_budget"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


@dataclass(frozen=True)
class LayerProfile:
    """One layer's numbers from a measured step.

    Attributes:
        saved_bytes: bytes it keeps for backward (after rebuilds): what offloading it to the host removes.
        recompute_bytes: the part of ``saved_bytes`` that selective recomputation frees (measured: what the layer
            saves less its inputs and the outputs the policy keeps, :mod:`~lightning_llmfast.offload.must_save`).
        forward_ms: its forward time.
        backward_ms: its backward time.
        recompute_ms: what recomputing it adds to its backward (the replay of its forward).
        tensor_bytes: the bytes of each storage it saves, in the order it saves them (the order offloading takes
            them); ``()``: one storage of ``saved_bytes``.
    """

    saved_bytes: int
    recompute_bytes: int
    forward_ms: float
    backward_ms: float
    recompute_ms: float
    tensor_bytes: tuple[int, ...] = ()

    @property
    def storages(self) -> tuple[int, ...]:
        """The bytes of each saved storage in save order (:attr:`tensor_bytes`, or one storage of all)."""
        if self.tensor_bytes:
            return self.tensor_bytes
        return (self.saved_bytes,) if self.saved_bytes else ()

    def __post_init__(self) -> None:
        check_int("LayerProfile: saved_bytes", self.saved_bytes, low=0, error=OffloadError)
        check_int(
            "LayerProfile: recompute_bytes", self.recompute_bytes, low=0, high=self.saved_bytes, error=OffloadError
        )
        for name in ("forward_ms", "backward_ms", "recompute_ms"):
            check_number(f"LayerProfile: {name}", getattr(self, name), low=0, error=OffloadError)
        if self.tensor_bytes and (sum(self.tensor_bytes) != self.saved_bytes or min(self.tensor_bytes) < 0):
            raise OffloadError(
                f"LayerProfile: tensor_bytes must be >= 0 and add up to saved_bytes={self.saved_bytes}, got "
                f"{self.tensor_bytes}"
            )


@dataclass(frozen=True)
class MemoryProfile:
    """The layers of one measured step, in forward order, and the host link.

    Attributes:
        layers: per layer.
        bandwidth_bytes_per_ms: host link bandwidth, the slower direction (one timed copy each way; on CPU the
            measured memcpy rate).
        copies_overlap: whether copies run beside compute (CUDA side streams); ``False`` where the host that computes
            also copies (CPU), so every copy adds its whole time to the step.
        nvme_bandwidth_bytes_per_ms: the NVMe tier's bandwidth, the slower of writing and reading a file (``None``:
            no NVMe tier).
        storage_ms: host time per offloaded storage beyond its copies (the pack and unpack bookkeeping, buffers,
            the allocator), both directions together; measured where copies do not overlap compute
            (:func:`~lightning_llmfast.offload.measure.fit_storage_ms`), else 0.
    """

    layers: tuple[LayerProfile, ...]
    bandwidth_bytes_per_ms: float
    copies_overlap: bool = True
    nvme_bandwidth_bytes_per_ms: float | None = None
    storage_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise OffloadError("MemoryProfile: no layers")
        check_number(
            "MemoryProfile: bandwidth_bytes_per_ms",
            self.bandwidth_bytes_per_ms,
            low=0,
            low_open=True,
            error=OffloadError,
        )
        check_number("MemoryProfile: storage_ms", self.storage_ms, low=0, error=OffloadError)
        if self.nvme_bandwidth_bytes_per_ms is not None:
            check_number(
                "MemoryProfile: nvme_bandwidth_bytes_per_ms",
                self.nvme_bandwidth_bytes_per_ms,
                low=0,
                low_open=True,
                error=OffloadError,
            )

    @property
    def saved_bytes(self) -> int:
        """Bytes all layers save for backward without any mechanism: the peak a plan takes from."""
        return sum(layer.saved_bytes for layer in self.layers)

    @property
    def step_ms(self) -> float:
        """Forward plus backward time of the layers."""
        return sum(layer.forward_ms + layer.backward_ms for layer in self.layers)


def parse_budget(budget: int | float | str) -> int | float:
    """``budget`` checked: an int of bytes, a string with a unit (``"40GiB"``, ``"512 MB"``), or a float in
    ``(0, 1]`` (a fraction of device memory, returned as is).

    Raises:
        OffloadError: anything else (a bool, a negative or non-finite number, an unknown unit).

    Example::

        parse_budget("1.5GiB")  # 1610612736
    """
    if isinstance(budget, bool):
        raise OffloadError(f"budget must be bytes (int), a size ('40GiB') or a fraction <= 1 (float), got {budget!r}")
    if isinstance(budget, int):
        return check_int("budget", budget, low=1, error=OffloadError)
    if isinstance(budget, float):
        return check_number(
            "budget (a fraction of device memory)", budget, low=0, high=1, low_open=True, error=OffloadError
        )
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget) if isinstance(budget, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise OffloadError(f"budget must be bytes (int), a size ('40GiB') or a fraction <= 1 (float), got {budget!r}")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if nbytes < 1:
        raise OffloadError(f"budget must be at least one byte, got {budget!r}")
    return nbytes


def resolve_budget(budget: int | float | str, device: torch.device) -> int:
    """Bytes for ``budget`` on ``device`` (a fraction: of the CUDA device's memory, or on CPU of the host's RAM)."""
    value = parse_budget(budget)
    if isinstance(value, int):
        return value
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(int(total * value), 1)
