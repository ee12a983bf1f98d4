"""The import layering of ``src/tailguard`` (docs/architecture.md): every import points down or sideways within its
floor, never up, and no modules import each other in a circle.

Every import counts for the floors, the lazy ones inside functions and the type-only ones under ``TYPE_CHECKING``
alike: a floor that needs a higher one's types has the wrong cut. For circles, type-only imports do not count (they
never run, so they cannot make one module load half-done before another); lazy imports do.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tailguard"

# Lowest first. A module may import its own floor and the floors below it.
FLOORS: list[tuple[str, ...]] = [
    ("tailguard", "tailguard.fast_json", "tailguard.api_error", "tailguard.usage", "tailguard.urls",
     "tailguard.output_path"),  # shared vocabulary, no dependencies
    ("tailguard.engine",),  # the model, the scheduler, the KV cache: no HTTP, no policy
    ("tailguard.observe",),  # timelines, metrics, the store, traces
    ("tailguard.plan", "tailguard.slo"),  # forecasts and capacity; SLO profiles, windows, alerts and actions
    ("tailguard.policy",),  # who may send what, and in which lane
    ("tailguard.backends",),  # where a prepared request goes: the embedded engine, upstream replicas
    ("tailguard.serving",),  # the HTTP server
    ("tailguard.bench", "tailguard.cli", "tailguard.demo", "tailguard.demo_report", "tailguard.engine_options",
     "tailguard.rebuild"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def floor_of(name: str) -> int:
    best, floor = -1, None
    for i, members in enumerate(FLOORS):
        for m in members:
            if (name == m or name.startswith(m + ".")) and len(m) > best:
                best, floor = len(m), i
    assert floor is not None, f"{name} is on no floor: add it to FLOORS (and to docs/architecture.md)"
    return floor


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, type-only) for each tailguard import in the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def resolve(base: str, names: list[str]) -> list[str]:
        # ``from tailguard.x import y`` imports module tailguard.x.y when there is one, else names from tailguard.x
        targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
        return targets if len(targets) == len(names) else [*targets, base]

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, type_only)
                continue
            visit_stmt(child, type_only)

    def visit_stmt(stmt: ast.AST, type_only: bool) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name == "tailguard" or alias.name.startswith("tailguard."):
                    found.append((alias.name, stmt.lineno, type_only))
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - stmt.level + 1])
                base = f"{base}.{stmt.module}" if stmt.module else base
            else:
                base = stmt.module or ""
            if base == "tailguard" or base.startswith("tailguard."):
                for target in resolve(base, [a.name for a in stmt.names]):
                    found.append((target, stmt.lineno, type_only))
        visit(stmt, type_only)

    visit(tree, False)
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    mods = modules()
    known = set(mods)
    return mods, {name: imports(name, path, known) for name, path in mods.items()}


def test_every_module_is_on_a_floor():
    for name in modules():
        floor_of(name)


def test_no_import_points_up_a_floor():
    mods, edges = graph()
    upward = [
        f"{mods[a].relative_to(SRC)}:{line} imports {b} ({'type only' if type_only else 'runs'}): "
        f"floor {floor_of(a)} -> {floor_of(b)}"
        for a, targets in edges.items() for b, line, type_only in targets
        if b in mods and floor_of(b) > floor_of(a)
    ]
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def circles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, []))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_modules_import_each_other_in_a_circle():
    mods, edges = graph()
    # A package's __init__ importing its own submodules is how a package exposes them, not a circle of design.
    runtime = {a: sorted({b for b, _, type_only in targets if not type_only and b in mods and b != a
                          and not a.startswith(b + ".")})
               for a, targets in edges.items()}
    found = circles(runtime)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_an_upward_arrow_and_a_circle():
    """The rules themselves: a made-up graph with an upward import and a circle is caught."""
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert circles({"a": ["b"], "b": []}) == []
    assert floor_of("tailguard.engine.scheduler") < floor_of("tailguard.serving.endpoint")
    assert floor_of("tailguard.fast_json") == 0
    assert imports("tailguard.engine.x", _write_probe(), set()) == [
        ("tailguard.serving", 3, False), ("tailguard.policy.lanes", 6, True), ("tailguard.backends", 9, False)]


def _write_probe() -> Path:
    import tempfile

    text = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\nfrom tailguard.serving import state\n"
            "import os\nif TYPE_CHECKING:\n    from tailguard.policy.lanes import Lanes\n\ndef f():\n"
            "    import tailguard.backends\n")
    path = Path(tempfile.mkdtemp()) / "x.py"
    path.write_text(text)
    return path
