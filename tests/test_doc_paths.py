"""Every ``.py`` path that the documentation, READMEs, YAML files and Python comments or docstrings name exists in
the repository: a module renamed or removed leaves no reader pointing at a file that is gone.

Which paths are checked: a ``/``-separated path ending in ``.py`` whose first folder is one of the repository's
top-level folders (``pipelines/…``, ``dml_core/…``, ``tests/…``, ``bench/…``) must exist from the repository root;
one whose first folder is a sub-package of ``dml_core`` or ``pipelines`` (``execution/…``, ``losses/…``), the
short form the docs use inside a package's section, must be the tail of a file that exists.  Paths of other
projects (Ray's, MLflow's, PyTorch's) and example user code (``mylab/losses.py``) start with folders the repository
does not have, and are left alone.  ``CHANGELOG.md`` is history: it names files as they were on their day.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dml_core", "pipelines")
HISTORY = {"CHANGELOG.md"}  # names files as they were when each entry was written
TEXT_SUFFIXES = {".md", ".rst", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh"}
TEXT_NAMES = {"Makefile", "Dockerfile"}

# a relative path with at least one folder, ending in .py, not part of a longer path or a URL
_PY_PATH = re.compile(r"(?<![\w./:-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.py)(?![\w/])")


def repo_files(root: Path = ROOT) -> list[str]:
    """The repository's files as git sees them (tracked, plus new files not ignored), '/'-separated."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(f for f in out.split("\0") if f and (root / f).is_file())


def _python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def _prose(path: Path) -> list[tuple[int, str]] | None:
    """(line, text) pieces of a file to scan, or None for a file of another kind."""
    if path.suffix == ".py":
        return _python_prose(path.read_text(encoding="utf-8"))
    if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
        return list(enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1))
    return None


def stale_paths(root: Path = ROOT) -> tuple[list[str], int, int]:
    """(``file:line: path`` of every named .py path that does not exist, files scanned, paths checked)."""
    files = repo_files(root)
    existing = set(files)
    top = {f.split("/")[0] for f in files if "/" in f}
    subpackages = {
        part for f in files if f.split("/")[0] in PACKAGES and f.endswith(".py") for part in f.split("/")[1:-1]
    }
    stale: list[str] = []
    scanned = checked = 0
    for name in files:
        if name in HISTORY:
            continue
        pieces = _prose(root / name)
        if pieces is None:
            continue
        scanned += 1
        for line, text in pieces:
            for match in _PY_PATH.finditer(text):
                path = match.group(1).removeprefix("./")
                first = path.split("/")[0]
                if first in top:
                    ok = path in existing
                elif first in subpackages:
                    ok = any(f.endswith("/" + path) for f in existing)
                else:
                    continue  # another project's file, or example user code
                checked += 1
                if not ok:
                    stale.append(f"{name}:{line}: {path}")
    return stale, scanned, checked


def test_every_py_path_named_in_docs_and_comments_exists():
    stale, scanned, checked = stale_paths()
    assert scanned >= 100, f"the scan read only {scanned} files: is `git ls-files` seeing the repository?"
    assert checked >= 50, f"the scan checked only {checked} .py paths: is the pattern still finding them?"
    assert not stale, "named .py files that do not exist in the repository (fix the reference):\n" + "\n".join(stale)


def test_the_checker_finds_stale_paths_and_leaves_other_projects_alone(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "pipelines" / "execution").mkdir(parents=True)
    (tmp_path / "pipelines" / "__init__.py").write_text("")
    (tmp_path / "pipelines" / "execution" / "fold.py").write_text(
        '"""Runs one fold; see pipelines/execution/fold.py and execution/fold.py."""\n'
        "# moved from pipelines/fold.py; Ray's own ray/train/_internal/session.py is not ours\n"
        "X = 'pipelines/gone.py'  # a string that is not a docstring is code, not prose\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "See `pipelines/config.py`, execution/preflight.py and `mylab/losses.py`.\n"
        "Here: pipelines/execution/fold.py and ./pipelines/execution/fold.py.\n"
    )
    (tmp_path / "CHANGELOG.md").write_text("- pipelines/old.py was removed\n")
    stale, scanned, checked = stale_paths(tmp_path)
    assert stale == [
        "docs/a.md:1: pipelines/config.py",
        "docs/a.md:1: execution/preflight.py",
        "pipelines/execution/fold.py:2: pipelines/fold.py",
    ]
    assert (scanned, checked) == (3, 7)
