"""The sweep pipeline: fold reduction, best-trial choice, CIs (fast) and one real sweep against ``mlflow server``
(slow).

The slow tests run ``dmlrc sweep`` in a subprocess (it starts its own local Ray) against an ``mlflow server``
process with a sqlite backend and, when PostgreSQL answers on 127.0.0.1:5432, with a fresh PostgreSQL database;
then they read the MLflow run tree back and check it against the contract in ``docs/architecture.md``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipelines.execution.folds.config import FoldOutcome
from pipelines.execution.folds.trial import reduce_folds
from pipelines.names import OBJECTIVE, REPRODUCTION, study_dirname, tuner_name
from pipelines.results.embeddings import concatenated_embeddings
from tests.tiny_sweep import tiny_sweep

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("map_at_r", "r_precision", "precision_at_1")


# ------------------------------------------------------------------------------------------------ fast units


def _outcome(fold, status="ok", map_at_r=0.5, reason=""):
    return FoldOutcome(
        fold=fold,
        status=status,
        reason=reason,
        best_metrics={"map_at_r": map_at_r, "r_precision": map_at_r + 0.1, "precision_at_1": 0.9},
    )


def test_objective_is_the_fold_mean_with_its_sem():
    from scipy import stats

    vals = [0.41, 0.44, 0.39, 0.47]
    out = reduce_folds([_outcome(k, map_at_r=v) for k, v in enumerate(vals)])
    assert out["status"] == "ok"
    assert out["val.map_at_r.mean"] == pytest.approx(np.mean(vals), abs=1e-12)
    assert out["val.map_at_r.sem"] == pytest.approx(stats.sem(vals), abs=1e-12)
    assert out["val.r_precision.mean"] == pytest.approx(np.mean(vals) + 0.1)


def test_a_diverged_fold_scores_the_trial_zero_and_says_why():
    outs = [
        _outcome(0),
        _outcome(1, "diverged", reason="non-finite loss nan at iteration 7 (epoch 1)"),
        _outcome(2),
        _outcome(3),
    ]
    out = reduce_folds(outs)
    assert out["status"] == "diverged"
    assert out["val.map_at_r.mean"] == 0.0 and out["val.map_at_r.sem"] == 0.0
    assert out["reason"] == "fold 1: non-finite loss nan at iteration 7 (epoch 1)"


def test_best_trial_is_the_highest_observed_mean_among_ok_trials():
    from pipelines.execution.search.searcher import best_result

    rows = [
        {"trial_id": "a_00000", OBJECTIVE: 0.30, "status": "ok"},
        {"trial_id": "a_00001", OBJECTIVE: 0.0, "status": "diverged"},
        {"trial_id": "a_00002", OBJECTIVE: 0.42, "status": "ok"},
        {"trial_id": "a_00003", OBJECTIVE: 0.42, "status": "ok"},  # tie: the earlier trial wins
        {"trial_id": "a_00004", "error": "boom"},
    ]
    assert best_result(rows)["trial_id"] == "a_00002"
    assert best_result([rows[1], rows[4]]) is None


def test_concatenated_embedding_normalises_each_fold_model_first():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(5, 3)) * s for s in (1.0, 100.0)]
    cat = concatenated_embeddings(parts)
    assert cat.shape == (5, 6)
    np.testing.assert_allclose(np.linalg.norm(cat[:, :3], axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(cat[:, 3:], axis=1), 1.0, rtol=1e-6)


def test_confidence_intervals_are_student_t_across_reproductions():
    from scipy import stats

    from pipelines.results.study_results import StudySummary, ci_report, ci_table, confidence_intervals

    reps = [
        {REPRODUCTION: i, "test_concat_map_at_r": v, "test_separated_map_at_r": v - 0.05}
        for i, v in enumerate([0.30, 0.34, 0.32])
    ]
    ci = confidence_intervals(reps)
    lo, hi = stats.t.interval(0.95, 2, loc=0.32, scale=stats.sem([0.30, 0.34, 0.32]))
    assert ci["concat"]["map_at_r"] == pytest.approx((0.32, lo, hi))
    assert ci["separated"]["map_at_r"][0] == pytest.approx(0.27)
    s = StudySummary("d/l", "d", "l", "run", "ok", best_trial="t", best_params={"x": 1}, best_val=(0.4, 0.01), ci=ci)
    md, doc = ci_report(s, reps)
    assert "| map_at_r | 32.00 ±" in md and doc["metrics"]["concat"]["map_at_r"]["ci_low"] == pytest.approx(lo)
    assert "32.00 ± " in ci_table([s])


def test_optuna_space_follows_the_tune_space_scales():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from pipelines.config.spaces import Param
    from pipelines.execution.search.searcher import optuna_space

    sp = optuna_space(
        {
            "a": Param("a", 1e-6, 1.0, log=True),
            "k": Param("k", 1, 10, type="int"),
            "m": Param("m", -0.2, 2.0),
            "c": Param("c", type="categorical", choices=(0.05, 0.1)),
        }
    )
    assert sp["a"] == FloatDistribution(1e-6, 1.0, log=True)
    assert sp["k"] == IntDistribution(1, 10) and sp["m"] == FloatDistribution(-0.2, 2.0)
    assert sp["c"] == CategoricalDistribution([0.05, 0.1])


def test_gp_sampler_exists_with_startup_trials():
    import optuna

    s = optuna.samplers.GPSampler(seed=0, n_startup_trials=5)
    assert s._n_startup_trials == 5


def test_tracker_finds_runs_by_tags_and_hides_unfinished_attempts(tmp_path):
    from pipelines.tracking.runs import PARENT, Tracker

    t = Tracker.open(f"sqlite:///{tmp_path / 'm.db'}", "exp", (tmp_path / "art").as_uri())
    study, created = t.get_or_create({"study": "d/l", "stage": "study"})
    assert created
    assert t.get_or_create({"study": "d/l", "stage": "study"}) == (study, False)
    fold, _ = t.get_or_create({"stage": "fold", "fold": 0}, parent=study)
    assert t.run(fold).data.tags[PARENT] == study
    # a killed attempt left the fold RUNNING: it is soft-deleted and replaced, not reused
    fold2, created = t.get_or_create({"stage": "fold", "fold": 0}, parent=study, reuse_unfinished=False)
    assert created and fold2 != fold
    assert [r.info.run_id for r in t.children(study, stage="fold")] == [fold2]
    replaced = t.run(fold)  # ended, not left RUNNING among the deleted runs
    assert (replaced.info.lifecycle_stage, replaced.info.status) == ("deleted", "KILLED")
    t.finish(fold2)
    assert t.get_or_create({"stage": "fold", "fold": 0}, parent=study, reuse_unfinished=False) == (fold2, False)
    t.log_params(study, {"a": 1})
    t.log_params(study, {"a": 1, "b": 2})  # re-logging on resume skips existing keys
    assert t.run(study).data.params == {"a": "1", "b": "2"}


def test_trials_a_restored_search_no_longer_knows_are_ended_and_hidden(tmp_path):
    """A sweep driver killed before Tune's last snapshot reached storage: ``--resume`` reran a suggestion under a new
    trial id.  The lost trial's RUNNING run and its folds are ended KILLED with the reason and hidden; trials Tune
    knows (by id, or by the directory name of a trial that reported nothing) and finished runs stay."""
    from pipelines.execution.studies.runs import retire_lost_trials
    from pipelines.tracking.runs import Tracker

    t = Tracker.open(f"sqlite:///{tmp_path / 'm.db'}", "exp", (tmp_path / "art").as_uri())
    study, _ = t.get_or_create({"study": "d/l", "stage": "study"})
    runs = {
        tid: t.get_or_create({"stage": "trial", "trial_id": tid}, parent=study)[0]
        for tid in ("aaaa0001", "bbbb0002", "cccc0003", "dddd0004")
    }
    for tid in runs:
        t.set_tags(runs[tid], {"trial_id": tid})
    lost_fold, _ = t.get_or_create({"stage": "fold", "fold": 0}, parent=runs["bbbb0002"])
    t.finish(runs["dddd0004"], "FAILED")  # not RUNNING: left alone even though unknown
    known = {"aaaa0001", "run_trial_d__l_cccc0003_2_pos_margin=0.1_2026-11-24"}
    assert retire_lost_trials(t, study, known) == 1
    gone, fold = t.run(runs["bbbb0002"]), t.run(lost_fold)
    assert (gone.info.lifecycle_stage, gone.info.status) == ("deleted", "KILLED")
    assert (fold.info.lifecycle_stage, fold.info.status) == ("deleted", "KILLED")
    assert "new trial id" in gone.data.tags["reason"] and gone.data.tags["status"] == "replaced"
    kept = {r.data.tags["trial_id"] for r in t.children(study, stage="trial")}
    assert kept == {"aaaa0001", "cccc0003", "dddd0004"}
    assert retire_lost_trials(t, study, known) == 0


# ------------------------------------------------------------------------------------------------ the real sweep


def _sweep_config(
    tmp_path: Path, tracking_uri: str, *, losses, trials, workers, concurrent, name="e2e", folds: int = 4
) -> Path:
    return tiny_sweep(
        tmp_path,
        name,
        losses,
        protocol={"folds": folds, "fold_layout": "mlrc" if folds == 4 else "kfold", "trials": trials},
        # logical CPUs for every fold of every concurrent trial (the default is the usable cores): the run tree's
        # check wants a trial's folds to overlap in time
        resources={
            "workers_per_fold": workers,
            "max_concurrent_trials": concurrent,
            "num_cpus": folds * workers * concurrent + 1,
        },
        tracking={"uri": tracking_uri, "experiment": f"{name}-experiment"},
    )


def _run_cli(
    args: list[str], cwd: Path, timeout: int = 1200, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _check_run_tree(
    uri: str,
    experiment: str,
    *,
    losses: list[str],
    trials: int,
    workers: int,
    storage: Path,
    name: str,
    tune_result=None,
    n_folds: int = 4,
) -> None:
    """``tune_result(study, trial_id)`` reads what Tune stored for a trial (default: from local ``storage``)."""
    tune_result = tune_result or (lambda study, trial_id: _tune_result(storage, name, study, trial_id))
    import torch
    from mlflow.tracking import MlflowClient
    from scipy import stats

    from dml_core.evaluation.stats import confidence_interval
    from dml_core.splits import FoldManifest
    from pipelines.tracking.runs import PARENT, search_all

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None
    runs = search_all(c, exp.experiment_id, "")
    by_stage: dict[str, list] = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["stage"], []).append(r)
    assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]
    assert sorted(r.data.tags["loss"] for r in by_stage["study"]) == sorted(losses)
    n_rep = 2
    assert len(by_stage["trial"]) == trials * len(losses)
    assert len(by_stage["reproduction"]) == n_rep * len(losses)
    assert len(by_stage["fold"]) == n_folds * (trials + n_rep) * len(losses)
    children = {}
    for r in runs:
        children.setdefault(r.data.tags.get(PARENT), []).append(r)

    for study in by_stage["study"]:
        tags, m = study.data.tags, study.data.metrics
        sid = study.info.run_id
        for k in ("loss", "dataset", "protocol", "git_commit", "sweep"):
            assert tags.get(k), k
        assert tags["protocol"] == "mlrc" and tags["sweep"] == name and tags["done"] == "true"
        kids = children[sid]
        trial_runs = [r for r in kids if r.data.tags["stage"] == "trial"]
        rep_runs = sorted(
            (r for r in kids if r.data.tags["stage"] == "reproduction"), key=lambda r: int(r.data.tags["reproduction"])
        )
        assert len(trial_runs) == trials and [r.data.tags["reproduction"] for r in rep_runs] == ["0", "1"]

        # artifacts: fold manifest, CI report, best fold models
        names = {a.path for a in c.list_artifacts(sid)}
        assert {"folds.json", "ci_report.md", "ci_report.json", "models"} <= names, names
        manifest = FoldManifest.from_json(Path(c.download_artifacts(sid, "folds.json")).read_text())
        assert manifest.content_hash == tags["folds_hash"] and manifest.layout == ("mlrc" if n_folds == 4 else "kfold")
        model_files = sorted(a.path for a in c.list_artifacts(sid, "models"))
        assert model_files == [f"models/fold_{k}.pt" for k in range(n_folds)]
        state = torch.load(c.download_artifacts(sid, "models/fold_0.pt"), weights_only=False)
        from dml_core.models import build_model

        build_model(**state["model_kwargs"]).load_state_dict(state["model"])

        # trials: params = sampled hyperparameters; objective = fold mean (and its SEM) of best val MAP@R
        space_keys = {k[len("space.") :] for k in study.data.params if k.startswith("space.")}
        best_seen = -1.0
        for tr in trial_runs:
            assert set(tr.data.params) == space_keys
            assert tr.data.tags["status"] == "ok" and tr.data.tags["trial_id"]
            folds = sorted(children[tr.info.run_id], key=lambda r: int(r.data.tags["fold"]))
            assert [f.data.tags["fold"] for f in folds] == [str(k) for k in range(n_folds)]
            for metric in METRICS:
                vals = [f.data.metrics[f"best.val.{metric}"] for f in folds]
                assert tr.data.metrics[f"val.{metric}.mean"] == pytest.approx(np.mean(vals), abs=1e-9)
                assert tr.data.metrics[f"val.{metric}.sem"] == pytest.approx(stats.sem(vals), abs=1e-9)
            for f in folds:
                hist = c.get_metric_history(f.info.run_id, "val.map_at_r")
                steps = [h.step for h in hist]
                assert steps == sorted(set(steps)) and steps[0] == 0  # epoch 0 = untrained model, step = iteration
                assert f.data.metrics["best.val.map_at_r"] == pytest.approx(max(h.value for h in hist))
                assert f.data.tags["world_size"] == str(workers)
                assert f.data.tags["device"] == "cpu" and "gpu_name" not in f.data.tags
                if workers > 1:  # a Ray Train fold: torch.distributed on gloo (NCCL on GPUs: bench/README_gpu.md)
                    assert f.data.tags["dist_backend"] == "gloo"
            # the four folds of a trial ran concurrently: all four time spans overlap
            starts = [f.data.metrics["time.start"] for f in folds]
            ends = [f.data.metrics["time.end"] for f in folds]
            assert max(starts) < min(ends), (starts, ends)
            best_seen = max(best_seen, tr.data.metrics["val.map_at_r.mean"])
            # the Tune result (what the Bayesian optimiser saw) is the same fold mean
            result = tune_result(tags["study"], tr.data.tags["trial_id"])
            assert result[OBJECTIVE] == pytest.approx(tr.data.metrics["val.map_at_r.mean"], abs=1e-12)
        assert m["best.val.map_at_r.mean"] == pytest.approx(best_seen)
        assert study.data.params  # best.<hyperparameter>
        assert {k for k in study.data.params if k.startswith("best.")} == {f"best.{k}" for k in space_keys}

        # reproductions: separated = mean of the fold models' test metrics; CIs recomputed from the runs
        for rep in rep_runs:
            folds = children[rep.info.run_id]
            assert len(folds) == n_folds and rep.data.tags["seed"]
            for metric in METRICS:
                sep = np.mean([f.data.metrics[f"test.{metric}"] for f in folds])
                assert rep.data.metrics[f"test.separated.{metric}"] == pytest.approx(sep, abs=1e-9)
        test_keys = {k[len("test.concat.") :] for k in rep_runs[0].data.metrics if k.startswith("test.concat.")}
        assert {"precision_at_1", "r_precision", "map_at_r", "recall_at_1", "ndcg_at_2"} <= test_keys
        for mode in ("concat", "separated"):
            for metric in test_keys:
                if f"test.{mode}.{metric}" not in rep_runs[0].data.metrics:
                    continue
                vals = [r.data.metrics[f"test.{mode}.{metric}"] for r in rep_runs]
                mean, lo, hi = confidence_interval(vals)
                assert m[f"test.{mode}.{metric}.mean"] == pytest.approx(mean, abs=1e-9)
                if math.isfinite(lo):
                    assert m[f"test.{mode}.{metric}.ci_low"] == pytest.approx(lo, abs=1e-9)
                    assert m[f"test.{mode}.{metric}.ci_high"] == pytest.approx(hi, abs=1e-9)
        report = json.loads(Path(c.download_artifacts(sid, "ci_report.json")).read_text())
        assert report["n_reproductions"] == 2
        assert report["metrics"]["concat"]["map_at_r"]["mean"] == pytest.approx(m["test.concat.map_at_r.mean"])


def _tune_result(storage: Path, name: str, study: str, trial_id: str) -> dict:
    folder = storage / name / "ray" / study_dirname(study)
    search = folder / tuner_name(name, str(folder), "search")
    for result in search.glob(f"*{trial_id}*/result.json"):
        rows = [json.loads(line) for line in result.read_text().splitlines() if line.strip()]
        return rows[-1]
    raise AssertionError(f"no Tune result for {trial_id} under {search}")


@pytest.mark.slow
def test_sweep_end_to_end_against_mlflow_server_postgresql(tmp_path):
    """The same tree through an ``mlflow server`` on a fresh PostgreSQL database (skipped without PostgreSQL), two
    trials at once (single-worker warm folds)."""
    from tests.mlflow_server import PostgresUnavailable, mlflow_server, postgres_database

    try:
        db = postgres_database()
        pg_uri = db.__enter__()
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL not reachable: {e}")
    try:
        with mlflow_server(tmp_path / "server", backend_uri=pg_uri) as uri:
            cfg = _sweep_config(tmp_path, uri, losses=["contrastive"], trials=2, workers=1, concurrent=2, name="e2epg")
            out = _run_cli(["sweep", str(cfg)], cwd=tmp_path)
            assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
            _check_run_tree(
                uri,
                "e2epg-experiment",
                losses=["contrastive"],
                trials=2,
                workers=1,
                storage=tmp_path / "runs",
                name="e2epg",
            )
            from mlflow.tracking import MlflowClient

            from pipelines.tracking.runs import search_all

            c = MlflowClient(uri)
            runs = search_all(c, c.get_experiment_by_name("e2epg-experiment").experiment_id, "tags.stage = 'trial'")
            (s1, e1), (s2, e2) = sorted((r.info.start_time, r.info.end_time) for r in runs)
            assert s2 < e1, "max_concurrent_trials: 2 did not run the two trials at once"
    finally:
        db.__exit__(None, None, None)


@pytest.mark.slow
def test_sweep_with_mlflow_artifacts_and_ray_storage_on_s3(tmp_path, monkeypatch):
    """``storage: s3://…`` on a real S3 server (SeaweedFS): Ray Tune/Train persist there and MLflow's artifacts go there
    too (tracking DB local sqlite); nothing Ray writes lands on the local disk, and the run tree is complete.  Two
    k-fold folds: the protocol's four are the PostgreSQL sweep's subject."""
    import boto3
    from mlflow.tracking import MlflowClient
    from s3_server import s3_server

    with s3_server(tmp_path) as (endpoint, access_key, secret_key):
        s3_env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        for k, v in s3_env.items():  # this process reads the artifacts back through MLflow's S3 client
            monkeypatch.setenv(k, v)
        # The sweep must choose S3-compatible checksums itself (s3_compat_env): the test does not set them.
        for k in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"):
            monkeypatch.delenv(k, raising=False)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="sweeps")
        uri = "sqlite:///" + str(tmp_path / "tracking" / "mlflow.db")
        (tmp_path / "tracking").mkdir()
        cfg_path = _sweep_config(
            tmp_path, uri, losses=["contrastive"], trials=1, workers=1, concurrent=1, name="s3sweep", folds=2
        )
        doc = yaml.safe_load(cfg_path.read_text())
        doc["storage"] = "s3://sweeps/team"
        cfg_path.write_text(yaml.safe_dump(doc))

        out = _run_cli(["sweep", str(cfg_path)], cwd=tmp_path, extra_env=s3_env)
        assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
        assert "storage s3://sweeps/team/s3sweep/ray" in out.stdout

        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket="sweeps")
            for o in page.get("Contents", [])
        ]
        ray_prefix = f"team/s3sweep/ray/{study_dirname('synthetic/contrastive')}/"
        search = tuner_name("s3sweep", ray_prefix, "search") + "/"
        assert any(k.startswith(ray_prefix + search) and k.endswith("/result.json") for k in keys), keys[:50]
        fold_outcomes = [k for k in keys if k.startswith(ray_prefix + "folds/") and k.endswith("/outcome.json")]
        assert len(fold_outcomes) == 2 * (1 + 2), fold_outcomes  # (1 trial + 2 reproductions) × 2 folds
        assert not (tmp_path / "runs" / "s3sweep" / "ray").exists()  # Ray wrote nothing locally

        c = MlflowClient(uri)
        study = c.search_runs([c.get_experiment_by_name("s3sweep-experiment").experiment_id], "tags.stage = 'study'")[0]
        assert study.info.artifact_uri.startswith("s3://sweeps/team/s3sweep/mlartifacts/"), study.info.artifact_uri
        art_prefix = study.info.artifact_uri[len("s3://sweeps/") :]
        assert {f"{art_prefix}/models/fold_{k}.pt" for k in range(2)} | {f"{art_prefix}/folds.json"} <= set(keys)

        def tune_result_on_s3(study_key: str, trial_id: str) -> dict:
            folder = ray_prefix.replace(study_dirname("synthetic/contrastive"), study_dirname(study_key))
            prefix = folder + tuner_name("s3sweep", folder, "search") + "/"
            [key] = [k for k in keys if k.startswith(prefix) and trial_id in k and k.endswith("/result.json")]
            body = s3.get_object(Bucket="sweeps", Key=key)["Body"].read().decode()
            return [json.loads(line) for line in body.splitlines() if line.strip()][-1]

        # The whole tree (fold models and reports downloaded from S3 through MLflow) as in the local sweeps.
        _check_run_tree(
            uri,
            "s3sweep-experiment",
            losses=["contrastive"],
            trials=1,
            workers=1,
            storage=tmp_path / "runs",
            name="s3sweep",
            tune_result=tune_result_on_s3,
            n_folds=2,
        )


def test_s3_compat_env_only_for_a_custom_endpoint_and_never_over_the_users_choice(monkeypatch):
    from pipelines.execution.runtime.environment import s3_compat_env

    keys = (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REQUEST_CHECKSUM_CALCULATION",
        "AWS_RESPONSE_CHECKSUM_VALIDATION",
    )
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    s3_compat_env()  # AWS itself: the SDK defaults stay
    assert "AWS_REQUEST_CHECKSUM_CALCULATION" not in os.environ
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_supported")
    s3_compat_env()
    assert os.environ["AWS_REQUEST_CHECKSUM_CALCULATION"] == "when_required"
    assert os.environ["AWS_RESPONSE_CHECKSUM_VALIDATION"] == "when_supported"


def test_unreachable_s3_storage_is_one_error_naming_storage_before_ray_starts(tmp_path, monkeypatch, capsys):
    """A bucket nobody serves fails the sweep at once, naming ``storage``, before Ray or MLflow start."""
    from pipelines.cli import main
    from tests.mlflow_server import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for k in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"):
        monkeypatch.delenv(k, raising=False)  # should the sweep get as far as setting them here, undone afterwards
    monkeypatch.chdir(tmp_path)
    cfg_path = _sweep_config(
        tmp_path,
        "sqlite:///" + str(tmp_path / "m.db"),
        losses=["contrastive"],
        trials=1,
        workers=1,
        concurrent=1,
        name="nos3",
    )
    doc = yaml.safe_load(cfg_path.read_text())
    doc["storage"] = "s3://missing-bucket/x"
    cfg_path.write_text(yaml.safe_dump(doc))
    rc = main(["sweep", str(cfg_path)])
    err = capsys.readouterr().err
    assert rc != 0 and "storage" in err and "missing-bucket" in err, err
    assert not (tmp_path / "m.db").exists()  # MLflow was not touched


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_code_that_imports_on_the_driver_but_not_on_the_workers_is_one_line_and_writes_nothing(tmp_path):
    """A plugin loss that the driver imports and Ray's workers do not (here: its module raises on import where the
    config's ``runtime_env`` variable is set, as a missing native dependency would): the one ``config error`` line
    naming the loss comes before anything MLflow prints, and no sweep folder or ``mlflow.db`` is left behind.  The
    workers are asked before the tracking store is opened."""
    import shutil

    plugin = tmp_path / "plug"
    shutil.copytree(ROOT / "examples" / "plugin" / "src" / "dmlrc_example", plugin / "dmlrc_example")
    losses_py = plugin / "dmlrc_example" / "losses.py"
    future = "from __future__ import annotations\n"
    broken = (
        "import os\n"
        "if os.environ.get('DMLRC_TEST_ON_WORKER'):\n"
        "    raise ModuleNotFoundError(\"No module named 'mylab_native'\")\n"
    )
    losses_py.write_text(losses_py.read_text().replace(future, future + broken, 1))
    cfg_path = _sweep_config(
        tmp_path, "", losses=["dmlrc_example.losses:CircleLoss"], trials=1, workers=1, concurrent=1, name="split"
    )
    doc = yaml.safe_load(cfg_path.read_text())
    del doc["tracking"]  # the default store: runs/<name>/mlflow.db, next to the sweep's folder
    doc["runtime_env"] = {"env_vars": {"DMLRC_TEST_ON_WORKER": "1"}}
    doc["resources"]["num_cpus"] = 2
    cfg_path.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg_path)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order it was written
        text=True,
        timeout=540,
        env=env,
    )
    lines = proc.stdout.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("config error: ")]
    assert proc.returncode == 2 and errors, proc.stdout[-3000:]
    assert "losses[0].name" in lines[errors[0]] and "not on the Ray workers" in lines[errors[0]], lines[errors[0]]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    mlflow_lines = [line for line in lines[: errors[0]] if "mlflow" in line.lower() or " INFO " in line]
    assert mlflow_lines == [], mlflow_lines
    assert not (tmp_path / "runs" / "split" / "mlflow.db").exists()
    assert not (tmp_path / "runs" / "split").exists(), sorted(p.name for p in (tmp_path / "runs" / "split").iterdir())
