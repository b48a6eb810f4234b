"""The layers of the code base, checked on every import statement (function-level ones included):

- ``memfit`` (the core, with ``memfit.runtime``) imports no stage; the one exception is ``memfit.cli``, the
  umbrella command, which dispatches to the stages' CLIs;
- ``training`` imports only the core; ``compress`` imports the core, never ``serve`` or ``training``;
  ``serve`` imports the core and ``compress`` (to load compress outputs), never ``training``;
- no two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("memfit", "training", "compress", "serve")
ALLOWED = {  # package -> the stage packages it may import (the core is open to all)
    "memfit": set(),
    "training": set(),
    "compress": set(),
    "serve": {"compress"},
}
FRONT_DOOR = {"memfit.cli", "memfit.__main__"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (a package name stands for its ``__init__``)."""
    files = {_module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` depends on the submodule; the package's __init__ only for its own names
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for n in names:
                if n in files and n != mod:
                    deps.add(n)
        graph[mod] = deps
    return graph


def _stage(mod: str) -> str:
    return mod.split(".")[0]


def test_layer_rules() -> None:
    bad = []
    for mod, deps in import_graph().items():
        if mod in FRONT_DOOR:
            continue
        for d in deps:
            if _stage(d) != "memfit" and _stage(d) != _stage(mod) and _stage(d) not in ALLOWED[_stage(mod)]:
                bad.append(f"{mod} -> {d}")
    assert not bad, "forbidden imports:\n" + "\n".join(sorted(bad))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a list of modules in a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = {m: {d for d in deps if d not in FRONT_DOOR} for m, deps in import_graph().items() if m not in FRONT_DOOR}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_a_forbidden_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks themselves can fail: a core module importing serve, and two modules importing each other."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "memfit" / "core.py").write_text("def f():\n    from serve.api import app\n")
    (tmp_path / "serve" / "api.py").write_text("from . import engine\napp = 1\n")
    (tmp_path / "serve" / "engine.py").write_text("from serve.api import app\n")
    graph = import_graph(tmp_path)
    assert "serve.api" in graph["memfit.core"]
    assert cycles(graph) == [["serve.api", "serve.engine"]]
