"""The layout rules of the product: dml_core never imports Ray or MLflow; no machine paths in the repo."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.test_doc_paths import repo_files

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"ray", "mlflow"}

# An absolute path of one machine: a home or work folder on Linux or macOS, or a Windows drive.  Written in pieces so
# that this file does not hold what it looks for.
_MACHINE_PATH = re.compile(
    r"(?<![\w.~-])/(?:" + "|".join(["ho" + "me", "Us" + "ers", "wo" + "rk"]) + r")/[\w.-]"
    r"|(?<![\w])[A-Z]:\\{1,2}(?![ntr\"'\\])[\w.-]"
)


def _dml_core_files(root: Path = ROOT) -> list[Path]:
    files = sorted((root / "dml_core").rglob("*.py"))
    assert len(files) >= 30 and root / "dml_core" / "training" / "loop.py" in files, (
        f"the scan found {len(files)} files under {root / 'dml_core'}: is the repository where the test expects it?"
    )
    return files


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
        for p in _dml_core_files()
        if _imported_roots(p) & FORBIDDEN
    }
    assert not offenders, offenders


def test_importing_dml_core_loads_neither_ray_nor_mlflow():
    modules = sorted(
        "dml_core." + ".".join(p.relative_to(ROOT / "dml_core").with_suffix("").parts)
        for p in _dml_core_files()
        if p.name != "__init__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(len(sys.modules), sorted(r for r in ('ray', 'mlflow') if r in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    count, loaded = out.stdout.strip().split(" ", 1)
    assert int(count) > len(modules), out.stdout + out.stderr  # every module was imported
    assert loaded == "[]", out.stdout + out.stderr


def test_the_five_top_level_folders_exist_with_a_readme():
    for d in ("dml_core", "pipelines", "tune_spaces", "infra", "tests"):
        assert (ROOT / d / "README.md").is_file(), f"{d}/README.md missing"


def machine_paths(root: Path = ROOT) -> tuple[list[str], int]:
    """(``file:line: text`` of every absolute machine path in the repository's text files, files read).  The files
    are what git holds or would add (`git ls-files`: tracked, plus new files not ignored)."""
    found, read = [], 0
    for name in repo_files(root):
        path = root / name
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images, parquet): no text to hold a path
            continue
        read += 1
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if _MACHINE_PATH.search(line):
                found.append(f"{name}:{n}: {line.strip()[:160]}")
    return found, read


def test_no_machine_paths_in_the_repository():
    found, read = machine_paths()
    assert read >= 200, f"the scan read only {read} files: is `git ls-files` seeing the repository?"
    assert not found, (
        "absolute paths of one machine (tests make their own temp dirs; docs use ~ or relative paths):\n"
        + "\n".join(found)
    )


def test_the_machine_path_check_finds_them(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    home, users, work, drive = "/" + "home/alice", "/" + "Users/bob", "/" + "work/main", "C" + ":"
    (tmp_path / "a.md").write_text(f"data in {home}/data\nok: ~/.cache, https://example.org{home}/x\n")
    (tmp_path / "b.py").write_text(f'ROOT = "{users}/repo"\nprint("failed:\\n")\nW = r"{drive}\\Users\\carol"\n')
    (tmp_path / "c.yaml").write_text(f"path: {work}/runs\nkey: 'x:\\n'\n")
    (tmp_path / "d.png").write_bytes(b"\x89PNG\0" + home.encode())
    found, read = machine_paths(tmp_path)
    assert read == 3
    assert [f.split(":")[0] + ":" + f.split(":")[1] for f in found] == ["a.md:1", "b.py:1", "b.py:3", "c.yaml:1"]
