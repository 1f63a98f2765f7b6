"""House limits: short functions (issue 24, item 8). Modules have no line cap: a module holds one concept whole, and
the layering test (tests/test_layering.py) keeps the rooms apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_llmfast

PACKAGE = Path(lightning_llmfast.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 70


def test_the_walk_sees_the_package() -> None:
    assert len(MODULES) > 50 and PACKAGE / "moe" / "block.py" in MODULES


def _long_functions(source: str) -> list[str]:
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_over_the_limit(path: Path) -> None:
    source = path.read_text()
    assert not _long_functions(source), f"{path.name}: {_long_functions(source)}"


def test_the_check_finds_a_long_nested_function_and_passes_a_short_one() -> None:
    long_body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def short(self):\n        return 1\n    def long(self):\n{long_body}\n"
    assert _long_functions(source) == [f"long ({MAX_FUNCTION_LINES + 1} lines)"]
