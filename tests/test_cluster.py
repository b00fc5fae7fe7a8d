"""A sweep on a real multi-node Ray cluster: ``dmlrc sweep CONFIG --address <head>`` against a head + 2 worker nodes
started with ``ray start`` (``tests/cluster.py``), ``storage: s3://`` on SeaweedFS and an ``mlflow server`` on
PostgreSQL.  The head has no CPUs, each worker 2: a trial's four folds (1 CPU each, all submitted at once) cannot fit
on one node, so they must land on both workers — read back from the fold runs' ``node_id`` tags.

The sweep studies a user's own loss and trunk by import path (``examples/plugin``, never installed anywhere), shipped
to the worker nodes by the config's ``runtime_env.py_modules``, next to ``contrastive``, one study after the other
(``max_concurrent_studies: 1``: the second study run starts after the first has ended; the default, studies at once,
is ``tests/test_studies_sweep.py``).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_on_a_multi_node_cluster_spreads_folds_over_the_nodes(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all
    from tests.cluster import ClusterUnavailable, local_cluster

    try:
        cluster = local_cluster(tmp_path, workers=2, worker_cpus=2)
        c = cluster.__enter__()
    except ClusterUnavailable as e:
        pytest.skip(f"no PostgreSQL for the MLflow server: {e}")
    try:
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

        client = MlflowClient(c.tracking_uri)
        exp = client.get_experiment_by_name("multinode-experiment")
        runs = search_all(client, exp.experiment_id, "")
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
    finally:
        cluster.__exit__(None, None, None)
