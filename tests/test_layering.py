"""ferryman's import graph, read with `ast` (nothing is imported): no import cycle between modules,
no private name (`_x`) taken from another module, and the layering below.

A unit is a subpackage (ferryman/engine/) or a top-level module (ferryman/cli.py); "ferryman" is the
package's own __init__, the public facade. Every import counts, also one inside a function or
under `if TYPE_CHECKING:` (that one never runs, but a circle of types is still a circle of modules:
the types both sides need belong in a module below both).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ferryman"

# Top to bottom: a unit imports only units of lower rows; the units of one row do not import each
# other. The CLI starts the server (`ferryman serve`), so it sits above it; the planner sits with
# experts (experts/placement.py builds the backends from its MemoryPlan), calibrate under experts
# (used by it, not the reverse); the planner may use layers' pure shape and size functions.
LAYERS: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),
    ("cli_serve", "cli_ctl"),
    ("cli_bench",),
    ("server",),
    ("ferryman",),
    ("llm",),
    ("engine",),
    ("weights",),
    ("models",),
    ("experts",),
    ("calibrate", "plan_report"),
    ("planner_search",),
    ("planner_split",),
    ("planner",),
    ("kvcache",),
    ("layers",),
    ("quant",),
    ("config", "sampling_params", "tokenizer", "prefill_steps"),
    ("units",),
    ("envs",),
    ("errors",),
]

# Violations accepted for now; the test fails when one appears that is not listed (and when a
# listed one is gone: delete it here). Empty: the rules hold.
KNOWN_VIOLATIONS: set[str] = set()


@dataclass
class Module:
    name: str  # ferryman.engine.llm_engine
    path: Path
    imports: list[tuple[str, bool]] = field(default_factory=list)  # (target module, under TYPE_CHECKING)
    private: list[str] = field(default_factory=list)  # "ferryman.x._y": private names used from another module


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class ImportReader(ast.NodeVisitor):
    """The package's imports in one module, resolved to module names, and its uses of private names."""

    def __init__(self, mod: Module, modules: set[str], package: str) -> None:
        self.mod, self.modules, self.package = mod, modules, package
        self.type_only = False
        self.aliases: dict[str, str] = {}  # local name -> package module it is bound to

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            outer, self.type_only = self.type_only, True
            for child in node.body:
                self.visit(child)
            self.type_only = outer
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def add(self, target: str) -> None:
        self.mod.imports.append((target, self.type_only))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == self.package:
                self.add(alias.name)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            here = self.mod.name.split(".")
            if self.mod.path.name != "__init__.py":
                here = here[:-1]
            here = here[: len(here) - node.level + 1]
            base = ".".join(here + ([base] if base else []))
        if base.split(".")[0] != self.package:
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.modules:  # `from pkg.x import module`
                self.add(sub)
                self.aliases[alias.asname or alias.name] = sub
                continue
            self.add(base)
            if is_private(alias.name) and base != self.mod.name:
                self.mod.private.append(f"{base}.{alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases and is_private(node.attr):
            target = self.aliases[node.value.id]
            if target != self.mod.name:
                self.mod.private.append(f"{target}.{node.attr}")
        self.generic_visit(node)


def read_package(root: Path) -> dict[str, Module]:
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(root, p): Module(module_name(root, p), p) for p in paths}
    for mod in modules.values():
        ImportReader(mod, set(modules), root.name).visit(ast.parse(mod.path.read_text(), str(mod.path)))
    return modules


def cycle_edges(modules: dict[str, Module]) -> Iterator[tuple[str, str]]:
    """Every import edge that lies on a cycle, type-only ones too: the edges between two modules of
    one strongly connected component (Tarjan's algorithm, iterative)."""
    graph = {m: sorted({t for t, _ in mod.imports if t in modules}) for m, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    stack: list[str] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(graph[child])))
                    break
                if child not in comp:  # on the stack
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    while True:
                        member = stack.pop()
                        comp[member] = index[node]
                        if member == node:
                            break
    for a, targets in graph.items():
        for b in targets:
            if a != b and comp[a] == comp[b]:
                yield a, b


def type_only_mark(mod: Module, target: str) -> str:
    """' (TYPE_CHECKING)' when every import of `target` in `mod` is under `if TYPE_CHECKING:`."""
    return " (TYPE_CHECKING)" if all(type_only for t, type_only in mod.imports if t == target) else ""


def violations(root: Path, layers: Sequence[tuple[str, ...]]) -> set[str]:
    """Every breach of the three rules in the package at `root`, one line each."""
    rank = {unit: i for i, row in enumerate(layers) for unit in row}
    modules = read_package(root)
    found = {f"cycle: {a} -> {b}{type_only_mark(modules[a], b)}" for a, b in cycle_edges(modules)}
    for mod in modules.values():
        found |= {f"private: {mod.name} uses {name}" for name in mod.private}
        src = unit_of(mod.name)
        if src not in rank:
            found.add(f"unplaced: {src} is in no layer")
            continue
        for target, _ in mod.imports:
            dst = unit_of(target)
            if dst == src:
                continue
            if dst not in rank:
                found.add(f"unplaced: {dst} is in no layer")
            elif rank[dst] <= rank[src]:
                found.add(f"layer: {mod.name} -> {target}")
    return found


def compare(found: set[str], known: set[str]) -> str:
    """'' when `found` is `known`; otherwise what changed, and the list to paste."""
    if found == known:
        return ""
    lines = [f"new: {v}" for v in sorted(found - known)] + [f"gone: {v}" for v in sorted(known - found)]
    listed = [f"    {v!r}," for v in sorted(found)]
    return "\n".join(lines + ["", "KNOWN_VIOLATIONS now (paste it if the change is meant):",
                              "KNOWN_VIOLATIONS: set[str] = {" if found else "KNOWN_VIOLATIONS: set[str] = set()",
                              *listed, *(["}"] if found else [])])


def test_every_unit_has_one_layer() -> None:
    units = [u for row in LAYERS for u in row]
    assert len(units) == len(set(units)), "a unit is listed twice"
    present = {unit_of(module_name(PACKAGE, p)) for p in PACKAGE.rglob("*.py")}
    assert present <= set(units), f"place these in LAYERS: {sorted(present - set(units))}"
    assert set(units) <= present, f"no longer in ferryman/: {sorted(set(units) - present)}"


def test_import_graph_keeps_the_rules() -> None:
    report = compare(violations(PACKAGE, LAYERS), KNOWN_VIOLATIONS)
    print(report)
    assert not report, report


# ---- the checker itself, on a small package built in tmp_path ------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / rel.split("/")[0]


CLEAN = {
    "pkg/__init__.py": "from pkg.top import run\n",
    "pkg/top.py": "from pkg.low import helper\nfrom pkg.mid import a\n\ndef run():\n    from pkg.mid.b import B\n",
    "pkg/mid/__init__.py": "",
    "pkg/mid/a.py": "from . import b\nfrom .b import B\nimport pkg.low as low\n",
    "pkg/mid/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import helper\n_own = 1\nB = _own\n",
    "pkg/side.py": "import os\n",
    "pkg/low.py": "import json\ndef helper(): ...\n",
}
SMALL_LAYERS = [("pkg",), ("top",), ("mid", "side"), ("low",)]


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    """Downward imports, a relative import, a type-only import, a private name kept in its module."""
    assert violations(write(tmp_path, CLEAN), SMALL_LAYERS) == set()


def test_checker_finds_each_kind_of_violation(tmp_path: Path) -> None:
    files = dict(CLEAN)
    files["pkg/low.py"] = "def helper():\n    from pkg.side import s\n"  # upward, inside a function
    files["pkg/side.py"] = "from pkg.mid import B\n"  # a sibling of the same row
    files["pkg/mid/b.py"] = "from pkg.mid import a\n"  # a <-> b: a cycle inside one unit
    files["pkg/top.py"] = "from pkg.mid.b import _own\nfrom pkg.mid import b\nb._hidden()\n"
    files["pkg/extra.py"] = ""
    assert violations(write(tmp_path / "each", files), SMALL_LAYERS) == {
        "layer: pkg.low -> pkg.side",
        "layer: pkg.side -> pkg.mid",
        "cycle: pkg.mid.a -> pkg.mid.b",
        "cycle: pkg.mid.b -> pkg.mid.a",
        "private: pkg.top uses pkg.mid.b._own",
        "private: pkg.top uses pkg.mid.b._hidden",
        "unplaced: extra is in no layer",
    }
    # a cycle closed by a type-only import back: a cycle still, marked as such
    type_back = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid.a import A\nB = 1\n"
    assert violations(write(tmp_path / "types", dict(CLEAN, **{"pkg/mid/b.py": type_back})), SMALL_LAYERS) == {
        "cycle: pkg.mid.a -> pkg.mid.b", "cycle: pkg.mid.b -> pkg.mid.a (TYPE_CHECKING)"}
    # a cycle across units: its upward edge is also a layering breach
    files = dict(CLEAN, **{"pkg/low.py": "import pkg.mid.a\n"})
    assert violations(write(tmp_path / "across", files), SMALL_LAYERS) == {
        "layer: pkg.low -> pkg.mid.a", "cycle: pkg.mid.a -> pkg.low", "cycle: pkg.low -> pkg.mid.a",
        "cycle: pkg.mid.a -> pkg.mid.b", "cycle: pkg.mid.b -> pkg.low (TYPE_CHECKING)"}


def test_a_new_violation_fails_against_the_known_list(tmp_path: Path) -> None:
    root = write(tmp_path, dict(CLEAN, **{"pkg/low.py": "from pkg import side\n"}))
    known = violations(root, SMALL_LAYERS)
    assert known == {"layer: pkg.low -> pkg.side"} and compare(known, known) == ""
    write(tmp_path, {"pkg/mid/b.py": CLEAN["pkg/mid/b.py"] + "import pkg.side\n"})
    report = compare(violations(root, SMALL_LAYERS), known)
    assert "new: layer: pkg.mid.b -> pkg.side" in report and "gone" not in report
    write(tmp_path, {"pkg/low.py": "", "pkg/mid/b.py": CLEAN["pkg/mid/b.py"]})
    assert "gone: layer: pkg.low -> pkg.side" in compare(violations(root, SMALL_LAYERS), known)
