"""Joining a Ray cluster: a cluster that refuses the driver's authentication, a cluster that is not there, Ray Client
addresses, and a second Ray instance on the same machine.

The slow tests start one real Ray head with token authentication (``RAY_AUTH_MODE=token``, a token of its own, a
private ``HOME`` so that no ``~/.ray/auth_token`` of the machine takes part), on free ports, stopped by its process
id (``tests/cluster.py``).  It is also the "other Ray instance" of the placement-group-cleaner test.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster import ROOT, _start_node, _stop_node, cluster_sweep_config
from tests.mlflow_server import free_port


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This checkout on the path, a private HOME, no Ray or AWS settings of the machine (no token, no address)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_")) and k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


@pytest.fixture(scope="module")
def token_head():
    """A Ray head that requires a token: yields (GCS address, token)."""
    home = Path(tempfile.mkdtemp(prefix="dmlrc-auth-home-"))
    logs = home / "logs"
    logs.mkdir()
    token = secrets.token_hex(16)
    env = _clean_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    args = ["--head", "--port", str(free_port()), "--num-cpus", "0", "--num-gpus", "0", "--include-dashboard", "false"]
    node = _start_node(0, [*args, "--object-store-memory", str(80 * 2**20)], env, logs)
    try:
        deadline = time.monotonic() + 120
        address = ""
        while not address:  # the head prints the address workers join: `ray start --address='<ip>:<port>'`
            text = node.log_path.read_text(errors="replace")
            for line in text.splitlines():
                if "ray start --address=" in line:
                    address = line.split("--address=", 1)[1].strip().strip("'\"")
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray head with token auth did not start: {text[-3000:]}")
            time.sleep(0.5)
        yield address, token
    finally:
        _stop_node(node)


def _sweep(tmp_path: Path, address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cfg = cluster_sweep_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "runs"), name="auth")
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", address],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_driver_without_the_token_is_told_the_cluster_refused_it(token_head, tmp_path):
    """The cluster answers and refuses: one line that says so and what to set, not "no Ray cluster answers"."""
    address, token = token_head
    t0 = time.monotonic()
    out = _sweep(tmp_path, address, _clean_env(tmp_path))
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(
        f"config error: --address: the Ray cluster at {address} refused this driver: it requires token authentication"
    ), out.stderr
    assert "set RAY_AUTH_MODE=token and the cluster's token: RAY_AUTH_TOKEN_PATH=<full path" in lines[-1]
    assert "no Ray cluster answers" not in out.stderr and "Traceback" not in out.stderr
    assert "InvalidAuthToken" not in "\n".join(lines[:-1]), out.stderr  # no native retry warnings before it
    assert token not in out.stdout + out.stderr
    assert elapsed < 120, elapsed  # at once, not after Ray's minutes of retries

    # token mode on, the wrong token: the same line, without the RAY_AUTH_MODE advice
    out = _sweep(tmp_path, address, _clean_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32))
    assert out.returncode == 2, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "refused this driver: it requires token authentication" in last and "set RAY_AUTH_MODE" not in last, last
    assert token not in out.stdout + out.stderr


@pytest.mark.slow
def test_no_cluster_at_the_address_keeps_its_message(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = _sweep(tmp_path, address, _clean_env(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: --address: no Ray cluster answers at {address} ("), out.stderr
    assert "Traceback" not in out.stderr and "token" not in last


_CLEANER = textwrap.dedent(
    """
    import time
    import ray
    from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
    from ray.util.placement_group import placement_group, placement_group_table
    from pipelines.execution.runtime.session import init_ray, stop_ray

    started = init_ray(None, num_cpus=2)
    try:
        @ray.remote(num_cpus=0)
        class Controller:
            def actor_id(self):
                return ray.get_runtime_context().get_actor_id()

        controller = Controller.remote()
        pg = placement_group([{"CPU": 1}])
        ray.get(pg.ready())
        # what Ray Train's PlacementGroupCleanerCallback does for every Train run
        cleaner = ray.remote(num_cpus=0)(PlacementGroupCleaner).options(lifetime="detached").remote(
            controller_actor_id=ray.get(controller.actor_id.remote()),
            check_interval_s=0.5,
            get_actor_timeout_s=2,
            stop_timeout=5,
        )
        ray.get(cleaner.register_placement_group.remote(pg))
        ray.get(cleaner.start_monitoring.remote())
        time.sleep(8)
        print("PG_STATE", placement_group_table(pg)["state"], flush=True)
    finally:
        stop_ray(started)
    """
)


@pytest.mark.slow
def test_train_placement_group_cleaner_is_quiet_beside_another_ray(token_head, tmp_path):
    """With a second Ray instance on the machine (the token head), Ray Train's placement-group cleaner in a sweep's
    own Ray asks its own cluster: no ``Found multiple active Ray instances`` traceback in the driver's output, and
    the run's placement group is left alone."""
    out = subprocess.run(
        [sys.executable, "-c", _CLEANER],
        cwd=tmp_path,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "PG_STATE CREATED" in out.stdout, text
    assert "multiple active Ray instances" not in text and "Traceback" not in text, text


def test_ray_client_addresses_are_accepted():
    """``ray://`` (Ray Client) is offered in the help texts and infra/reeval/reeval.yaml: its extra is installed."""
    from ray._private.utils import get_ray_client_dependency_error

    from pipelines.config.uris import check_ray_address

    assert get_ray_client_dependency_error() is None
    assert check_ray_address("ray://head-svc:10001", "--address") == "ray://head-svc:10001"


@pytest.mark.slow  # starts a local Ray (twice): not for `make test-fast`
@pytest.mark.parametrize("token_before", [None, 0o644], ids=["new token", "a token readable by all"])
def test_a_local_ray_keeps_its_token_readable_by_this_user_only(tmp_path, token_before):
    """Ray writes a new local cluster's token to ~/.ray/auth_token with the umask (commonly 0644): anyone on the
    machine could read it and run code in this user's Ray.  The sweep's local Ray leaves it owner-only."""
    home = tmp_path / "home"
    home.mkdir()
    token = home / ".ray" / "auth_token"
    if token_before is not None:
        token.parent.mkdir(mode=0o755)
        token.write_text(secrets.token_hex(16))
        token.chmod(token_before)
    code = "from pipelines.execution.runtime.session import init_ray, stop_ray; stop_ray(init_ray(None, num_cpus=1))"
    env = _clean_env(home)
    env.pop("RAY_AUTH_MODE", None)  # Ray's default: token authentication for a new local cluster
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, umask=0o022
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert token.is_file(), "the local Ray wrote no token (token authentication off?)"
    assert token.stat().st_mode & 0o777 == 0o600
    if token_before is None:
        assert token.parent.stat().st_mode & 0o777 == 0o700
