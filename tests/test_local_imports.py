"""Every function-local import in ``dml_core`` and ``pipelines`` says why it is not at the top of its module.

An import inside a function hides a dependency from the module's header, so the project keeps one only where it
buys something real: a lean start of a process that must stay lean (the ``dmlrc`` CLI before its signal handlers
and config check, warm fold workers without torchvision, ranks that do not log to MLflow), an optional or
path-specific dependency (timm, torchvision, safetensors, boto3, scipy, matplotlib, ...), or an import order that
matters (Ray after its environment variables are set, pyplot after ``matplotlib.use``).  Such an import carries a
comment on its own line or on the line right above it; a comment line right above a run of consecutive imports
covers the whole run.  Everything else belongs at the top of its module.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dml_core", "pipelines")

_IMPORTS = (ast.Import, ast.ImportFrom)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _comment_lines(source: str) -> set[int]:
    """Line numbers (1-based) holding a comment."""
    return {
        tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT
    }


def _local_import_runs(tree: ast.AST) -> list[list[ast.stmt]]:
    """Function-local imports, as runs of consecutive import statements (each next one on the line after the
    previous one ends, in the same block)."""
    runs: list[list[ast.stmt]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt) and in_function:
                run: list[ast.stmt] = []
                for stmt in block:
                    if isinstance(stmt, _IMPORTS) and run and stmt.lineno == run[-1].end_lineno + 1:
                        run.append(stmt)
                        continue
                    if run:
                        runs.append(run)
                    run = [stmt] if isinstance(stmt, _IMPORTS) else []
                if run:
                    runs.append(run)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, _FUNCTIONS))

    visit(tree, False)
    return runs


def python_files(root: Path = ROOT) -> list[Path]:
    """The modules of ``root``'s packages."""
    return [path for pkg in PACKAGES for path in sorted((root / pkg).rglob("*.py"))]


def uncommented_local_imports(root: Path = ROOT) -> list[str]:
    """``path:line: statement`` of every function-local import under ``root``'s packages without a reason."""
    found = []
    for path in python_files(root):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        comments = _comment_lines(source)

        def comment_line(n: int) -> bool:  # a line that is a comment and nothing else
            return 1 <= n <= len(lines) and lines[n - 1].lstrip().startswith("#")

        for run in _local_import_runs(ast.parse(source, filename=str(path))):
            covered = comment_line(run[0].lineno - 1)
            for stmt in run:
                own = any(n in comments for n in range(stmt.lineno, stmt.end_lineno + 1))
                if not (covered or own or comment_line(stmt.lineno - 1)):
                    found.append(f"{path.relative_to(root)}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}")
    return found


def test_every_function_local_import_says_why():
    files = python_files()
    # a scan that found no modules would find no bare import either
    assert len(files) >= 80 and ROOT / "pipelines" / "cli.py" in files, f"{len(files)} modules scanned"
    missing = uncommented_local_imports()
    assert not missing, (
        "function-local imports without a comment saying why (move them to the module's top, or "
        "say on the line or right above what the local import buys):\n" + "\n".join(missing)
    )


def test_the_checker_finds_a_bare_local_import(tmp_path):
    pkg = tmp_path / "pipelines"
    pkg.mkdir()
    (tmp_path / "dml_core").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        "import os\n"
        "\n"
        "\n"
        "def reasons():\n"
        "    import json  # on the line itself\n"
        "    # one comment above a run covers the run\n"
        "    import math\n"
        "    from pathlib import Path\n"
        "    if Path:\n"
        "        # right above, in a nested block\n"
        "        import re\n"
        "    return json, math, re\n"
        "\n"
        "\n"
        "def bare():\n"
        "    x = 1  # a comment about the code above does not count\n"
        "    import shutil\n"
        "\n"
        "    import csv\n"
        "    return x, shutil, csv, os\n"
        "\n"
        "\n"
        "class Box:\n"
        "    def method(self):\n"
        "        from collections import (OrderedDict,\n"
        "                                 deque)\n"
        "        return OrderedDict, deque\n"
    )
    assert uncommented_local_imports(tmp_path) == [
        "pipelines/mod.py:17: import shutil",
        "pipelines/mod.py:19: import csv",
        "pipelines/mod.py:25: from collections import (OrderedDict,",
    ]
