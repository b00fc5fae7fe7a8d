"""A real multi-node Ray cluster on one machine, for tests and benchmarks.

    from tests.cluster import local_cluster
    with local_cluster(tmp_path, workers=2, worker_cpus=2) as c:
        subprocess.run(["dmlrc", "sweep", cfg, "--address", c.address], env=c.driver_env())
        c.node_ids            # [head, worker 1, worker 2] — Ray node ids, index = node index
        c.kill_node(1)        # SIGKILL every process of worker node 1 (a lost pod)

:func:`cluster_sweep_config` writes the tiny sweep config these tests and ``bench/cluster_scale_bench.py`` run on it.

What it starts, each on free ports (tests/ports.py) and in its own folders:

* a head and ``workers`` worker nodes, each one ``ray start --block`` process in its own session
  (``--temp-dir`` of its own, ``--object-store-memory`` small).  Node ``i`` declares the custom resource
  ``{"node_<i>": 1}`` (``node_0`` = head) plus ``worker_resources`` (e.g. accelerator slots) on the workers;
  the head has ``head_cpus`` logical CPUs (default 0, so that folds and trial actors run on the workers);
* SeaweedFS S3 (``tests/s3_server.py``) with the bucket ``bucket`` — the sweep's shared ``storage: s3://...``;
* an ``mlflow server`` (``tests/mlflow_server.py``) on a fresh PostgreSQL database (127.0.0.1:5432, trust auth,
  dropped afterwards), its artifacts proxied into the same S3 bucket under ``mlflow/``.

The nodes get the S3 keys through their own environment (as a KubeRay pod gets a secret), never through Ray's
runtime_env.  Processes are stopped by their own ids: a node's ``ray start --block`` process gets SIGTERM (it stops
the node's Ray processes), then every process that was below it (raylet children — the workers — included) that
still lives gets SIGKILL.  ``ray stop`` is never used: it would end every Ray on the machine.

Ray 2.60 cannot keep such a cluster on the loopback interface: ``ray start --node-ip-address 127.0.0.1`` is
replaced by the machine's routable address, and the loopback switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``)
makes ``ray start --address`` refuse to start a worker node.  So the nodes listen on the machine's address, on
random ports, for the few minutes of a test; the dashboard (head only) stays on 127.0.0.1.  Token auth is off
(``RAY_AUTH_MODE=disabled``) for these throwaway clusters.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.ports import PortInUse, SlowStart, bind_failure, free_ports, start_on_free_ports

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
TRIAL_DRIVER_RESOURCE = (
    "dmlrc_trial_driver"  # pipelines.execution.runtime.environment.TRIAL_DRIVER_RESOURCE (no pipelines import here)
)

__all__ = ["LocalCluster", "local_cluster", "ClusterUnavailable", "vendored_psutil"]


class ClusterUnavailable(RuntimeError):
    """PostgreSQL (or another service the cluster needs) is not there: callers skip."""


def vendored_psutil():
    """psutil as Ray vendors it (not a dependency of this project): importing ``ray`` first puts Ray's
    ``thirdparty_files`` on ``sys.path``, in whatever order a test process imported things before."""
    import importlib

    import ray  # noqa: F401 - for its sys.path entry

    return importlib.import_module("psutil")


#: How often a node is started again (on fresh ports) when its start failed for a reason of the moment: another
#: process took one of its ports before it bound them, or, on a busy machine, its raylet did not register with the
#: GCS within the 30 s that ``ray start`` allows (hard-coded in ray/_private/node.py; no setting raises it).
_START_TRIES = 4

#: What ``ray start`` prints when the node's raylet did not register with the GCS in time.
_SLOW_START = "timed out during startup"


@dataclass
class Node:
    index: int
    resource: str  # its own custom resource, e.g. "node_1"
    proc: subprocess.Popen  # `ray start --block`, leader of its own session
    temp_dir: str
    log_path: Path
    node_id: str = ""
    args: list[str] = field(default_factory=list)  # its `ray start` arguments, for replace_node

    def pids(self) -> list[int]:
        """The ``ray start`` process and every process below it (GCS, raylet, agents, workers), children first."""
        psutil = vendored_psutil()

        try:
            root = psutil.Process(self.proc.pid)
            return [p.pid for p in reversed(root.children(recursive=True))] + [root.pid]
        except psutil.NoSuchProcess:
            return []

    def raylet_pid(self) -> int | None:
        psutil = vendored_psutil()

        for pid in self.pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).name() == "raylet":
                    return pid
        return None


@dataclass
class LocalCluster:
    address: str  # GCS address for `dmlrc sweep --address` / ray.init(address=...)
    nodes: list[Node]
    base_env: dict[str, str]
    s3_endpoint: str = ""
    s3_bucket: str = ""
    access_key: str = ""
    secret_key: str = ""
    tracking_uri: str = ""
    mlflow: Any = None  # the tests.mlflow_server.MlflowServer behind tracking_uri (kill, restart)
    workdir: Path = field(default_factory=Path)

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def driver_env(self, **extra: str) -> dict[str, str]:
        """Environment for a driver process (``dmlrc sweep --address``): this checkout first, the S3 endpoint and
        keys, no token auth."""
        return {**self.base_env, **extra}

    def storage(self, prefix: str) -> str:
        return f"s3://{self.s3_bucket}/{prefix}"

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Kill every process of node ``i`` (0 = head) by pid, as a lost pod would lose them; returns the pids."""
        pids = self.nodes[i].pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def replace_node(self, i: int, timeout: float = 120) -> str:
        """Start a fresh worker node in place of dead worker node ``i`` (same resources, a new node id), as a
        cluster's autoscaler or KubeRay replaces a lost pod; returns its node id once the GCS counts it alive."""
        old = self.nodes[i]
        assert i > 0 and old.proc.poll() is not None, "replace_node replaces a dead worker node"
        shutil.rmtree(old.temp_dir, ignore_errors=True)
        new = _start_node(i, old.args, self.base_env, self.workdir / "cluster-logs", suffix=".replaced")
        self.nodes[i] = new
        deadline = time.monotonic() + timeout
        restarts = 0
        while True:
            listed = [n for n in _ray_nodes(self.address, self.base_env, timeout) if n["Alive"]]
            ids = [n["NodeID"] for n in listed if new.resource in n["Resources"] and n["NodeID"] != old.node_id]
            if ids:
                new.node_id = ids[0]
                return new.node_id
            if new.proc.poll() is not None and restarts < _START_TRIES - 1 and _start_failure(new):
                restarts += 1
                _stop_node(new)  # it lost a port, or its raylet registered too late: again on fresh ports
                new = _start_node(i, old.args, self.base_env, self.workdir / "cluster-logs", f".replaced{restarts}")
                self.nodes[i] = new
                continue
            if new.proc.poll() is not None or time.monotonic() > deadline:
                text = new.log_path.read_text(errors="replace")
                raise RuntimeError(f"replacement node {i} did not join: {text[-2000:]}")
            time.sleep(1)

    def alive_node_ids(self, timeout: float = 60) -> list[str]:
        """The node ids the GCS counts alive now (asked from a short-lived driver process)."""
        return [n["NodeID"] for n in _ray_nodes(self.address, self.base_env, timeout) if n["Alive"]]


_NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("NODES=" + json.dumps([{"NodeID": n["NodeID"], "Alive": n["Alive"], "Resources": n.get("Resources", {})}
                             for n in ray.nodes()]))
"""


def _ray_nodes(address: str, env: dict[str, str], timeout: float) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", _NODES_SCRIPT, address], env=env, capture_output=True, text=True, timeout=timeout
    )
    for line in out.stdout.splitlines():
        if line.startswith("NODES="):
            return json.loads(line[len("NODES=") :])
    raise RuntimeError(f"could not list the nodes of {address}: {out.stdout[-2000:]}{out.stderr[-2000:]}")


def _start_node(index: int, args: list[str], env: dict[str, str], logs: Path, suffix: str = "") -> Node:
    """Start node ``index`` with ``args`` on freshly chosen ports (tests/ports.py: above Ray's worker ports
    10002–19999, which every node of the machine leaves to Ray, and below the ephemeral range); the head (``--head``
    in ``args``) also gets its GCS and dashboard ports here."""
    # Unix socket paths live under the temp dir and must stay < 108 bytes: a short private folder, not tmp_path.
    temp_dir = tempfile.mkdtemp(prefix=f"dmlrc-n{index}-")
    log_path = logs / f"node{index}{suffix}.log"
    resource = f"node_{index}"
    ports = iter(free_ports(8))
    own_ports = ["--port", str(next(ports)), "--dashboard-port", str(next(ports))] if "--head" in args else []
    cmd = [
        RAY,
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        "--temp-dir",
        temp_dir,
        "--node-manager-port",
        str(next(ports)),
        "--object-manager-port",
        str(next(ports)),
        "--runtime-env-agent-port",
        str(next(ports)),
        "--dashboard-agent-listen-port",
        str(next(ports)),
        "--dashboard-agent-grpc-port",
        str(next(ports)),
        "--metrics-export-port",
        str(next(ports)),
        *own_ports,
        *args,
    ]
    # Each node its own dataset cache, as each machine of a real cluster has its own disk (a replacement, a new one).
    env = {**env, "DMLRC_CACHE_DIR": str(logs.parent / f"node{index}{suffix}-cache")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Node(index=index, resource=resource, proc=proc, temp_dir=temp_dir, log_path=log_path, args=list(args))


def _lost_ports(node: Node) -> str:
    """The line saying that a node which stopped could not bind one of its ports (``ray start``'s output or the logs
    of its GCS, raylet and agents), or ``""``."""
    texts = [node.log_path]
    for pattern in ("*.out", "*.err", "*.log"):
        texts += sorted(Path(node.temp_dir).glob(f"session_*/logs/{pattern}"))
    for path in texts:
        with contextlib.suppress(OSError):
            failure = bind_failure(path.read_text(errors="replace"))
            if failure:
                return f"{path.name}: {failure}"
    return ""


def _slow_start(node: Node) -> str:
    """The line of ``ray start``'s output saying that Ray gave up waiting for the node's raylet, or ``""``."""
    with contextlib.suppress(OSError):
        for line in node.log_path.read_text(errors="replace").splitlines():
            if _SLOW_START in line:
                return f"{node.log_path.name}: {line.strip()}"
    return ""


def _start_failure(node: Node) -> str:
    """Why a node that stopped is worth starting again: it lost one of its ports, or Ray gave up waiting for its
    raylet on a busy machine; ``""`` for any other failure, which is not retried."""
    return _lost_ports(node) or _slow_start(node)


def _start_head(args: list[str], env: dict[str, str], logs: Path, timeout: float) -> tuple[Node, str]:
    """The head node and the address it prints for workers (``ray start --address='<ip>:<port>'``); a head that
    stopped because another process took one of its ports raises :class:`PortInUse`, one whose raylet registered
    too late :class:`SlowStart` (and is cleaned up)."""
    attempt = len(list(logs.glob("node0*.log")))
    node = _start_node(0, args, env, logs, suffix=f".retry{attempt}" if attempt else "")
    deadline = time.monotonic() + timeout
    try:
        while True:
            text = node.log_path.read_text(errors="replace")
            for line in text.splitlines():
                if "ray start --address=" in line:
                    return node, line.split("--address=", 1)[1].strip().strip("'\"")
            if node.proc.poll() is not None:
                failure = _lost_ports(node)
                if failure:
                    raise PortInUse(f"Ray head: {failure}")
                failure = _slow_start(node)
                if failure:
                    raise SlowStart(f"Ray head: {failure}")
                raise RuntimeError(f"Ray head did not start: {text[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray head did not start: {text[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        _stop_node(node)
        raise


def _stop_node(node: Node, grace: float = 15.0) -> None:
    pids = node.pids()  # snapshot first: once the raylet is gone its workers are orphans, no longer below it
    if node.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGTERM)
        try:
            node.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    psutil = vendored_psutil()

    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        node.proc.wait(timeout=10)
    shutil.rmtree(node.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def local_cluster(
    workdir: str | os.PathLike,
    *,
    workers: int = 2,
    head_cpus: int = 0,
    worker_cpus: int = 2,
    worker_resources: dict[str, float] | None = None,
    driver_resource: bool = True,
    object_store_mb: int = 80,
    bucket: str = "dmlrc",
    services: bool = True,
    start_timeout: float = 120.0,
):
    """Start head + ``workers`` worker nodes (and, with ``services``, S3 and MLflow-on-PostgreSQL); yield a
    :class:`LocalCluster`; stop everything by pid on exit.  Raises :class:`ClusterUnavailable` without PostgreSQL.
    ``driver_resource``: the head declares ``dmlrc_trial_driver`` (trial drivers run there), as a deployment should."""
    from tests.s3_server import create_bucket, s3_server

    workdir = Path(workdir)
    logs = workdir / "cluster-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith(("AWS_", "RAY_"))}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        cluster = LocalCluster(address="", nodes=nodes, base_env=env, workdir=workdir)
        if services:
            from tests.mlflow_server import PostgresUnavailable, mlflow_server_process, postgres_database

            try:
                pg_uri = stack.enter_context(postgres_database())
            except PostgresUnavailable as e:
                raise ClusterUnavailable(str(e)) from None
            endpoint, key, secret = stack.enter_context(s3_server(workdir))
            s3_env = {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": key,
                "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            }
            create_bucket(endpoint, bucket)
            env.update(s3_env)
            cluster.mlflow = stack.enter_context(
                mlflow_server_process(
                    workdir / "mlflow",
                    backend_uri=pg_uri,
                    artifacts_destination=f"s3://{bucket}/mlflow",
                    env={**s3_env, "MLFLOW_S3_ENDPOINT_URL": endpoint},
                )
            )
            cluster.tracking_uri = cluster.mlflow.uri
            cluster.s3_endpoint, cluster.s3_bucket, cluster.access_key, cluster.secret_key = (
                endpoint,
                bucket,
                key,
                secret,
            )

        def stop_all() -> None:
            for node in reversed(nodes):  # workers first, the head (GCS) last
                _stop_node(node)

        stack.callback(stop_all)
        # The head is where trial drivers belong, as infra/ray/raycluster.yaml declares it.
        head_resources = {TRIAL_DRIVER_RESOURCE: 10_000} if driver_resource else {}
        head_args = [
            "--head",
            "--num-cpus",
            str(head_cpus),
            "--num-gpus",
            "0",
            "--resources",
            json.dumps({"node_0": 1, **head_resources}),
            "--object-store-memory",
            str(object_store_mb * 2**20),
            "--include-dashboard",
            "false",
            "--dashboard-host",
            "127.0.0.1",
        ]
        deadline = time.monotonic() + start_timeout
        head, address = start_on_free_ports(
            lambda: _start_head(head_args, env, logs, max(10.0, deadline - time.monotonic())), "the Ray head node"
        )
        nodes.append(head)
        cluster.address = address
        for i in range(1, workers + 1):
            nodes.append(
                _start_node(
                    i,
                    [
                        "--address",
                        address,
                        "--num-cpus",
                        str(worker_cpus),
                        "--num-gpus",
                        "0",
                        "--resources",
                        json.dumps({f"node_{i}": 1, **(worker_resources or {})}),
                        "--object-store-memory",
                        str(object_store_mb * 2**20),
                    ],
                    env,
                    logs,
                )
            )
        restarts = dict.fromkeys(range(1, workers + 1), 0)
        # Every node registered, and which node id is which (by its own custom resource).
        while True:
            listed = [n for n in _ray_nodes(address, env, timeout=max(10.0, deadline - time.monotonic())) if n["Alive"]]
            by_resource = {r: n["NodeID"] for n in listed for r in n["Resources"] if r.startswith("node_")}
            if all(node.resource in by_resource for node in nodes):
                for node in nodes:
                    node.node_id = by_resource[node.resource]
                break
            dead = [n.index for n in nodes if n.proc.poll() is not None]
            for i in list(dead):
                # a worker that lost a port, or whose raylet registered too late: the same node again on fresh ports
                if i > 0 and restarts[i] < _START_TRIES - 1 and _start_failure(nodes[i]):
                    restarts[i] += 1
                    _stop_node(nodes[i])
                    nodes[i] = _start_node(i, nodes[i].args, env, logs, suffix=f".retry{restarts[i]}")
                    dead.remove(i)
                    deadline = max(deadline, time.monotonic() + 60)  # the restarted node's own time to join
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Ray nodes {dead or '?'} did not join {address}: "
                    + " | ".join(n.log_path.read_text(errors="replace")[-1500:] for n in nodes)
                )
            time.sleep(1)
        yield cluster


def cluster_sweep_config(
    tmp_path: Path,
    tracking_uri: str,
    storage: str,
    *,
    name: str,
    losses=("contrastive",),
    datasets: int = 1,
    trials: int = 1,
    reproductions: int = 2,
    iters_per_epoch: int = 2,
    max_epochs: int = 1,
    trunk: str = "tiny",
    runtime_env: dict | None = None,
    **resources,
) -> Path:
    """A tiny real sweep: synthetic data, 4 kfold folds, warm single-worker folds of 1 CPU."""
    doc = {
        "name": name,
        "seed": 1,
        "datasets": [
            {
                "name": f"synthetic{i}" if datasets > 1 else "synthetic",
                "kind": "synthetic",
                "num_classes": 16,
                "per_class": 6,
                "image_size": 16,
                "seed": i + 1,
            }
            for i in range(datasets)
        ],
        "losses": list(losses),
        "model": {"trunk": trunk, "embedding_dim": 8, "freeze_bn": False},
        "protocol": {
            "folds": 4,
            "fold_layout": "kfold",
            "trials": trials,
            "startup_trials": trials,
            "reproductions": reproductions,
            "iters_per_epoch": iters_per_epoch,
            "eval_every": 1,
            "patience": 1,
            "max_epochs": max_epochs,
            "train": {"classes_per_batch": 2, "m": 2, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
        },
        "resources": {"workers_per_fold": 1, "cpus_per_worker": 1, "max_concurrent_trials": 1, **resources},
        "tracking": {"uri": tracking_uri, "experiment": f"{name}-experiment"},
        "storage": storage,
    }
    if runtime_env:
        doc["runtime_env"] = runtime_env
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
