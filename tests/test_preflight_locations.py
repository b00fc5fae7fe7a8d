"""Locations where nothing can be written — even by root, to whom ``os.access`` says yes everywhere (``/proc``) — are
one config error before anything starts, and the check itself leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import ConfigError
from pipelines.execution.preflight.locations import check_dir_writable

needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


@needs_proc
def test_a_folder_under_proc_is_not_writable_even_for_root():
    with pytest.raises(ConfigError) as info:
        check_dir_writable(Path("/proc/rep"), "--out", "report folder")
    assert info.value.field == "--out" and "no file can be created in '/proc'" in info.value.problem


def test_the_check_leaves_nothing_behind(tmp_path):
    (tmp_path / "a").mkdir()
    check_dir_writable(tmp_path / "a" / "new" / "deeper", "storage", "sweep folder")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a"]


@needs_proc
def test_report_out_under_proc_is_one_config_error(tmp_path, capsys, monkeypatch):
    from pipelines.cli import main
    from pipelines.tracking.runs import Tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'db.sqlite'}"
    Tracker.open(uri, "real")
    capsys.readouterr()
    rc = main(["report", "--experiment", "real", "--tracking-uri", uri, "--out", "/proc/rep"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("config error: --out: report folder '/proc/rep'"), err
