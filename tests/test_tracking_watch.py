"""pipelines.tracking.outage: MLflow retries that outlast the outage timeout, and the watch that measures an outage.

The retry arithmetic is checked against urllib3's own ``Retry`` (what MLflow's HTTP session uses), not against our
formula; the watch probes a real HTTP server on a loopback port that is stopped mid-test.  The whole fault (an
``mlflow server`` killed mid-sweep on a cluster, then ``--resume``) is ``tests/test_faults.py``.
"""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest
from urllib3.util.retry import Retry

from pipelines.config.presets import demo_config
from pipelines.config.schema import ConfigError, parse_config
from pipelines.tracking.outage import TrackingWatch, apply_retry_env, mlflow_retry_env


def _urllib3_sleeps(max_retries: int, factor: int) -> float:
    """Total back-off urllib3 sleeps before giving up on a refused connection, retry by retry."""
    retry, total = Retry(total=max_retries, connect=max_retries, backoff_factor=factor), 0.0
    for _ in range(max_retries):
        retry = retry.increment(method="GET", url="/", error=ConnectionRefusedError())
        total += retry.get_backoff_time()
    return total


@pytest.mark.parametrize("timeout_s", [10, 60, 300, 500, 900])
def test_mlflow_retries_outlast_the_outage_timeout(timeout_s):
    env = mlflow_retry_env(timeout_s)
    retries, factor = int(env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]), int(env["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"])
    assert retries <= 10 and 1 <= factor <= 120  # MLflow's own limits on both
    assert _urllib3_sleeps(retries, factor) >= timeout_s + 60


def test_retry_env_keeps_what_the_user_set_and_is_undone(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", raising=False)
    undo: list = []
    workers = apply_retry_env(300, undo)
    assert workers == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    for fn in undo:
        fn()
    assert "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


def test_the_watch_counts_an_outage_from_its_first_failed_probe_and_forgets_it_when_the_server_is_back():
    from tests.ports import free_port

    # below the ephemeral range: the watch's own probes during the outage cannot take the port it is bound again on
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    watch = TrackingWatch(f"http://user:secret@127.0.0.1:{port}", outage_timeout_s=2.0, interval_s=0.2).start()
    try:
        time.sleep(0.6)
        assert watch.down_for() == 0 and not watch.expired()
        server.shutdown()
        server.server_close()
        deadline = time.monotonic() + 10
        while not watch.expired():
            assert time.monotonic() < deadline, watch.down_for()
            time.sleep(0.1)
        assert watch.down_for() >= 2.0
        # the same port answers again: the outage is over
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        deadline = time.monotonic() + 10
        while watch.down_for() > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        watch.stop()
        server.shutdown()
        server.server_close()


def test_a_sqlite_store_has_nothing_to_watch(tmp_path):
    watch = TrackingWatch(f"sqlite:///{tmp_path / 'mlflow.db'}", 10).start()
    assert watch.target is None and not watch.expired()


@pytest.mark.parametrize("value", [5, 901, "soon"])
def test_outage_timeout_out_of_bounds_is_a_config_error(tmp_path, value):
    doc = demo_config("watch", str(tmp_path))
    doc["tracking"] = {**doc.get("tracking", {}), "outage_timeout_s": value}
    with pytest.raises(ConfigError) as info:
        parse_config(doc, source="test")
    assert info.value.field == "tracking.outage_timeout_s"
