"""What ``dmlrc ui`` runs (its parser: :mod:`pipelines.ui_cli`): a sweep's MLflow UI.

For a store (``sqlite:///…``, ``postgresql://…``) it starts MLflow's own ``mlflow server`` as a child process, bound to
127.0.0.1 on a free port (or ``--port``), in a session of its own (a terminal's Ctrl-C reaches ``dmlrc`` only, which
then stops the server's process group by the server's pid), waits until it answers ``/health``, prints the link to the
experiment's studies view (:func:`pipelines.tracking.ui.experiment_url`) and opens it in a browser unless
``--no-browser``; it serves until Ctrl-C (or SIGTERM), which stops the server and exits 0.  For an ``http(s)://``
server it only prints (and opens) the link.

Everything it is told is checked first, each problem one ``config error:`` line: the config or URI, that a sqlite DB
exists (MLflow would create an empty one), that the experiment is in the store, that ``--port`` is free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import webbrowser
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mlflow import MlflowClient

from pipelines.config import ConfigError, check_tracking_uri
from pipelines.config.errors import did_you_mean
from pipelines.config.schema import load_config
from pipelines.config.uris import absolute_tracking_uri, redact_uri
from pipelines.execution.runtime.environment import check_tracking_reachable
from pipelines.tracking.server import answers, check_mlflow_server
from pipelines.tracking.ui import SHARED_VIEW_TAG_PREFIX, STUDIES_VIEW_KEY, experiment_url

__all__ = ["run_ui", "LOOPBACK"]

LOOPBACK = "127.0.0.1"
#: How long ``mlflow server`` may take to answer ``/health`` (seconds; it starts in about 6 s on a busy 2-core machine).
START_TIMEOUT_S = 180.0
#: How long the server's process group gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 20.0


# ------------------------------------------------------------------------------------------------------- checks


def _store(args) -> tuple[str, str, str | None]:
    """(tracking URI, the option it came from, experiment name or None), checked; nothing is created."""
    experiment = args.experiment
    if args.config is not None:
        if args.tracking_uri is not None:
            raise ConfigError("--tracking-uri", "give a sweep config or --tracking-uri, not both")
        cfg = load_config(args.config, name=args.name)
        return cfg.tracking_uri(), args.config, experiment or cfg.experiment_name()
    if args.name is not None:
        raise ConfigError("--name", "only with a sweep config (the sweep name it ran under)")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    where = "--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI"
    if not uri:
        raise ConfigError(
            "--tracking-uri",
            "required (or a sweep config, or $MLFLOW_TRACKING_URI): the MLflow store the sweep logged to, "
            "e.g. sqlite:///runs/NAME/mlflow.db",
        )
    return absolute_tracking_uri(check_tracking_uri(uri, where)), where, experiment


def _check_reachable(uri: str, where: str) -> None:
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        if not db.is_file():  # MLflow would create an empty store there and show nothing
            raise ConfigError(where, f"no sqlite DB at {str(db)!r} (a sweep writes runs/NAME/mlflow.db)")
    elif uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, where)
    else:
        try:
            check_tracking_reachable(uri)
        except ConfigError as e:  # it names the sweep config's field
            raise ConfigError(where, e.problem) from None


def _experiment_id(uri: str, where: str, experiment: str | None) -> tuple[str | None, list[tuple[str, str]]]:
    """The experiment to open (its id; ``None``: the UI's list of experiments) and every experiment to mention
    (name, id) when the store holds several and none was named."""
    client = MlflowClient(uri)
    try:
        found = client.search_experiments(max_results=1000)
    except Exception as e:  # not an MLflow store, a refused connection: one line
        raise ConfigError(where, f"cannot read experiments from {redact_uri(uri)} ({type(e).__name__})") from None
    names = {e.name: e.experiment_id for e in found}
    if experiment is not None:
        if experiment not in names:
            listed = ", ".join(sorted(names)) or "none"
            raise ConfigError(
                "--experiment",
                f"no experiment {experiment!r} in {redact_uri(uri)} (experiments: {listed})"
                f"{did_you_mean(experiment, names)}",
            )
        return names[experiment], []
    studies = [e for e in found if SHARED_VIEW_TAG_PREFIX + STUDIES_VIEW_KEY in (e.tags or {})]
    candidates = studies or [e for e in found if e.name != "Default"]
    if len(candidates) == 1:
        return candidates[0].experiment_id, []
    return None, sorted((e.name, e.experiment_id) for e in candidates)


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError("--port", f"{port} is not a port (1–65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as e:
            raise ConfigError(
                "--port", f"{LOOPBACK}:{port} cannot be used ({e.strerror or e}); leave --port out for a free one"
            ) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------- server


class _Server:
    """``mlflow server`` for one store on one loopback port, in its own session; its output goes to a temporary log
    (shown when it fails to start)."""

    def __init__(self, uri: str, port: int):
        self.uri, self.port = uri, port
        self.base = f"http://{LOOPBACK}:{port}"
        self.stopped = False
        self.log = tempfile.NamedTemporaryFile(prefix="dmlrc-ui-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", LOOPBACK, "--port", str(port)]
        cmd += ["--backend-store-uri", uri, "--workers", "1"]
        if uri.startswith("sqlite:///"):  # artifacts of experiments made in the UI beside the DB, not in the cwd
            cmd += ["--artifacts-destination", str(Path(uri[len("sqlite:///") :]).parent / "mlartifacts")]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the terminal reaches dmlrc only; dmlrc stops the group
            # a viewer submits no jobs: no background job runner processes
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )

    def log_tail(self) -> str:
        try:
            lines = [line for line in Path(self.log.name).read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return redact_uri(lines[-1].strip()) if lines else ""

    def waitanswers(self, timeout: float) -> str | None:
        """``None`` once it answers ``/health``; else why not (its exit, or the time-out)."""
        deadline = time.monotonic() + timeout
        while not answers(self.base):
            code = self.proc.poll()
            if code is not None:
                return f"mlflow server exited with status {code}: {self.log_tail()}"
            if time.monotonic() > deadline:
                return f"mlflow server did not answer {self.base}/health within {timeout:.0f} s: {self.log_tail()}"
            time.sleep(0.3)
        return None

    def stop(self) -> None:
        """SIGTERM to the server's process group (the server and the uvicorn worker it started), by the server's pid;
        SIGKILL if it has not stopped in :data:`STOP_TIMEOUT_S`."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # a worker still exiting after its server
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def _port_taken(reason: str) -> bool:
    return "address already in use" in reason.lower() or "errno 98" in reason.lower()


def _start(uri: str, where: str, port: int | None) -> _Server:
    """The server, answering; a free port taken between its choice and the server's bind is chosen again."""
    for _ in range(3):
        server = _Server(uri, port or _free_port())
        try:
            problem = server.waitanswers(START_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        if problem is None:
            return server
        server.stop()
        if port is not None or not _port_taken(problem):
            break
    raise ConfigError(where, f"cannot serve {redact_uri(uri)}: {problem}")


def _can_open_browser() -> bool:
    """A graphical browser is there to open: a desktop session (or the user's own ``$BROWSER``).  On a headless
    machine ``webbrowser`` would run a text browser in this terminal instead."""
    if os.environ.get("BROWSER"):
        return True
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _open(link: str, no_browser: bool) -> None:
    if no_browser:
        return
    if not (_can_open_browser() and webbrowser.open(link, new=2)):
        print("(no browser to open here: open the link above yourself)", flush=True)


def _without_credentials(uri: str) -> str:
    """A server URI without ``user:password@``: links are printed and opened without it (the browser asks)."""
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _links(base: str, experiment_id: str | None, others: list[tuple[str, str]]) -> str:
    """Print the link(s); return the one to open."""
    if experiment_id is not None:
        link = experiment_url(base, experiment_id)
        print(f"  {link}", flush=True)
        return link
    for name, eid in others:
        print(f"  {name}: {experiment_url(base, eid)}", flush=True)
    link = f"{base.rstrip('/')}/#/experiments"
    if not others:
        print(f"  {link}  (no experiment in the store yet)", flush=True)
    return link


def run_ui(args) -> int:
    uri, where, experiment = _store(args)
    if args.port is not None:
        if uri.startswith(("http://", "https://")):
            raise ConfigError("--port", f"only for a store dmlrc serves: {redact_uri(uri)} is a server already")
        _check_port(args.port)
    _check_reachable(uri, where)
    experiment_id, others = _experiment_id(uri, where, experiment)
    if uri.startswith(("http://", "https://")):
        print(f"MLflow server {redact_uri(uri)}:", flush=True)
        _open(_links(_without_credentials(uri), experiment_id, others), args.no_browser)
        return 0
    server = _start(uri, where, args.port)
    try:
        print(
            f"MLflow UI of {redact_uri(uri)} on {server.base} (mlflow server, pid {server.proc.pid}); Ctrl-C stops it",
            flush=True,
        )
        _open(_links(server.base, experiment_id, others), args.no_browser)
        code = server.proc.wait()
        print(f"mlflow server exited with status {code}: {server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (pipelines.cli's handlers): the way to end this command
        server.stop()
        print("MLflow UI stopped", flush=True)
        return 0
    finally:
        server.stop()
