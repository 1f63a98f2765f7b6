"""Lazy public names for packages: ``import lightning_llmfast.moe`` stays cheap until a name is used."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["lazy_dir", "lazy_getattr"]


def lazy_getattr(package: str, names: dict[str, str], moved: dict[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names[name]`` (a module path) on first use and caches the value.

    ``moved`` maps deprecated names of ``package`` to the package that now holds them: they still resolve, with a
    ``DeprecationWarning`` that says where to import them from.

    Example::

        __getattr__ = lazy_getattr(__name__, {"MoEBlock": "lightning_llmfast.moe.block"})
    """
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None and name in moved:
            warnings.warn(
                f"{package}.{name} moved to {moved[name]}.{name}; import it from {moved[name]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__


def lazy_dir(package: str, names: dict[str, str]) -> Callable[[], list[str]]:
    """A module ``__dir__`` that lists the lazy ``names`` too (tab completion, ``dir()``), next to ``__getattr__``.

    Example::

        __dir__ = lazy_dir(__name__, _LAZY)
    """

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __dir__
