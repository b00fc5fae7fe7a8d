"""Security of a sweep's own Ray: no password in what is printed, the private credentials folder of a killed driver
removed by the next sweep, why a trial failed said without secrets, and the cluster's resources checked before any
trial starts.

What a real sweep leaves behind is checked on tests/test_resume.py's Ray Train kill-and-resume sweep, which runs with
fake AWS credentials in its environment: no credential in Ray's session folder, MLflow or the sweep's folder, across
two driver sessions (one killed outright) and a restarted worker group, and every socket of its Ray on loopback but
each fold's torch rendezvous store.  One Ray Train sweep serves both files' checks (a module fixture is built once
per pytest worker, and ``--dist loadfile`` hands each file to one worker): a second would cost minutes of suite time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tiny_sweep import smallest_sweep

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ fast units


def test_redact_uri_hides_only_the_password():
    from pipelines.execution.runtime.environment import redact_uri, scrub

    assert redact_uri("postgresql://alice:s3cr%40t@db:5432/mlflow") == "postgresql://alice:***@db:5432/mlflow"
    assert redact_uri("postgresql+psycopg2://u:p@127.0.0.1/x") == "postgresql+psycopg2://u:***@127.0.0.1/x"
    assert redact_uri("http://bob:pw@host:5000") == "http://bob:***@host:5000"
    for same in ("http://host:5000/x", "sqlite:////tmp/a:b@c.db", "postgresql://u@h/db", "", None):
        assert redact_uri(same) == same
    # a driver error quoting the password (raw or URL-decoded) loses it too
    assert (
        scrub("auth failed for s3cr@t and s3cr%40t", "postgresql://alice:s3cr%40t@db/m")
        == "auth failed for *** and ***"
    )


def test_a_killed_drivers_credentials_folder_is_deleted_by_the_next_sweep_and_a_live_ones_is_kept(
    tmp_path, monkeypatch
):
    """A driver killed outright leaves its private credentials folder (``dmlrc-aws-<pid>-*``) behind; the next
    sweep's start deletes the folders of dead drivers of the same user, and no other folder."""
    from pipelines.execution.runtime import environment as ray_runtime

    monkeypatch.setattr(ray_runtime, "CREDENTIALS_PARENT", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"dmlrc-aws-{gone.pid}-x1"
    live = tmp_path / f"dmlrc-aws-{os.getppid()}-x2"  # a running process's (a sweep still going)
    unnamed = tmp_path / "dmlrc-aws-x3"  # no pid in the name: not ours to judge
    for d in (stale, live, unnamed):
        d.mkdir()
        (d / "credentials").write_text("[default]\n")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    try:
        ray_runtime.hide_credentials()
        mine = Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"])
        assert mine.parent.parent == tmp_path and mine.parent.name.startswith(f"dmlrc-aws-{os.getpid()}-")
        assert "fake-secret" in mine.read_text() and "AWS_SECRET_ACCESS_KEY" not in os.environ
        assert not stale.exists() and live.exists() and unnamed.exists()
    finally:
        ray_runtime.undo_settings()
    assert not mine.parent.exists() and os.environ["AWS_SECRET_ACCESS_KEY"] == "fake-secret"


def test_failure_reason_says_why_each_trial_failed():
    from pipelines.execution.runtime.interrupts import failure_reason

    rows = [
        {"trial_id": "t1", "status": "diverged", "reason": "fold 0: loss is NaN"},
        {"trial_id": "t2", "error": RuntimeError("fold 1: worker died")},
        {"trial_id": "t3"},
        {"trial_id": "t4"},
    ]
    text = failure_reason(rows)
    assert "diverged: fold 0: loss is NaN [t1]" in text
    assert "RuntimeError: fold 1: worker died [t2]" in text
    assert "stopped before reporting a result" in text and "[t3, t4]" in text
    assert "?" not in text
    assert failure_reason([]) == "no trial ran"


def test_failure_reason_unwraps_what_ray_raised_in_a_task_inside_a_trial():
    """A fold's error reaches the study through two Ray wrappers (the fold task's, then the trial actor's), each a
    RayTaskError whose text is a coloured traceback: the reason is the innermost error's own line."""
    from ray.exceptions import RayTaskError

    from pipelines.execution.runtime.interrupts import error_text, failure_reason

    inner = ValueError("s3://b/shards/part-00000.parquet: sha256 abc does not match the manifest's def")
    fold = RayTaskError("fold", "Traceback (most recent call last):\n  ...\n", inner).as_instanceof_cause()
    trial_err = RuntimeError(f"study t1: fold 0: {error_text(fold)}")
    wrapped = RayTaskError(
        "\x1b[36mray::ImplicitFunc.train()\x1b[39m", "Traceback ...\n  ^^^^\n", trial_err
    ).as_instanceof_cause()
    assert error_text(fold) == f"ValueError: {inner}"
    text = failure_reason([{"trial_id": "t1", "error": wrapped}])
    assert text == f"error: RuntimeError: study t1: fold 0: ValueError: {inner} [t1]"


def test_run_sweep_checks_the_clusters_resources_before_any_trial(tmp_path, monkeypatch):
    """``use_gpu: true`` against a running Ray without GPUs (e.g. a cluster given with ``--address``): one config
    error naming ``resources.use_gpu`` and what the cluster has, right after Ray starts — no trial, no stored
    config, no run (before: Ray Train retried its worker-group start-up forever).  Ray itself is stubbed here."""
    import ray

    from pipelines.config.schema import ConfigError, parse_config
    from pipelines.execution import sweep
    from pipelines.execution.runtime import session as ray_session
    from pipelines.execution.studies import sweep_studies

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = yaml.safe_load(
        smallest_sweep(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", name="gpu", use_gpu=True).read_text()
    )
    cfg = parse_config(doc)
    started = []
    monkeypatch.setattr(ray_session, "start_ray", lambda cfg, address: started.append(address) or False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(sweep_studies.SweepStudies, "run_study", lambda self, plan: pytest.fail("a study started"))
    with pytest.raises(ConfigError) as e:
        sweep.run_sweep(cfg, address="ray://cluster:10001")
    assert started == ["ray://cluster:10001"]
    assert e.value.field == "resources.use_gpu" and "0 GPUs" in str(e.value) and "8 CPUs" in str(e.value)
    assert not (cfg.local_dir() / "sweep_config.json").exists()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = c.get_experiment_by_name("gpu-experiment")
    assert exp is None or c.search_runs([exp.experiment_id]) == []
