"""The house's layering, enforced by the imports themselves (issue 42, item 4).

Every module of the package is read with ``ast``: every ``import``/``from ... import`` (module level or inside a
function; not the body of ``if TYPE_CHECKING:``), every ``importlib.import_module("lightning_llmfast...")`` and every
lazy-name table (a dict literal whose values are package module names, as ``_lazy.lazy_getattr`` reads them). Each
module belongs to a room (a subpackage, or a named group of root modules) and each room to a layer
(:data:`LAYERS`). The test fails on

- a cycle between rooms,
- a cycle between the files of one folder (here ``if TYPE_CHECKING:`` imports count too: a name two files both
  need belongs one floor down, in a module both import),
- an edge from a lower layer to a higher one,
- the runtime (every room but ``bench`` and the CLI entry points) importing ``bench`` or the ``moe.naive`` baselines,
  and ``import lightning_llmfast`` (or any Lightning-layer room) loading them (checked in a fresh interpreter),
- a room below the Lightning layer importing Lightning,
- ``docs/architecture.md`` drawing another graph than the one computed here.

Run ``python tests/test_layering.py`` to print the doc's generated sections and the house's counts.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "lightning_llmfast"
DOC = ROOT / "docs" / "architecture.md"
NAME = "lightning_llmfast"

# The layers, bottom up. A room may import rooms of its own layer or below; inside a layer only without a cycle.
LAYERS: dict[str, int] = {
    "core": 0,
    "data": 1,
    "seqmeta": 1,
    "moe": 1,
    "offload": 1,
    "comm": 1,
    "hf": 1,
    "models": 1,
    "expert_parallel": 2,
    "parallel": 3,
    "strategy": 4,
    "callbacks": 4,
    "modules": 4,
    "datamodules": 4,
    "package": 5,
    "cli": 5,
    "bench": 5,
}
LAYER_NAMES = ("core", "plain PyTorch", "expert parallel", "parallel", "Lightning layer", "entry points and bench")
LIGHTNING_LAYER = 4

# Modules at the package root, by room: the core helpers and the CLI entry points (``python -m lightning_llmfast.X``,
# a module or a package of its own).
ROOT_MODULES: dict[str, str] = {
    "errors": "core",
    "_checks": "core",
    "_lazy": "core",
    "_autograd": "core",
    "_rebuild": "core",
    "_layers": "core",
    "_compile": "core",
    "cli": "cli",
    "plan": "cli",
    "prepare": "cli",
    "export": "cli",
    "tune": "cli",
}

# The runtime never imports these (the baselines benchmarks compare against).
BASELINES = (f"{NAME}.bench", f"{NAME}.moe.naive")
# Rooms that may import the baselines: the benchmarks, the CLI, and the reference model, which builds the naive block
# when asked for it (``router_backend="naive"``, a function-level import; the fresh-interpreter test below shows the
# runtime never loads it otherwise).
BASELINE_USERS = frozenset({"bench", "cli", "models"})
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "torchmetrics")

# Lazy names that a lower room keeps at the path users imported them from before their module moved up (into the
# Lightning layer, or into expert_parallel): resolved on attribute access only (importing the room loads nothing
# above it), and drawn in docs/architecture.md. They are not edges of the room graph.
COMPAT_LAZY_NAMES: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{NAME}.hf", f"{NAME}.modules.hf"),
        (f"{NAME}.models", f"{NAME}.modules.reference"),
        (f"{NAME}.comm", f"{NAME}.expert_parallel"),
        (f"{NAME}.moe", f"{NAME}.expert_parallel"),
    }
)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (module names); ``lazy``: through a lazy-name table, ``line``: where."""

    source: str
    target: str
    lazy: bool
    line: int


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package rooted at ``package``."""
    files = {}
    for file in sorted(package.rglob("*.py")):
        parts = file.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, type_checking: bool = False) -> Iterable[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs, so it is kept); with
    ``type_checking``, those bodies too."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _deepest(name: str, modules: Mapping[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, file: Path, modules: Mapping[str, Path], type_checking: bool = False) -> list[Edge]:
    """The package modules ``module`` imports: statements anywhere (under ``TYPE_CHECKING`` only with
    ``type_checking``), literal ``import_module`` calls and lazy-name tables; and the third-party top-level names, as
    ``Edge(target="!name")``."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    root = module.partition(".")[0]
    edges = []

    def add(name: str, line: int, lazy: bool = False) -> None:
        if name.partition(".")[0] != root:
            edges.append(Edge(module, "!" + name.partition(".")[0], lazy, line))
            return
        target = _deepest(name, modules)
        if target is not None and target != module:
            edges.append(Edge(module, target, lazy, line))

    for node in _nodes(ast.parse(file.read_text()), type_checking):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*kept, base]).rstrip(".")
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                add(node.args[0].value, node.lineno)
        elif isinstance(node, ast.Dict) and node.values:
            values = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if len(values) == len(node.values) and all(v in modules for v in values):
                for value in values:
                    add(value, node.lineno, lazy=True)
    return edges


def room_of(module: str, package: Path = PACKAGE) -> str:
    """The room of a module name: the room :data:`ROOT_MODULES` gives a root module or entry-point package, its
    subpackage, or ``"package"`` for the package itself. Raises ``KeyError`` for a root module no room has taken."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in ROOT_MODULES:
        return ROOT_MODULES[parts[1]]
    if (package / parts[1]).is_dir():
        return parts[1]
    return ROOT_MODULES[parts[1]]


@dataclass
class House:
    """The package's modules, their import edges and the room graph they make."""

    package: Path
    modules: dict[str, Path]
    edges: list[Edge]

    @classmethod
    def read(cls, package: Path = PACKAGE, type_checking: bool = False) -> House:
        """The package's modules and edges (``type_checking``: the ``if TYPE_CHECKING:`` imports too)."""
        modules = module_files(package)
        edges = [edge for name, file in modules.items() for edge in imports_of(name, file, modules, type_checking)]
        return cls(package, modules, edges)

    def room(self, module: str) -> str:
        return room_of(module, self.package)

    def package_edges(self) -> list[Edge]:
        return [e for e in self.edges if not e.target.startswith("!")]

    def room_edges(self, exclude: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], list[Edge]]:
        """``(room, room) -> edges`` between different rooms, without the compat lazy names and ``exclude``."""
        skip = set(exclude) | COMPAT_LAZY_NAMES
        rooms: dict[tuple[str, str], list[Edge]] = defaultdict(list)
        for edge in self.package_edges():
            pair = (self.room(edge.source), self.room(edge.target))
            if pair[0] != pair[1] and (edge.source, edge.target) not in skip:
                rooms[pair].append(edge)
        return dict(rooms)

    def folder_edges(self) -> dict[tuple[str, str], list[Edge]]:
        """``(module, module) -> edges`` between two modules whose files lie in one folder (a package's
        ``__init__`` and its submodules included)."""
        pairs: dict[tuple[str, str], list[Edge]] = defaultdict(list)
        for edge in self.package_edges():
            if self.modules[edge.source].parent == self.modules[edge.target].parent:
                pairs[(edge.source, edge.target)].append(edge)
        return dict(pairs)

    def closure(self, start: Iterable[str]) -> set[str]:
        """The modules ``start`` reaches through import statements (lazy tables not followed)."""
        statement: dict[str, set[str]] = defaultdict(set)
        for edge in self.package_edges():
            if not edge.lazy:
                statement[edge.source].add(edge.target)
        seen, todo = set(), list(start)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(statement[name] - seen)
        return seen


def cycles(graph: Mapping[tuple[str, str], object]) -> list[list[str]]:
    """The strongly connected components of more than one node (room or module; Tarjan), each sorted."""
    successors: dict[str, set[str]] = defaultdict(set)
    for a, b in graph:
        successors[a].add(b)
        successors[b]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(successors[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return found


def upward(graph: Mapping[tuple[str, str], list[Edge]], layers: Mapping[str, int] = LAYERS) -> list[str]:
    """``"a -> b (module -> module)"`` for every edge from a lower layer to a higher one."""
    return [
        f"{a} -> {b} ({edges[0].source} -> {edges[0].target})"
        for (a, b), edges in sorted(graph.items())
        if layers[a] < layers[b]
    ]


def render_rooms_table(graph: Mapping[tuple[str, str], object], holds: Mapping[str, str]) -> str:
    """The doc's room table: room, layer, the rooms it imports, what it holds (``holds``: from the doc)."""
    lines = ["| room | layer | imports | holds |", "| --- | --- | --- | --- |"]
    for room in sorted(LAYERS, key=lambda r: (LAYERS[r], r)):
        imported = ", ".join(f"`{b}`" for b in sorted(b for a, b in graph if a == room)) or "-"
        layer = f"{LAYERS[room]} ({LAYER_NAMES[LAYERS[room]]})"
        lines.append(f"| `{room}` | {layer} | {imported} | {holds.get(room, '')} |")
    return "\n".join(lines)


def render_mermaid(graph: Mapping[tuple[str, str], object]) -> str:
    """The room graph as a mermaid flowchart, one subgraph per layer, arrows pointing down (those into ``core``, which
    every room may import, left out); dotted: the compat lazy names."""
    lines = ["```mermaid", "flowchart TD"]
    for layer in sorted(set(LAYERS.values()), reverse=True):
        lines.append(f'  subgraph L{layer}["{layer}: {LAYER_NAMES[layer]}"]')
        lines.extend(f"    {room}" for room in sorted(r for r in LAYERS if LAYERS[r] == layer))
        lines.append("  end")
    lines.extend(f"  {a} --> {b}" for a, b in sorted(graph) if b != "core")  # every room may import the core
    lines.extend(f"  {HOUSE.room(s)} -. old names .-> {HOUSE.room(t)}" for s, t in sorted(COMPAT_LAZY_NAMES))
    lines.append("```")
    return "\n".join(lines)


def doc_section(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"docs/architecture.md lacks the {begin} ... {end} section"
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def doc_holds(table: str) -> dict[str, str]:
    """``room -> holds`` from the doc's room table (the one column a person writes)."""
    holds = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        holds[cells[0].strip("`")] = cells[-1]
    return holds


# --- the tests -------------------------------------------------------------------------------------------------------

HOUSE = House.read()


def test_the_walk_sees_every_kind_of_import() -> None:
    by_source = defaultdict(set)
    for edge in HOUSE.package_edges():
        by_source[edge.source].add((edge.target, edge.lazy))
    assert len(HOUSE.modules) > 80
    assert (f"{NAME}.strategy", False) in by_source[NAME]  # importlib.import_module("lightning_llmfast.strategy")
    assert (f"{NAME}.modules", True) in by_source[NAME]  # the lazy-name table
    assert (f"{NAME}.seqmeta.metadata", False) in by_source[f"{NAME}.seqmeta"]  # a module-level statement
    # function-level imports count: plan.py imports the models inside a function
    assert (f"{NAME}.models", False) in by_source[f"{NAME}.plan"]


def test_every_module_has_a_room_and_every_room_a_layer() -> None:
    rooms = set()
    for module in HOUSE.modules:
        try:
            rooms.add(room_of(module))
        except KeyError:
            pytest.fail(f"{module}: a root module in no room; add it to ROOT_MODULES (and docs/architecture.md)")
    assert rooms <= set(LAYERS), rooms - set(LAYERS)


def test_no_cycle_between_rooms() -> None:
    assert cycles(HOUSE.room_edges()) == []


def test_no_cycle_between_the_files_of_one_folder() -> None:
    typed = House.read(type_checking=True)
    graph = typed.folder_edges()
    assert (f"{NAME}.models.model", f"{NAME}.models.config") in graph  # the walk sees same-folder edges
    found = {
        " <-> ".join(component): [f"{e.source}:{e.line} -> {e.target}" for (a, b), es in graph.items()
                                  if a in component and b in component for e in es]
        for component in cycles(graph)
    }  # fmt: skip
    assert found == {}


def test_no_edge_points_up() -> None:
    assert upward(HOUSE.room_edges()) == []


def test_the_runtime_imports_no_baseline() -> None:
    offending = [
        f"{e.source}:{e.line} -> {e.target}"
        for e in HOUSE.package_edges()
        if not e.lazy
        and e.target.startswith(BASELINES)
        and not e.source.startswith(BASELINES)
        and room_of(e.source) not in BASELINE_USERS
    ]
    assert offending == []


def test_no_room_below_the_lightning_layer_imports_lightning() -> None:
    offending = [
        f"{e.source}:{e.line} imports {e.target[1:]}"
        for e in HOUSE.edges
        if e.target[1:] in LIGHTNING_PACKAGES and LAYERS[room_of(e.source)] < LIGHTNING_LAYER
    ]
    assert offending == []


def test_compat_names_stay_lazy() -> None:
    lazy = {(e.source, e.target) for e in HOUSE.package_edges() if e.lazy}
    statements = {(e.source, e.target) for e in HOUSE.package_edges() if not e.lazy}
    assert lazy >= COMPAT_LAZY_NAMES and not statements & COMPAT_LAZY_NAMES


_IMPORT_SCRIPT = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    print(json.dumps(sorted(m for m in sys.modules if m.startswith("lightning_llmfast"))))
"""
# The package first (what `import lightning_llmfast` loads), then every Lightning-layer room on top of it.
_RUNTIME = [
    NAME,
    *(f"{NAME}.{room}" for room in ("strategy", "callbacks", "datamodules.packed", "modules.hf")),
    *(f"{NAME}.{room}" for room in ("modules.reference", "modules.grouped_router", "parallel.layout")),
]


def test_importing_the_runtime_loads_no_baseline() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_SCRIPT, *_RUNTIME],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    snapshots = [set(json.loads(line)) for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(snapshots) == len(_RUNTIME)
    assert f"{NAME}.strategy.llmfast" in snapshots[0]  # the package registers its strategies: the runtime loaded
    for name, loaded in zip(_RUNTIME, snapshots):
        assert sorted(m for m in loaded if m.startswith(BASELINES)) == [], name


def test_the_doc_draws_the_computed_graph() -> None:
    text = DOC.read_text()
    graph = HOUSE.room_edges()
    table = doc_section(text, "rooms")
    holds = doc_holds(table)
    assert all(holds.get(room) for room in LAYERS), "docs/architecture.md: say what every room holds"
    assert table == render_rooms_table(graph, holds), "run `python tests/test_layering.py` and paste the rooms table"
    assert doc_section(text, "graph") == render_mermaid(graph), "run `python tests/test_layering.py`, paste the graph"


def test_data_reaches_nothing_of_seqmeta_nor_the_lightning_layer() -> None:
    data = [m for m in HOUSE.modules if room_of(m) == "data"]
    reached = HOUSE.closure(data)
    assert f"{NAME}.data.consistency" in reached  # the walk follows the package's own imports
    assert {room_of(m) for m in reached} <= {"data", "core"}, sorted(reached)


# --- the checker fails where it must: a planted cycle and a planted upward edge ------------------------------------


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / NAME
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_the_checker_finds_a_planted_cycle_and_a_planted_upward_edge(tmp_path: Path) -> None:
    package = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "data/__init__.py": "",
            "data/batch.py": "from lightning_llmfast.errors import X\n",
            # seqmeta -> data at module level, data -> seqmeta inside a function: a cycle in one layer
            "seqmeta/__init__.py": "from lightning_llmfast.data.batch import PackedBatch\n",
            "data/late.py": "def f():\n    from lightning_llmfast.seqmeta import SequenceMetadata\n",
            # moe -> parallel (layer 1 -> 3), through a relative import two levels up
            "moe/__init__.py": "",
            "moe/block.py": "from ..parallel import layout\n",
            "parallel/__init__.py": "",
            "parallel/layout.py": "",
            # an import only a type checker sees is no edge
            "comm/__init__.py": "import typing\nif typing.TYPE_CHECKING:\n    import lightning_llmfast.parallel\n",
        },
    )
    house = House.read(package)
    graph = house.room_edges()
    assert cycles(graph) == [["data", "seqmeta"]]
    assert upward(graph) == ["moe -> parallel (lightning_llmfast.moe.block -> lightning_llmfast.parallel.layout)"]
    assert ("comm", "parallel") not in graph
    # and the same package without the plants passes
    (package / "data" / "late.py").write_text("")
    (package / "moe" / "block.py").write_text("from lightning_llmfast.errors import X\n")
    clean = House.read(package).room_edges()
    assert cycles(clean) == [] and upward(clean) == []


def test_the_folder_check_finds_a_cycle_through_a_function_or_a_type_checking_import(tmp_path: Path) -> None:
    package = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "offload/__init__.py": "",
            # plan -> plot inside a function, plot -> plan only for the type checker: still a cycle of the folder
            "offload/plan.py": "def draw():\n    from lightning_llmfast.offload.plot import f\n",
            "offload/plot.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import Plan\n",
            # a one-way pair in another folder is no cycle
            "seqmeta/__init__.py": "",
            "seqmeta/cache.py": "from lightning_llmfast.seqmeta.metadata import M\n",
            "seqmeta/metadata.py": "",
        },
    )
    modules = [f"{NAME}.offload.plan", f"{NAME}.offload.plot"]
    assert cycles(House.read(package, type_checking=True).folder_edges()) == [modules]
    assert cycles(House.read(package).folder_edges()) == []  # what the room checks read: type-only edges left out
    (package / "offload" / "plot.py").write_text("")
    assert cycles(House.read(package, type_checking=True).folder_edges()) == []


def test_the_baseline_check_finds_a_function_level_import_of_bench(tmp_path: Path) -> None:
    package = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "bench/__init__.py": "",
            "bench/counters.py": "",
            "offload/__init__.py": "def f():\n    import lightning_llmfast.bench.counters\n",
        },
    )
    edges = House.read(package).package_edges()
    assert [(e.source, e.target, e.lazy) for e in edges] == [
        ("lightning_llmfast.offload", "lightning_llmfast.bench.counters", False)
    ]


def summary(house: House) -> dict[str, int]:
    """The house's counts: modules and lines without ``bench/``, rooms, room edges, cycles and upward edges."""
    runtime = {name: file for name, file in house.modules.items() if house.room(name) != "bench"}
    graph = house.room_edges()
    return {
        "modules (without bench/)": len(runtime),
        "lines (without bench/)": sum(file.read_text().count("\n") for file in runtime.values()),
        "rooms": len({house.room(m) for m in house.modules}),
        "room edges": len(graph),
        "room cycles": len(cycles(graph)),
        "upward edges (pending edges included)": len(upward(graph)),
    }


if __name__ == "__main__":
    graph = HOUSE.room_edges()
    print("<!-- rooms:begin -->")
    print(render_rooms_table(graph, doc_holds(doc_section(DOC.read_text(), "rooms")) if DOC.exists() else {}))
    print("<!-- rooms:end -->\n\n<!-- graph:begin -->")
    print(render_mermaid(graph))
    print("<!-- graph:end -->\n")
    print(json.dumps(summary(HOUSE), indent=2))
