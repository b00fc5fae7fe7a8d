"""PostgreSQL as a *direct* MLflow tracking store (no MLflow server), on a fresh database of the PostgreSQL at
127.0.0.1:5432 (``$DMLRC_TEST_PG`` overrides the admin URI; skipped when none answers).

The end-to-end sweep on ``postgresql://`` with a password (SQLAlchemy 2.1's default driver is psycopg 3; without it
the config pins the installed psycopg2), the password never shown nor stored, is ``tests/test_interrupt.py``'s
SIGTERM sweep: stopped, resumed and finished on that store.  Here: ``postgresql+psycopg2://`` accepted by the config
and written and read through by MLflow in-process (the sweep hands the URI to MLflow unchanged), and the helpers.
"""

from __future__ import annotations

import pytest

PASSWORD = "pw-never-printed-7f3a"


def check_accepted(scheme: str) -> None:
    """The scheme is an accepted tracking store: a refusal is a failure, not a reason to skip."""
    from pipelines.config.schema import ConfigError, check_tracking_uri

    try:
        check_tracking_uri(f"{scheme}://u@127.0.0.1:5432/db")
    except ConfigError as e:
        pytest.fail(f"tracking.uri check refuses {scheme}://: {e}")


def with_password(admin_uri: str, scheme: str) -> tuple[str, str]:
    """(``scheme://user:PASSWORD@host:port/db`` of the test database, its ``host:port/db``)."""
    user, hostpart = admin_uri.split("://", 1)[1].split("@", 1)
    return f"{scheme}://{user}:{PASSWORD}@{hostpart}", hostpart


@pytest.mark.slow
def test_postgresql_psycopg2_is_an_accepted_direct_tracking_store(tmp_path):
    """``postgresql+psycopg2://`` with a password: the config accepts it, and MLflow creates, logs to and reads back a
    run on it (in this process: what a sweep does with the URI after the config check)."""
    from mlflow.tracking import MlflowClient

    from tests.mlflow_server import PostgresUnavailable, postgres_database

    check_accepted("postgresql+psycopg2")
    try:
        db = postgres_database()
        admin_uri = db.__enter__()
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL not reachable: {e}")
    try:
        uri, _ = with_password(admin_uri, "postgresql+psycopg2")
        c = MlflowClient(uri)
        exp = c.create_experiment("psycopg2-experiment")
        run = c.create_run(exp, tags={"stage": "study"})
        c.log_metric(run.info.run_id, "test.concat.map_at_r.mean", 0.25)
        c.set_terminated(run.info.run_id)
        back = MlflowClient(admin_uri).get_run(run.info.run_id)
        assert back.data.metrics["test.concat.map_at_r.mean"] == 0.25 and back.info.status == "FINISHED"
    finally:
        db.__exit__(None, None, None)
