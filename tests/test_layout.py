"""The layout rules of the product: dml_core never imports Ray or MLflow; no machine paths in the repo."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"ray", "mlflow"}


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_dml_core_source_does_not_import_ray_or_mlflow():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_roots(p) & FORBIDDEN)
        for p in (ROOT / "dml_core").rglob("*.py")
        if _imported_roots(p) & FORBIDDEN
    }
    assert not offenders, offenders


def test_importing_dml_core_loads_neither_ray_nor_mlflow():
    modules = sorted(
        "dml_core." + ".".join(p.relative_to(ROOT / "dml_core").with_suffix("").parts)
        for p in (ROOT / "dml_core").rglob("*.py")
        if p.name != "__init__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(r for r in ('ray', 'mlflow') if r in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_five_top_level_folders_exist_with_a_readme():
    for d in ("dml_core", "pipelines", "tune_spaces", "infra", "tests"):
        assert (ROOT / d / "README.md").is_file(), f"{d}/README.md missing"
