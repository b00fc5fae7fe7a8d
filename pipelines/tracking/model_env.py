"""What a registered model needs to load in another environment, carried inside the model.

A colleague installs a model with ``pip install -r requirements.txt`` from the model's folder (or MLflow does, for
``mlflow models serve`` / ``env_manager="virtualenv"``: it runs pip in the model's folder too).  Neither this package
nor a user's plugin is on a package index, so the model carries them as wheels (``artifacts/<wheel>``), and its
requirements name each by relative file URL and sha256 — ``file:artifacts/<wheel>#sha256=<hex>``: pip installs that
file and refuses one whose hash differs, without turning on hash-checking for the public dependencies (torch and the
rest come from the user's index or are installed already).  A distribution the training machine did not install
from an index is never pinned by ``name==version``: an index would serve whatever carries that name.

Where each wheel comes from (:func:`distribution_wheel`), with no network:

* this package, running from a source tree (an editable install, or the checkout on ``PYTHONPATH``), and a plugin
  installed editable: ``pip wheel --no-deps --no-build-isolation --no-index`` of a copy of its source folder (a build
  in place would leave ``build/`` and ``*.egg-info`` in the user's folder);
* a distribution installed from a wheel file that is still there with the recorded hash: that file;
* any other install (a local folder, an archive since removed, a VCS or URL): its installed files (``RECORD``)
  packed again as a wheel.

Plugins installed from an index keep ``name==version``.  A plugin given by import path outside any installed
distribution — or whose only metadata is an ``*.egg-info`` beside its code — travels as code (MLflow's
``code_paths``: ``code/`` is put on ``sys.path`` when the model loads).
"""

from __future__ import annotations

import ast
import atexit
import base64
import csv
import hashlib
import importlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pipelines
from dml_core.plugins import PluginDistribution

__all__ = [
    "DISTRIBUTION",
    "ModelEnvironment",
    "ModelEnvironmentError",
    "model_environment",
    "distribution_wheel",
    "own_wheel",
    "wheel_requirement",
]

#: This project's distribution name (pyproject.toml).
DISTRIBUTION = "dml-reality-check"
#: Where pyfunc models keep their artifacts, relative to the model's folder (MLflow's layout).
ARTIFACTS_DIR = "artifacts"

#: Never copied into a build: what a source folder accumulates besides its sources.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".tox",
    ".whl",
    "runs",
    "mlruns",
    "mlflow.db",
)
#: Files of an installed ``*.dist-info`` that describe the installation, not the distribution.
_INSTALL_RECORDS = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")


class ModelEnvironmentError(RuntimeError):
    """A distribution the model needs cannot be bundled with it; the message names it and what to do."""


@dataclass
class ModelEnvironment:
    """``requirements``: pip requirement lines; ``wheels``: artifact name -> local wheel file, to log with the model
    (each named by a ``file:artifacts/...`` requirement); ``code_paths``: folders or modules for MLflow to copy into
    the model's ``code/``."""

    requirements: list[str] = field(default_factory=list)
    wheels: dict[str, str] = field(default_factory=dict)
    code_paths: list[str] = field(default_factory=list)

    def add_wheel(self, wheel: Path) -> None:
        key = f"wheel_{wheel.name.split('-', 1)[0]}"
        if key not in self.wheels:
            self.wheels[key] = str(wheel)
            self.requirements.append(wheel_requirement(wheel))


def wheel_requirement(wheel: Path) -> str:
    """``file:artifacts/<wheel>#sha256=<hex>``: the wheel as logged in the model, relative to the model's folder."""
    digest = hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    return f"file:{ARTIFACTS_DIR}/{urllib.parse.quote(Path(wheel).name)}#sha256={digest}"


def model_environment(trunk: str) -> ModelEnvironment:
    """The requirements, wheels and code a model built with ``trunk`` needs to load and embed: this package's wheel
    (its core requirements: torch, torchvision, numpy, pillow, MLflow — no training stack, which is the ``train``
    extra), then the trunk's library or plugin — pinned when installed from an index (timm for ``timm:`` trunks), else
    a wheel, or its code when no installer put it there.  The loss a model was trained with is not among them: the
    model computes embeddings, never a loss, so a loss plugin is not needed where the model is used.
    """
    # the trunk registry (torch) only when a model is logged: not when the CLI imports this module
    from dml_core.trunks import resolve_trunk

    env = ModelEnvironment()
    env.add_wheel(own_wheel())
    spec = resolve_trunk(trunk)
    if spec.kind not in ("import", "entry_point", "timm"):
        return env  # a built-in trunk: this package and its core requirements
    what = f"trunk {trunk!r}"
    dist = spec.distribution
    entry_point = spec.kind == "entry_point"
    if dist is not None and re.sub(r"[-_.]+", "-", dist.name).lower() == DISTRIBUTION:
        return env  # this package itself, bundled above
    requirement = dist.requirement if dist is not None else None  # "name==version" for one from an index
    if requirement is not None:
        env.requirements.append(requirement)
    elif dist is not None and dist.origin == "direct":
        env.add_wheel(distribution_wheel(dist))
    elif entry_point:  # found by its entry point's name: its code alone would not be found
        why = (
            f"its distribution {dist} has only setuptools' egg-info metadata ({dist.metadata_dir}), no record of an "
            "installation"
            if dist is not None
            else "no installed distribution is known to declare its entry point"
        )
        raise ModelEnvironmentError(
            f"{what}: {why} to bundle with the model; install it with pip (pip install -e <folder>)"
        )
    else:  # outside any installed distribution, or beside a stray egg-info: its code travels with the model
        path = _module_code(spec.name.split(":", 1)[0] if spec.kind == "import" else None)
        if path is not None:
            env.code_paths.append(path)
    return env


# ------------------------------------------------------------------------------------------------ wheels
_CACHE: dict[tuple[str, str], Path] = {}
_LOCK = threading.Lock()
_WORK: list[Path] = []
#: top-level package folder -> the copy of the modules of it that plugins need (:func:`_module_code`)
_CODE: dict[Path, Path] = {}


def _workdir() -> Path:
    """A folder for this process's wheels, removed when it exits (the sweep logs several models from each)."""
    if not _WORK:
        path = Path(tempfile.mkdtemp(prefix="dmlrc-wheels-"))
        atexit.register(shutil.rmtree, path, True)
        _WORK.append(path)
    return _WORK[0]


def _cached(key: tuple[str, str], make) -> Path:
    with _LOCK:  # a sweep's studies register their models from parallel threads
        wheel = _CACHE.get(key)
        if wheel is None or not wheel.exists():
            out = _workdir() / hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            wheel = _CACHE[key] = make(out)
        return wheel


def own_wheel() -> Path:
    """A wheel of this package as it runs here: built from its source tree, or taken from the installation."""
    root = Path(pipelines.__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "dml_core").is_dir():
        # the checkout's top-level files (pyproject.toml, README, LICENSE) and its packages: not the data, runs or
        # virtual environments a checkout gathers
        parts = [p.name for p in root.iterdir() if p.is_file()] + ["dml_core", "pipelines", "tune_spaces"]
        return _cached(("source", str(root)), lambda out: _build(root, out, DISTRIBUTION, parts))
    running = Path(pipelines.__file__).resolve()
    installed = [
        (dist, found)
        for dist in importlib.metadata.distributions(name=DISTRIBUTION)
        if (found := PluginDistribution.of(dist, DISTRIBUTION)).origin != "unmanaged"
    ]
    # the installation this code runs from, when several are on sys.path
    installed.sort(key=lambda pair: Path(str(pair[0].locate_file("pipelines/__init__.py"))).resolve() != running)
    if installed:
        return distribution_wheel(installed[0][1])
    raise ModelEnvironmentError(f"{DISTRIBUTION} is neither a source tree nor an installed distribution here")


def distribution_wheel(dist: PluginDistribution) -> Path:
    """A wheel of the installed distribution ``dist`` (see the module's docstring for where it comes from)."""
    if dist.metadata_dir is None or dist.origin == "unmanaged":
        raise ModelEnvironmentError(f"{dist}: no installation record to build a wheel from")
    meta = Path(dist.metadata_dir)
    direct = _direct_url(meta)
    source = _local_path(direct.get("url", ""))
    if direct.get("dir_info", {}).get("editable") and source is not None:
        if not source.is_dir():
            raise ModelEnvironmentError(f"{dist}: installed editable from {source}, which is gone; install it again")
        return _cached(("source", str(source)), lambda out: _build(source, out, str(dist)))
    archive = direct.get("archive_info")
    if archive is not None and source is not None and source.suffix == ".whl" and source.is_file():
        algo, _, expected = (archive.get("hash") or "").partition("=")
        hashes = archive.get("hashes") or ({algo: expected} if expected else {})
        if all(hashlib.new(a, source.read_bytes()).hexdigest() == h for a, h in hashes.items()):
            return source  # the very file it was installed from
    return _cached(("installed", str(meta)), lambda out: _repack(dist, meta, out))


def _direct_url(meta: Path) -> dict:
    try:
        return json.loads((meta / "direct_url.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _local_path(url: str) -> Path | None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        return None
    return Path(urllib.request.url2pathname(parts.path))


def _build(source: Path, out: Path, what: str, parts: list[str] | None = None) -> Path:
    """``pip wheel`` of a copy of ``source`` (only its entries ``parts`` if given) with this environment's build
    backend: no network, no isolation."""
    copy = out / "src" / source.name
    if parts is None:
        shutil.copytree(source, copy, ignore=_NOT_SOURCES, symlinks=True)
    else:
        copy.mkdir(parents=True)
        for name in parts:
            if (source / name).is_dir():
                shutil.copytree(source / name, copy / name, ignore=_NOT_SOURCES, symlinks=True)
            elif (source / name).is_file() and not _NOT_SOURCES(str(source), [name]):
                shutil.copy2(source / name, copy / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--isolated", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(out / "wheel"), str(copy)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    shutil.rmtree(out / "src", ignore_errors=True)
    wheels = sorted((out / "wheel").glob("*.whl"))
    if r.returncode != 0 or len(wheels) != 1:
        last = (r.stderr.strip() or r.stdout.strip() or "no wheel written").splitlines()[-1]
        raise ModelEnvironmentError(f"cannot build a wheel of {what} from {source}: {last}")
    return wheels[0]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _repack(dist: PluginDistribution, meta: Path, out: Path) -> Path:
    """The installed files of ``dist`` (its ``RECORD``) as a wheel: the dist-info without the installer's own
    records, no bytecode, no generated scripts (pip writes them again from ``entry_points.txt``)."""
    site = meta.parent
    try:
        rows = list(csv.reader(io.StringIO((meta / "RECORD").read_text(encoding="utf-8"))))
    except OSError:
        raise ModelEnvironmentError(f"{dist}: no RECORD in {meta} to build a wheel from") from None
    files = []
    for row in rows:
        if not row or not row[0]:
            continue
        rel = Path(row[0])
        parts = rel.parts
        if rel.is_absolute() or ".." in parts or "__pycache__" in parts or rel.suffix == ".pyc":
            continue
        if parts[0] in ("bin", "Scripts") or (parts[0] == meta.name and rel.name in _INSTALL_RECORDS):
            continue
        if (site / rel).is_file():
            files.append(rel.as_posix())
    wheel_meta = (meta / "WHEEL").read_text(encoding="utf-8") if (meta / "WHEEL").is_file() else ""
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    tag = ".".join(dict.fromkeys(t.split("-")[0] for t in tags)) if tags else "py3"
    tag += "-" + (".".join(dict.fromkeys(t.split("-")[1] for t in tags)) if tags else "none")
    tag += "-" + (".".join(dict.fromkeys(t.split("-")[2] for t in tags)) if tags else "any")
    if not wheel_meta:
        files.append(f"{meta.name}/WHEEL")
        wheel_meta = f"Wheel-Version: 1.0\nGenerator: {DISTRIBUTION}\nRoot-Is-Purelib: true\nTag: {tag}\n"
    name = re.sub(r"[-_.]+", "_", dist.name).lower()
    wheel = out / f"{name}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name_in_wheel in sorted(set(files)):
            installed_file = site / name_in_wheel
            data = wheel_meta.encode() if name_in_wheel == f"{meta.name}/WHEEL" else installed_file.read_bytes()
            info = zipfile.ZipInfo(name_in_wheel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if os.access(installed_file, os.X_OK) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            record.append((name_in_wheel, _record_hash(data), str(len(data))))
        record.append((f"{meta.name}/RECORD", "", ""))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record)
        zf.writestr(zipfile.ZipInfo(f"{meta.name}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())
    return wheel


# ------------------------------------------------------------------------------------------------ plugin code
def _module_code(module: str | None) -> str | None:
    """The code an import-path plugin needs, for ``code_paths``: the module file alone when it is a top-level module;
    inside a package, a copy of just that module, the ``__init__.py`` of each package above it and every module of
    the same top-level package that these import (followed transitively), each at its place in the package.  Never
    the whole package: a plugin that lives in a project's ``tests`` or ``scripts`` package must not carry its
    neighbours (other code, credentials in test fixtures) into a model others download.  ``None`` for the standard
    library."""
    if not module:
        return None
    mod = sys.modules.get(module) or importlib.import_module(module)
    file = getattr(mod, "__file__", None)
    if not file:
        return None
    file = Path(file).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    if file.is_relative_to(stdlib) and "site-packages" not in file.parts:
        return None
    depth = len(module.split(".")) - (1 if file.name == "__init__.py" else 2)
    if depth < 0:
        return str(file)
    top = file.parents[depth]  # the top-level package folder
    with _LOCK:  # one copy per top-level package: a loss and a trunk from the same package share it
        if top not in _CODE:
            _CODE[top] = Path(tempfile.mkdtemp(prefix="dmlrc-code-", dir=_workdir())) / top.name
        dest = _CODE[top]
    for src in sorted(_package_closure(file, top)):
        target = dest / src.relative_to(top)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return str(dest)


def _package_closure(file: Path, top: Path) -> set[Path]:
    """``file``, the ``__init__.py`` files from ``top`` down to it, and the files of ``top``'s modules it imports,
    transitively (absolute imports of the top-level package and relative ones)."""
    seen: set[Path] = set()
    todo = [file]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for parent in f.parents:  # the package chain above the module
            if parent == top.parent or not parent.is_relative_to(top):
                break
            init = parent / "__init__.py"
            if init.is_file() and init not in seen:
                todo.append(init)
        todo.extend(_imported_files(f, top))
    return seen


def _imported_files(file: Path, top: Path) -> list[Path]:
    """The files of ``top``'s package that ``file`` imports (``import top.x``, ``from top.x import y``, ``from . import
    y``, ``from .x import y``; ``y`` counts when it is a module itself)."""
    here = file.parent.relative_to(top.parent).parts  # the package ``file`` is in, as name parts
    out: list[Path] = []

    def resolve(parts: tuple[str, ...]) -> None:
        if not parts or parts[0] != top.name:
            return
        base = top.parent.joinpath(*parts)
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                out.append(cand.resolve())

    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(tuple(alias.name.split(".")))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                parts = pkg + tuple(node.module.split(".") if node.module else ())
            else:
                parts = tuple((node.module or "").split("."))
            resolve(parts)
            for alias in node.names:
                resolve((*parts, alias.name))
    return out
