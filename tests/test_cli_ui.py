"""``dmlrc ui``: a sweep's MLflow store served on a loopback port by a real ``mlflow server`` child, its studies-view
link printed; Ctrl-C stops the child (by its pid) and exits cleanly.  The end-of-sweep lines print the exact
``dmlrc ui`` command and the registered model names.

The slow test starts the real server (seconds); the others check what is refused before anything starts and what
the end of a sweep prints.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines.commands import _finish, build_parser, run
from pipelines.execution.sweep import SweepOutcome, _registered_models
from pipelines.results.study_results import StudySummary
from pipelines.tracking.ui import experiment_url
from tests.ports import free_port

DMLRC = str(Path(sys.executable).with_name("dmlrc"))


def _store(tmp_path: Path, *experiments: str) -> tuple[str, dict[str, str]]:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, {name: client.create_experiment(name) for name in experiments}


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: "), err
    return err[0]


# ------------------------------------------------------------------------------------------------ refused early


def test_a_missing_sqlite_db_is_one_line_and_is_not_created(tmp_path, capsys):
    db = tmp_path / "runs" / "x" / "mlflow.db"
    assert run(["ui", "--tracking-uri", f"sqlite:///{db}", "--no-browser"]) == 2
    assert _one_error(capsys).startswith(f"config error: --tracking-uri: no sqlite DB at '{db}'")
    assert not db.exists()


def test_an_unknown_experiment_is_one_line_with_the_stores_experiments(tmp_path, capsys):
    uri, _ = _store(tmp_path, "omniglot")
    assert run(["ui", "--tracking-uri", uri, "--experiment", "omniglt", "--no-browser"]) == 2
    line = _one_error(capsys)
    assert line.startswith("config error: --experiment: no experiment 'omniglt'") and "did you mean 'omniglot'" in line


def test_a_port_in_use_is_one_line_before_any_server_starts(tmp_path, capsys):
    uri, _ = _store(tmp_path, "e")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert run(["ui", "--tracking-uri", uri, "--port", str(port), "--no-browser"]) == 2
    assert _one_error(capsys).startswith(f"config error: --port: 127.0.0.1:{port} cannot be used")


@pytest.mark.parametrize(
    "argv, field",
    [
        (["ui", "c.yaml", "--tracking-uri", "sqlite:///x.db"], "--tracking-uri"),
        (["ui", "--tracking-uri", "sqlite:///x.db", "--name", "n"], "--name"),
        (["ui", "--tracking-uri", "file:///tmp/mlruns"], "--tracking-uri"),
        (["ui", "--tracking-uri", "http://127.0.0.1:9", "--port", "5001"], "--port"),
    ],
)
def test_contradicting_or_bad_arguments_are_one_line(argv, field, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert run(argv) == 2
    assert _one_error(capsys).startswith(f"config error: {field}: ")


def test_a_sweep_config_names_its_store(tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(
        "name: s\nstorage: " + str(tmp_path / "runs") + "\n"
        "datasets: [{kind: synthetic, num_classes: 8, per_class: 4}]\nlosses: [contrastive]\n"
    )
    assert run(["ui", str(cfg), "--no-browser"]) == 2  # the sweep has not run: its DB is not there
    assert _one_error(capsys).startswith(
        f"config error: {cfg}: no sqlite DB at '{tmp_path / 'runs' / 's' / 'mlflow.db'}'"
    )


# ------------------------------------------------------------------------------------------------ end of a sweep


def test_the_end_of_a_sweep_prints_the_exact_dmlrc_ui_command_and_the_registered_names(tmp_path, capsys):
    db = tmp_path / "my runs" / "mlflow.db"  # a space: the printed command quotes it
    ci = {"concat": {"map_at_r": (0.5, 0.4, 0.6)}, "separated": {"map_at_r": (0.4, 0.3, 0.5)}}
    studies = [
        StudySummary("synthetic/sec:triplet", "synthetic", "sec:triplet", "r1", "ok", ci=ci),
        StudySummary("synthetic/contrastive", "synthetic", "contrastive", "r2", "ok", ci=ci),
    ]
    registered = {
        "synthetic/sec:triplet": "dmlrc.exp 1.synthetic.sec-triplet/3",
        "synthetic/contrastive": "failed: RestException: no space left",
    }
    outcome = SweepOutcome("s", tmp_path, f"sqlite:///{db}", "exp 1", "1", studies, 60.0, registered)
    _finish(outcome)
    out = capsys.readouterr().out
    assert "mlflow ui" not in out and ":5000" not in out
    (command,) = [line.strip() for line in out.splitlines() if line.strip().startswith("dmlrc ui ")]
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.tracking_uri == f"sqlite:///{db}" and args.experiment == "exp 1" and args.config is None
    lines = out.splitlines()
    assert any(
        line.split() == ["synthetic/sec:triplet", "dmlrc.exp", "1.synthetic.sec-triplet", "version", "3"]
        for line in lines
    ), out
    assert any("synthetic/contrastive" in line and "failed: RestException" in line for line in lines), out


def test_the_registered_names_come_from_the_study_runs_tags(tmp_path):
    from mlflow import MlflowClient

    from pipelines.tracking.runs import Tracker

    uri, ids = _store(tmp_path, "e")
    tracker = Tracker.open(uri, "e")
    client = MlflowClient(uri)
    ok = client.create_run(ids["e"], tags={"stage": "study", "registered_model": "dmlrc.e.d.sec-triplet/2"})
    other = client.create_run(ids["e"], tags={"stage": "study"})  # no model registered
    studies = [
        StudySummary("d/sec:triplet", "d", "sec:triplet", ok.info.run_id, "ok"),
        StudySummary("d/contrastive", "d", "contrastive", other.info.run_id, "ok"),
        StudySummary("d/bundled", "d", "bundled", "a-run-of-another-store", "ok"),
    ]
    assert _registered_models(tracker, studies) == {"d/sec:triplet": "dmlrc.e.d.sec-triplet/2"}


# ------------------------------------------------------------------------------------------------ the real server


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _read_until(q: queue.Queue, prefix: str, timeout: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.strip().startswith(prefix):
            return line.strip()
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(seen)}")


def _group_alive(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are still running (zombies awaiting their reaper do not count)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dmlrc_ui_serves_the_store_until_ctrl_c_and_stops_its_server(tmp_path):
    uri, ids = _store(tmp_path, "sweep-x")
    port = free_port()  # below the ephemeral range (tests/ports.py)
    proc = subprocess.Popen(
        [DMLRC, "ui", "--tracking-uri", uri, "--no-browser", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, out), daemon=True).start()
    seen: list[str] = []
    try:
        started = _read_until(out, "MLflow UI of", 300, seen)
        child = int(started.split("pid ")[1].split(")")[0])
        link = _read_until(out, "http://", 30, seen)
        base = f"http://127.0.0.1:{port}"
        assert link == experiment_url(base, ids["sweep-x"])
        assert _get(base + "/health") == (200, "OK")
        status, page = _get(link)  # the fragment stays in the browser: the UI's page
        assert status == 200 and "<!doctype html>" in page.lower()

        # a server URI: only its link, nothing started
        r = subprocess.run(
            [DMLRC, "ui", "--tracking-uri", base, "--experiment", "sweep-x", "--no-browser"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert experiment_url(base, ids["sweep-x"]) in r.stdout and "pid" not in r.stdout

        assert _group_alive(child), "the server runs in its own process group, led by the child"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
        rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "Traceback" not in err and "Traceback" not in "".join(seen), err
    rest = []
    while (line := out.get(timeout=10)) is not None:
        rest.append(line)
    assert any("MLflow UI stopped" in line for line in rest), rest
    left = _group_alive(child)
    if left:  # the test's own clean-up of what dmlrc should have stopped
        os.killpg(child, signal.SIGKILL)
    assert not left, "the server and its worker are gone"
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/health")
