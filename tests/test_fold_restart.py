"""Fault tolerance inside a trial: SIGKILL a fold's process mid-training (what an OOM kill does), on both executors.

``resources.fold_retries`` is Ray's own retry: the warm executor's fold task is resubmitted by Ray
(``max_retries``) onto another worker process; Ray Train's ``FailureConfig(max_failures)`` starts the fold's worker
group again.  Either way the fold continues from its last checkpoint (mid-fold resume, ``pipelines/fold.py``).
Checked afterwards: the sweep still finishes (exit 0, study done, CIs logged); a fold killed after it had stored a
checkpoint past epoch 0 resumed from it in the *same* MLflow run (tags ``resumes``/``resumed_from``, no
``restarted`` replacement, nothing soft-deleted), and every fold run holds each evaluation step exactly once, none
missing; the iterations trained twice (``redone_iterations`` in MLflow and ``outcome.json``) are at most one
evaluation interval per restart; every trial and reproduction keeps exactly one run per fold, all FINISHED with
their summary (none left RUNNING); the trial's objective is the mean of the folds' best val MAP@R as logged; and the
finished folds' checkpoints were deleted.  Two k-fold folds per trial (the protocol's four are checked end to end in
tests/test_sweep.py): what is tested here is one fold's restart, and half the folds halve the test's time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_resume import _alive, _descendants, sweep_started


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


#: Folds per trial: k-fold, two (see the module docstring).
FOLDS = 2
#: The process title Ray gives a process while it runs a fold, per executor.
_FOLD_TITLE = {"warm": "ray::fold:", "train": "RayTrainWorker"}


def _checkpointed_past(root: Path, iteration: int) -> bool:
    """Some fold's ``ckpt/latest.json`` points at a state of at least ``iteration``."""
    for f in root.glob("**/ckpt/latest.json"):
        try:
            if json.loads(f.read_text())["iteration"] >= iteration:
                return True
        except (OSError, ValueError, KeyError):
            continue  # replaced while we read it
    return False


def _fold_processes(root: int, executor: str) -> list[int]:
    """Processes below ``root`` running a fold right now (found by the title Ray sets)."""
    return [p for p in _descendants(root) if _FOLD_TITLE[executor] in _cmdline(p) and _alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["warm", "train"])
def test_a_killed_fold_resumes_from_its_checkpoint_and_its_fold_is_logged_once(tmp_path, executor):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the sweep's Ray Train worker processes")
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    doc = {
        "name": "restart",
        "seed": 3,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 8, "image_size": 16}],
        "losses": ["contrastive"],
        "model": {"trunk": "tiny", "embedding_dim": 16, "freeze_bn": False},
        # Long enough epochs (and no early stop) that a fold is still training a while after its first evaluation.
        "protocol": {
            "folds": FOLDS,
            "fold_layout": "kfold",
            "trials": 1,
            "startup_trials": 1,
            "reproductions": 2,
            "iters_per_epoch": 40,
            "eval_every": 1,
            "patience": 50,
            "max_epochs": 4,
            "train": {"classes_per_batch": 8, "m": 4, "trunk_lr": 1e-3, "embedder_lr": 1e-3},
        },
        "resources": {"workers_per_fold": 1, "max_concurrent_trials": 1, "fold_retries": 1, "fold_executor": executor},
        "storage": str(tmp_path / "runs"),
    }
    interval = doc["protocol"]["iters_per_epoch"] * doc["protocol"]["eval_every"]
    cfg = tmp_path / "restart.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    db = tmp_path / "runs" / "restart" / "mlflow.db"
    uri = f"sqlite:///{db}"

    log_path = tmp_path / "sweep.log"
    log = open(log_path, "wb")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        # Wait until some fold of the search trial has logged two evaluations, stored a checkpoint past epoch 0 and is
        # still running, then kill every fold process alive at that moment (each one's fold restarts and resumes).
        deadline = time.time() + 900
        killed: list[int] = []
        while not killed:
            assert proc.poll() is None, "sweep ended before a fold could be killed:\n" + log_path.read_text()[-4000:]
            assert time.time() < deadline, "no fold logged evaluations in time:\n" + log_path.read_text()[-4000:]
            time.sleep(1)
            if not sweep_started(log_path):
                continue
            try:
                c = MlflowClient(uri)
                exp = c.get_experiment_by_name("restart")
                runs = search_all(c, exp.experiment_id, "tags.stage = 'fold'") if exp else []
                busy = [
                    r
                    for r in runs
                    if r.info.status == "RUNNING" and len(c.get_metric_history(r.info.run_id, "val.map_at_r")) >= 2
                ]
            except Exception:  # noqa: BLE001 - the DB may be mid-creation
                continue
            if busy and _checkpointed_past(tmp_path / "runs", interval):
                for pid in _fold_processes(proc.pid, executor):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        rc = proc.wait(timeout=1500)
    finally:
        if proc.poll() is None:
            family = _descendants(proc.pid)
            proc.kill()
            for p in family:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
        log.close()
    text = log_path.read_text()
    assert rc == 0, text[-6000:]

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("restart")
    runs = search_all(c, exp.experiment_id, "")
    stage = lambda s: [r for r in runs if r.data.tags.get("stage") == s]  # noqa: E731
    assert len(stage("study")) == 1 and stage("study")[0].data.tags["done"] == "true"
    assert "test.concat.map_at_r.mean" in stage("study")[0].data.metrics
    assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]

    parents = stage("trial") + stage("reproduction")
    assert len(parents) == 3
    folds = stage("fold")
    assert not [r for r in folds if r.data.tags.get("restarted")], "a restarted fold got a replacement run"
    deleted = c.search_runs([exp.experiment_id], "tags.stage = 'fold'", run_view_type=ViewType.DELETED_ONLY)
    assert not deleted, [r.data.tags for r in deleted]
    resumed = [r for r in folds if int(r.data.tags.get("resumes", 0)) >= 1]
    assert resumed, f"no fold run resumed after killing {len(killed)} worker(s):\n{text[-4000:]}"
    assert max(int(r.data.tags["resumed_from"]) for r in resumed) >= interval, [r.data.tags for r in resumed]
    evals = doc["protocol"]["max_epochs"] // doc["protocol"]["eval_every"] + 1  # epochs 0..max_epochs
    for r in folds:
        # every evaluation step exactly once, none missing, also in the resumed runs
        for key in ("val.map_at_r", "epoch"):
            steps = [m.step for m in c.get_metric_history(r.info.run_id, key)]
            assert sorted(steps) == [i * interval for i in range(evals)], (key, r.data.tags, steps)
        assert "best_epoch" in r.data.metrics and r.data.tags["status"] == "ok"
        restarts = int(r.data.tags.get("resumes", 0))
        outcome = json.loads((Path(r.data.tags["checkpoint"]) / "outcome.json").read_text())
        assert outcome["restarts"] == restarts and len(outcome["resumed_from"]) == restarts
        assert 0 <= outcome["redone_iterations"] <= restarts * interval, outcome
        if restarts:
            assert r.data.metrics["redone_iterations"] == outcome["redone_iterations"]
            assert outcome["resumed_from"][-1] == int(r.data.tags["resumed_from"])
    # the finished folds' mid-fold states were deleted once their results were stored
    assert not list((tmp_path / "runs").glob("**/ckpt/state-*.pt"))

    for parent in parents:
        kids = [r for r in stage("fold") if r.data.tags["mlflow.parentRunId"] == parent.info.run_id]
        assert sorted(int(r.data.tags["fold"]) for r in kids) == list(range(FOLDS))
        best = [r.data.metrics["best.val.map_at_r"] for r in kids]
        assert parent.data.metrics["val.map_at_r.mean"] == pytest.approx(sum(best) / FOLDS, abs=1e-9)

    if executor == "warm":
        # Warm processes outlive a fold: the study's folds ran on the processes of its first trial plus the
        # replacements for the killed ones, so some process ran several folds.
        pids = [r.data.tags["pid"] for r in stage("fold")]
        assert len(pids) == 3 * FOLDS and len(set(pids)) <= 4 + len(killed), pids  # 2 CPUs: at most a few processes
        assert max(pids.count(p) for p in set(pids)) >= 2, pids
