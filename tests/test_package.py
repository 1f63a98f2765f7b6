"""The lazily exported public names: every one resolves, and ``dir()`` (tab completion) lists it before first use."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    "package", ["lightning_llmfast", "lightning_llmfast.callbacks", "lightning_llmfast.moe", "lightning_llmfast.bench"]
)
def test_every_public_name_resolves_and_is_listed(package: str) -> None:
    module = importlib.import_module(package)
    listed = set(dir(module))
    missing = [name for name in module.__all__ if name not in listed]
    assert not missing, f"{package}: dir() lacks {missing}"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


def test_the_declared_torch_floor_is_the_torch_ci_tests() -> None:
    # pyproject's floor is the truth only where CI runs the tests on it: the two stay in step.
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    floors = re.findall(r'^\s*"torch>=(\d+\.\d+)"', (root / "pyproject.toml").read_text(), flags=re.MULTILINE)
    pinned = re.findall(r"pip install -q torch==(\d+\.\d+)\.\d+", (root / ".ci" / "run").read_text())
    assert len(floors) == 1 and floors == pinned, (floors, pinned)
