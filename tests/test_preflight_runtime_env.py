"""A config's ``runtime_env`` that Ray would only refuse late (pip without virtualenv, a folder over Ray's upload
limit) or that would carry a credential: one config error before Ray starts, nothing written."""

from __future__ import annotations

import copy
import os
import sys

import pytest

from pipelines.config.presets import DEMO
from pipelines.config.schema import ConfigError, parse_config

MiB = 2**20


def _cfg(tmp_path, runtime_env: dict) -> dict:
    doc = copy.deepcopy(DEMO)
    doc["storage"] = str(tmp_path / "runs")
    doc["runtime_env"] = runtime_env
    return doc


def test_pip_entries_without_virtualenv_are_refused_up_front(tmp_path, monkeypatch):
    from pipelines.config import runtime_env

    monkeypatch.setattr(runtime_env, "_virtualenv_installed", lambda: False)
    with pytest.raises(ConfigError) as info:
        parse_config(_cfg(tmp_path, {"pip": ["mylab==0.1"]}))
    assert info.value.field == "runtime_env.pip"
    assert "virtualenv" in info.value.problem and "install the packages on every node" in info.value.problem
    monkeypatch.setattr(runtime_env, "_virtualenv_installed", lambda: True)
    assert parse_config(_cfg(tmp_path, {"pip": ["mylab==0.1"]})).runtime_env.pip == ["mylab==0.1"]
    monkeypatch.setattr(runtime_env, "_virtualenv_installed", lambda: False)
    assert parse_config(_cfg(tmp_path, {})).runtime_env.pip == []  # no pip entries: nothing to install


def _big(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # sparse: no disk space used
        f.truncate(size)


def test_a_working_dir_over_rays_upload_limit_is_refused_before_ray(tmp_path, monkeypatch):
    from pipelines.execution.preflight.study_plans import preflight

    monkeypatch.setattr(sys, "path", list(sys.path))  # working_dir goes on the driver's sys.path
    wd = tmp_path / "project"
    _big(wd / "data" / "images.bin", 600 * MiB)
    (wd / "code.py").write_text("X = 1\n")
    with pytest.raises(ConfigError) as info:
        preflight(parse_config(_cfg(tmp_path, {"working_dir": str(wd)})))
    assert info.value.field == "runtime_env.working_dir"
    assert "600 MiB" in info.value.problem and "limit of 512 MiB" in info.value.problem
    assert not (tmp_path / "runs").exists()
    # what Ray leaves out is not counted: the config's excludes, a .gitignore, Ray's default excludes (.venv)
    preflight(parse_config(_cfg(tmp_path, {"working_dir": str(wd), "excludes": ["data/"]})))
    (wd / ".gitignore").write_text("*.bin\n")
    preflight(parse_config(_cfg(tmp_path, {"working_dir": str(wd)})))
    (wd / ".gitignore").unlink()
    os.rename(wd / "data", wd / ".venv")
    preflight(parse_config(_cfg(tmp_path, {"working_dir": str(wd)})))


def test_a_py_modules_folder_over_the_limit_is_refused(tmp_path, monkeypatch):
    from pipelines.execution.preflight.study_plans import preflight

    monkeypatch.setattr(sys, "path", list(sys.path))
    pkg = tmp_path / "mylab"
    (pkg).mkdir()
    (pkg / "__init__.py").write_text("")
    _big(pkg / "weights.bin", 520 * MiB)
    with pytest.raises(ConfigError) as info:
        preflight(parse_config(_cfg(tmp_path, {"py_modules": [str(pkg)]})))
    assert info.value.field == "runtime_env.py_modules[0]"


@pytest.mark.parametrize(
    "value",
    [
        "postgresql://me:s3cr3t@db.example/x",
        "https://hooks.example/x?token=s3cr3t",
        "https://api.example/v1?api_key=s3cr3t&mode=fast",
    ],
)
def test_a_credential_in_an_env_var_value_is_refused_and_never_echoed(tmp_path, value):
    with pytest.raises(ConfigError) as info:
        parse_config(_cfg(tmp_path, {"env_vars": {"MYLAB_TARGET": value}}))
    assert info.value.field == "runtime_env.env_vars.MYLAB_TARGET"
    assert "credential" in info.value.problem and "s3cr3t" not in str(info.value)


def test_plain_env_var_values_pass(tmp_path):
    env = {"MYLAB_MODE": "fast", "MYLAB_URL": "https://example.org/x?page=2", "MYLAB_DB": "postgresql://me@db/x"}
    assert parse_config(_cfg(tmp_path, {"env_vars": env})).runtime_env.env_vars == env
