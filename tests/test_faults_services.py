"""The faults of the services a cluster sweep depends on, and of its data, on a real multi-node Ray cluster on one
machine (the cluster and the helpers of ``tests/test_faults.py``; a cluster of this module's own, so that it runs
beside the node faults).  In order:

1. **the S3 server frozen** (SIGSTOP) for 30 s during the search trial's folds and for 120 s (longer than a fold)
   during a reproduction's: storage trouble is retried, not turned into retraining; nothing lost.

2. **the MLflow server killed** (SIGKILL of its process group) once a fold has evaluated twice, and left down for
   longer than ``tracking.outage_timeout_s`` (20 s here): the sweep stops by itself within a bounded time, with one
   ``tracking error:`` line naming the setting and the resume command (exit status 3, no traceback).  The server is
   started again on the same port and database; ``--resume`` completes the study and the logging: every evaluation
   of every fold once, none missing, no run left RUNNING, nothing trained twice beyond one interval per resume.

3. **a corrupt data shard and a diverging trial, in one sweep of two studies**: CUB-layout shards prepared into S3,
   verified into the driver's cache, then shard 0 in S3 overwritten with a damaged copy; each worker node has its own
   cache (its own disk), so its folds download the damaged shard.  The folds fail naming the shard, the trials are
   recorded FAILED with that reason and the shard study fails with it.  The other study (synthetic data) searches a
   space whose second trial draws a margin that makes the loss +inf at once: that trial is recorded ``diverged`` with
   the fold's reason, and the study goes on to its reproductions and finishes.  Exit 1 (a study failed), no hang.

Where a fold runs does not matter to these faults: two folds per trial (half the work of four).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.paced_trunk import pace_file
from tests.test_faults import (
    SHORT,
    _check_tree,
    _config,
    _finish,
    _record,
    _runs,
    _start,
    _wait_for_fold,
    _with_node_2,
)

pytestmark = pytest.mark.slow


def _s3_pid(c) -> int:
    """The pid of the cluster's SeaweedFS server (one ``weed server -s3`` process), found by its S3 port."""
    from tests.cluster import vendored_psutil

    psutil = vendored_psutil()

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
    pace = pace_file(tmp_path)
    cfg = _config(
        tmp_path, c.tracking_uri, c.storage("s3outage"), name="s3outage", trials=1, reproductions=2, folds=2, pace=pace
    )
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
            if stage == "reproduction":
                pace.unlink()  # the last fault: the rest at full speed
            try:
                time.sleep(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)
            outages.append(seconds)
        text = _finish(proc, log_path, timeout=1200)
    finally:
        pace.unlink(missing_ok=True)
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
        tmp_path,
        c.tracking_uri,
        c.storage("mlflowdown"),
        name="mlflowdown",
        trials=1,
        reproductions=2,
        folds=2,
        pace=(pace := pace_file(tmp_path)),
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
        pace.unlink()  # --resume at full speed
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
        pace.unlink(missing_ok=True)
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
def test_a_corrupt_shard_fails_its_study_naming_it_and_a_diverging_trial_is_recorded_while_the_other_study_goes_on(
    cluster, tmp_path
):
    """Two studies of ``contrastive``, two random start-up trials each, over a space where ``neg_margin`` is 0.3841
    (MLRC's CUB200 optimum) or 3e38 (every negative pair's hinge is ~3e38; their mean overflows to +inf on the first
    batch).  With ``seed: 5`` Optuna draws one of each for the synthetic study; the test asserts only that exactly
    one of its trials diverged.  The shard study's folds never train: its shard fails its checksum first."""
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
        tmp_path, c.tracking_uri, c.storage("corrupt"), name="corrupt", trials=2, reproductions=2, epochs=SHORT, folds=2
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["datasets"].append({"name": "cub-shards", "kind": "parquet", "path": dest, "image_size": 16})
    doc["tune_spaces"] = str(spaces)
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
    counts = _check_tree(c, "corrupt-experiment", parents=4, study="synthetic/contrastive", epochs=SHORT, n_folds=2)
    from mlflow.entities import ViewType

    _, runs = _runs(c, "corrupt-experiment", ViewType.ACTIVE_ONLY)

    # the corrupt shard: its study and trials FAILED, each saying which file is at fault; no fold left RUNNING
    mine = [r for r in runs if r.data.tags.get("study") == "cub-shards/contrastive"]
    study = [r for r in mine if r.data.tags.get("stage") == "study"]
    assert len(study) == 1 and study[0].info.status == "FAILED", [r.data.tags for r in study]
    failed = [r for r in mine if r.data.tags.get("stage") == "trial"]
    assert failed and all(r.info.status == "FAILED" for r in failed), [(r.info.status, r.data.tags) for r in failed]
    for r in failed + study:
        assert f"{dest}/{shard}" in r.data.tags.get("reason", ""), r.data.tags
        assert "sha256" in r.data.tags["reason"], r.data.tags
    folds = [r for r in mine if r.data.tags.get("stage") == "fold"]
    assert folds and all(r.info.status != "RUNNING" for r in folds)

    # the diverging trial of the synthetic study: recorded with its reason, the study went on with the other trial
    ours = [r for r in runs if r.data.tags.get("study") == "synthetic/contrastive"]
    trials = [r for r in ours if r.data.tags.get("stage") == "trial"]
    diverged = [r for r in trials if r.data.tags.get("status") == "diverged"]
    assert len(diverged) == 1, [(r.data.tags.get("status"), r.data.params) for r in trials]
    assert float(diverged[0].data.params["neg_margin"]) == 3.0e38
    assert "non-finite loss" in diverged[0].data.tags["reason"], diverged[0].data.tags
    assert diverged[0].data.tags["reason"].startswith("fold "), diverged[0].data.tags  # which fold, then why
    synthetic = [r for r in ours if r.data.tags.get("stage") == "study"][0]
    assert synthetic.data.metrics["trials.diverged"] == 1 and synthetic.data.metrics["trials.ok"] == 1
    ok = [r for r in trials if r is not diverged[0]][0]
    assert synthetic.data.tags["best_trial_id"] == ok.data.tags["trial_id"]
    _record(
        tmp_path,
        {
            "fault": "a corrupt data shard in S3 (one study); a trial whose folds diverge (the other study)",
            "trials_lost": 0,
            "trials_duplicated": 0,
            "trials_diverged": len(diverged),
            "failed_study_trials": len(failed),
            "failed_study_folds": len(folds),
            **counts,
            "wall_s": round(time.time() - t0, 1),
        },
    )
