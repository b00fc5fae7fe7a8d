"""The package as a user installs it, with a plugin of their own (docs/plugins.md).

One slow test builds this project's wheel and the example plugin's (``examples/plugin``), installs both without
dependencies into a prefix over the test environment's packages — in an interpreter where the source tree is not
importable — and, from a folder outside the checkout:

* sweeps the plugin's loss by its entry-point name (``circle``) against ``contrastive``, with the plugin's trunk
  (``wide_tiny``, an entry point too) loaded from a ``model.pretrained`` file: both studies end with confidence
  intervals and a registered model;
* ``dmlrc reeval`` re-evaluates the plugin's registered model: ``ok``;
* with the pretrained file deleted, in another folder, the registered model loads and embeds: it carries the wheels
  this distribution and the plugin were installed from, its pip requirements name them by file and sha256, and none
  of its files names a path of the training run.

Fast tests: the wheel holds the search spaces, the demo preset and the license; its requirements are what a
registered model needs, the training stack its ``train`` extra; ``dmlrc --version``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.tiny_sweep import tiny_sweep

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin"


#: Never copied into a build: what a checkout accumulates besides its sources.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "mlruns"
)


def _wheel(src: Path, out: Path) -> Path:
    """``pip wheel`` of a project folder with this environment's setuptools (no network, no build isolation), built
    from a copy: setuptools writes ``build/`` and ``*.egg-info`` into the folder it builds, and an egg-info left in
    ``examples/plugin/src`` would make the example plugin an installed distribution for any process with that folder
    on its path (a config's ``runtime_env.py_modules`` puts it there)."""
    copy = out / "src" / src.name
    shutil.copytree(src, copy, ignore=_NOT_SOURCES)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(copy)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    ours = _wheel(ROOT, out / "ours")
    plugin = _wheel(PLUGIN, out / "plugin")
    return {"ours": ours, "plugin": plugin}


def test_the_wheel_holds_what_a_sweep_and_the_demo_need(wheels):
    names = set(zipfile.ZipFile(wheels["ours"]).namelist())
    spaces = {n for n in names if n.startswith("tune_spaces/") and n.endswith(".yaml")}
    assert len(spaces) == len(list((ROOT / "tune_spaces").glob("*.yaml"))) >= 28, sorted(spaces)
    assert "pipelines/config/demo.yaml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheels["ours"]).read(meta).decode()
    assert "License-Expression: MIT" in text or "License: MIT" in text
    assert not any(n.startswith(("tests/", "examples/", "bench/")) for n in names)


def test_the_training_stack_is_the_train_extra_and_dev_installs_it(wheels):
    """``pip install dml-reality-check`` (what a registered model's requirements install) gets no training stack;
    ``[train]`` adds it; ``[dev]`` (``make install``, the test suite) includes ``[train]``."""
    from packaging.requirements import Requirement

    zf = zipfile.ZipFile(wheels["ours"])
    meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    by_extra: dict[str, set[str]] = {}
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            extra = next((e for e in ("train", "dev", "gpu") if req.marker and req.marker.evaluate({"extra": e})), "")
            by_extra.setdefault(extra, set()).add(
                req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
            )
    assert by_extra[""] == {"torch", "torchvision", "numpy", "pillow", "mlflow"}, by_extra[""]
    training = {"ray[client,train,tune]", "optuna", "greenlet", "pytorch-metric-learning", "faiss-cpu", "timm"}
    assert training <= by_extra["train"], by_extra["train"]
    assert "dml-reality-check[train]" in by_extra["dev"], by_extra["dev"]
    assert "Provides-Extra: train" in meta


def test_dmlrc_version_prints_the_distribution_version():
    import importlib.metadata

    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"dmlrc {importlib.metadata.version('dml-reality-check')}"


def venv_with_site_path(env_dir: Path, path: str | Path) -> Path:
    """A fresh venv without pip whose site directory holds one ``.pth`` line, ``path``: a folder added as a plain
    path (no ``.pth`` file inside it runs).  Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "extra-site.pth").write_text(f"{path}\n")
    return py


def _isolated_python(tmp: Path, prefix: Path) -> tuple[Path, dict[str, str]]:
    """A venv whose only site directory is its own; a ``.pth`` line adds the test environment's site-packages as a
    plain path (its ``.pth`` files — the editable install's finder among them — are not run), so torch, Ray and
    MLflow import but this checkout does not.  ``prefix`` (the installed wheels) comes first on PYTHONPATH."""
    env_dir = tmp / "venv"
    py = venv_with_site_path(env_dir, sysconfig.get_paths()["purelib"])
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(prefix)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, env


def _run(py: Path, args: list[str], cwd: Path, env: dict[str, str], timeout: int = 900):
    return subprocess.run([str(py), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_installed_wheel_sweeps_an_entry_point_plugin_and_its_model_loads_anywhere(wheels, tmp_path):
    import torch

    from tests.test_registry import parquet_dataset

    prefix = tmp_path / "prefix"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(prefix),
            str(wheels["ours"]),
            str(wheels["plugin"]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    py, env = _isolated_python(tmp_path, prefix)
    work = tmp_path / "work"  # outside the checkout
    work.mkdir()
    where = _run(
        py,
        [
            "-c",
            "import dml_core, pipelines, tune_spaces, dmlrc_example; "
            "print(dml_core.__file__, pipelines.__file__, dmlrc_example.__file__)",
        ],
        work,
        env,
    )
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and where.stdout.count(str(prefix)) == 3, where.stdout

    data = parquet_dataset(work / "data")
    from dml_core.trunks import resolve_trunk  # the plugin trunk's own layout, for a pretrained file

    sys.path.insert(0, str(PLUGIN / "src"))
    try:
        module, _ = resolve_trunk("dmlrc_example.trunks:wide_tiny").build()
    finally:
        sys.path.remove(str(PLUGIN / "src"))
        for name in [m for m in sys.modules if m.startswith("dmlrc_example")]:
            del sys.modules[name]
    pretrained = work / "wide_tiny.pth"
    torch.save(module.state_dict(), pretrained)

    uri = f"sqlite:///{work / 'mlflow.db'}"
    tiny_sweep(
        work,
        "pkg",
        ["contrastive", "circle"],
        datasets=[{"name": "shapes", "kind": "parquet", "path": data, "image_size": 16}],
        model={"trunk": "wide_tiny", "embedding_dim": 8, "freeze_bn": False, "pretrained": str(pretrained)},
        protocol={
            "iters_per_epoch": 2,
            "max_epochs": 1,
            "train": {"classes_per_batch": 4, "m": 4, "eval_batch_size": 64},
        },
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1},
        tracking={"uri": uri, "experiment": "pkg-experiment"},
    )
    out = _run(py, ["-m", "pipelines.cli", "sweep", "pkg.yaml"], work, env)
    log = out.stdout[-6000:] + out.stderr[-4000:]
    assert out.returncode == 0, log
    for loss in ("contrastive", "circle"):
        assert f"registered 2 reproduction models as dmlrc.pkg-experiment.shapes.{loss} version 1" in out.stdout, log
    table = out.stdout[out.stdout.index("test metrics ×100") :]
    assert "circle" in table and "contrastive" in table and table.count("±") >= 12, table

    # dmlrc reeval of the plugin's model, in the installed environment: ok
    (work / "reeval.yaml").write_text(
        yaml.safe_dump(
            {
                "schedule": "pkg",
                "tracking_uri": uri,
                "models": [{"name": "dmlrc.pkg-experiment.shapes.circle"}],
                "datasets": {"shapes": data},
                "tolerance": 0.01,
                "out": str(work / "reeval-out"),
                "batch_size": 64,
            }
        )
    )
    rv = _run(py, ["-m", "pipelines.cli", "reeval", "reeval.yaml"], work, env)
    assert rv.returncode == 0, rv.stdout[-4000:] + rv.stderr[-3000:]
    assert "| dmlrc.pkg-experiment.shapes.circle | 1 |" in rv.stdout and "| ok |" in rv.stdout, rv.stdout[-3000:]

    # The registered model elsewhere: the pretrained file gone, another folder, only the two distributions.
    pretrained.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = f"""
import json, mlflow, numpy as np
from mlflow.artifacts import download_artifacts
mlflow.set_tracking_uri({uri!r})
m = mlflow.pyfunc.load_model("models:/dmlrc.pkg-experiment.shapes.circle@reality-check")
x = np.random.default_rng(0).random((3, 3, 16, 16), dtype=np.float32)
print(json.dumps({{"shape": list(m.predict(x).shape),
                   "dir": download_artifacts("models:/dmlrc.pkg-experiment.shapes.circle@reality-check")}}))
"""
    got = _run(py, ["-c", probe], elsewhere, env)
    assert got.returncode == 0, got.stderr[-4000:]
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["shape"] == [3, 2 * 8], result  # 2 k-fold fold models × embedding 8, concatenated
    model_dir = Path(result["dir"])
    reqs = (model_dir / "requirements.txt").read_text().split()
    # neither distribution is on an index: the model carries the very wheels they were installed from, named by
    # relative file and sha256 (tests/test_model_install.py installs such a model where no index holds them)
    assert not [r for r in reqs if r.startswith(("dml-reality-check", "dmlrc-example-plugin"))], reqs
    for wheel in (wheels["ours"], wheels["plugin"]):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert f"file:artifacts/{wheel.name}#sha256={digest}" in reqs, reqs
        assert (model_dir / "artifacts" / wheel.name).read_bytes() == wheel.read_bytes()
    checked = []
    for f in model_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".txt", ".yaml", ".py", "") and f.stat().st_size < 1 << 20:
            if f.name == "MLmodel":
                # MLflow's own provenance: where its store keeps the model, the code file and artifact files as they
                # were logged (temporary copies, gone since).  Loading reads none of them: the model's own folder
                # holds the code and the artifacts.
                doc = yaml.safe_load(f.read_text())
                doc.pop("artifact_path", None)
                flavor = doc["flavors"]["python_function"]
                flavor.pop("model_code_path", None)
                for a in flavor.get("artifacts", {}).values():
                    assert not Path(a.pop("uri")).exists()
                text = yaml.safe_dump(doc)
            else:
                text = f.read_text(errors="replace")
            assert str(work) not in text and str(tmp_path) not in text, f"{f} names {work}: {text[:2000]}"
            checked.append(f.name)
    assert {"MLmodel", "requirements.txt", "embedder.json"} <= set(checked), checked
