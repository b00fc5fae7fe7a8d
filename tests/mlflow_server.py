"""A real ``mlflow server`` for tests, on a free loopback port.

    from tests.mlflow_server import mlflow_server, postgres_database
    with mlflow_server(tmp_path) as uri:                        # sqlite backend in tmp_path
        ...
    with postgres_database() as pg_uri, mlflow_server(tmp_path, backend_uri=pg_uri) as uri:
        ...
    with mlflow_server(tmp_path, backend_uri=pg_uri, artifacts_destination="s3://bucket/mlflow",
                       env={"MLFLOW_S3_ENDPOINT_URL": ..., "AWS_ACCESS_KEY_ID": ..., ...}) as uri:   # artifacts in S3

The server runs in its own session (process group) and is stopped by that process id — never by name.
Artifacts are proxied by the server (``--artifacts-destination`` inside ``tmp_path``), as in a shared deployment.
``postgres_database()`` yields a ``postgresql+psycopg2://`` URI of a fresh database on the PostgreSQL at 127.0.0.1:5432
(``$DMLRC_TEST_PG`` overrides the admin URI) and drops it afterwards; it raises :class:`PostgresUnavailable` when none
is reachable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipelines.tracking.server import answers
from tests.ports import PortInUse, bind_failure, free_port, start_on_free_ports

__all__ = [
    "mlflow_server",
    "mlflow_server_process",
    "MlflowServer",
    "postgres_database",
    "PostgresUnavailable",
    "free_port",
]

PG_ADMIN_URI = os.environ.get("DMLRC_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


class PostgresUnavailable(RuntimeError):
    pass


class MlflowServer:
    """One ``mlflow server`` process (its own process group) on a fixed loopback port: it can be killed and started
    again on the same port, with the same backend and artifact store, as an operator restarts a crashed server."""

    def __init__(self, workdir: Path, backend: str, artifacts: str, env: dict[str, str] | None, port: int):
        self.workdir, self.backend, self.artifacts, self.env = workdir, backend, artifacts, env or {}
        self.uri = f"http://127.0.0.1:{port}"
        self.port = port
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 180.0) -> None:
        """Start the server and wait until it answers ``/health``; :class:`tests.ports.PortInUse` (the server stopped)
        when another process holds its port."""
        log_path = self.workdir / "mlflow-server.log"
        self._log = open(log_path, "ab")
        log_start = self._log.tell()  # this start's part of the log (a restart appends)
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--backend-store-uri",
            self.backend,
            "--artifacts-destination",
            self.artifacts,
            "--workers",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # no background job runner (8 huey consumer processes): no job is submitted
            env={**os.environ, **self.env, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        deadline = time.time() + timeout
        while not answers(self.uri):
            exited = self.proc.poll() is not None
            with open(log_path, "rb") as f:
                f.seek(log_start)
                text = f.read().decode(errors="replace")
            failure = bind_failure(text)
            if failure:  # its port was taken between the choice and the bind: not our server's to answer
                self.stop()
                raise PortInUse(f"mlflow server on {self.uri}: {failure}")
            if exited:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"mlflow server exited with {code}: " + text[-3000:])
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server on {self.uri} not healthy after {timeout:.0f}s: " + text[-3000:])
            time.sleep(0.5)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the server's process group (the server and the uvicorn workers it started) and reap it;
        ``SIGKILL`` is a crash."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        self._log.close()
        self.proc = None


@contextlib.contextmanager
def mlflow_server_process(
    workdir: str | os.PathLike,
    backend_uri: str | None = None,
    timeout: float = 180.0,
    *,
    artifacts_destination: str | None = None,
    env: dict[str, str] | None = None,
):
    """:func:`mlflow_server`, yielding the :class:`MlflowServer` (to kill and restart it) instead of its URI."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    backend = backend_uri or f"sqlite:///{workdir / 'mlflow-server.db'}"
    artifacts = artifacts_destination or str(workdir / "mlflow-artifacts")

    def start() -> MlflowServer:
        server = MlflowServer(workdir, backend, artifacts, env, free_port())
        server.start(timeout)
        return server

    server = start_on_free_ports(start, "mlflow server")
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def mlflow_server(
    workdir: str | os.PathLike,
    backend_uri: str | None = None,
    timeout: float = 180.0,
    *,
    artifacts_destination: str | None = None,
    env: dict[str, str] | None = None,
):
    """Start ``mlflow server`` (sqlite in ``workdir`` unless ``backend_uri``); yield its ``http://127.0.0.1:<port>``.

    ``artifacts_destination`` (default: a folder in ``workdir``) may be an ``s3://`` URI; ``env`` is added to the
    server's environment (e.g. ``MLFLOW_S3_ENDPOINT_URL`` and the S3 keys for such a destination)."""
    with mlflow_server_process(
        workdir, backend_uri, timeout, artifacts_destination=artifacts_destination, env=env
    ) as server:
        yield server.uri


@contextlib.contextmanager
def postgres_database(admin_uri: str = PG_ADMIN_URI):
    """A fresh database (``dmlrc_test_<random>``) on a reachable PostgreSQL; dropped on exit."""
    try:
        import psycopg2
    except ImportError as e:  # the dev extra installs psycopg2-binary
        raise PostgresUnavailable(f"psycopg2 not installed: {e}") from None
    try:
        admin = psycopg2.connect(admin_uri, connect_timeout=5)
    except psycopg2.OperationalError as e:
        raise PostgresUnavailable(f"no PostgreSQL at {admin_uri}: {str(e).strip()}") from None
    admin.autocommit = True
    name = f"dmlrc_test_{uuid.uuid4().hex[:12]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    # SQLAlchemy >= 2.1 maps plain postgresql:// to psycopg 3; the dev extra installs psycopg2.
    base = admin_uri.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with admin.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()
