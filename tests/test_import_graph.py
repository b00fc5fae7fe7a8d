"""The import graph of ``dml_core`` and ``pipelines`` has no cycle — function-local imports included, since a cycle
hidden behind one is still a cycle: two modules that need each other are one concern split in the wrong place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dml_core", "pipelines")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the project modules it imports (anywhere in its body; ``from pkg import mod`` resolves to the
    submodule when one exists)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # ``from pkg import submodule`` depends on the submodule, ``from pkg import name`` on pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t)
                if r and r != m and r.split(".")[0] in PACKAGES:
                    graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_dml_core_or_pipelines():
    graph = import_graph()
    # a scan that found no modules (or no imports) would find no cycle either
    assert len(graph) >= 80 and {"dml_core.training.loop", "pipelines.cli"} <= set(graph), f"{len(graph)} modules"
    assert sum(len(targets) for targets in graph.values()) >= 100, "the scan found almost no project imports"
    assert cycles(graph) == []


def test_the_checker_finds_a_cycle_hidden_behind_a_function_local_import(tmp_path):
    pkg = tmp_path / "pipelines"
    pkg.mkdir()
    (tmp_path / "dml_core").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pipelines.b import X\n")
    (pkg / "b.py").write_text("X = 1\n\ndef f():\n    from pipelines import a\n    return a\n")
    assert cycles(import_graph(tmp_path)) == [["pipelines.a", "pipelines.b"]]
