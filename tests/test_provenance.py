"""Where every row comes from: a study the sweep did not train (reused from another sweep of the experiment, a results
bundle's, a records folder's) is marked as such — its source's location (credentials redacted), date and protocol
fingerprint — in the end-of-sweep table (ranked per dataset by concatenated test MAP@R), report.md / report.html,
report.csv / report.json, and the MLflow descriptions (the reused run's note, the experiment's table)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from pipelines.config.errors import ConfigError
from pipelines.execution.studies.runs import summary_from_run, summary_from_study
from pipelines.results.bundle import bundle_doc, checksum, read_bundle, write_bundle
from pipelines.results.fingerprint import Fingerprint, fingerprint_tags
from pipelines.results.report import write_report_files
from pipelines.results.report_html import render_html
from pipelines.results.report_markdown import render_markdown
from pipelines.results.report_studies import Study
from pipelines.results.study_results import Provenance, StudySummary, ci_table, iso_time
from pipelines.tracking.ui import NOTE_TAG, REUSED_BY_TAG, experiment_note, record_taken_studies

FP = Fingerprint({"dataset.name": "d", "protocol.max_epochs": 3})
UNTRAINED = {"precision_at_1": 0.10, "r_precision": 0.05, "map_at_r": 0.02}
BUNDLE = Provenance("bundle", "s3://zoo/published/results-bundle.json", "2026-01-02T03:04:05Z", FP.hash)


def _ci(v: float) -> dict:
    return {m: {k: (v, v - 0.01, v + 0.01) for k in UNTRAINED} for m in ("concat", "separated")}


def _summary(dataset: str, loss: str, v: float | None, provenance: Provenance | None = None) -> StudySummary:
    return StudySummary(
        f"{dataset}/{loss}",
        dataset,
        loss,
        f"run-{loss}",
        "ok" if v is not None else "failed",
        ci=_ci(v) if v is not None else {},
        n_reproductions=4,
        untrained=dict(UNTRAINED),
        provenance=provenance,
    )


def _reused(sweep: str, loss: str = "c") -> Provenance:
    return Provenance(
        "mlflow", f"MLflow run run-{loss}", "2026-01-01T00:00:00Z", FP.hash, sweep=sweep, run_id=f"run-{loss}"
    )


def _body(table: str, datasets: tuple[str, ...] = ("c", "d")) -> list[list[str]]:
    """The table's rows as word lists, without its header and the notes under it."""
    return [line.split() for line in table.splitlines()[2:] if line.split()[:1] and line.split()[0] in datasets]


# ------------------------------------------------------------------------------------------- end-of-sweep table


def test_the_end_of_sweep_table_is_ranked_per_dataset_with_each_reference_row_under_its_studies():
    studies = [
        _summary("d", "low", 0.30),
        _summary("c", "only", 0.20),
        _summary("d", "broken", None),
        _summary("d", "high", 0.50),
        _summary("d", "mid", 0.40),
    ]
    rows = [r[:2] for r in _body(ci_table(studies))]
    assert rows == [
        ["c", "only"],
        ["c", "untrained"],
        ["d", "high"],
        ["d", "mid"],
        ["d", "low"],
        ["d", "broken"],  # no metric (failed): last
        ["d", "untrained"],
    ], rows


def test_the_end_of_sweep_table_marks_reused_and_bundled_rows_with_uri_date_and_fingerprint():
    studies = [
        _summary("d", "a", 0.30),
        _summary("d", "b", 0.50, BUNDLE),
        _summary("d", "c", 0.40, _reused("old")),
    ]
    table = ci_table(studies, sweep="new")
    lines = table.splitlines()
    assert lines[0].split()[-1] == "source"
    marks = {r[1]: r[-2:] if r[-1].startswith("[") else r[-1:] for r in _body(table) if r[1] != "untrained"}
    assert marks == {"b": ["bundle", "[1]"], "c": ["reused", "[2]"], "a": ["trained"]}, table
    assert [r[1] for r in _body(table)] == ["b", "c", "a", "untrained"]  # ranked, not in the order given
    assert (
        "  [1] results bundle s3://zoo/published/results-bundle.json (created 2026-01-02T03:04:05Z); "
        f"protocol fingerprint {FP.hash}" in lines
    )
    assert any(
        line.startswith("  [2] reused: finished in sweep 'old' of the experiment (MLflow run run-c, ended 2026-01-01")
        and line.endswith(FP.hash)
        for line in lines
    ), table


def test_a_study_of_this_sweeps_earlier_run_is_trained_and_an_all_trained_table_has_no_source_column():
    studies = [_summary("d", "a", 0.30), _summary("d", "c", 0.40, _reused("new"))]  # --resume of the same sweep
    table = ci_table(studies, sweep="new")
    assert "source" not in table and "reused" not in table and "[1]" not in table


def test_the_bundle_uri_is_shown_without_credentials():
    p = Provenance.of_source("bundle https://alice:hunter2@example.org/b.json?token=abc123", date="", fingerprint="")
    text = ci_table([_summary("d", "b", 0.5, p)])
    assert "hunter2" not in text and "abc123" not in text and "https://alice:***@example.org/b.json" in text
    assert "created not recorded" in text and "protocol fingerprint not recorded" in text


# ------------------------------------------------------------------------------------ the sweep's summaries


def test_summaries_keep_where_their_study_comes_from():
    run = SimpleNamespace(
        info=SimpleNamespace(run_id="r9", end_time=1767225600000, start_time=1767225000000),
        data=SimpleNamespace(metrics={}, params={}, tags={"sweep": "old", **fingerprint_tags(FP)}),
    )
    s = summary_from_run(StudySummary("d/c", "d", "c", "r9", "ok"), run)
    assert s.provenance == Provenance(
        "mlflow", "MLflow run r9", "2026-01-01T00:00:00Z", FP.hash, sweep="old", run_id="r9"
    )
    study = Study(
        "r1",
        "d",
        "b",
        {"test.concat.map_at_r.mean": 0.5},
        source="bundle s3://zoo/b.json",
        source_date="2026-01-02T03:04:05Z",
        fingerprint=FP,
        sweep="zoo",
    )
    p = summary_from_study(study).provenance
    assert (p.kind, p.location, p.date, p.fingerprint) == ("bundle", "s3://zoo/b.json", "2026-01-02T03:04:05Z", FP.hash)
    assert iso_time(None) == "" and iso_time(0) == ""


# ------------------------------------------------------------------------------------------------ the report


def _study(loss: str, v: float, source: str = "mlflow", date: str = "") -> Study:
    metrics = {f"test.concat.{k}.{s}": x for k in UNTRAINED for s, x in (("mean", v), ("ci_low", v - 0.01))}
    metrics.update({f"test.concat.{k}.ci_high": v + 0.01 for k in UNTRAINED})
    reps = {i: {"test.concat.map_at_r": v + 0.01 * (i - 1.5)} for i in range(4)}
    return Study(
        f"run-{loss}",
        "d",
        loss,
        metrics,
        reproductions=reps,
        seeds={i: str(100 + i) for i in range(4)},
        sweep="zoo",
        fingerprint=FP,
        source=source,
        source_date=date,
    )


REPORT = [
    _study("own", 0.40, date="2026-01-03T00:00:00Z"),
    _study("bundled", 0.50, "bundle s3://zoo/published/results-bundle.json", "2026-01-02T03:04:05Z"),
    _study("recorded", 0.30, "records rec/d/recorded", "2026-01-01T10:00:00+00:00"),
]


def test_report_md_and_html_mark_bundled_and_recorded_rows_and_say_where_they_come_from():
    md = render_markdown(REPORT, [])
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert "| bundled (bundle [1]) | " in "\n".join(rows) and "| recorded (records [2]) | " in "\n".join(rows)
    assert any(line.startswith("| own | ") for line in rows)  # the experiment's own run: no mark
    notes = [line for line in md.splitlines() if line.startswith("- [")]
    assert notes == [
        "- [1] results bundle s3://zoo/published/results-bundle.json (created 2026-01-02T03:04:05Z); "
        f"protocol fingerprint {FP.hash}",
        f"- [2] records folder rec/d/recorded (last record written 2026-01-01T10:00:00+00:00); protocol fingerprint "
        f"{FP.hash}",
    ]
    page = render_html(REPORT, [])
    assert "<td>bundled (bundle [1])</td>" in page and "<p>[1] results bundle s3://zoo/published/" in page


def test_a_loss_whose_datasets_differ_in_source_is_marked_per_cell():
    other = _study("bundled", 0.45)
    other.dataset = "e"  # the same loss trained here on another dataset
    md = render_markdown([*REPORT, other], [])
    (row,) = [line for line in md.splitlines() if line.startswith("| bundled")][:1]
    assert row.startswith("| bundled | ") and "(bundle [1])" in row


def test_report_csv_and_json_carry_each_rows_source(tmp_path):
    paths = write_report_files("exp", REPORT, tmp_path)
    rows = list(csv.DictReader(paths["csv"].open()))
    got = {(r["loss"], r["source"], r["source_location"], r["source_date"], r["fingerprint"]) for r in rows}
    assert got == {
        ("own", "mlflow", "MLflow run run-own", "2026-01-03T00:00:00Z", FP.hash),
        ("bundled", "bundle", "s3://zoo/published/results-bundle.json", "2026-01-02T03:04:05Z", FP.hash),
        ("recorded", "records", "rec/d/recorded", "2026-01-01T10:00:00+00:00", FP.hash),
    }
    doc = json.loads(paths["json"].read_text())
    source = {s["loss"]: s["source"] for s in doc["studies"]}
    assert source["bundled"] == {
        "kind": "bundle",
        "location": "s3://zoo/published/results-bundle.json",
        "date": "2026-01-02T03:04:05Z",
        "fingerprint": FP.hash,
        "sweep": "zoo",
        "run_id": "run-bundled",
    }
    assert source["own"]["kind"] == "mlflow" and source["own"]["sweep"] == "zoo"


# ------------------------------------------------------------------------------------------- the bundle's date


def test_a_bundle_records_when_it_was_created_and_its_studies_carry_that_date(tmp_path):
    path = write_bundle("zoo", [_study("own", 0.4)], tmp_path / "results-bundle.json")
    doc = json.loads(path.read_text())
    assert doc["created"].endswith("Z") and doc["checksum"] == checksum(doc)
    (s,) = read_bundle(str(path)).studies
    assert s.source_date == doc["created"] and s.source == f"bundle {path}"
    old = tmp_path / "old.json"  # written before bundles had a date: read, the date unknown
    old.write_text(json.dumps(bundle_doc("zoo", [_study("own", 0.4)])))
    assert "created" not in json.loads(old.read_text()) and read_bundle(str(old)).studies[0].source_date == ""


@pytest.mark.parametrize("created", ["yesterday", "2026-01-02\x1b[2J", 20260102])
def test_a_bundle_whose_created_is_not_a_time_is_one_config_error(tmp_path, created):
    doc = bundle_doc("zoo", [_study("own", 0.4)])
    doc["created"] = created
    doc["checksum"] = checksum(doc)  # re-stamped: only the value is wrong
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        read_bundle(str(path))
    assert info.value.field == "compare_with" and "created is not an ISO 8601 time" in str(info.value)
    assert "\x1b" not in str(info.value)


# --------------------------------------------------------------------------------------------------- MLflow


def test_mlflow_says_which_studies_were_reused_or_bundled(tmp_path):
    from pipelines.tracking.runs import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker.open(uri, "e")
    client = MlflowClient(uri)
    tags = {"stage": "study", "sweep": "old", "study": "d/c", "dataset": "d", "loss": "c", **fingerprint_tags(FP)}
    run_id = client.create_run(tracker.experiment_id, tags=tags).info.run_id
    client.log_metric(run_id, "test.concat.map_at_r.mean", 0.4)
    client.set_terminated(run_id)
    run = tracker.run(run_id)
    reused = summary_from_run(StudySummary("d/c", "d", "c", run_id, "ok"), run)
    bundled = _summary("d", "b", 0.5, BUNDLE)
    trained = _summary("d", "a", 0.3)

    record_taken_studies(tracker, "new", [trained, reused, bundled])
    record_taken_studies(tracker, "new", [trained, reused, bundled])  # a resumed sweep: the same, not twice
    tags = tracker.run(run_id).data.tags
    assert tags[REUSED_BY_TAG] == "new"
    assert "Trained in sweep 'old'; reused by sweep 'new' (not run again there)." in tags[NOTE_TAG]
    note = client.get_experiment(tracker.experiment_id).tags[NOTE_TAG]
    assert note == experiment_note(tracker)
    rows = [line for line in note.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2, note
    assert rows[0].startswith("| new | d/b | 50.00 |") and rows[0].endswith(
        f"| – | bundle: results bundle s3://zoo/published/results-bundle.json (created 2026-01-02T03:04:05Z); "
        f"protocol fingerprint {FP.hash} |"
    ), rows[0]
    assert rows[1].startswith("| old | d/c |") and "trained; reused by sweep 'new' (not run again there) |" in rows[1]
