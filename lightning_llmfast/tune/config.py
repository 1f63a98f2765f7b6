"""What a search is: :class:`TuneConfig`, checked at construction, and :func:`parse_bytes` for memory sizes."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import ConfigError

__all__ = ["TuneConfig", "parse_bytes"]

_UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """A memory size in bytes: plain bytes (``"81604378624"``) or a number and a unit, decimal (``B``, ``KB``, ``MB``,
    ``GB``, ``TB``: powers of 1000) or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024), the unit in any
    case; a fraction of a byte is rounded.

    Raises:
        ConfigError: not a size, an unknown unit, or less than one byte.

    Example::

        parse_bytes("80GiB")  # 85899345920
        parse_bytes("500MB")  # 500000000
    """
    match = _SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower() if match.group(2) else "b") if match else None
    if match is None or unit is None:
        raise ConfigError(
            f"not a memory size: {text!r} (bytes, or a number and one of the units "
            f"{', '.join(('B', 'KB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB'))}, e.g. 80GiB)"
        )
    value = round(Fraction(match.group(1)) * unit)
    if value < 1:
        raise ConfigError(f"memory size {text!r} is less than one byte")
    return value


@dataclass(frozen=True)
class TuneConfig:
    """What :func:`tune` searches, checked at construction.

    Args:
        config: the example-CLI config (a YAML file).
        out: the results directory (created; a rerun with the same arguments continues its search).
        space: dotted key -> list of values, or a YAML file of that mapping; ``None``: :func:`default_space`.
        global_batch: sequences per optimizer step in every trial; ``None``: the config's (micro-batch x
            accumulation x world).
        time_budget: seconds the search may take (this run); ``None``: no limit.
        memory_budget: bytes per device; candidates predicted over it are pruned. ``None``: none pruned.
        steps: measured optimizer steps of the first (shortest) trials; each halving multiplies them by ``eta``.
        warmup_steps: optimizer steps before the measured ones, left out of the rate (at least 1: the first step
            has no rate of its own, it carries one-time costs).
        eta: the halving factor: the best ``ceil(n / eta)`` of a rung go on, ``eta`` times longer.
        trial_timeout: seconds one trial may run (start-up included).
        script: the example CLI; ``None``: ``examples/train_moe.py`` beside the package.

    Raises:
        ConfigError: naming the field, the rule and the value.

    Example::

        TuneConfig("examples/configs/tiny.yaml", "tuned/", global_batch=16, time_budget=600, steps=4)
    """

    config: str | Path
    out: str | Path
    space: Mapping[str, Sequence[Any]] | str | Path | None = None
    global_batch: int | None = None
    time_budget: float | None = None
    memory_budget: int | None = None
    steps: int = 4
    warmup_steps: int = 2
    eta: int = 3
    trial_timeout: float = 600.0
    script: str | Path | None = None

    def __post_init__(self) -> None:
        if self.global_batch is not None:
            check_int("TuneConfig.global_batch", self.global_batch, low=1)
        if self.time_budget is not None:
            check_number("TuneConfig.time_budget", self.time_budget, low=0, low_open=True)
        if self.memory_budget is not None:
            check_int("TuneConfig.memory_budget", self.memory_budget, low=1)
        check_int("TuneConfig.steps", self.steps, low=1)
        check_int("TuneConfig.warmup_steps", self.warmup_steps, low=1)
        check_int("TuneConfig.eta", self.eta, low=2)
        check_number("TuneConfig.trial_timeout", self.trial_timeout, low=0, low_open=True)
        if not Path(self.config).is_file():
            raise ConfigError(f"TuneConfig.config: no such file {str(self.config)!r}")
        if not Path(self.script_path).is_file():
            raise ConfigError(f"TuneConfig.script: no such file {str(self.script_path)!r}")

    @property
    def script_path(self) -> Path:
        """The example CLI the trials run."""
        return Path(self.script) if self.script is not None else Path(__file__).parents[2] / "examples/train_moe.py"
