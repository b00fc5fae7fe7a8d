"""PostgreSQL as a *direct* MLflow tracking store (no MLflow server), on a fresh database of the PostgreSQL at
127.0.0.1:5432 (``$DMLRC_TEST_PG`` overrides the admin URI; skipped when none answers): an end-to-end sweep with
``postgresql://`` (SQLAlchemy 2.1's default driver is psycopg 3; without it the config pins the installed psycopg2),
and ``postgresql+psycopg2://`` accepted by the config and written and read through by MLflow in-process (the sweep
hands the URI to MLflow unchanged; one sweep is what the store's path through the product needs).

The URI carries a password (the test server trusts local connections, so any password is accepted): it must not
appear in what the sweep prints, in any MLflow param, tag or artifact, in the sweep folder or in Ray's session dir.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_security import files_containing, ray_tmpdir, sweep_env, tiny_sweep_config

PASSWORD = "pw-never-printed-7f3a"


def _check_accepted(scheme: str) -> None:
    """The scheme is an accepted tracking store: a refusal is a failure, not a reason to skip."""
    from pipelines.config.schema import ConfigError, check_tracking_uri

    try:
        check_tracking_uri(f"{scheme}://u@127.0.0.1:5432/db")
    except ConfigError as e:
        pytest.fail(f"tracking.uri check refuses {scheme}://: {e}")


def _with_password(admin_uri: str, scheme: str) -> tuple[str, str]:
    """(``scheme://user:PASSWORD@host:port/db`` of the test database, its ``host:port/db``)."""
    user, hostpart = admin_uri.split("://", 1)[1].split("@", 1)
    return f"{scheme}://{user}:{PASSWORD}@{hostpart}", hostpart


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_with_postgresql_as_direct_tracking_store(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all
    from tests.mlflow_server import PostgresUnavailable, postgres_database

    _check_accepted("postgresql")
    try:
        db = postgres_database()
        admin_uri = db.__enter__()
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL not reachable: {e}")
    ray_tmp = ray_tmpdir()
    try:
        # postgres_database() yields postgresql+psycopg2://user@host:port/db; put the scheme and a password in.
        uri, hostpart = _with_password(admin_uri, "postgresql")
        name = "pgpostgresql"
        cfg = tiny_sweep_config(tmp_path, uri, name=name)
        out = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=800,
            env=sweep_env(ray_tmp),
        )
        assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
        # the banner, password redacted (postgresql:// may be pinned to the installed psycopg2: pipelines.config.schema)
        assert f":***@{hostpart} experiment" in out.stdout and "MLflow postgresql" in out.stdout, out.stdout[-3000:]
        assert PASSWORD not in out.stdout + out.stderr

        # The run tree, read back directly from PostgreSQL (no password needed: trust auth).
        c = MlflowClient(admin_uri)
        exp = c.get_experiment_by_name(f"{name}-experiment")
        assert exp is not None
        runs = search_all(c, exp.experiment_id, "")
        stages = sorted(r.data.tags["stage"] for r in runs)
        assert stages == ["fold"] * 6 + ["reproduction"] * 2 + ["study", "trial"], stages
        assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]
        study = next(r for r in runs if r.data.tags["stage"] == "study")
        assert study.data.tags["done"] == "true" and "test.concat.map_at_r.mean" in study.data.metrics

        # No password in params or tags of any run, nor in the study's artifacts, the sweep folder, Ray's logs.
        for r in runs:
            assert PASSWORD not in repr(r.data.params) + repr(r.data.tags), r.info.run_id
        art = tmp_path / "artifacts"
        c.download_artifacts(study.info.run_id, "", str(art.mkdir() or art))
        assert files_containing(art, [PASSWORD.encode()]) == []
        assert files_containing(tmp_path / "runs", [PASSWORD.encode()]) == []  # (the config file itself has it)
        assert files_containing(Path(ray_tmp), [PASSWORD.encode()]) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
        db.__exit__(None, None, None)


@pytest.mark.slow
def test_postgresql_psycopg2_is_an_accepted_direct_tracking_store(tmp_path):
    """``postgresql+psycopg2://`` with a password: the config accepts it, and MLflow creates, logs to and reads back a
    run on it (in this process: what a sweep does with the URI after the config check)."""
    from mlflow.tracking import MlflowClient

    from tests.mlflow_server import PostgresUnavailable, postgres_database

    _check_accepted("postgresql+psycopg2")
    try:
        db = postgres_database()
        admin_uri = db.__enter__()
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL not reachable: {e}")
    try:
        uri, _ = _with_password(admin_uri, "postgresql+psycopg2")
        c = MlflowClient(uri)
        exp = c.create_experiment("psycopg2-experiment")
        run = c.create_run(exp, tags={"stage": "study"})
        c.log_metric(run.info.run_id, "test.concat.map_at_r.mean", 0.25)
        c.set_terminated(run.info.run_id)
        back = MlflowClient(admin_uri).get_run(run.info.run_id)
        assert back.data.metrics["test.concat.map_at_r.mean"] == 0.25 and back.info.status == "FINISHED"
    finally:
        db.__exit__(None, None, None)
