"""`dmlrc report` over a real MLflow store holding the run tree the sweep writes (docs/architecture.md)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from scipy import stats

from dml_core.evaluation.stats import confidence_interval
from pipelines.results.report import collect_studies, write_report

# Reproduction test MAP@R per loss; reproduction i of both losses used seed 100 + i (so they pair).
REPRO = {"contrastive": [0.30, 0.32, 0.31, 0.29], "mpa": [0.35, 0.36, 0.37, 0.34]}


def _populate(uri: str, experiment: str, repro: dict[str, list[float]] = REPRO) -> None:
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(experiment)
    for loss, values in repro.items():
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
        # two fold runs as the sweep logs them: one still improving at its last epoch, one stopped by patience
        for epoch, best in ((3, 3), (2, 1)):
            f = client.create_run(
                exp_id,
                tags={"stage": "fold", "status": "ok", "study": f"synthetic/{loss}", "mlflow.parentRunId": study},
            ).info.run_id
            client.log_metric(f, "epoch", epoch)
            client.log_metric(f, "best_epoch", best)
            client.set_terminated(f)
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
    # how the folds' training ended, per loss (the epoch cap vs patience)
    assert "| contrastive | – | 1/2 (50 %), 2.50 epochs |" in md

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
    assert names == {f"report/report.{e}" for e in ("md", "csv", "html", "json", "png")} | {
        "report/paired_tests.csv",
        "report/results-bundle.json",
    }
    (pair,) = list(csv.DictReader(paths["paired_csv"].open()))
    assert (pair["loss_a"], pair["loss_b"]) == ("contrastive", "mpa") and float(pair["p"]) == pytest.approx(p)


def test_report_of_many_losses_reads_as_a_ranking(tmp_path):
    """24 losses (a zoo): tables ranked by test MAP@R, each loss tested against the best and against contrastive
    (not all 276 pairs in the markdown), a chart whose height, not width, grows with the losses."""
    from PIL import Image

    rng = np.random.default_rng(0)
    means = {f"loss{i:02d}": 0.20 + 0.01 * i for i in range(23)} | {"contrastive": 0.30}
    repro = {loss: list(m + rng.normal(0, 0.002, 3)) for loss, m in means.items()}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "zoo", repro)
    paths = write_report(uri, "zoo", tmp_path / "out", log_to_mlflow=False)
    md = paths["md"].read_text()

    table = md.split("## Concatenated")[1].split("##")[0]
    ranked = [
        line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "loss |" not in line
    ]
    assert ranked == sorted(means, key=lambda loss: -np.mean(repro[loss])), "rows not ranked by test MAP@R"
    assert md.index("**synthetic / loss22**") < md.index("**synthetic / loss00**"), "hyperparameters not ranked"

    report = json.loads(paths["json"].read_text())
    assert len(report["paired_tests"]) == 24 * 23 // 2
    summary = report["paired_summary"]
    vs_base = [c for c in summary if c["kind"] == "baseline"]
    assert {c["reference"] for c in vs_base} == {"contrastive"} and len(vs_base) == 23 == len(summary)
    # which losses may be the best: every loss has a verdict in the dataset's best group, none a test "vs the best"
    group = report["best_group"]["synthetic"]
    assert group["leader"] == "loss22" and len(group["members"]) == 24
    assert report["top_group"]["synthetic"][0] == "loss22"
    # signs: loss − reference
    (c,) = [c for c in vs_base if c["loss"] == "loss22"]
    assert c["mean_diff"] == pytest.approx(np.mean(repro["loss22"]) - np.mean(repro["contrastive"]))
    assert c["p"] < 0.05 and "| loss22 | +" in md
    assert "against loss22 (the best loss)" not in md
    assert "### synthetic: against contrastive (the baseline)" in md
    paired = md.split("## Against the baseline")[1].split("\n## ")[0]
    rows = [line for line in paired.splitlines() if line.startswith("| ") and not line.startswith("| loss |")]
    assert len(rows) == 23, "the markdown should test each loss against the baseline only"
    best = md.split("## Which losses may be the best")[1].split("\n## ")[0]
    assert len([line for line in best.splitlines() if line.startswith("| ") and "| rank |" not in line]) == 24
    assert len(list(csv.DictReader(paths["paired_csv"].open()))) == 24 * 23 // 2

    width, height = Image.open(paths["png"]).size
    assert height > 600 and width < 1500, (width, height)


def test_unknown_experiment_is_named(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ValueError, match="--experiment: no MLflow experiment named 'nope'"):
        write_report(uri, "nope", tmp_path / "out")
