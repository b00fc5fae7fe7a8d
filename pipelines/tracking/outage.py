"""What a sweep does while its MLflow tracking server is down: ride out a short outage, stop cleanly on a long one.

A sweep runs for days; its MLflow server may restart (an upgrade, a crashed pod) or die.  Three parts:

* **MLflow's own HTTP retries** carry every process through a short outage (:func:`mlflow_retry_env`): the driver,
  the trial drivers and the folds get ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``…_BACKOFF_FACTOR`` set so that their
  back-off outlasts ``tracking.outage_timeout_s`` by a margin.  A trial therefore never errors out (and is never
  lost, as an errored trial is not rerun by ``--resume``) on an outage the sweep either survives or stops on; a fold
  waits in its logging call and trains on when the server is back.  A value the user set in the environment wins.
* **A watch on the driver** (:class:`TrackingWatch`) asks the server's ``/health`` (a PostgreSQL store: a TCP
  connect) every few seconds.  Unreachable for ``tracking.outage_timeout_s`` in a row, the sweep stops as on Ctrl-C
  (:meth:`pipelines.execution.studies.sweep_studies.SweepStudies.run_all`): Tune's experiment state and the folds'
  checkpoints stay in the sweep's storage, Ray is shut down, and the CLI prints one line (``tracking error: …``, exit
  status 3) with the resume command.  The runs it could not close stay RUNNING, which is what ``--resume`` reuses.
* **``--resume``** then completes the logging: unfinished trials rerun under their trial ids, folds with a stored
  result are not trained again, and every fold run gets the evaluations it misses
  (``pipelines.tracking.evaluations.logged_evaluations`` says which it holds) from its checkpoint
  (``pipelines.execution.folds.fold.run_fold``) or its stored result
  (``pipelines.execution.folds.trial._finish_fold_run``).

A sqlite store is a local file: it has no outage to watch.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from pipelines.tracking.server import health_url

__all__ = ["TrackingUnavailable", "TrackingWatch", "mlflow_retry_env", "apply_retry_env", "MLFLOW_RETRY_KEYS"]

MLFLOW_RETRY_KEYS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")

#: MLflow caps its retries at 10 (``_MLFLOW_HTTP_REQUEST_MAX_RETRIES_LIMIT``); urllib3 caps one back-off at 120 s
#: (``Retry.DEFAULT_BACKOFF_MAX``) and sleeps nothing before the first retry.
_MAX_RETRIES = 10
_BACKOFF_MAX_S = 120.0
#: How much longer than the outage timeout a process keeps retrying: the watch stops the sweep first.  (The
#: config's bound on ``tracking.outage_timeout_s``, 900 s, leaves it inside the longest back-off, 9 × 120 s.)
_MARGIN_S = 60.0


def _backoff_total(factor: int, retries: int = _MAX_RETRIES) -> float:
    """Seconds urllib3 sleeps over ``retries`` failed attempts: 0, then factor·2^(n−1) for the n-th, each ≤ 120 s."""
    return sum(min(factor * 2 ** (n - 1), _BACKOFF_MAX_S) for n in range(2, retries + 1))


def mlflow_retry_env(outage_timeout_s: float) -> dict[str, str]:
    """MLflow HTTP retry settings whose back-off lasts at least ``outage_timeout_s`` + 60 s: the smallest integer
    back-off factor (MLflow reads it as an int) with MLflow's maximum of 10 retries."""
    factor = 1
    while _backoff_total(factor) < outage_timeout_s + _MARGIN_S and factor < _BACKOFF_MAX_S:
        factor += 1
    return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(_MAX_RETRIES), "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(factor)}


class TrackingUnavailable(Exception):
    """The tracking server stayed unreachable for ``tracking.outage_timeout_s``; the sweep stopped (not a bug: the
    CLI prints the message as one line)."""


def _probe_target(uri: str) -> tuple[str, str | tuple[str, int]] | None:
    """``("http", health URL)``, ``("tcp", (host, port))`` for a PostgreSQL store, or None (sqlite: nothing to
    watch)."""
    if uri.startswith(("http://", "https://")):
        return "http", health_url(uri)
    if uri.startswith("postgresql"):
        parts = urlsplit(uri)
        return "tcp", (parts.hostname or "127.0.0.1", parts.port or 5432)
    return None


class TrackingWatch:
    """A daemon thread that probes the tracking store every ``interval_s`` and knows for how long it has been
    unreachable (:meth:`down_for`).  Probes carry no credentials (``health_url`` strips them)."""

    def __init__(self, uri: str, outage_timeout_s: float, interval_s: float | None = None):
        self.target = _probe_target(uri)
        self.timeout_s = float(outage_timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(10.0, max(1.0, self.timeout_s / 10))
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TrackingWatch":
        if self.target is not None:
            self._thread = threading.Thread(target=self._loop, name="tracking-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def down_for(self) -> float:
        """Seconds since the first of the failed probes in a row (0 while the store answers): an outage is noticed
        at most ``interval_s`` (≤ 10 s) after it began."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def expired(self) -> bool:
        return self.down_for() >= self.timeout_s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            ok = self.probe()
            with self._lock:
                if ok:
                    self._down_since = None
                elif self._down_since is None:
                    # counted from the first failed probe: the sweep never stops on an outage shorter than the timeout
                    self._down_since = time.monotonic()

    def probe(self) -> bool:
        """One probe, at most ~5 s: does the tracking store answer?  (A sqlite store has nothing to probe: yes.)"""
        if self.target is None:
            return True
        _, where = self.target
        try:
            if isinstance(where, str):  # ("http", health URL); else ("tcp", (host, port))
                with urllib.request.urlopen(where, timeout=5) as r:
                    r.read()
            else:
                socket.create_connection(where, timeout=5).close()
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False


def apply_retry_env(outage_timeout_s: float, undo: list) -> dict[str, str]:
    """Set :func:`mlflow_retry_env` in this process (names the user has set are kept) and return what the Ray
    workers must get (the values in force here).  ``undo`` receives the callables that restore the environment."""
    for key, value in mlflow_retry_env(outage_timeout_s).items():
        if key not in os.environ:
            os.environ[key] = value
            undo.append(lambda key=key: os.environ.pop(key, None))
    return {k: os.environ[k] for k in MLFLOW_RETRY_KEYS}
