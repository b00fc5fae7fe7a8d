"""`dmlrc report` over a real MLflow store holding the run tree the sweep writes (docs/architecture.md)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from scipy import stats

from dml_core.stats import confidence_interval
from pipelines.results.report import collect_studies, write_report

# Reproduction test MAP@R per loss; reproduction i of both losses used seed 100 + i (so they pair).
REPRO = {"contrastive": [0.30, 0.32, 0.31, 0.29], "mpa": [0.35, 0.36, 0.37, 0.34]}


def _populate(uri: str, experiment: str) -> None:
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(experiment)
    for loss, values in REPRO.items():
        study = client.create_run(exp_id, tags={"stage": "study", "loss": loss, "dataset": "synthetic"}).info.run_id
        client.log_param(study, f"best.margin_{loss}", "0.25")  # the winning trial's hyperparameters (sweep.py)
        client.log_param(study, "space.margin", "uniform(0, 1)")
        for i, v in enumerate(values):
            r = client.create_run(
                exp_id,
                tags={
                    "stage": "reproduction",
                    "mlflow.parentRunId": study,
                    "reproduction": str(i),
                    "seed": str(100 + i),
                },
            ).info.run_id
            client.log_metric(r, "test.concat.map_at_r", v)
            client.log_metric(r, "test.separated.map_at_r", v - 0.05)
            client.set_terminated(r)
        for mode, shift in (("concat", 0.0), ("separated", -0.05)):
            mean, low, high = confidence_interval(np.array(values) + shift)
            client.log_metric(study, f"test.{mode}.map_at_r.mean", mean)
            client.log_metric(study, f"test.{mode}.map_at_r.ci_low", low)
            client.log_metric(study, f"test.{mode}.map_at_r.ci_high", high)
        client.set_terminated(study)
    # An unfinished study (no test metrics) must not appear.
    client.create_run(exp_id, tags={"stage": "study", "loss": "rsw", "dataset": "synthetic"})


def test_report_tables_chart_and_paired_test(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "sweep-x")
    studies = collect_studies(MlflowClient(uri), "sweep-x")
    assert [s.loss for s in studies] == ["contrastive", "mpa"]
    assert all(len(s.reproductions) == 4 for s in studies)

    paths = write_report(uri, "sweep-x", tmp_path / "out")
    md = paths["md"].read_text()
    mean, low, high = confidence_interval(REPRO["mpa"])
    assert f"{100 * mean:.2f} ± {100 * (high - low) / 2:.2f}" in md
    assert "rsw" not in md

    rows = list(csv.DictReader(paths["csv"].open()))
    row = next(r for r in rows if r["loss"] == "contrastive" and r["mode"] == "concat" and r["metric"] == "map_at_r")
    assert float(row["mean"]) == pytest.approx(np.mean(REPRO["contrastive"]))
    assert float(row["ci_low"]) == pytest.approx(confidence_interval(REPRO["contrastive"])[1])

    report = json.loads(paths["json"].read_text())
    (cmp,) = [c for c in report["paired_tests"] if c["metric"] == "test.concat.map_at_r"]
    t, p = stats.ttest_rel(REPRO["contrastive"], REPRO["mpa"])
    assert cmp["n"] == 4 and cmp["t"] == pytest.approx(t) and cmp["p"] == pytest.approx(p)

    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in paths["html"].read_text()
    # the winning hyperparameters of every study: in the markdown, the HTML and the JSON
    assert "**synthetic / mpa**: margin_mpa=0.25" in md and "space.margin" not in md
    assert "margin_contrastive=0.25" in paths["html"].read_text()
    assert {s["loss"]: s["best_params"] for s in report["studies"]} == {
        "contrastive": {"margin_contrastive": "0.25"},
        "mpa": {"margin_mpa": "0.25"},
    }
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sweep-x")
    (logged,) = client.search_runs([exp.experiment_id], "tags.stage = 'report'")
    names = {a.path for a in client.list_artifacts(logged.info.run_id, "report")}
    assert names == {f"report/report.{e}" for e in ("md", "csv", "html", "json", "png")}


def test_unknown_experiment_is_named(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ValueError, match="--experiment: no MLflow experiment named 'nope'"):
        write_report(uri, "nope", tmp_path / "out")
