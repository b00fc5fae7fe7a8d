"""Results that look fine and are not, said as such: a study whose best checkpoints are all the untrained network's
(epoch 0), a paired test that cannot be computed, and the untrained network as the tables' reference row — in the
end-of-sweep table and in ``dmlrc report`` (md, html, json).  The sweep's side (tag, metrics, printed table) is checked
on a real sweep in ``tests/test_studies_sweep.py``."""

from __future__ import annotations

import json
import math

import pytest
from mlflow.tracking import MlflowClient

from dml_core.evaluation.stats import paired_t_test, paired_untestable
from pipelines.results.report import write_report
from pipelines.results.study_results import EPOCH0_TAG, StudySummary, best_at_epoch_0, ci_table
from tests.test_report import _populate

UNTRAINED = {"precision_at_1": 0.125, "r_precision": 0.0625, "map_at_r": 0.03125}


def test_an_untestable_pair_says_why():
    assert paired_untestable([0.3, 0.4, 0.5], [0.3, 0.4, 0.5]) == "identical values"
    assert math.isnan(paired_t_test([0.3, 0.4, 0.5], [0.3, 0.4, 0.5])[1])
    assert paired_untestable([0.3], [0.2]) == "fewer than 2 pairs"
    assert paired_untestable([0.3, 0.4, 0.5], [0.3, 0.4, 0.6]) is None
    # every difference equal and non-zero is testable (t = ±inf, p = 0: scipy's convention)
    assert paired_untestable([0.3, 0.4], [0.2, 0.3]) is None
    with pytest.raises(ValueError, match="paired"):
        paired_untestable([0.3, 0.4], [0.3])


def test_identical_values_are_not_testable_in_every_format(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    same = [0.30, 0.32, 0.31]
    _populate(uri, "same", {"contrastive": same, "ntxent": list(same)})
    paths = write_report(uri, "same", tmp_path / "out", log_to_mlflow=False)
    md, page = paths["md"].read_text(), paths["html"].read_text()
    paired = md.split("## Against the baseline")[1].split("\n## ")[0]
    (row,) = [line for line in paired.splitlines() if line.startswith("| ntxent |")]
    assert row.endswith("| – | – | – | 3 | not testable (identical values) |"), row
    assert "not testable (identical values)" in page and "<td>nan</td>" not in page
    (c,) = json.loads(paths["json"].read_text())["paired_tests"]
    assert c["untestable"] == "identical values" and c["p"] is None and c["t"] is None  # null, not NaN
    assert "identical values" in paths["paired_csv"].read_text()


def _flag(uri: str, experiment: str, loss: str) -> None:
    """What the sweep writes on a study run: the epoch-0 tag and the untrained network's metrics."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    for run in client.search_runs([exp.experiment_id], "tags.stage = 'study'"):
        if not any(k.startswith("test.") for k in run.data.metrics):
            continue
        client.set_tag(run.info.run_id, EPOCH0_TAG, str(run.data.tags["loss"] == loss).lower())
        for k, v in UNTRAINED.items():
            client.log_metric(run.info.run_id, f"untrained.{k}", v)


def test_report_flags_epoch_0_studies_and_shows_the_untrained_reference(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "flags")
    _flag(uri, "flags", "mpa")
    paths = write_report(uri, "flags", tmp_path / "out", log_to_mlflow=False)
    md, page = paths["md"].read_text(), paths["html"].read_text()
    concat = md.split("## Concatenated")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line for line in concat.splitlines() if line.startswith("| ")}
    assert "(best at epoch 0)" in rows["mpa"] and "(best at epoch 0)" not in rows["contrastive"]
    assert rows["untrained network (reference)"].split("|")[2:5] == [" 12.50 ", " 6.25 ", " 3.12 "]
    assert "untrained network" in page and "best at epoch 0" in page and "synthetic / mpa" in page
    assert "**Best at epoch 0** (synthetic / mpa): every fold of every reproduction chose the untrained network" in md
    studies = {s["loss"]: s for s in json.loads(paths["json"].read_text())["studies"]}
    assert studies["mpa"]["best_at_epoch_0"] is True and studies["contrastive"]["best_at_epoch_0"] is False
    assert studies["mpa"]["untrained"] == UNTRAINED


def test_a_report_without_the_sweeps_new_tags_has_no_flags(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "old")
    md = write_report(uri, "old", tmp_path / "out", log_to_mlflow=False)["md"].read_text()
    assert "epoch 0" not in md and "untrained network" not in md


def test_best_at_epoch_0_needs_every_fold_at_epoch_0():
    assert best_at_epoch_0([0, 0.0, 0]) and not best_at_epoch_0([0, 0, 1]) and not best_at_epoch_0([])


def test_end_of_sweep_table_marks_epoch_0_and_has_the_reference_row():
    ci = {mode: {k: (0.5, 0.45, 0.55) for k in UNTRAINED} for mode in ("concat", "separated")}
    studies = [
        StudySummary("d/a", "d", "a", "r1", "ok", ci=ci, untrained=dict(UNTRAINED), best_at_epoch_0=True),
        StudySummary("d/b", "d", "b", "r2", "ok", ci=ci, untrained=dict(UNTRAINED)),
    ]
    table = ci_table(studies).splitlines()
    assert table[2].split()[:2] == ["d", "a"] and table[2].split()[2] == "*"
    assert table[3].split()[:2] == ["d", "b"] and "*" not in table[3]
    (ref,) = [line for line in table if line.startswith("d ") and "untrained network" in line]
    assert ref.split()[3:] == ["12.50", "6.25", "3.12"] * 2, "one reference row per network, both modes"
    assert any(line.startswith("* best at epoch 0: every fold of every reproduction") for line in table)
    assert "best at epoch 0" not in ci_table(studies[1:])


def test_the_demo_prints_the_untrained_score_once_as_the_tables_reference_row(tmp_path, monkeypatch, capsys):
    """``dmlrc demo``'s summary: the sweep's table with its untrained-network row, and no second line of its own."""
    import pipelines.execution.sweep as sweep
    from pipelines.cli import main

    ci = {mode: {k: (0.5, 0.45, 0.55) for k in UNTRAINED} for mode in ("concat", "separated")}
    studies = [StudySummary("synthetic/contrastive", "synthetic", "contrastive", "r", "ok", ci=ci, untrained=UNTRAINED)]

    def fake_sweep(cfg, resume=False, address=None, rerun=frozenset()):
        return sweep.SweepOutcome(cfg.name, tmp_path, "sqlite:///x.db", cfg.name, "1", studies, 60.0)

    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    assert main(["demo", "--storage", str(tmp_path), "--name", "once"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "untrained" in line]
    assert len(lines) == 2, "\n".join(lines)  # the table's reference row and the note that explains it
    assert lines[0].split()[:4] == ["synthetic", "untrained", "network", "12.50"] and lines[1].startswith("untrained")
