"""Argument checks shared by every public entry point: one wording for every "must be an int >= 1, got ..." error.

Each check raises the caller's error class (a subclass of :class:`~lightning_llmfast.errors.LLMFastError`) naming
the argument, the rule and the value. Python and NumPy integers and reals pass (``numpy.int64(2)`` is an int here);
``bool`` is rejected where an int or a number is expected (``True`` is the int 1 in Python, almost always a mistake
here), and so are NaN and infinities.

Example::

    >>> check_int("top_k", 0, low=1)
    Traceback (most recent call last):
    ...
    lightning_llmfast.errors.ConfigError: top_k must be an int >= 1, got 0
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from lightning_llmfast.errors import ConfigError, LLMFastError

__all__ = ["check_bool", "check_int", "check_number"]


def _range(low: float | None, high: float | None, low_open: bool = False) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    return " " + " and ".join(parts) if parts else ""


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    error: type[LLMFastError] = ConfigError,
) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[low, high]``; else raise ``error``."""
    if _is_bool(value) or not isinstance(value, Integral):
        raise error(f"{name} must be an int{_range(low, high)}, got {value!r}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise error(f"{name} must be an int{_range(low, high)}, got {value!r}")
    return number


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    error: type[LLMFastError] = ConfigError,
) -> float:
    """``value`` as a float if it is a finite real number (not a bool) in its range (``low_open``: ``> low``)."""
    if _is_bool(value) or not isinstance(value, Real):
        raise error(f"{name} must be a finite number{_range(low, high, low_open)}, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the largest float (10**400)
        number = math.inf
    if (
        not math.isfinite(number)
        or (low is not None and (number <= low if low_open else number < low))
        or (high is not None and number > high)
    ):
        raise error(f"{name} must be a finite number{_range(low, high, low_open)}, got {value!r}")
    return number


def check_bool(name: str, value: object, *, error: type[LLMFastError] = ConfigError) -> bool:
    """``value`` if it is a bool; else raise ``error`` (``bool("no")`` is ``True``: a string must not pass)."""
    if not _is_bool(value):
        raise error(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))
