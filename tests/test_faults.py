"""A sweep on a real multi-node Ray cluster on one machine, then node faults on the same cluster: ``tests/cluster.py``
starts a head (no CPUs; it declares ``dmlrc_trial_driver``, so trial drivers run there) and two worker nodes of 2
CPUs, SeaweedFS for ``storage: s3://`` and an ``mlflow server`` on PostgreSQL.  One cluster serves the module, in
order:

0. **the multi-node sweep** (``dmlrc sweep CONFIG --address <head>``, before any fault): a trial's four folds land on
   both worker nodes (read back from the fold runs' ``node_id`` tags), trial drivers on the head, fold results in
   S3; a user's loss and trunk by import path shipped by ``runtime_env.py_modules``; ``max_concurrent_studies: 1``.
1. **a worker node killed mid-fold** (every process of node 2, by pid: a lost pod).  The folds it ran are retried by
   Ray on node 1 and resume from their last checkpoint in S3 (``resumes``/``resumed_from`` tags in the *same* MLflow
   run); the sweep finishes (exit 0) without a hang; every parent keeps exactly four fold runs, each evaluation step
   logged once; no run of the experiment, deleted ones included, is left RUNNING; the iterations trained twice are
   at most one evaluation interval per resume.
2. **the same node loss with ``mid_fold_resume: false``** (node 2 replaced by a fresh node first, as KubeRay replaces
   a lost pod): the lost folds start over in fresh runs; the iterations trained twice are what resume saves.
3. **the sweep driver SIGKILLed while node 2 is down again**, then ``dmlrc sweep --resume``: the study completes on
   the surviving node; the finished trial is not rerun; ``max_concurrent_trials: 1`` holds across the resume (no two
   trial runs overlap in time); every run of the resumed sweep carries the identifying tags the first attempt's
   runs carry.

These faults need a trial's four folds spread over both worker nodes.  The faults of the services (S3 frozen, MLflow
killed, a diverging trial, a corrupt shard) are ``tests/test_faults_services.py``, on a cluster of their own, and the
node that hosts a trial's driver is ``tests/test_faults_driver_host.py`` (a head without the trial-driver resource):
three modules, so that the two pytest workers run them side by side.  This module also holds what they share:
the sweep config, the cluster fixture, the waits and the invariants every fault must keep (:func:`_check_tree`).

Each test writes one row of measurements (faults, trials finished/lost/duplicated, folds resumed, iterations redone,
wall time) to ``reliability.jsonl`` in its tmp dir and prints it: ``bench/README_faults.md`` quotes them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import cluster_sweep_config
from tests.paced_trunk import PACE_FILE_ENV, PACED_TRUNK, pace_file

pytestmark = pytest.mark.slow

ITERS, EPOCHS = 40, 5  # long enough epochs (no early stop) that a fold is still training after its 3rd evaluation
SHORT = 2  # epochs of the sweeps whose fault does not need a fold caught mid-training
IDENTIFYING = ("sweep", "stage", "study", "dataset", "loss", "fold", "trial_id")


def _config(
    tmp_path: Path,
    tracking_uri: str,
    storage: str,
    *,
    name: str,
    trials: int,
    reproductions: int,
    epochs: int = EPOCHS,
    folds: int = 4,
    pace: Path | None = None,
    **resources,
) -> Path:
    """The tiny cluster sweep (:func:`tests.cluster.cluster_sweep_config`) with longer folds: 32 classes × 8, no
    early stop.  ``pace``: a pace file (:func:`tests.paced_trunk.pace_file`): the paced trunk, whose steps wait while
    the file exists, so that a fold is caught mid-training by waiting, not computing (the test deletes the file after
    its fault); else ``tiny``.
    ``folds``: 4 spread a trial over both worker nodes (2 CPUs each), which the node faults need; the faults whose
    place does not matter (S3, MLflow, a diverging trial, a corrupt shard) run 2, half the work."""
    path = cluster_sweep_config(
        tmp_path,
        tracking_uri,
        storage,
        name=name,
        trials=trials,
        reproductions=reproductions,
        iters_per_epoch=ITERS,
        max_epochs=epochs,
        fold_retries=2,
        trunk=PACED_TRUNK if pace else "tiny",
        runtime_env={"env_vars": {PACE_FILE_ENV: str(pace)}} if pace else None,
        **resources,
    )
    doc = yaml.safe_load(path.read_text())
    doc["seed"] = 5
    doc["datasets"][0].update(num_classes=32, per_class=8)
    doc["model"]["embedding_dim"] = 16
    doc["protocol"]["patience"] = 50
    doc["protocol"]["folds"] = folds
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(c, cfg: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", c.address, *extra],
        cwd=cfg.parent,
        stdout=open(log_path, "ab"),
        stderr=subprocess.STDOUT,
        env=c.driver_env(),
        start_new_session=True,
    )


def _runs(c, experiment: str, view=None):
    """(client, every run of the experiment: deleted ones too unless ``view`` says otherwise)."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    client = MlflowClient(c.tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return client, []
    return client, search_all(client, exp.experiment_id, "", view or ViewType.ALL)


def _with_node_2(c) -> None:
    """Worker node 2 up: replaced by a fresh node if an earlier test of the module killed it."""
    if c.nodes[2].proc.poll() is not None or c.node_ids[2] not in c.alive_node_ids():
        c.replace_node(2)


def _wait_for_fold(
    c, experiment: str, proc: subprocess.Popen, log_path: Path, *, node_id: str | None, evals: int, timeout: float = 600
):
    """Block until a RUNNING fold run (on ``node_id``, if given) has logged ``evals`` evaluations; return it."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, "sweep ended before the fault:\n" + log_path.read_text()[-4000:]
        assert time.time() < deadline, "no fold reached the fault point in time:\n" + log_path.read_text()[-4000:]
        time.sleep(1)
        try:
            client, runs = _runs(c, experiment)
            for r in runs:
                if (
                    r.data.tags.get("stage") == "fold"
                    and r.info.status == "RUNNING"
                    and (node_id is None or r.data.tags.get("node_id") == node_id)
                    and len(client.get_metric_history(r.info.run_id, "val.map_at_r")) >= evals
                ):
                    return r
        except Exception:  # noqa: BLE001 - the experiment may not exist yet
            continue


def _finish(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the sweep hung after the fault:\n" + log_path.read_text()[-6000:]) from None
    text = log_path.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    return text


def _check_tree(
    c,
    experiment: str,
    *,
    parents: int,
    resume: bool = True,
    study: str | None = None,
    epochs: int = EPOCHS,
    n_folds: int = 4,
) -> dict:
    """The invariants every fault must keep (of one ``study`` only, if given); returns counts for the reliability
    table."""
    from mlflow.entities import ViewType

    client, every = _runs(c, experiment)
    running = [(r.data.tags.get("stage"), r.info.lifecycle_stage) for r in every if r.info.status == "RUNNING"]
    assert not running, f"runs left RUNNING: {running}"
    _, runs = _runs(c, experiment, ViewType.ACTIVE_ONLY)
    if study is not None:
        runs = [r for r in runs if r.data.tags.get("study") == study]
        every = [r for r in every if r.data.tags.get("study") == study]
    stage = lambda s: [r for r in runs if r.data.tags.get("stage") == s]  # noqa: E731
    study = stage("study")
    assert len(study) == 1 and study[0].data.tags.get("done") == "true"
    assert "test.concat.map_at_r.mean" in study[0].data.metrics
    ps = stage("trial") + stage("reproduction")
    assert len(ps) == parents, [r.data.tags for r in ps]
    interval = ITERS
    folds, resumed, redone = stage("fold"), 0, 0
    for p in ps:
        kids = [r for r in folds if r.data.tags["mlflow.parentRunId"] == p.info.run_id]
        assert sorted(int(r.data.tags["fold"]) for r in kids) == list(range(n_folds)), [r.data.tags for r in kids]
        for r in kids:
            steps = [m.step for m in client.get_metric_history(r.info.run_id, "val.map_at_r")]
            # each evaluation once, none missing: all of them, or those before a divergence ended the fold
            n_evals = len(steps) if r.data.tags.get("status") == "diverged" else epochs + 1
            assert sorted(steps) == [i * interval for i in range(n_evals)], (r.data.tags, steps)
            n = int(r.data.tags.get("resumes", 0))
            resumed += n
            if n:
                redone_here = int(r.data.metrics["redone_iterations"])
                # with mid-fold resume at most one evaluation interval per restart; without it, everything done
                assert 0 <= redone_here <= n * interval * (1 if resume else epochs), (r.data.tags, redone_here)
                redone += redone_here
    deleted_folds = [r for r in every if r.data.tags.get("stage") == "fold" and r.info.lifecycle_stage == "deleted"]
    return {
        "trials_finished": len(ps),
        "folds": len(folds),
        "folds_resumed": resumed,
        "iterations_redone": redone,
        "replaced_fold_attempts": len(deleted_folds),
        "trial_ids": [r.data.tags.get("trial_id") for r in ps],
    }


def _record(tmp_path: Path, row: dict) -> None:
    line = json.dumps(row)
    print("RELIABILITY " + line)
    with open(tmp_path / "reliability.jsonl", "a") as f:
        f.write(line + "\n")


@pytest.mark.timeout(900)
def test_sweep_on_a_multi_node_cluster_spreads_folds_over_the_nodes(cluster, tmp_path):
    """Before any fault, on the module's fresh cluster: a trial's four folds (1 CPU each, all submitted at once)
    cannot fit on one 2-CPU worker, so they land on both.  The sweep studies a user's own loss and trunk by import
    path (``examples/plugin``, never installed anywhere), shipped to the worker nodes by the config's
    ``runtime_env.py_modules``, next to ``contrastive``, one study after the other (``max_concurrent_studies: 1``;
    the default, studies at once, is ``tests/test_studies_sweep.py``)."""
    from mlflow.entities import ViewType

    c = cluster
    plugin = Path(__file__).resolve().parents[1] / "examples" / "plugin" / "src" / "dmlrc_example"
    cfg = cluster_sweep_config(
        tmp_path,
        c.tracking_uri,
        c.storage("sweeps"),
        name="multinode",
        losses=("contrastive", "dmlrc_example.losses:CircleLoss"),
        trunk="dmlrc_example.trunks:wide_tiny",
        runtime_env={"py_modules": [str(plugin)]},
        max_concurrent_studies=1,
    )
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", c.address],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=800,
        env=c.driver_env(),
    )
    log = out.stdout[-5000:] + out.stderr[-5000:]
    assert out.returncode == 0, log
    assert "warning:" not in out.stdout, log  # S3 storage and an MLflow server: nothing to warn about
    assert "2 studies (synthetic/contrastive, synthetic/dmlrc_example.losses:CircleLoss), ≤ 1 at once" in out.stdout

    _, runs = _runs(c, "multinode-experiment", ViewType.ACTIVE_ONLY)
    stages = sorted(r.data.tags["stage"] for r in runs)
    assert stages == ["fold"] * 24 + ["reproduction"] * 4 + ["study"] * 2 + ["trial"] * 2, stages
    assert [r.info.run_id for r in runs if r.info.status != "FINISHED"] == []  # nothing left RUNNING
    studies = {r.data.tags["loss"]: r for r in runs if r.data.tags["stage"] == "study"}
    assert sorted(studies) == ["contrastive", "dmlrc_example.losses:CircleLoss"], sorted(studies)
    for study in studies.values():
        assert study.data.tags.get("done") == "true"
        m = study.data.metrics
        mean, low, high = (m[f"test.concat.map_at_r.{k}"] for k in ("mean", "ci_low", "ci_high"))
        assert all(math.isfinite(v) for v in (mean, low, high)) and low <= mean <= high, (mean, low, high)
        assert study.data.tags.get("registered_model", "").startswith("dmlrc."), study.data.tags

    # max_concurrent_studies: 1 — the second study started after the first had ended
    spans = sorted((r.info.start_time, r.info.end_time) for r in studies.values())
    assert spans[0][1] <= spans[1][0], spans

    # Folds ran on the worker nodes of *this* cluster, on at least two of them.
    fold_nodes = [r.data.tags.get("node_id") for r in runs if r.data.tags["stage"] == "fold"]
    workers = set(c.node_ids[1:])
    assert set(fold_nodes) <= workers, (fold_nodes, c.node_ids)
    assert len(set(fold_nodes)) >= 2, fold_nodes
    # Trial drivers run on the head, the node declaring the driver resource (not in a worker's fold slots).
    drivers = {r.data.tags.get("driver_node_id") for r in runs if r.data.tags["stage"] in ("trial", "reproduction")}
    assert drivers == {c.node_ids[0]}, (drivers, c.node_ids)
    # Fold results went through the shared S3 storage (no local path on a multi-node cluster).
    assert all(
        r.data.tags["checkpoint"].startswith(f"s3://{c.s3_bucket}/sweeps")
        for r in runs
        if r.data.tags["stage"] == "fold"
    )


@pytest.mark.timeout(1200)
def test_a_worker_node_killed_mid_fold_resumes_on_the_surviving_node(cluster, tmp_path):
    c = cluster
    pace = pace_file(tmp_path)
    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("nodekill"), name="nodekill", trials=1, reproductions=2, pace=pace
    )
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        victim = _wait_for_fold(c, "nodekill-experiment", proc, log_path, node_id=c.node_ids[2], evals=3)
        killed = c.kill_node(2)
        t_fault = time.time()
        pace.unlink()  # the rest at full speed
        text = _finish(proc, log_path, timeout=900)
    finally:
        pace.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert killed and c.node_ids[2] not in c.alive_node_ids()
    counts = _check_tree(c, "nodekill-experiment", parents=3)
    client, runs = _runs(c, "nodekill-experiment")
    after = client.get_run(victim.info.run_id)  # the killed fold went on in its own run, on the surviving node
    assert int(after.data.tags.get("resumes", 0)) >= 1, (after.data.tags, text[-3000:])
    # 3 evaluations logged: the checkpoint of the 2nd was stored for sure; the 3rd's may still have been on its way
    # to S3 when the node died (a fold logs an evaluation, then stores its state), so it resumed from >= 1 interval
    assert int(after.data.tags["resumed_from"]) >= ITERS, after.data.tags
    assert after.data.tags["node_id"] == c.node_ids[1], after.data.tags
    assert counts["folds"] == 12 and counts["replaced_fold_attempts"] == 0, counts
    _record(
        tmp_path,
        {
            "fault": "worker node killed mid-fold (SIGKILL of its raylet and workers)",
            "trials_lost": 0,
            "trials_duplicated": 0,
            **counts,
            "wall_s": round(time.time() - t0, 1),
            "after_fault_s": round(time.time() - t_fault, 1),
        },
    )


@pytest.mark.timeout(1200)
def test_the_same_node_loss_without_mid_fold_resume_trains_the_lost_folds_again(cluster, tmp_path):
    """The comparison row: ``mid_fold_resume: false``, node 2 replaced by a fresh node and killed again at the same
    point.  The lost folds start over in fresh runs (the half-logged ones soft-deleted, none left RUNNING): every
    iteration they had done is trained again."""
    c = cluster
    _with_node_2(c)
    cfg = _config(
        tmp_path,
        c.tracking_uri,
        c.storage("noresume"),
        name="noresume",
        trials=1,
        reproductions=2,
        mid_fold_resume=False,
        pace=(pace := pace_file(tmp_path)),
    )
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        victim = _wait_for_fold(c, "noresume-experiment", proc, log_path, node_id=c.node_ids[2], evals=3)
        c.kill_node(2)
        t_fault = time.time()
        pace.unlink()
        _finish(proc, log_path, timeout=900)
    finally:
        pace.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    counts = _check_tree(c, "noresume-experiment", parents=3, resume=False)
    client, runs = _runs(c, "noresume-experiment")
    assert client.get_run(victim.info.run_id).info.lifecycle_stage == "deleted"  # replaced by a fresh run
    assert counts["replaced_fold_attempts"] >= 1 and counts["iterations_redone"] >= 2 * ITERS, counts
    _record(
        tmp_path,
        {
            "fault": "worker node killed mid-fold, mid_fold_resume: false",
            "trials_lost": 0,
            "trials_duplicated": 0,
            **counts,
            "wall_s": round(time.time() - t0, 1),
            "after_fault_s": round(time.time() - t_fault, 1),
        },
    )


@pytest.mark.timeout(1500)
def test_driver_killed_while_a_node_is_down_then_resume_completes(cluster, tmp_path):
    c = cluster
    alive = c.alive_node_ids()
    if c.node_ids[2] in alive:  # run alone: take node 2 down first, as the test above leaves it
        c.kill_node(2)
    assert c.node_ids[1] in alive
    pace = pace_file(tmp_path)
    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("driverkill"), name="driverkill", trials=2, reproductions=2, pace=pace
    )
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        # Kill the driver once the first trial has finished and the second has folds running, mid-fold.
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.time() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)
            _, runs = _runs(c, "driverkill-experiment")
            trials = [r for r in runs if r.data.tags.get("stage") == "trial"]
            if any(r.info.status == "FINISHED" for r in trials) and len(trials) == 2:
                break
        _wait_for_fold(c, "driverkill-experiment", proc, log_path, node_id=None, evals=2)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started on this machine
        proc.wait(timeout=60)
    finally:
        pace.unlink(missing_ok=True)  # --resume at full speed
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, before = _runs(c, "driverkill-experiment")
    first_done = [r for r in before if r.data.tags.get("stage") == "trial" and r.info.status == "FINISHED"]
    assert len(first_done) == 1

    proc = _start(c, cfg, log_path, "--resume")
    text = _finish(proc, log_path, timeout=1200)
    counts = _check_tree(c, "driverkill-experiment", parents=4)
    from mlflow.entities import ViewType

    _, active = _runs(c, "driverkill-experiment", ViewType.ACTIVE_ONLY)
    trials = sorted((r for r in active if r.data.tags.get("stage") == "trial"), key=lambda r: r.info.start_time)
    assert len(trials) == 2, [r.data.tags for r in trials]
    # the trial that had finished before the kill is the same run, not rerun
    assert first_done[0].info.run_id in {r.info.run_id for r in trials}
    reps = [r for r in active if r.data.tags.get("stage") == "reproduction"]
    assert sorted(int(r.data.tags["reproduction"]) for r in reps) == [0, 1]  # none duplicated
    # max_concurrent_trials: 1 across the resume: trial runs do not overlap in time
    for a, b in zip(trials, trials[1:]):
        assert a.info.end_time <= b.info.start_time, [(r.info.start_time, r.info.end_time) for r in trials]
    # every run of the resumed sweep, replacements included, carries the identifying tags
    for r in active:
        s = r.data.tags.get("stage")
        need = {
            "study": ("stage", "study", "dataset", "loss"),
            "trial": ("stage", "study", "trial_id"),
            "reproduction": ("stage", "study", "trial_id"),
            "fold": IDENTIFYING,
        }[s]
        missing = [k for k in need if k not in r.data.tags]
        assert not missing, (s, missing, r.data.tags)
    assert "resum" in text.lower()
    _record(
        tmp_path,
        {
            "fault": "sweep driver SIGKILLed while a worker node is down, then --resume",
            "trials_lost": 0,
            "trials_duplicated": 0,
            **counts,
            "wall_s": round(time.time() - t0, 1),
        },
    )
