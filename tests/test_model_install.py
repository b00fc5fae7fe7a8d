"""A registered model installs where neither this package nor its plugin is on an index.

* Fast: a plugin installed from a local folder, or found beside a stray ``*.egg-info``, is never pinned by
  ``name==version`` (an index would serve a stranger's package of that name); the first travels as a wheel named
  by file and sha256, the second as code.  A distribution installed from an index keeps its pin.  Only the trunk's
  distribution travels (a model computes no loss); timm is pinned for a ``timm:`` trunk only.  A saved model loads
  and embeds in a process where every module outside this package's core requirements (and their dependencies)
  fails to import: Ray, Optuna, PML, faiss, timm among them.
* Slow: a model registered with the example plugin's trunk and loss (``examples/plugin``, installed from its
  folder) is installed with ``pip install --no-index -r requirements.txt`` into a fresh venv that has torch,
  torchvision, numpy, pillow and MLflow with their dependencies — no training stack, neither this package nor the
  plugin — then loaded there with ``mlflow.pyfunc.load_model`` and fed images as encoded bytes, paths, uint8 arrays
  and PIL images; the install brings in neither Ray nor Optuna.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tomllib
from packaging.requirements import Requirement

from tests.test_packaging import venv_with_site_path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin"
PLUGIN_MODULE = "dmlrc_example"
PLUGIN_DIST = "dmlrc-example-plugin"
DISTRIBUTION = "dml-reality-check"
#: What a colleague who only uses registered models has installed (with their dependencies): this package's core
#: requirements as the README names them, and pip.
MODEL_RUNTIME = ("torch", "torchvision", "numpy", "pillow", "mlflow", "pip")
#: The training stack (the ``train`` extra) that a model's install must not bring in, by import name.
TRAINING_MODULES = ("ray", "optuna", "pytorch_metric_learning", "faiss")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: Iterable[str]) -> set[str]:
    """The installed distributions (normalised names) that ``requirements`` need, transitively: each one's
    ``Requires-Dist`` whose marker holds here (with the extras asked for)."""
    installed: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():  # the first on sys.path is the one imported
        installed.setdefault(_norm(dist.metadata["Name"]), dist)
    found: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if (name, frozenset(req.extras)) in seen or name not in installed:
            continue
        seen.add((name, frozenset(req.extras)))
        found.add(name)
        for line in installed[name].requires or []:
            dep = Requirement(line)
            envs = [{"extra": e} for e in sorted(req.extras)] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in envs):
                todo.append(dep)
    return found


def _core_requirements() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _pip_env() -> dict[str, str]:
    """The environment without pip's own settings (this machine's find-links and extra indexes among them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH",)}


def _pip(py, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(py), "-m", "pip", *args, "--isolated", "--no-input", "--disable-pip-version-check"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=_pip_env(),
    )


def _forget_plugin_modules() -> None:
    for name in [m for m in sys.modules if m == PLUGIN_MODULE or m.startswith(PLUGIN_MODULE + ".")]:
        del sys.modules[name]


@pytest.fixture
def plugin_site(tmp_path, monkeypatch) -> Path:
    """``examples/plugin`` installed by pip from (a copy of) its folder — not from an index — into a site folder on
    ``sys.path``: its ``*.dist-info`` records ``direct_url.json``, as on a machine where a user ran ``pip install
    ./mylab``."""
    src = tmp_path / "plugin-src"
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path / "plugin-site"
    r = _pip(
        sys.executable,
        ["install", "-q", "--no-deps", "--no-index", "--no-build-isolation", "--target", str(site)] + [str(src)],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _forget_plugin_modules()
    monkeypatch.syspath_prepend(str(site))
    yield site
    _forget_plugin_modules()


# ------------------------------------------------------------------------------------------------ fast
def test_a_plugin_not_installed_from_an_index_is_bundled_never_pinned_by_name(plugin_site, tmp_path):
    from dml_core.losses import loss_info
    from dml_core.trunks import resolve_trunk
    from pipelines.tracking.model_env import model_environment

    for dist in (resolve_trunk("wide_tiny").distribution, loss_info("circle").distribution):
        assert dist.requirement is None, dist.requirement  # never "dmlrc-example-plugin==0.1.0"
        assert (dist.name, dist.version, dist.origin) == (PLUGIN_DIST, "0.1.0", "direct"), dist

    env = model_environment("wide_tiny")
    assert not [r for r in env.requirements if "==" in r and "dml" in r.lower()], env.requirements
    assert len(env.requirements) == 2 and env.code_paths == [], env
    for req in env.requirements:
        assert req.startswith("file:artifacts/") and "#sha256=" in req, req
    plugin_req = next(r for r in env.requirements if "dmlrc_example_plugin-0.1.0-" in r)
    wheel = Path(env.wheels["wheel_dmlrc_example_plugin"])
    assert plugin_req == f"file:artifacts/{wheel.name}#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}"

    # the wheel packed from the installed files installs: module, search space file, entry points; no bytecode
    names = zipfile.ZipFile(wheel).namelist()
    assert f"{PLUGIN_MODULE}/circle.yaml" in names and not [n for n in names if n.endswith(".pyc")], names
    assert not [n for n in names if n.endswith(("direct_url.json", "INSTALLER"))], names
    again = tmp_path / "again"
    r = _pip(sys.executable, ["install", "-q", "--no-deps", "--no-index", "--target", str(again), str(wheel)])
    assert r.returncode == 0, r.stderr[-3000:]
    (info,) = again.glob("dmlrc_example_plugin-0.1.0.dist-info")
    assert "wide_tiny = dmlrc_example.trunks:wide_tiny" in (info / "entry_points.txt").read_text()
    assert (again / PLUGIN_MODULE / "trunks.py").read_bytes() == (
        PLUGIN / "src" / PLUGIN_MODULE / "trunks.py"
    ).read_bytes()


def test_an_import_path_beside_a_stray_egg_info_travels_as_code(tmp_path, monkeypatch):
    """``mylab.egg-info`` left beside ``mylab/`` (a build in place, ``setup.py develop``) is metadata no installer
    wrote: pinning ``mylab==<version>`` from it installs whatever an index calls ``mylab``."""
    from dml_core.plugins import distribution_of_module
    from dml_core.trunks import resolve_trunk
    from pipelines.tracking.model_env import ModelEnvironmentError, model_environment

    work = tmp_path / "project"
    shutil.copytree(PLUGIN / "src" / PLUGIN_MODULE, work / PLUGIN_MODULE)
    egg = work / f"{PLUGIN_DIST.replace('-', '_')}.egg-info"  # setuptools names it after the distribution
    egg.mkdir()
    (egg / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0.1\n")
    (egg / "top_level.txt").write_text(f"{PLUGIN_MODULE}\n")
    _forget_plugin_modules()
    monkeypatch.syspath_prepend(str(work))
    try:
        trunk = f"{PLUGIN_MODULE}.trunks:wide_tiny"
        dist = resolve_trunk(trunk).distribution
        assert dist == distribution_of_module(f"{PLUGIN_MODULE}.trunks")
        assert dist.requirement is None, dist.requirement  # never "dmlrc-example-plugin==0.1"
        assert (dist.name, dist.origin) == (PLUGIN_DIST, "unmanaged"), dist
        env = model_environment(trunk)
        assert [r for r in env.requirements if PLUGIN_DIST in r or "==" in r] == [], env.requirements
        (code,) = env.code_paths  # a copy of the modules the trunk needs, at their place in the package
        copied = Path(code)
        assert copied.name == PLUGIN_MODULE and not copied.is_relative_to(work), code
        for name in ("__init__.py", "trunks.py"):
            assert (copied / name).read_bytes() == (work / PLUGIN_MODULE / name).read_bytes(), name
        # the loss the model was trained with stays behind: a model computes embeddings, never a loss
        assert not (copied / "losses.py").exists(), sorted(p.name for p in copied.iterdir())
        # a trunk found by an entry point of such metadata: code alone would not be found by name on load
        (egg / "entry_points.txt").write_text(
            f"[dml_reality_check.trunks]\nstray_tiny = {PLUGIN_MODULE}.trunks:wide_tiny\n"
        )
        with pytest.raises(ModelEnvironmentError, match=r"^trunk 'stray_tiny': its distribution dmlrc-example-plugin"):
            model_environment("stray_tiny")
    finally:
        _forget_plugin_modules()


def test_a_distribution_installed_from_an_index_keeps_its_pin(tmp_path, monkeypatch):
    """A ``*.dist-info`` without ``direct_url.json`` is what an installer leaves for a package from an index."""
    from dml_core.plugins import installed_distribution

    site = tmp_path / "site"
    info = site / "indexed_lab-1.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: indexed-lab\nVersion: 1.2\n")
    monkeypatch.syspath_prepend(str(site))
    dist = installed_distribution("indexed-lab")
    assert (dist.origin, dist.requirement) == ("index", "indexed-lab==1.2")
    (info / "direct_url.json").write_text(json.dumps({"url": "file:///somewhere", "dir_info": {}}))
    dist = installed_distribution("indexed-lab")
    assert (dist.requirement, dist.origin) == (None, "direct")


def test_a_model_pins_the_trunk_s_library_and_nothing_of_the_training_stack():
    """The core requirements do without timm; a ``timm:`` trunk's model pins the timm it was built with."""
    from pipelines.tracking.model_env import model_environment

    (own,) = model_environment("tiny").requirements  # a built-in trunk: this package alone
    assert own.startswith("file:artifacts/dml_reality_check-") and "#sha256=" in own, own
    wheel = Path(model_environment("tiny").wheels["wheel_dml_reality_check"])
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    core = [
        Requirement(line.split(":", 1)[1].strip())
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    core = sorted(_norm(r.name) for r in core if r.marker is None)  # what the model's requirements line installs
    assert core == ["mlflow", "numpy", "pillow", "torch", "torchvision"], core
    assert model_environment("timm:resnet18").requirements == [own, f"timm=={importlib.metadata.version('timm')}"]


_BLOCKED_PROBE = r"""
import json, sys
blocked = set(json.loads(sys.argv[1]))


class NotInstalled:
    # every module outside the core requirements' distributions: as if the training stack were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


before = set(sys.modules)
sys.meta_path.insert(0, NotInstalled())
import mlflow

model = mlflow.pyfunc.load_model(sys.argv[2])
emb = model.predict([open(sys.argv[3], "rb").read()])
loaded = sorted({m.split(".")[0] for m in set(sys.modules) - before} & blocked)
print(json.dumps({"emb": emb.tolist(), "loaded": loaded}))
"""


def test_a_saved_model_loads_and_embeds_without_the_training_stack(tmp_path):
    """The model from code (``pipelines/tracking/pyfunc_model.py``) with two fold models of the built-in ``tiny``
    trunk, saved by MLflow, loaded and fed an encoded image in a process where importing any module of a distribution
    outside the core requirements' closure fails."""
    import mlflow
    import torch
    from PIL import Image

    from dml_core.models import build_model
    from dml_core.trunks import trunk_preprocessing
    from pipelines.tracking import pyfunc_model

    allowed = _closure(_core_requirements()) | {"dml-reality-check"}
    blocked = sorted(
        top
        for top, dists in importlib.metadata.packages_distributions().items()
        if top not in sys.stdlib_module_names and not any(_norm(d) in allowed for d in dists)
    )
    assert set(TRAINING_MODULES) | {"timm", "boto3"} <= set(blocked), blocked

    kwargs = {"trunk": "tiny", "embedding_dim": 8, "freeze_bn": False, "pretrained": None}
    artifacts = {}
    for k in range(2):
        torch.manual_seed(k)
        torch.save(build_model(**kwargs).state_dict(), tmp_path / f"fold_{k}.pt")
        artifacts[pyfunc_model.fold_artifact(k)] = str(tmp_path / f"fold_{k}.pt")
    spec = {
        "folds": 2,
        "model_kwargs": kwargs,
        "image_size": 16,
        "embedding_dim": 8,
        "preprocessing": trunk_preprocessing("tiny").as_dict(),
    }
    (tmp_path / pyfunc_model.EMBEDDER_FILE).write_text(json.dumps(spec))
    artifacts["embedder"] = str(tmp_path / pyfunc_model.EMBEDDER_FILE)
    mlflow.pyfunc.save_model(
        str(tmp_path / "model"), python_model=pyfunc_model.__file__, artifacts=artifacts, pip_requirements=[]
    )
    image = tmp_path / "im.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(image)
    want = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict([image.read_bytes()])

    r = subprocess.run(
        [sys.executable, "-c", _BLOCKED_PROBE, json.dumps(blocked), str(tmp_path / "model"), str(image)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], got["loaded"]
    np.testing.assert_allclose(np.asarray(got["emb"]), want, atol=1e-5)
    assert want.shape == (1, 2 * 8)


# ------------------------------------------------------------------------------------------------ slow
def _register(tmp: Path, uri: str) -> str:
    """A study registered with the plugin's trunk and loss (4 untrained fold models); its ``models:/`` URI."""
    import torch

    from dml_core.models import build_model
    from pipelines.config.schema import SyntheticDataset
    from pipelines.names import ALIAS
    from pipelines.tracking.model_registry import register_study
    from pipelines.tracking.runs import Tracker

    kwargs = {"trunk": "wide_tiny", "embedding_dim": 8, "freeze_bn": False}
    ckpts = []
    for k in range(4):
        d = tmp / f"ckpt{k}"
        d.mkdir(parents=True)
        torch.manual_seed(k)
        torch.save(
            {"model": build_model(**kwargs).state_dict(), "model_kwargs": kwargs, "loss_name": "circle"}, d / "model.pt"
        )
        ckpts.append(str(d))
    t = Tracker.open(uri, "install")
    run_id, _ = t.get_or_create({"sweep": "inst", "study": "shapes/circle", "stage": "study"}, run_name="s")
    spec = SyntheticDataset(name="shapes", kind="synthetic", image_size=16, num_classes=8, per_class=4, seed=0)
    plan = SimpleNamespace(
        key="shapes/circle", loss=SimpleNamespace(name="circle"), dataset=SimpleNamespace(spec=spec, table=None)
    )
    reps = [{"__reproduction__": 0, "seed": 7, "fold_checkpoints": ckpts}]
    ref = register_study(
        t, study_run_id=run_id, experiment="install", sweep="inst", plan=plan, reps=reps, ci={}, say=lambda s: None
    )
    t.finish(run_id)
    return f"models:/{ref.split('/')[0]}@{ALIAS}"


def _public_site(dest: Path) -> Path:
    """What a colleague who only uses models has — :data:`MODEL_RUNTIME` and the distributions they require, no
    training stack, neither this package nor the plugin — as a folder of links to this environment's site-packages
    entries (each distribution's packages, modules and ``*.dist-info``; no ``.pth``)."""
    src = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    wanted, linked = _closure(MODEL_RUNTIME), set()
    for dist in importlib.metadata.distributions():
        name = _norm(dist.metadata["Name"])
        if name not in wanted or name in linked or Path(dist.locate_file("")).resolve() != src.resolve():
            continue
        linked.add(name)
        for top in {f.parts[0] for f in dist.files or []}:
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and (src / top).exists():
                if not os.path.lexists(dest / top):
                    (dest / top).symlink_to(src / top)
    assert linked == wanted and not wanted & {"ray", "optuna", DISTRIBUTION, PLUGIN_DIST}, (wanted, linked)
    return dest


_PROBE = r"""
import io, json, os, sys
import importlib.metadata
import numpy as np
from PIL import Image
import mlflow

model_dir, images_dir = sys.argv[1], sys.argv[2]
model = mlflow.pyfunc.load_model(model_dir)
paths = sorted(os.path.join(images_dir, n) for n in os.listdir(images_dir))
raw = [open(p, "rb").read() for p in paths]
arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
pils = [Image.open(p) for p in paths]
out = {
    "bytes": model.predict(raw).tolist(),
    "one_bytes": model.predict(raw[0]).tolist(),
    "paths": model.predict(paths).tolist(),
    "arrays": model.predict(arrays).tolist(),
    "stacked": model.predict(np.stack([arrays[1], arrays[1]])).tolist(),  # uint8 (B, H, W, C): same-size images
    "pil": model.predict(pils).tolist(),
    "folds": model.predict(raw, params={"output": "folds"}).tolist(),
}
import dml_core, dmlrc_example
out["where"] = [dml_core.__file__, dmlrc_example.__file__]
out["dists"] = [importlib.metadata.version("dml-reality-check"), importlib.metadata.version("dmlrc-example-plugin")]
import importlib.util
out["training"] = [n for n in json.loads(sys.argv[3]) if importlib.util.find_spec(n) is not None]
out["training"] += [d.metadata["Name"] for d in importlib.metadata.distributions()
                    if d.metadata["Name"] in ("ray", "optuna")]
try:
    model.predict(b"not an image at all" * 50)
except Exception as e:
    out["bad"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_registered_model_installs_and_embeds_where_no_index_holds_our_packages(plugin_site, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the sqlite store keeps its artifacts in ./mlruns
    import mlflow
    from PIL import Image

    from pipelines.tracking.model_registry import fluent_tracking
    from pipelines.tracking.pyfunc_model import preprocess

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model_uri = _register(tmp_path / "train", uri)
    with fluent_tracking(uri):
        local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "download")))
        model = mlflow.pyfunc.load_model(model_uri)
    model_dir = tmp_path / "colleague" / "model"  # the model as a colleague receives it: a folder
    shutil.copytree(local, model_dir)
    reqs = (model_dir / "requirements.txt").read_text().split()
    assert not [r for r in reqs if r.startswith(("dml-reality-check", PLUGIN_DIST))], reqs

    # a fresh venv: torch, torchvision, numpy, pillow, MLflow and what they need; no training stack, neither this
    # package nor the plugin, no index
    venv = tmp_path / "venv"
    py = venv_with_site_path(venv, _public_site(tmp_path / "public"))
    env = {**_pip_env(), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    elsewhere = tmp_path / "colleague"
    absent = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util as u, importlib.metadata as m; "
            "print([u.find_spec(n) is None for n in ('dml_core', 'pipelines', 'dmlrc_example')], "
            "[d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] in ('dml-reality-check', "
            f"'{PLUGIN_DIST}')])",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert absent.stdout.strip() == "[True, True, True] []", absent.stdout + absent.stderr[-2000:]

    inst = _pip(py, ["install", "--no-index", "-r", "requirements.txt"], cwd=model_dir)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]

    # images as a user has them: encoded files
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    for i, (w, h) in enumerate([(20, 24), (16, 16), (31, 17)]):
        fmt = "PNG" if i != 1 else "JPEG"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images / f"im{i}.{fmt.lower()}", fmt)
    probe = subprocess.run(
        [str(py), "-c", _PROBE, str(model_dir), str(images), json.dumps(TRAINING_MODULES)],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-5000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert all(str(venv) in w for w in got["where"]), got["where"]  # installed from the model's wheels
    assert got["dists"] == ["0.1.0", "0.1.0"], got["dists"]
    assert got["training"] == [], got["training"]  # the model's install brought in no training stack
    # there, the command line says in one line what it lacks
    cli = subprocess.run(
        [str(py), "-m", "pipelines.cli", "list"], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300
    )
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stdout[-2000:] + cli.stderr[-3000:]
    assert cli.stderr.startswith("dmlrc: cannot import ") and "ray" in cli.stderr, cli.stderr
    assert cli.stderr.strip().endswith("pip install 'dml-reality-check[train]'"), cli.stderr

    # the same embeddings as the training machine's model on the model's own preprocessing
    spec = model.unwrap_python_model().spec
    paths = sorted(images.iterdir())
    want = model.predict(preprocess([p.read_bytes() for p in paths], spec["image_size"], spec["preprocessing"]))
    assert want.shape == (3, 4 * 8)
    for kind in ("bytes", "paths", "arrays", "pil"):
        np.testing.assert_allclose(np.asarray(got[kind]), want, atol=1e-5, err_msg=kind)
    np.testing.assert_allclose(np.asarray(got["stacked"]), want[[1, 1]], atol=1e-5)
    np.testing.assert_allclose(np.asarray(got["one_bytes"]), want[:1], atol=1e-5)
    assert np.asarray(got["folds"]).shape == (3, 4 * 8)
    # bad bytes: one line naming the input by its size, never its content
    assert got["bad"].startswith("image 0 (950 bytes): UnidentifiedImageError"), got["bad"]
    assert "not an image" not in got["bad"] and "not an image" not in probe.stderr


def test_an_import_path_plugin_carries_only_the_modules_it_needs_never_its_neighbours(tmp_path, monkeypatch):
    """A plugin in a project's ``tests`` package (or any package with other files) carries its module, the
    ``__init__.py`` files above it and the package modules it imports; a sibling holding a test fixture's password
    stays behind."""
    from pipelines.tracking.model_env import _module_code

    pkg = tmp_path / "labcode"
    (pkg / "plugins").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("SCALE = 2\n")
    (pkg / "other.py").write_text("UNUSED = 1\n")
    (pkg / "plugins" / "__init__.py").write_text("")
    (pkg / "plugins" / "helper.py").write_text("from labcode.util import SCALE\n")
    (pkg / "plugins" / "fixtures.py").write_text("PASSWORD = 'hunter2'\n")
    (pkg / "plugins" / "myloss.py").write_text("import torch\nfrom . import helper\nfrom ..util import SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = Path(_module_code("labcode.plugins.myloss"))
        got = sorted(str(p.relative_to(code)) for p in code.rglob("*.py"))
        assert got == ["__init__.py", "plugins/__init__.py", "plugins/helper.py", "plugins/myloss.py", "util.py"], got
        assert "hunter2" not in "".join(p.read_text() for p in code.rglob("*") if p.is_file())
        assert _module_code("labcode.plugins.helper") == str(code)  # one copy per top-level package
    finally:
        for name in [m for m in sys.modules if m == "labcode" or m.startswith("labcode.")]:
            del sys.modules[name]
