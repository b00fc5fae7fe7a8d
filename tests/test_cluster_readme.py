"""README.md's "Running on a cluster" steps, run as printed.

The README marks each step's code block with ``<!-- cluster-steps: NAME -->``: ``settings`` (the lines every
terminal starts with), ``head``, ``worker``, ``driver`` and ``stop``.  The slow test runs them in bash on this
machine, each step in a fresh shell after the settings (as a user's separate terminals would), with only the
documented variables set beforehand: ``CLUSTER_DIR`` (a short private folder), ``HEAD_PORT`` and ``CLIENT_PORT``
(free ports, tests/ports.py).  Before the cluster it starts another Ray of the same user (its own ``--temp-dir``,
its own ports), which the README's stop must leave running while every process of the cluster's two nodes ends.
Between the steps it waits as a user would (``Ray runtime started.`` in a node's log, two ``Active`` nodes in
``ray status``), and it checks the token forms that the README and the driver's refusal advise.  Whatever still
runs at the end is stopped by its process id.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster import ROOT, cluster_sweep_config, vendored_psutil
from tests.ports import free_ports

README = ROOT / "README.md"
STEPS = ("settings", "head", "worker", "driver", "stop")
#: The variables the settings block reads from the environment (``NAME=${NAME:-default}``).
SETTINGS = ("CLUSTER_DIR", "HEAD_IP", "HEAD_PORT", "CLIENT_PORT", "NODE")
_BLOCK = re.compile(r"<!-- cluster-steps: (\w+) -->\n```bash\n(.*?)```", re.S)
_STARTED = "Ray runtime started."

#: What a driver does to join (``dmlrc sweep --address``): the preflight that refuses in one line, then ``ray.init``.
_JOIN = """
import sys
import ray
from pipelines.config import ConfigError
from pipelines.execution.runtime.session import check_cluster_answers
try:
    check_cluster_answers(sys.argv[1], "--address")
except ConfigError as e:
    print("REFUSED", e)
    raise SystemExit(2)
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("NODES", sum(n["Alive"] for n in ray.nodes()))
"""


def readme_steps(text: str) -> dict[str, str]:
    """The marked blocks of README.md, by step name, in the README's order."""
    return dict(_BLOCK.findall(text))


def active_nodes(status: str) -> int:
    """The number of nodes ``ray status`` lists as active."""
    block = status.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in status else ""
    return len(re.findall(r"^\s*\d+ node_[0-9a-f]+", block, re.M))


def test_readme_has_every_cluster_step_with_documented_inputs():
    steps = readme_steps(README.read_text())
    assert tuple(steps) == STEPS, list(steps)
    for name in SETTINGS:
        assert re.search(rf"^{name}=\$\{{{name}:-", steps["settings"], re.M), name
    assert "export RAY_AUTH_MODE=token" in steps["settings"]
    assert "export RAY_AUTH_TOKEN_PATH=" in steps["settings"]
    assert "ray stop" not in "".join(steps.values())  # it stops every Ray of the user on the machine


def test_the_refusal_advises_what_the_readme_does():
    """The driver's refusal names each way the README gives the token, the file by its path, not its content."""
    from pipelines.execution.runtime.session import _auth_problem

    line = _auth_problem("10.0.0.1:6379", "Token authentication is enabled but no authentication token was found")
    assert "set RAY_AUTH_MODE=token and the cluster's token: RAY_AUTH_TOKEN_PATH=<full path of a file" in line
    assert "RAY_AUTH_TOKEN=<the token>" in line and "~/.ray/auth_token" in line
    section = README.read_text().split("## Running on a cluster", 1)[1].split("\n## ", 1)[0]
    assert "RAY_AUTH_TOKEN_PATH=" in section and "RAY_AUTH_TOKEN=<the token>" in section
    assert "~/.ray/auth_token" in section


def test_a_token_set_as_the_token_path_is_not_printed(monkeypatch):
    """Ray's reason quotes RAY_AUTH_TOKEN_PATH's value when no file is there: set to the token by mistake, the
    refusal must not print it."""
    from pipelines.execution.runtime.session import _auth_problem

    token = "5f" * 32
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", token)
    line = _auth_problem("10.0.0.1:6379", f"RAY_AUTH_TOKEN_PATH is set but file cannot be opened or is empty: {token}")
    assert token not in line, line
    assert "cannot be opened or is empty: $RAY_AUTH_TOKEN_PATH" in line, line


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This checkout and its venv's commands first, a private HOME, no Ray/AWS/MLflow settings of the machine."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "AWS_")) and k not in ("MLFLOW_TRACKING_URI", *SETTINGS)
    }
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # COLUMNS as a terminal of 80 columns sets it: `ps` then cuts a command line at 80 characters unless told not to
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", COLUMNS="80", **extra)
    return env


def _bash(script: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _wait_started(log: Path, pid_of, timeout: float = 180) -> None:
    """Until ``log`` says the node started; fails at once when its ``ray start`` process is gone."""
    psutil = vendored_psutil()
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        if _STARTED in text:
            return
        pid = pid_of()
        if (pid and not psutil.pid_exists(pid)) or time.monotonic() > deadline:
            raise AssertionError(f"{log.name}: the node did not start:\n{text[-3000:]}")
        time.sleep(1)


def _tree(pid: int) -> list:
    """psutil processes of ``pid`` and everything below it (empty when it is gone)."""
    psutil = vendored_psutil()
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _running(procs: list) -> list:
    psutil = vendored_psutil()
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # is_running: the same process, not a reuse
                alive.append(p)
    return alive


def _mentioning(folder: str) -> list:
    """Processes whose command line names a path below ``folder`` (a node's ``--temp-dir``, which Ray passes on to
    the node's processes)."""
    psutil = vendored_psutil()
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(folder + "/" in arg for arg in p.info["cmdline"] or ()):
                found.append(p)
    return found


def _kill(procs: list, grace: float = 15.0) -> None:
    """SIGTERM the first (a ``ray start --block``: it stops its node), then SIGKILL whatever of ``procs`` is left.
    psutil signals a process only while it is the one recorded (not a reused pid)."""
    if not procs:
        return
    with contextlib.suppress(Exception):
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=grace)
    for p in _running(procs):
        with contextlib.suppress(Exception):
            p.kill()


def _join(address: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _JOIN, address], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_readme_cluster_steps_on_one_machine(tmp_path):
    steps = readme_steps(README.read_text())
    assert tuple(steps) == STEPS, list(steps)
    home = tmp_path / "home"
    home.mkdir()
    # Ray's unix sockets live under a node's --temp-dir (paths < 108 bytes): short private folders, not tmp_path
    cluster_dir = tempfile.mkdtemp(prefix="dmlrc-rc-")
    other_dir = tempfile.mkdtemp(prefix="dmlrc-ro-")
    head_port, client_port, other_port, other_client_port = free_ports(4)
    env = _env(home, CLUSTER_DIR=cluster_dir, HEAD_PORT=str(head_port), CLIENT_PORT=str(client_port))
    pid_files = {"head": Path(cluster_dir) / "head.pid", "worker": Path(cluster_dir) / "worker1.pid"}
    cluster: list = []  # every process of the cluster seen so far, for the cleanup
    roots: list = []  # the nodes' `ray start --block` processes
    other_log = tmp_path / "other-ray.log"
    other = None

    def pid_in(path: Path) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        return 0

    def step(name: str, timeout: float = 120, extra: str = "") -> subprocess.CompletedProcess:
        return _bash(steps["settings"] + steps[name] + extra, env, tmp_path, timeout)

    try:
        # another Ray of the same user on this machine, not part of the cluster
        with open(other_log, "wb") as log:
            other = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("ray")),
                    "start",
                    "--head",
                    "--block",
                    "--temp-dir",
                    other_dir,
                    "--port",
                    str(other_port),
                    "--ray-client-server-port",
                    str(other_client_port),
                    "--num-cpus",
                    "1",
                    "--include-dashboard",
                    "false",
                ],
                env=_env(home, RAY_AUTH_MODE="disabled"),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_started(other_log, lambda: other.pid)
        other_address = re.search(r"ray start --address='([^']+)'", other_log.read_text()).group(1)
        other_procs = _tree(other.pid)

        out = step("head")
        assert out.returncode == 0, out.stdout + out.stderr
        _wait_started(Path(cluster_dir) / "head.log", lambda: pid_in(pid_files["head"]))
        cluster += _tree(pid_in(pid_files["head"]))
        roots += cluster[:1]
        token_file = Path(cluster_dir) / "token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", token)

        out = step("worker")
        assert out.returncode == 0, out.stdout + out.stderr
        _wait_started(Path(cluster_dir) / "worker1.log", lambda: pid_in(pid_files["worker"]))
        worker = _tree(pid_in(pid_files["worker"]))
        cluster += worker
        roots += worker[:1]

        # the driver's check (its first line): two active nodes once the worker has registered
        check = next(line for line in steps["driver"].splitlines() if line.startswith("ray status"))
        deadline = time.monotonic() + 120
        while True:
            out = _bash(steps["settings"] + check, env, tmp_path, 120)
            if out.returncode == 0 and active_nodes(out.stdout) == 2:
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(2)

        # the sweep, as printed: a tiny real sweep in my-sweep.yaml (one machine: local storage, sqlite tracking)
        cluster_sweep_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "runs"), name="my-sweep")
        out = step("driver", timeout=900)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        assert active_nodes(out.stdout) == 2, out.stdout[:3000]
        assert "sweep 'my-sweep' finished" in out.stdout, out.stdout[-4000:]
        assert token not in out.stdout + out.stderr

        # the token as the refusal advises it: no token is refused in one line that does not print it; the token
        # as a variable joins; the token put into RAY_AUTH_TOKEN_PATH by mistake is refused without printing it
        head_ip = _bash(steps["settings"] + 'echo "$HEAD_IP"', env, tmp_path, 30).stdout.strip()
        address = f"{head_ip}:{head_port}"
        out = _join(address, _env(home), tmp_path)
        assert out.returncode == 2 and "refused this driver: it requires token authentication" in out.stdout, (
            out.stdout + out.stderr
        )
        assert "set RAY_AUTH_MODE=token and the cluster's token: RAY_AUTH_TOKEN_PATH=<" in out.stdout
        out = _join(address, _env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token), tmp_path)
        assert out.returncode == 0 and "NODES 2" in out.stdout, out.stdout + out.stderr
        out = _join(address, _env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token), tmp_path)
        assert out.returncode == 2 and "refused this driver" in out.stdout, out.stdout + out.stderr
        assert token not in out.stdout + out.stderr

        # the stop: every process of the cluster's nodes ends, the other Ray keeps running
        for root in roots:
            cluster += _tree(root.pid)
        cluster += _mentioning(cluster_dir)
        names = {p.name() for p in _running(cluster)}
        assert {"raylet", "gcs_server"} <= names, names
        out = step("stop")
        assert not list(Path(cluster_dir).glob("*.pid")), out.stdout + out.stderr
        deadline = time.monotonic() + 240  # a hang guard: on a loaded 2-core machine Ray's processes took over 60 s
        while _running(cluster) or _mentioning(cluster_dir):
            left = [f"{p.pid} {p.name()}" for p in _running(cluster) + _mentioning(cluster_dir)]
            assert time.monotonic() < deadline, f"cluster processes still running after the stop: {left}"
            time.sleep(1)
        assert other.poll() is None, other_log.read_text()[-3000:]
        assert len(_running(other_procs)) == len(other_procs), other_log.read_text()[-3000:]
        status = subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "status", "--address", other_address],
            env=_env(home, RAY_AUTH_MODE="disabled"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0 and active_nodes(status.stdout) == 1, status.stdout + status.stderr
    finally:
        for root in roots:  # each node's own stop first, then whatever of the cluster is left
            with contextlib.suppress(Exception):
                _kill([root, *root.children(recursive=True)])
        for p in _running(cluster + _mentioning(cluster_dir)):
            with contextlib.suppress(Exception):
                p.kill()
        if other is not None:
            _kill(_tree(other.pid))
            with contextlib.suppress(subprocess.TimeoutExpired):
                other.wait(timeout=10)
        shutil.rmtree(cluster_dir, ignore_errors=True)
        shutil.rmtree(other_dir, ignore_errors=True)
