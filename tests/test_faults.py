"""Faults on a real multi-node Ray cluster on one machine: ``tests/cluster.py`` starts a head
(no CPUs; it declares ``dmlrc_trial_driver``, so trial drivers run there) and two worker nodes of 2 CPUs, SeaweedFS
for ``storage: s3://`` and an ``mlflow server`` on PostgreSQL.  One cluster serves the module, in order:

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

4. **the S3 server frozen** (SIGSTOP) for 30 s during the search trial's folds and for 120 s (longer than a fold)
   during a reproduction's: storage trouble is retried, not turned into retraining; nothing lost.

5. **the MLflow server killed** (SIGKILL of its process group) once a fold has evaluated twice, and left down for
   longer than ``tracking.outage_timeout_s`` (20 s here): the sweep stops by itself within a bounded time, with one
   ``tracking error:`` line naming the setting and the resume command (exit status 3, no traceback).  The server is
   started again on the same port and database; ``--resume`` completes the study and the logging: every evaluation
   of every fold once, none missing, no run left RUNNING, nothing trained twice beyond one interval per resume.

6. **a trial whose folds diverge** (a search space whose second trial draws a margin that makes the loss +inf at
   once): the trial is recorded ``diverged`` with the fold's reason, and the study goes on to its reproductions.

7. **a corrupt data shard**: CUB-layout shards prepared into S3, verified into the driver's cache, then shard 0 in
   S3 overwritten with a damaged copy; each worker node has its own cache (its own disk), so its folds download the
   damaged shard.  The folds fail naming the shard, the trial is recorded FAILED with that reason, the shard study
   fails with it, and the sweep's other study (synthetic data) finishes: exit 1 (a study failed), no hang.

8. **the node that hosts the trial's own driver killed mid-fold**, on a cluster whose head does *not* declare
   ``dmlrc_trial_driver`` (so the trial's Tune actor runs on a worker node) and ``resources.trial_retries: 1``: Tune
   restarts the trial on the surviving node under the same trial id and MLflow run; every fold, those of the dead
   node and those whose owner died with it, resumes from its checkpoint; nothing lost or duplicated.

Faults 1-3 and 8 need a trial's four folds spread over both worker nodes; 4-7 do not depend on where a fold runs
and use two folds per trial (half the work of this, the slowest test module).

Each test writes one row of measurements (faults, trials finished/lost/duplicated, folds resumed, iterations redone,
wall time) to ``reliability.jsonl`` in its tmp dir and prints it: ``bench/README_faults.md`` quotes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

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
    **resources,
) -> Path:
    """test_cluster's tiny cluster sweep with longer folds: 32 classes × 8, batches of 8 × 4, no early stop.
    ``folds``: 4 spread a trial over both worker nodes (2 CPUs each), which the node faults need; the faults whose
    place does not matter (S3, MLflow, a diverging trial, a corrupt shard) run 2, half the work."""
    from tests.test_cluster import cluster_sweep_config

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
        **resources,
    )
    doc = yaml.safe_load(path.read_text())
    doc["seed"] = 5
    doc["datasets"][0].update(num_classes=32, per_class=8)
    doc["model"]["embedding_dim"] = 16
    doc["protocol"]["patience"] = 50
    doc["protocol"]["folds"] = folds
    doc["protocol"]["train"].update(classes_per_batch=8, m=4)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.cluster import ClusterUnavailable, local_cluster

    work = tmp_path_factory.mktemp("faults")
    try:
        cm = local_cluster(work, workers=2, worker_cpus=2)
        c = cm.__enter__()
    except ClusterUnavailable as e:
        pytest.skip(f"no PostgreSQL for the MLflow server: {e}")
    try:
        yield c
    finally:
        cm.__exit__(None, None, None)


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


@pytest.mark.timeout(1200)
def test_a_worker_node_killed_mid_fold_resumes_on_the_surviving_node(cluster, tmp_path):
    c = cluster
    cfg = _config(tmp_path, c.tracking_uri, c.storage("nodekill"), name="nodekill", trials=1, reproductions=2)
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        victim = _wait_for_fold(c, "nodekill-experiment", proc, log_path, node_id=c.node_ids[2], evals=3)
        killed = c.kill_node(2)
        t_fault = time.time()
        text = _finish(proc, log_path, timeout=900)
    finally:
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
    )
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        victim = _wait_for_fold(c, "noresume-experiment", proc, log_path, node_id=c.node_ids[2], evals=3)
        c.kill_node(2)
        t_fault = time.time()
        _finish(proc, log_path, timeout=900)
    finally:
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
    cfg = _config(tmp_path, c.tracking_uri, c.storage("driverkill"), name="driverkill", trials=2, reproductions=2)
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


def _s3_pid(c) -> int:
    """The pid of the cluster's SeaweedFS server (one ``weed server -s3`` process), found by its S3 port."""
    import psutil
    import ray  # noqa: F401 - puts Ray's vendored psutil on sys.path

    flag = "-s3.port=" + c.s3_endpoint.rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        if flag in (p.info["cmdline"] or []):
            return p.pid
    raise AssertionError(f"no process runs the S3 server of {c.s3_endpoint}")


@pytest.mark.timeout(1500)
def test_s3_stopped_for_30_s_and_for_longer_than_a_fold(cluster, tmp_path):
    """The S3 server (checkpoints, fold results, MLflow's artifacts) is frozen (SIGSTOP: it accepts connections and
    answers nothing) for 30 s once the search trial's folds have evaluated twice, and again for 120 s -- longer than a
    whole fold here -- once a reproduction's folds are training.  Nothing is lost and no fold trains again more than
    the interval since its last stored checkpoint; storage trouble is retried, not turned into retraining."""
    c = cluster
    _with_node_2(c)
    cfg = _config(tmp_path, c.tracking_uri, c.storage("s3outage"), name="s3outage", trials=1, reproductions=2, folds=2)
    log_path = tmp_path / "sweep.log"
    pid = _s3_pid(c)
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    outages = []
    try:
        for evals, seconds, stage in ((2, 30, "trial"), (1, 120, "reproduction")):
            deadline = time.time() + 900
            while True:  # a RUNNING fold of the stage's parent with `evals` evaluations
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.time() < deadline, log_path.read_text()[-4000:]
                time.sleep(1)
                try:
                    client, runs = _runs(c, "s3outage-experiment")
                    parents = {r.info.run_id for r in runs if r.data.tags.get("stage") == stage}
                    if any(
                        r.data.tags.get("stage") == "fold"
                        and r.info.status == "RUNNING"
                        and r.data.tags.get("mlflow.parentRunId") in parents
                        and len(client.get_metric_history(r.info.run_id, "val.map_at_r")) >= evals
                        for r in runs
                    ):
                        break
                except Exception:  # noqa: BLE001
                    continue
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)
            outages.append(seconds)
        text = _finish(proc, log_path, timeout=1200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    counts = _check_tree(c, "s3outage-experiment", parents=3, n_folds=2)
    store_failures = text.count("failed (")
    _record(
        tmp_path,
        {
            "fault": "S3 server stopped (SIGSTOP) for 30 s, then for 120 s",
            "outages_s": outages,
            "trials_lost": 0,
            "trials_duplicated": 0,
            **counts,
            "storage_warnings": store_failures,
            "wall_s": round(time.time() - t0, 1),
        },
    )


OUTAGE_S = 20  # tracking.outage_timeout_s of the MLflow test: the sweep must stop this long after the server died
STOP_BOUND_S = 200  # ... plus at most this: one MLflow back-off step (≤ 120 s), the studies' stop, Ray's shutdown


@pytest.mark.timeout(1500)
def test_mlflow_killed_longer_than_its_retries_stops_the_sweep_then_resume_completes(cluster, tmp_path):
    c = cluster
    _with_node_2(c)
    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("mlflowdown"), name="mlflowdown", trials=1, reproductions=2, folds=2
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["tracking"]["outage_timeout_s"] = OUTAGE_S
    cfg.write_text(yaml.safe_dump(doc))
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        _wait_for_fold(c, "mlflowdown-experiment", proc, log_path, node_id=None, evals=2)
        c.mlflow.stop(signal.SIGKILL)
        t_kill = time.time()
        try:
            rc = proc.wait(timeout=OUTAGE_S + STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                "the sweep did not stop while MLflow was down:\n" + log_path.read_text(errors="replace")[-6000:]
            ) from None
        stopped_after = time.time() - t_kill
        down_s = stopped_after + 5
        time.sleep(5)  # still down a little after the stop: nothing may depend on the server coming back at once
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if c.mlflow.proc is None:  # an operator restarts the server: same port, same database and artifact store
            c.mlflow.start()
    text = log_path.read_text(errors="replace")
    assert rc == 3, text[-6000:]
    said = [line for line in text.splitlines() if line.startswith("tracking error:")]
    assert len(said) == 1, text[-6000:]
    assert "tracking.outage_timeout_s" in said[0] and "--resume" in said[0], said
    assert "Traceback" not in text, text[-6000:]
    assert OUTAGE_S <= stopped_after <= OUTAGE_S + STOP_BOUND_S, stopped_after

    t_resume = time.time()
    proc = _start(c, cfg, log_path, "--resume")
    _finish(proc, log_path, timeout=1200)
    counts = _check_tree(c, "mlflowdown-experiment", parents=3, n_folds=2)
    _record(
        tmp_path,
        {
            "fault": f"MLflow server SIGKILLed mid-fold, down {down_s:.0f} s "
            f"(tracking.outage_timeout_s {OUTAGE_S}), restarted, then --resume",
            "trials_lost": 0,
            "trials_duplicated": 0,
            **counts,
            "stopped_after_s": round(stopped_after, 1),
            "resume_s": round(time.time() - t_resume, 1),
            "wall_s": round(time.time() - t0, 1),
        },
    )


@pytest.mark.timeout(1200)
def test_a_trial_whose_folds_diverge_is_recorded_with_its_reason_and_the_study_goes_on(cluster, tmp_path):
    """Two random start-up trials over a space where ``neg_margin`` is 0.3841 (MLRC's CUB200 optimum) or 3e38 (every
    negative pair's hinge is ~3e38; their mean overflows to +inf on the first batch).  With ``seed: 5`` Optuna draws
    one of each; the test asserts only that exactly one trial diverged."""
    c = cluster
    _with_node_2(c)
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "contrastive.yaml").write_text(
        yaml.safe_dump(
            {
                "loss": "contrastive",
                "space": {
                    "pos_margin": {"low": -0.2, "high": 2.0},
                    "neg_margin": {"type": "categorical", "choices": [0.3841, 3.0e38]},
                },
                "paper_defaults": {"pos_margin": -0.2, "neg_margin": 0.3841},
            }
        )
    )
    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("diverge"), name="diverge", trials=2, reproductions=2, epochs=SHORT, folds=2
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["tune_spaces"] = str(spaces)
    cfg.write_text(yaml.safe_dump(doc))
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = _start(c, cfg, log_path)
    try:
        _finish(proc, log_path, timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    counts = _check_tree(c, "diverge-experiment", parents=4, epochs=SHORT, n_folds=2)
    from mlflow.entities import ViewType

    client, runs = _runs(c, "diverge-experiment", ViewType.ACTIVE_ONLY)
    trials = [r for r in runs if r.data.tags.get("stage") == "trial"]
    diverged = [r for r in trials if r.data.tags.get("status") == "diverged"]
    assert len(diverged) == 1, [(r.data.tags.get("status"), r.data.params) for r in trials]
    assert float(diverged[0].data.params["neg_margin"]) == 3.0e38
    assert "non-finite loss" in diverged[0].data.tags["reason"], diverged[0].data.tags
    assert diverged[0].data.tags["reason"].startswith("fold "), diverged[0].data.tags  # which fold, then why
    study = [r for r in runs if r.data.tags.get("stage") == "study"][0]
    assert study.data.metrics["trials.diverged"] == 1 and study.data.metrics["trials.ok"] == 1
    ok = [r for r in trials if r is not diverged[0]][0]
    assert study.data.tags["best_trial_id"] == ok.data.tags["trial_id"]  # the study went on with the other trial
    _record(
        tmp_path,
        {
            "fault": "a trial whose folds diverge (loss +inf on the first batch)",
            "trials_lost": 0,
            "trials_duplicated": 0,
            "trials_diverged": len(diverged),
            **counts,
            "wall_s": round(time.time() - t0, 1),
        },
    )


@pytest.mark.timeout(1200)
def test_a_corrupt_shard_fails_its_folds_naming_it_and_the_other_study_finishes(cluster, tmp_path):
    import boto3

    from dml_core.datasets import prepare
    from dml_core.shards import verify_shards
    from tests.test_datasets_prepare import make_fake_cub

    c = cluster
    _with_node_2(c)
    s3 = boto3.client(
        "s3",
        endpoint_url=c.s3_endpoint,
        aws_access_key_id=c.access_key,
        aws_secret_access_key=c.secret_key,
        region_name="us-east-1",
    )
    dest = f"s3://{c.s3_bucket}/corrupt/cub"
    make_fake_cub(tmp_path / "src", n_classes=32, per_class=6)
    env = c.driver_env(DMLRC_CACHE_DIR=str(tmp_path / "driver-cache"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # prepare and verify as the driver's machine does: its S3 keys and its own cache
    try:
        manifest = prepare(
            "cub200", tmp_path / "src", dest, endpoint_url=c.s3_endpoint, progress=False, max_shard_bytes=4000
        )
        verify_shards(dest, endpoint_url=c.s3_endpoint)  # a good copy of every shard in the driver's cache
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    shard = manifest["shards"][0]["path"]
    key = f"corrupt/cub/{shard}"
    good = s3.get_object(Bucket=c.s3_bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # a damaged object (a bad upload, bit rot): its sha256 no longer matches
    s3.put_object(Bucket=c.s3_bucket, Key=key, Body=bytes(bad))

    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("corrupt"), name="corrupt", trials=1, reproductions=2, epochs=SHORT, folds=2
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["datasets"].append({"name": "cub-shards", "kind": "parquet", "path": dest, "image_size": 16})
    cfg.write_text(yaml.safe_dump(doc))
    log_path = tmp_path / "sweep.log"
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", c.address],
        cwd=tmp_path,
        stdout=open(log_path, "ab"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        rc = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the sweep hung:\n" + log_path.read_text(errors="replace")[-6000:]) from None
    text = log_path.read_text(errors="replace")
    assert rc == 1, text[-6000:]  # one study failed, the sweep itself did not
    counts = _check_tree(c, "corrupt-experiment", parents=3, study="synthetic/contrastive", epochs=SHORT, n_folds=2)
    from mlflow.entities import ViewType

    _, runs = _runs(c, "corrupt-experiment", ViewType.ACTIVE_ONLY)
    mine = [r for r in runs if r.data.tags.get("study") == "cub-shards/contrastive"]
    study = [r for r in mine if r.data.tags.get("stage") == "study"]
    assert len(study) == 1 and study[0].info.status == "FAILED", [r.data.tags for r in study]
    trials = [r for r in mine if r.data.tags.get("stage") == "trial"]
    assert trials and all(r.info.status == "FAILED" for r in trials), [(r.info.status, r.data.tags) for r in trials]
    for r in trials + study:  # the trial and the study say which file is at fault
        assert f"{dest}/{shard}" in r.data.tags.get("reason", ""), r.data.tags
        assert "sha256" in r.data.tags["reason"], r.data.tags
    folds = [r for r in mine if r.data.tags.get("stage") == "fold"]
    assert folds and all(r.info.status != "RUNNING" for r in folds)
    _record(
        tmp_path,
        {
            "fault": "a corrupt data shard in S3 (one study), the other study synthetic",
            "trials_lost": 0,
            "trials_duplicated": 0,
            "failed_study_trials": len(trials),
            "failed_study_folds": len(folds),
            **counts,
            "wall_s": round(time.time() - t0, 1),
        },
    )


@pytest.mark.timeout(1500)
def test_the_node_hosting_the_trials_driver_killed_mid_fold_the_trial_retries_on_the_survivor(tmp_path):
    from tests.cluster import ClusterUnavailable, local_cluster

    try:
        cm = local_cluster(tmp_path / "cluster", workers=2, worker_cpus=2, driver_resource=False)
        c = cm.__enter__()
    except ClusterUnavailable as e:
        pytest.skip(f"no PostgreSQL for the MLflow server: {e}")
    try:
        cfg = _config(
            tmp_path,
            c.tracking_uri,
            c.storage("driverhost"),
            name="driverhost",
            trials=1,
            reproductions=2,
            trial_retries=1,
        )
        log_path = tmp_path / "sweep.log"
        t0 = time.time()
        proc = _start(c, cfg, log_path)
        try:
            _wait_for_fold(c, "driverhost-experiment", proc, log_path, node_id=None, evals=3)
            _, runs = _runs(c, "driverhost-experiment")
            trial = [r for r in runs if r.data.tags.get("stage") == "trial"][0]
            host = trial.data.tags["driver_node_id"]
            assert host in c.node_ids[1:], (host, c.node_ids)  # the trial's driver runs on a worker node
            victim = c.node_ids.index(host)
            c.kill_node(victim)
            t_fault = time.time()
            text = _finish(proc, log_path, timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        counts = _check_tree(c, "driverhost-experiment", parents=3)
        from mlflow.entities import ViewType

        _, active = _runs(c, "driverhost-experiment", ViewType.ACTIVE_ONLY)
        trials = [r for r in active if r.data.tags.get("stage") == "trial"]
        assert [r.info.run_id for r in trials] == [trial.info.run_id], [r.data.tags for r in trials]  # same run
        survivor = c.node_ids[3 - victim]
        assert trials[0].data.tags["driver_node_id"] == survivor, trials[0].data.tags
        assert counts["folds_resumed"] >= 1 and counts["replaced_fold_attempts"] == 0, counts
        _record(
            tmp_path,
            {
                "fault": "the node hosting the trial's driver killed mid-fold (trial_retries: 1)",
                "trials_lost": 0,
                "trials_duplicated": 0,
                **counts,
                "wall_s": round(time.time() - t0, 1),
                "after_fault_s": round(time.time() - t_fault, 1),
            },
        )
        assert "no node declares the custom resource" in text and "trial_retries >= 1" not in text  # the set-up note
    finally:
        cm.__exit__(None, None, None)
