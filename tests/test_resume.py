"""Resume: SIGKILL the sweep driver mid-study, then ``dmlrc sweep CONFIG --resume`` finishes it (both executors).

Checked afterwards: every trial ran exactly once to completion (the trial that had finished before the kill was not
rerun: its MLflow metrics and its folds' start times were logged once), the Bayesian optimiser's history was kept
(the restored Optuna study holds every trial), no MLflow run is duplicated, and the study completed with its CIs.
Two k-fold folds per trial, each twice as long (the protocol's four folds are checked end to end in
tests/test_sweep.py): a trial lasts as long as with four, and there are half as many fold jobs to start.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_sweep import _run_cli


def _children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> list[int]:
    """Every process started (directly or not) by ``pid`` — read from /proc, so Linux only."""
    kids, out, todo = _children_of(), [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def sweep_started(log: Path) -> bool:
    """The sweep printed its banner, so its MLflow store exists and is migrated.  Opening a sqlite store earlier
    races the sweep's own schema migration (MLflow migrates a new DB from whichever process opens it first)."""
    try:
        return " studies (" in log.read_text(errors="replace")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["warm", "train"])
def test_sigkilled_sweep_resumes_without_rerunning_finished_trials(tmp_path, executor):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the killed driver's child processes")
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    trials, folds = 2, 2
    doc = {
        "name": "resume",
        "seed": 5,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 8, "image_size": 16}],
        "losses": ["contrastive"],
        "model": {"trunk": "tiny", "embedding_dim": 16, "freeze_bn": False},
        # folds long enough (also warm ones, whose trials take seconds) that trial 2 still runs when the driver dies
        "protocol": {
            "folds": folds,
            "fold_layout": "kfold",
            "trials": trials,
            "startup_trials": 1,
            "reproductions": 2,
            "iters_per_epoch": 100,
            "eval_every": 1,
            "patience": 3,
            "max_epochs": 3,
            "train": {"classes_per_batch": 8, "m": 4, "trunk_lr": 1e-3, "embedder_lr": 1e-3},
        },
        "resources": {"workers_per_fold": 1, "max_concurrent_trials": 1, "fold_executor": executor},
        "storage": str(tmp_path / "runs"),
    }
    cfg = tmp_path / "resume.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    db = tmp_path / "runs" / "resume" / "mlflow.db"
    uri = f"sqlite:///{db}"

    log = open(tmp_path / "first.log", "wb")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    # Wait until trial 1 finished and trial 2 is running (its fold runs exist), then kill the driver.
    deadline = time.time() + 900
    finished: list = []
    while True:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        assert time.time() < deadline, "no trial finished in time: " + (tmp_path / "first.log").read_text()[-4000:]
        time.sleep(3)
        if not sweep_started(tmp_path / "first.log"):
            continue
        try:
            c = MlflowClient(uri)
            exp = c.get_experiment_by_name("resume")
            runs = search_all(c, exp.experiment_id, "") if exp else []
        except Exception:  # noqa: BLE001 - the DB may be mid-creation
            continue
        trial_runs = [r for r in runs if r.data.tags.get("stage") == "trial"]
        finished = [r for r in trial_runs if r.info.status == "FINISHED"]
        running = [r for r in trial_runs if r.info.status == "RUNNING"]
        if finished and running:
            break
    time.sleep(8)  # Tune writes its experiment state every ~2 s (TUNE_GLOBAL_CHECKPOINT_S)
    assert proc.poll() is None, "the sweep finished before it could be killed"
    family = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    log.close()
    # The local Ray the driver started notices its death and exits; stop whatever is left, by pid.
    t_end = time.time() + 60
    while any(_alive(p) for p in family) and time.time() < t_end:
        time.sleep(1)
    for p in family:
        if _alive(p):
            os.kill(p, signal.SIGKILL)

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("resume")
    done = finished[0]
    done_id, done_trial = done.info.run_id, done.data.tags["trial_id"]
    done_folds = {r.info.run_id for r in search_all(c, exp.experiment_id, f"tags.`mlflow.parentRunId` = '{done_id}'")}
    assert len(done_folds) == folds

    out = _run_cli(["sweep", str(cfg), "--resume"], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert "resuming search" in out.stdout

    runs = search_all(c, exp.experiment_id, "")
    stage = lambda s: [r for r in runs if r.data.tags.get("stage") == s]  # noqa: E731
    assert len(stage("study")) == 1 and stage("study")[0].data.tags["done"] == "true"
    trial_runs = stage("trial")
    assert len(trial_runs) == trials, [r.data.tags for r in trial_runs]  # no duplicated trial runs
    assert len({r.data.tags["trial_id"] for r in trial_runs}) == trials
    assert len(stage("reproduction")) == 2 and len(stage("fold")) == folds * (trials + 2)
    assert all(r.info.status == "FINISHED" for r in runs)
    # the trial finished before the kill was not rerun: same run, each metric logged once, folds not retrained
    again = c.get_run(done_id)
    assert again.data.tags["trial_id"] == done_trial
    assert len(c.get_metric_history(done_id, "val.map_at_r.mean")) == 1
    kids = search_all(c, exp.experiment_id, f"tags.`mlflow.parentRunId` = '{done_id}'")
    assert {r.info.run_id for r in kids} == done_folds
    for f in kids:
        assert len(c.get_metric_history(f.info.run_id, "time.start")) == 1
    assert "test.concat.map_at_r.mean" in stage("study")[0].data.metrics

    # the Bayesian optimiser's history survived: the restored Optuna study holds every trial, with its objective
    search = tmp_path / "runs" / "resume" / "ray" / "synthetic__contrastive" / "search"
    state_files = sorted(search.glob("searcher-state-*.pkl"))  # one per driver session, named by its start time
    assert state_files, list(search.iterdir())
    with open(state_files[-1], "rb") as f:
        state = pickle.load(f)
    study = state["_ot_study"]
    values = sorted(t.value for t in study.trials if t.state.name == "COMPLETE")
    assert len(values) == trials
    mlflow_values = sorted(r.data.metrics["val.map_at_r.mean"] for r in trial_runs)
    assert values == pytest.approx(mlflow_values, abs=1e-12)
    assert type(state["_sampler"]).__name__ == "GPSampler"
