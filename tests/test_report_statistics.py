"""The report's statistics on hand-built studies (pipelines.results.report.write_report_files): the best group per
dataset with its method and power, expected validation performance, and standard JSON (no NaN/Infinity) in
report.json and compare.json; the search trials' objectives read from MLflow."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from scipy import stats

from dml_core.evaluation.expected_validation import expected_max
from dml_core.evaluation.selection import best_group
from dml_core.evaluation.stats import confidence_interval, paired_detectable_difference
from pipelines.results.compare import compare_studies, render_compare_markdown
from pipelines.results.report import write_report_files
from pipelines.results.report_cells import json_safe
from pipelines.results.report_studies import Study, collect_studies
from tests.test_report import _populate


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (not standard JSON)."""

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _study(dataset: str, loss: str, values: list[float], trials: list[float] | None = None) -> Study:
    mean, low, high = confidence_interval(values)
    metrics = {
        "test.concat.map_at_r.mean": mean,
        "test.concat.map_at_r.ci_low": low,
        "test.concat.map_at_r.ci_high": high,
    }
    return Study(
        run_id=f"run-{dataset}-{loss}",
        dataset=dataset,
        loss=loss,
        metrics=metrics,
        reproductions={i: {"test.concat.map_at_r": v} for i, v in enumerate(values)},
        seeds={i: str(100 + i) for i in range(len(values))},
        trial_values=list(trials or []),
    )


# Two datasets whose leaders differ: "a" leads on cub by far, "b" leads on cars by far; "c" is close to each leader.
CUB = {"a": [0.60, 0.62, 0.61, 0.63], "b": [0.40, 0.41, 0.42, 0.40], "c": [0.598, 0.625, 0.607, 0.628]}
CARS = {"a": [0.30, 0.31, 0.32, 0.30], "b": [0.50, 0.52, 0.51, 0.53], "c": [0.497, 0.523, 0.508, 0.529]}


def test_best_group_is_per_dataset(tmp_path):
    studies = [_study("cub", k, v) for k, v in CUB.items()] + [_study("cars", k, v) for k, v in CARS.items()]
    paths = write_report_files("x", sorted(studies, key=lambda s: (s.dataset, s.loss)), tmp_path)
    report = _strict(paths["json"].read_text())
    assert report["top_group"] == {"cars": ["b", "c"], "cub": ["a", "c"]}
    for dataset, values in (("cub", CUB), ("cars", CARS)):
        g = report["best_group"][dataset]
        want = best_group(values)
        assert g["leader"] == want.members[0].name and g["n"] == 4 and g["family_size"] == 6
        assert "Holm" in g["method"] and g["alpha"] == 0.05
        for m in g["members"]:
            assert m["in_group"] == want[m["loss"]].in_group
            assert m["p_adjusted"] == pytest.approx(want[m["loss"]].p_adjusted)
            assert m["verdict"] == ("in the best group" if m["in_group"] else "worse than the best group")
        (c,) = [m for m in g["members"] if m["loss"] == "c"]
        diffs = np.array(values["c"]) - np.array(values[g["leader"]])
        assert c["sd_diff"] == pytest.approx(np.std(diffs, ddof=1))
        # the one-sided test at the Bonferroni level of the 6 ordered pairs, 80 % power
        assert c["detectable_diff"] == pytest.approx(
            paired_detectable_difference(float(np.std(diffs, ddof=1)), 4, alpha=0.05 / 6, alternative="greater")
        )
    md = paths["md"].read_text()
    assert "**Best group on cub** (2 of 3 losses, n = 4 reproductions, 6 ordered pairs in the Holm family): a, c" in md
    assert "**Best group on cars** (2 of 3 losses" in md and "| worse than the best group |" in md
    assert "Holm 1979" in md and "gap found with 80 % power" in md
    assert "Which losses may be the best" in paths["html"].read_text()


def test_not_distinguishable_comes_with_the_gap_it_could_see(tmp_path):
    values = {"contrastive": [0.30, 0.32, 0.31], "x": [0.305, 0.318, 0.316]}
    paths = write_report_files("x", [_study("d", k, v) for k, v in values.items()], tmp_path)
    report = _strict(paths["json"].read_text())
    (c,) = report["paired_summary"]
    sd = float(np.std(np.subtract(values["x"], values["contrastive"]), ddof=1))
    assert c["detectable_diff"] == pytest.approx(paired_detectable_difference(sd, 3))
    assert f"not distinguishable below {100 * c['detectable_diff']:.2f} points" in paths["md"].read_text()


def test_json_holds_no_nan_where_values_are_undefined(tmp_path):
    """A single-reproduction study (no interval, no test) and two identical studies (t = 0/0): null, not NaN."""
    studies = [
        _study("d", "contrastive", [0.3, 0.31, 0.32]),
        _study("d", "twin", [0.3, 0.31, 0.32]),
        _study("d", "lonely", [0.4]),
    ]
    paths = write_report_files("x", studies, tmp_path)
    report = _strict(paths["json"].read_text())
    (pair,) = report["paired_tests"]
    assert pair["p"] is None and pair["untestable"] == "identical values"
    lonely = next(s for s in report["studies"] if s["loss"] == "lonely")
    assert lonely["test"]["test.concat.map_at_r.ci_low"] is None
    assert report["best_group"]["d"]["left_out"][0]["loss"] == "lonely"
    assert "NaN" not in paths["paired_csv"].read_text()


def test_expected_validation_table_figure_and_json(tmp_path):
    trials = {"a": [0.1, 0.5, 0.3, 0.2], "b": [0.4, 0.4, 0.35]}
    studies = [_study("d", k, v, trials[k]) for k, v in {"a": [0.6, 0.61, 0.62], "b": [0.5, 0.52, 0.51]}.items()]
    paths = write_report_files("x", studies, tmp_path)
    report = _strict(paths["json"].read_text())
    curves = {c["loss"]: c for c in report["expected_validation"]["curves"]}
    assert curves["a"]["curve"] == pytest.approx(expected_max(trials["a"]))
    assert curves["a"]["curve"][0] == pytest.approx(0.275) and curves["a"]["curve"][-1] == pytest.approx(0.5)
    assert curves["b"]["trials"] == 3
    md = paths["md"].read_text()
    assert "## Expected validation performance" in md
    assert "| d | a | 4 | 27.50 | 38.33 | 45.00 | 50.00 |" in md  # E[max of 2] = (2·0.2 + 3·0.3 + 4·0.5 ... ) / 6
    assert "| d | b | 3 | 38.33 | 40.00 | 40.00 | – |" in md
    assert paths["expected_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trial_objectives_are_read_from_the_trial_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "e", {"contrastive": [0.3, 0.32, 0.31]})
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("e")
    (study,) = client.search_runs([exp.experiment_id], "tags.stage = 'study' and tags.loss = 'contrastive'")
    for status, value in (("ok", 0.41), ("diverged", 0.0), ("ok", 0.44), ("pruned", 0.2), ("failed", 0.9)):
        r = client.create_run(
            exp.experiment_id,
            tags={"stage": "trial", "mlflow.parentRunId": study.info.run_id, "status": status},
        ).info.run_id
        client.log_metric(r, "val.map_at_r.mean", value)
        client.set_terminated(r)
    (s,) = collect_studies(client, "e")
    assert sorted(s.trial_values) == [0.0, 0.41, 0.44]


def test_compare_of_two_losses_says_tau_is_undefined():
    a = [_study("d", "x", [0.5, 0.51, 0.52]), _study("d", "y", [0.4, 0.41, 0.42])]
    b = [_study("d", "x", [0.4, 0.41, 0.42]), _study("d", "y", [0.5, 0.51, 0.52])]
    result = compare_studies(a, b, ("A", "B"))
    text = json.dumps(json_safe(result), allow_nan=False)
    (d,) = _strict(text)["datasets"]
    assert d["kendall_tau"] is None and d["spearman_rho"] is None and "fewer than 3 losses" in d["rank_reason"]
    md = render_compare_markdown(result)
    assert "Kendall's τ and Spearman's ρ: undefined with 2 loss(es)" in md and "τ = -1" not in md
    assert d["flips"] and all(f["status"] == "not established" for f in d["flips"])
    assert d["best_group_not_established"] == ["x", "y"]
    assert d["spread"]["mean_abs_diff"] == pytest.approx(0.1)


def test_compare_tau_interval_is_fisher_z():
    rng = np.random.default_rng(5)
    means = np.linspace(0.3, 0.6, 8)
    shuffled = means + rng.normal(0, 0.05, 8)
    a = [_study("d", f"l{i}", list(m + np.array([0.0, 0.01, 0.02]))) for i, m in enumerate(means)]
    b = [_study("d", f"l{i}", list(m + np.array([0.0, 0.01, 0.02]))) for i, m in enumerate(shuffled)]
    (d,) = compare_studies(a, b)["datasets"]
    tau = stats.kendalltau(means, shuffled).statistic
    half = 1.959963984540054 * math.sqrt(0.437 / 4)
    assert d["kendall_tau"] == pytest.approx(tau)
    assert d["kendall_tau_ci"] == pytest.approx([math.tanh(math.atanh(tau) - half), math.tanh(math.atanh(tau) + half)])
    assert "Fisher z" in render_compare_markdown(compare_studies(a, b))
