"""The app's shape, read from its source (no imports, no Ray): every function fits in one breath (80 lines at
most) and the modules import each other without a circle, counting imports under TYPE_CHECKING and inside
functions (a circle hidden there is still a circle: one of the two modules cannot be read without the other)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"
MAX_FUNCTION_LINES = 80


def modules(root: Path = APP) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def long_functions(path: Path, root: Path = APP, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name (N lines)' for every function or method, nested ones included, longer than `limit`
    (from its `def` line to its last line; decorators not counted)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > limit
    ]


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere in its source. `from P import x` counts as an import
    of P.x when that is a module, else of P."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {name for name in out if name in known and name != module}


def import_graph(root: Path = APP) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan's algorithm), each as a path
    that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while (member := stack.pop()) != node:
                component.add(member)
            components.append(component | {node})

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [circle(graph, c) for c in components if len(c) > 1]


def circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_no_function_in_app_is_longer_than_80_lines():
    offenders = [line for path in modules().values() for line in long_functions(path)]
    assert not offenders, "split these functions (at most 80 lines each):\n" + "\n".join(offenders)


def test_app_modules_import_each_other_without_a_circle():
    graph = import_graph()
    assert len(graph) > 20 and sum(map(len, graph.values())) > 20  # it read the package, not an empty folder
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The two checks find a long function and a circle hidden under TYPE_CHECKING and inside a function."""
    pkg = tmp_path / "app"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from app.sub import b\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.sub.b import X\n"
        + "def long():\n"
        + "    x = 1\n" * MAX_FUNCTION_LINES
    )
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import app.a\nfrom app import sub\n")
    assert long_functions(pkg / "a.py", pkg) == [f"app/a.py:4 long ({MAX_FUNCTION_LINES + 1} lines)"]
    graph = import_graph(pkg)
    assert graph["app.sub"] == {"app.sub.b"} and graph["app.c"] == {"app.a", "app.sub"}
    assert cycles(graph) == [["app.a", "app.sub.b", "app.c", "app.a"]]
    (pkg / "c.py").write_text("import os\n")  # the circle broken: none left
    assert cycles(import_graph(pkg)) == []
