"""``data/`` sits below ``seqmeta/``: nothing it imports, directly or through other package modules, is ``seqmeta``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lightning_llmfast"


def _module_file(name: str) -> Path | None:
    relative = Path(*name.split(".")[1:])
    for candidate in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(file: Path) -> set[str]:
    """Absolute names of the package modules ``file`` imports (module-level or not, ``TYPE_CHECKING`` included)."""
    package = ".".join(("lightning_llmfast", *file.relative_to(PACKAGE).with_suffix("").parts[:-1]))
    names = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {name for name in names if name.startswith("lightning_llmfast.") and _module_file(name) is not None}


def _closure(start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        file = _module_file(name)
        assert file is not None
        todo.extend(_imports(file) - seen)
    return seen


def test_data_imports_nothing_from_seqmeta_directly_or_transitively() -> None:
    data = {f"lightning_llmfast.data.{f.stem}" for f in (PACKAGE / "data").glob("*.py") if f.stem != "__init__"}
    reached = _closure(data | {"lightning_llmfast.data"})
    assert "lightning_llmfast.data.consistency" in reached  # the walk follows the package's own imports
    assert not [name for name in reached if name.startswith("lightning_llmfast.seqmeta")], sorted(reached)
    assert not [
        name for name in reached if name.startswith(("lightning_llmfast.callbacks", "lightning_llmfast.strategy"))
    ]
