"""The node that hosts a trial's own driver killed mid-fold, on a real multi-node Ray cluster on one machine whose head
does *not* declare ``dmlrc_trial_driver`` (so the trial's Tune actor runs on a worker node), with
``resources.trial_retries: 1``: Tune restarts the trial on the surviving node under the same trial id and MLflow run;
every fold, those of the dead node and those whose owner died with it, resumes from its checkpoint; nothing lost or
duplicated.  Its own cluster (a different head), the sweep and checks of ``tests/test_faults.py``; a module of its
own, so that a pytest worker runs it beside the other fault modules.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.paced_trunk import pace_file
from tests.test_faults import _check_tree, _config, _finish, _record, _runs, _start, _wait_for_fold

pytestmark = pytest.mark.slow


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
            pace=(pace := pace_file(tmp_path)),
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
            pace.unlink()  # the retried trial at full speed
            text = _finish(proc, log_path, timeout=900)
        finally:
            pace.unlink(missing_ok=True)
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
