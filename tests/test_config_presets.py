"""The built-in sweep presets: ``dmlrc init`` lists them and copies one to start from, in a checkout and from an
installed wheel (which has no ``configs/`` folder: the presets are package data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from pipelines.cli import main
from pipelines.config.presets import copy_preset, presets
from pipelines.config.schema import load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_example_config_and_the_demo_is_a_preset():
    names = set(presets())
    assert names == {"demo"} | {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert presets()["omniglot"].read_text() == (ROOT / "configs" / "omniglot.yaml").read_text()  # one copy


def test_the_compare_example_runs_the_demo_presets_protocol():
    """examples/circle-vs-demo.yaml compares a plug-in with the demo's studies through their bundle, which a sweep
    admits only under the same protocol: the example must follow every change of the preset."""
    demo = load_config(presets()["demo"])
    doc = yaml.safe_load((ROOT / "examples" / "circle-vs-demo.yaml").read_text())
    del doc["compare_with"], doc["runtime_env"]  # the bundle and the plug-in: not here
    doc["losses"] = ["contrastive"]
    example = parse_config(doc)
    for section in ("seed", "datasets", "model", "protocol"):
        assert getattr(example, section) == getattr(demo, section), section


def test_init_lists_the_presets(capsys):
    assert main(["init"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in presets())


def test_init_copies_a_preset_that_then_validates(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "demo"]) == 0
    assert "dmlrc sweep demo.yaml" in capsys.readouterr().out
    assert load_config(tmp_path / "demo.yaml").name == "demo"
    assert main(["init", "omniglot", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_text() == presets()["omniglot"].read_text()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["init", "omniglt"], "config error: PRESET: no preset 'omniglt' (known: demo, "),
        (["init", "demo", "{tmp}/demo.yaml"], "config error: DEST: '{tmp}/demo.yaml' already exists (not overwritten)"),
        (["init", "demo", "{tmp}/no/such/folder.yaml"], "config error: DEST: folder '{tmp}/no/such' does not exist"),
    ],
)
def test_init_bad_input_is_one_config_error(argv, line, tmp_path, capsys):
    (tmp_path / "demo.yaml").write_text("mine\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line.replace("{tmp}", str(tmp_path))), err
    assert (tmp_path / "demo.yaml").read_text() == "mine\n"  # never overwritten
    assert "did you mean 'omniglot'" in err[0] or argv[1] != "omniglt"


def test_sweep_help_points_at_init_not_at_a_folder_the_wheel_lacks(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "dmlrc init" in out and "configs/" not in out


def test_an_installed_wheel_has_the_presets_and_init_copies_one(tmp_path):
    """Build this project's wheel, unpack it (a pure-Python wheel's install layout) and run ``dmlrc init`` from it,
    outside the checkout."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs", "mlruns"),
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"pipelines/config/sweep_presets/{p.name}" for p in (ROOT / "configs").glob("*.yaml")} <= names
    assert not any(n.startswith("configs/") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    code = (
        "import sys, pipelines\n"
        "from pipelines.cli import main\n"
        "assert pipelines.__file__.startswith(sys.argv[1]), pipelines.__file__\n"
        "sys.exit(main(['init', 'mlrc-cub200']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-c", code, str(site)], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "mlrc-cub200.yaml").read_text() == (ROOT / "configs" / "mlrc-cub200.yaml").read_text()


def test_copy_preset_into_a_folder_names_the_file_after_the_preset(tmp_path):
    assert copy_preset("omniglot-zoo", tmp_path) == tmp_path / "omniglot-zoo.yaml"
