"""Security of a sweep's own Ray: no credentials anywhere Ray or MLflow write, loopback-only sockets,
no password in what is printed, and the cluster's resources checked before any trial starts.

The slow tests share one sweep of a tiny config (2 k-fold folds, 1 trial, 2 reproductions, DDP folds of 2 gloo
workers) in subprocesses with their own Ray temp dir (``RAY_TMPDIR``), so that the whole Ray session directory can be
searched, against a real ``mlflow server`` (sqlite) whose database is searched too.  It is also the Ray Train
executor's kill-and-resume sweep of tests/test_resume.py (:func:`~tests.test_resume.kill_and_resume`): a fold's
worker group SIGKILLed mid-training, then the driver mid-reproductions, then ``--resume`` finishes it — so the
security checks cover two driver sessions, one of them killed outright (its private credentials file cannot be
deleted by itself: the next session deletes it), and restarted worker groups.  Its MLflow tree is checked as
tests/test_sweep.py checks the warm sweeps', which makes it the Ray Train executor's end-to-end test too.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ helpers


def tiny_sweep_config(
    tmp_path: Path,
    tracking_uri: str,
    *,
    name: str,
    max_epochs: int = 1,
    iters_per_epoch: int = 2,
    trunk: str = "tiny",
    **resources,
) -> Path:
    """The smallest real sweep: 1 loss, 2 kfold folds, 1 trial + 2 reproductions, 1 gloo worker per fold."""
    doc = {
        "name": name,
        "seed": 1,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 16, "per_class": 6, "image_size": 16}],
        "losses": ["contrastive"],
        "model": {"trunk": trunk, "embedding_dim": 8, "freeze_bn": False},
        "protocol": {
            "folds": 2,
            "fold_layout": "kfold",
            "trials": 1,
            "startup_trials": 1,
            "reproductions": 2,
            "iters_per_epoch": iters_per_epoch,
            "eval_every": 1,
            "patience": 1,
            "max_epochs": max_epochs,
            "train": {"classes_per_batch": 4, "m": 2, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
        },
        "resources": {"workers_per_fold": 1, "max_concurrent_trials": 1, **resources},
        "tracking": {"uri": tracking_uri, "experiment": f"{name}-experiment"},
        "storage": str(tmp_path / "runs"),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def sweep_env(ray_tmp: str, **extra: str) -> dict[str, str]:
    """The test's environment for a sweep subprocess: this checkout first, its own Ray temp dir."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_TMPDIR"] = ray_tmp
    env.update(extra)
    return env


def ray_tmpdir() -> str:
    """A short private directory for Ray (its unix sockets live under it: paths must stay < 108 bytes)."""
    return tempfile.mkdtemp(prefix="dmlrc-ray-")


def files_containing(root: Path, needles: list[bytes]) -> list[str]:
    """Every file under ``root`` whose bytes contain one of ``needles`` (binary files included)."""
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if any(n in data for n in needles):
                hits.append(str(p))
    return hits


def _descendants(pid: int) -> set[int]:
    from tests.cluster import vendored_psutil

    psutil = vendored_psutil()

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)} | {pid}
    except psutil.NoSuchProcess:
        return set()


def _listening(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process title, address, port) of every TCP socket in LISTEN state owned by one of ``pids``."""
    from tests.cluster import vendored_psutil

    psutil = vendored_psutil()

    out = []
    for c in psutil.net_connections("inet"):
        if c.pid in pids and c.status == psutil.CONN_LISTEN:
            try:
                proc = psutil.Process(c.pid)
                title = f"{proc.name()} {' '.join(proc.cmdline())[:100]}"
            except psutil.NoSuchProcess:
                title = "?"
            out.append((c.pid, title, c.laddr.ip, c.laddr.port))
    return out


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


# ------------------------------------------------------------------------------------------------ fast units


def test_redact_uri_hides_only_the_password():
    from pipelines.execution.ray_runtime import redact_uri, scrub

    assert redact_uri("postgresql://alice:s3cr%40t@db:5432/mlflow") == "postgresql://alice:***@db:5432/mlflow"
    assert redact_uri("postgresql+psycopg2://u:p@127.0.0.1/x") == "postgresql+psycopg2://u:***@127.0.0.1/x"
    assert redact_uri("http://bob:pw@host:5000") == "http://bob:***@host:5000"
    for same in ("http://host:5000/x", "sqlite:////tmp/a:b@c.db", "postgresql://u@h/db", "", None):
        assert redact_uri(same) == same
    # a driver error quoting the password (raw or URL-decoded) loses it too
    assert (
        scrub("auth failed for s3cr@t and s3cr%40t", "postgresql://alice:s3cr%40t@db/m")
        == "auth failed for *** and ***"
    )


def test_a_killed_drivers_credentials_folder_is_deleted_by_the_next_sweep_and_a_live_ones_is_kept(
    tmp_path, monkeypatch
):
    """A driver killed outright leaves its private credentials folder (``dmlrc-aws-<pid>-*``) behind; the next
    sweep's start deletes the folders of dead drivers of the same user, and no other folder."""
    from pipelines.execution import ray_runtime

    monkeypatch.setattr(ray_runtime, "CREDENTIALS_PARENT", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"dmlrc-aws-{gone.pid}-x1"
    live = tmp_path / f"dmlrc-aws-{os.getppid()}-x2"  # a running process's (a sweep still going)
    unnamed = tmp_path / "dmlrc-aws-x3"  # no pid in the name: not ours to judge
    for d in (stale, live, unnamed):
        d.mkdir()
        (d / "credentials").write_text("[default]\n")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    try:
        ray_runtime._hide_credentials()
        mine = Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"])
        assert mine.parent.parent == tmp_path and mine.parent.name.startswith(f"dmlrc-aws-{os.getpid()}-")
        assert "fake-secret" in mine.read_text() and "AWS_SECRET_ACCESS_KEY" not in os.environ
        assert not stale.exists() and live.exists() and unnamed.exists()
    finally:
        ray_runtime.stop_ray(False)
    assert not mine.parent.exists() and os.environ["AWS_SECRET_ACCESS_KEY"] == "fake-secret"


def test_failure_reason_says_why_each_trial_failed():
    from pipelines.execution.interrupts import failure_reason

    rows = [
        {"trial_id": "t1", "status": "diverged", "reason": "fold 0: loss is NaN"},
        {"trial_id": "t2", "error": RuntimeError("fold 1: worker died")},
        {"trial_id": "t3"},
        {"trial_id": "t4"},
    ]
    text = failure_reason(rows)
    assert "diverged: fold 0: loss is NaN [t1]" in text
    assert "RuntimeError: fold 1: worker died [t2]" in text
    assert "stopped before reporting a result" in text and "[t3, t4]" in text
    assert "?" not in text
    assert failure_reason([]) == "no trial ran"


def test_failure_reason_unwraps_what_ray_raised_in_a_task_inside_a_trial():
    """A fold's error reaches the study through two Ray wrappers (the fold task's, then the trial actor's), each a
    RayTaskError whose text is a coloured traceback: the reason is the innermost error's own line."""
    from ray.exceptions import RayTaskError

    from pipelines.execution.interrupts import error_text, failure_reason

    inner = ValueError("s3://b/shards/part-00000.parquet: sha256 abc does not match the manifest's def")
    fold = RayTaskError("fold", "Traceback (most recent call last):\n  ...\n", inner).as_instanceof_cause()
    trial_err = RuntimeError(f"study t1: fold 0: {error_text(fold)}")
    wrapped = RayTaskError(
        "\x1b[36mray::ImplicitFunc.train()\x1b[39m", "Traceback ...\n  ^^^^\n", trial_err
    ).as_instanceof_cause()
    assert error_text(fold) == f"ValueError: {inner}"
    text = failure_reason([{"trial_id": "t1", "error": wrapped}])
    assert text == f"error: RuntimeError: study t1: fold 0: ValueError: {inner} [t1]"


def test_run_sweep_checks_the_clusters_resources_before_any_trial(tmp_path, monkeypatch):
    """``use_gpu: true`` against a running Ray without GPUs (e.g. a cluster given with ``--address``): one config
    error naming ``resources.use_gpu`` and what the cluster has, right after Ray starts — no trial, no stored
    config, no run (before: Ray Train retried its worker-group start-up forever).  Ray itself is stubbed here."""
    import ray

    from pipelines.config.schema import ConfigError, parse_config
    from pipelines.execution import sweep

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = yaml.safe_load(
        tiny_sweep_config(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", name="gpu", use_gpu=True).read_text()
    )
    cfg = parse_config(doc)
    started = []
    monkeypatch.setattr(sweep, "start_ray", lambda cfg, address: started.append(address) or False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(sweep._Sweep, "run_study", lambda self, plan: pytest.fail("a study started"))
    with pytest.raises(ConfigError) as e:
        sweep.run_sweep(cfg, address="ray://cluster:10001")
    assert started == ["ray://cluster:10001"]
    assert e.value.field == "resources.use_gpu" and "0 GPUs" in str(e.value) and "8 CPUs" in str(e.value)
    assert not (cfg.local_dir() / "sweep_config.json").exists()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = c.get_experiment_by_name("gpu-experiment")
    assert exp is None or c.search_runs([exp.experiment_id]) == []


# ------------------------------------------------------------------------------------------------ the real sweep


@pytest.fixture(scope="module")
def sweep_with_credentials(tmp_path_factory):
    """The DDP kill-and-resume sweep (module docstring) with fake AWS credentials in its environment, against an
    ``mlflow server`` whose files live in the sweep's tmp dir; the sockets of both driver sessions' process trees
    sampled while they run."""
    from tests.mlflow_server import mlflow_server
    from tests.test_resume import kill_and_resume

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the sweep's fold processes and the killed driver's children")
    tmp = tmp_path_factory.mktemp("secure")
    ray_tmp = ray_tmpdir()
    secret = {
        "AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
        "AWS_SECRET_ACCESS_KEY": "fake-secret-" + secrets.token_hex(16),
        "AWS_SESSION_TOKEN": "fake-token-" + secrets.token_hex(16),
    }
    sockets: set[tuple[int, str, str, int]] = set()
    with mlflow_server(tmp / "server") as uri:
        # 2 workers per fold (Ray Train): the gloo connections between them are checked too
        run = kill_and_resume(
            tmp,
            executor="train",
            workers=2,
            name="secure",
            tracking_uri=uri,
            env=sweep_env(ray_tmp, **secret),
            watch=lambda pid: sockets.update(_listening(_descendants(pid))),
        )
        yield {
            "run": run,
            "rc": run.resume_rc,
            "out": (run.first_output + run.resume_output).encode(),
            "tmp": tmp,
            "ray_tmp": Path(ray_tmp),
            "secret": secret,
            "sockets": sockets,
            "uri": uri,
        }
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(1800)
def test_ddp_sweep_killed_and_resumed_end_to_end_against_an_mlflow_server(sweep_with_credentials):
    """One trial + 2 reproductions of one loss as DDP folds (Ray Train, 2 gloo workers each), against a real
    ``mlflow server``, a fold's worker group and then the driver SIGKILLed, ``--resume`` finishing the study:
    tests/test_resume.py's checks (the killed folds resumed in their runs, nothing finished rerun, the optimiser's
    history kept), then the whole MLflow tree with Tune's results = MLflow's metrics (tests/test_sweep.py's check).
    Two k-fold folds per trial and one trial: the Ray Train path's properties depend neither on the number of folds
    nor on the search, and every Ray Train job costs a worker group's start-up; the reality check's 4 folds in the
    ``mlrc`` layout and a Bayesian search run end to end in test_sweep.py's PostgreSQL sweep (warm folds)."""
    from tests.test_resume import check_killed_and_resumed
    from tests.test_sweep import _check_run_tree

    s = sweep_with_credentials
    out = s["out"].decode(errors="replace")
    assert s["rc"] == 0, out[-5000:]
    assert "mlflow ui" not in out and s["uri"] in out  # the server to browse
    assert "[synthetic/contrastive] done in" in out
    check_killed_and_resumed(s["run"])
    _check_run_tree(
        s["uri"],
        "secure",
        losses=["contrastive"],
        trials=1,
        workers=2,
        storage=s["tmp"] / "runs",
        name="secure",
        n_folds=2,
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_aws_credentials_never_reach_ray_logs_mlflow_or_the_sweep_folder(sweep_with_credentials):
    s = sweep_with_credentials
    assert s["rc"] == 0, s["out"].decode(errors="replace")[-5000:]
    sessions = list((s["ray_tmp"] / "ray").glob("session_2*"))
    assert sessions, "the sweep's Ray did not use the test's RAY_TMPDIR"
    assert any(sessions[0].rglob("runtime_env_agent.log")), "no runtime-env agent log: nothing was checked"
    needles = [v.encode() for v in s["secret"].values()]
    for root in (s["ray_tmp"], s["tmp"]):  # Ray's whole session dir; MLflow DB, artifacts, Ray storage, config
        assert files_containing(root, needles) == []
    assert not any(n in s["out"] for n in needles)
    # the private credentials files the sweep used while Ray ran are gone: the resumed session's (deleted when it
    # stopped) and the killed one's (deleted when the resumed session started)
    leftovers = [
        p for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d) for p in Path(d).glob("dmlrc-aws-*")
    ]
    assert files_containing_any(leftovers, needles) == []


def files_containing_any(paths: list[Path], needles: list[bytes]) -> list[str]:
    hits = []
    for p in paths:
        hits += files_containing(p, needles) if p.is_dir() else []
    return hits


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_sweeps_own_ray_listens_on_loopback_only(sweep_with_credentials):
    s = sweep_with_credentials
    assert s["rc"] == 0, s["out"].decode(errors="replace")[-5000:]
    titles = " | ".join(sorted({t for _, t, _, _ in s["sockets"]}))
    # GCS, raylet, the runtime-env agent and Train workers must have been seen, or the sampling checked nothing
    for process in ("gcs_server", "raylet", "RuntimeEnvAgent", "RayTrainWo"):
        assert process in titles, titles
    # A process's title changes with the task it runs (a Train worker shows "ray::RayTrainWorker", then e.g.
    # "ray::execute._setup_torch_process_group"): classify processes by every title seen for their pid.
    titles_of: dict[int, set[str]] = {}
    for pid, title, _, _ in s["sockets"]:
        titles_of.setdefault(pid, set()).add(title)
    public = sorted({(pid, ip, port) for pid, _, ip, port in s["sockets"] if not _is_loopback(ip)})
    # The one known exception: each fold's torch.distributed rendezvous store (a TCPStore that rank 0 of the Train
    # worker group opens; torch has no bind-address option for it) — at most one such socket per Train worker,
    # and never anywhere else.
    per_pid: dict[int, int] = {}
    for pid, ip, port in public:
        assert any("RayTrainWo" in t for t in titles_of[pid]), [(p, i, o, titles_of[p]) for p, i, o in public]
        per_pid[pid] = per_pid.get(pid, 0) + 1
    assert all(n == 1 for n in per_pid.values()), public
