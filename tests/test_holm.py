"""Holm–Bonferroni adjustment (dml_core.evaluation.stats.holm_adjust): a hand-computed example, the step-down rule it
encodes, and NaN p-values kept out of the family."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dml_core.evaluation.stats import holm_adjust


def test_hand_computed_example():
    # m = 4.  Sorted: 0.005 (#3), 0.01 (#0), 0.03 (#2), 0.04 (#1).
    #   0.005 · 4 = 0.02;  0.01 · 3 = 0.03;  0.03 · 2 = 0.06;  0.04 · 1 = 0.04 → raised to 0.06 (monotone step-down).
    adjusted = holm_adjust([0.01, 0.04, 0.03, 0.005])
    assert adjusted.tolist() == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)


def test_capped_at_one_and_single_test_unchanged():
    # 0.2 · 3 = 0.6; 0.5 · 2 = 1.0; 0.9 · 1 = 0.9 → 1.0 (monotone), every value ≤ 1
    assert holm_adjust([0.9, 0.2, 0.5]).tolist() == pytest.approx([1.0, 0.6, 1.0])
    assert holm_adjust([0.3, 0.6]).tolist() == pytest.approx([0.6, 0.6])
    assert holm_adjust([0.0123]).tolist() == [0.0123]
    assert holm_adjust([]).size == 0


def test_nan_stays_nan_and_is_not_counted_in_the_family():
    # Two tested p-values: m = 2, not 4.  0.01 · 2 = 0.02; 0.04 · 1 = 0.04.
    adjusted = holm_adjust([math.nan, 0.04, math.nan, 0.01])
    assert math.isnan(adjusted[0]) and math.isnan(adjusted[2])
    assert adjusted[[1, 3]].tolist() == pytest.approx([0.04, 0.02])
    assert np.isnan(holm_adjust([math.nan, math.nan])).all()


def _holm_rejects(p: np.ndarray, alpha: float) -> np.ndarray:
    """The Holm procedure as its decision rule: reject the smallest p while p_(j) ≤ α / (m − j), j = 0, 1, …"""
    order = np.argsort(p, kind="stable")
    reject = np.zeros(p.size, dtype=bool)
    for j, i in enumerate(order):
        if p[i] > alpha / (p.size - j):
            break
        reject[i] = True
    return reject


@pytest.mark.parametrize("seed", range(20))
def test_adjusted_p_below_alpha_is_exactly_the_step_down_rejection(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 30))
    p = rng.uniform(0, 1, m) ** rng.uniform(1, 6)  # many small p-values as well as large ones
    if seed % 3 == 0:
        p[: m // 2] = p[0]  # ties
    adjusted = holm_adjust(p)
    assert (adjusted >= p).all() and (adjusted <= 1.0).all()
    order = np.argsort(p, kind="stable")
    assert (np.diff(adjusted[order]) >= 0).all(), "adjusted p-values are not monotone in the raw ones"
    for alpha in (0.001, 0.01, 0.05, 0.1, 0.2, 0.5):
        assert ((adjusted <= alpha) == _holm_rejects(p, alpha)).all(), alpha


def test_p_values_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match=r"outside \[0, 1\] at positions \[1\]"):
        holm_adjust([0.1, 1.5])
    with pytest.raises(ValueError, match="outside"):
        holm_adjust([-0.1])
    with pytest.raises(ValueError, match="outside"):
        holm_adjust([math.inf])


# Reproduction test MAP@R of four losses against the baseline "contrastive" (a fixed reference: one family of 3):
# "near1" and "near2" differ from it at raw p ≈ 0.030 and 0.028, "far" at p ≈ 0.0003.  Holm: 3 · 0.0003 ≈ 0.001;
# 2 · 0.028 ≈ 0.055; max(0.055, 0.030) = 0.055, so near1 and near2 are not distinguishable from the baseline once
# adjusted, though each raw p is below 0.05.
HOLM_REPRO = {
    "contrastive": [0.50, 0.52, 0.51, 0.49],
    "near1": [0.49, 0.50, 0.48, 0.45],
    "near2": [0.489, 0.499, 0.481, 0.449],
    "far": [0.46, 0.47, 0.46, 0.44],
}


def test_report_judges_not_distinguishable_on_the_holm_adjusted_p(tmp_path):
    import csv
    import json

    from scipy import stats

    from pipelines.results.report import write_report
    from tests.test_report import _populate

    raw = {
        loss: stats.ttest_rel(v, HOLM_REPRO["contrastive"]).pvalue
        for loss, v in HOLM_REPRO.items()
        if loss != "contrastive"
    }
    assert 0.025 < raw["near2"] < raw["near1"] < 0.05 and raw["far"] < 0.001
    expected = {"far": 3 * raw["far"], "near2": 2 * raw["near2"], "near1": 2 * raw["near2"]}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "holm", HOLM_REPRO)
    paths = write_report(uri, "holm", tmp_path / "out", log_to_mlflow=False)
    report = json.loads(paths["json"].read_text())

    vs_base = {c["loss"]: c for c in report["paired_summary"] if c["kind"] == "baseline"}
    assert {loss: c["p"] for loss, c in vs_base.items()} == pytest.approx(raw)
    assert {loss: c["p_holm"] for loss, c in vs_base.items()} == pytest.approx(expected)
    family = "Holm–Bonferroni over the 3 comparisons against contrastive on synthetic, concatenated test MAP@R"
    assert {c["family"] for c in vs_base.values()} == {family}

    md = paths["md"].read_text()
    assert f"Family: {family}." in md
    rows = {
        line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| near") or "| far |" in line
    }
    gap = 100 * vs_base["near1"]["detectable_diff"]
    assert (
        rows["near1"]
        .rstrip()
        .endswith(f"| {raw['near1']:.4f} | {expected['near1']:.4f} | 4 | not distinguishable below {gap:.2f} points |")
    )
    assert rows["far"].rstrip().endswith("| worse |")
    html = paths["html"].read_text()
    assert f"<td>{raw['near1']:.4f}</td><td>{expected['near1']:.4f}</td><td>4</td><td>not distinguishable" in html

    # paired_tests.csv: every pair of the dataset is one family
    pairs = list(csv.DictReader(paths["paired_csv"].open()))
    assert len(pairs) == 6
    p_all = [float(r["p"]) for r in pairs]
    assert [float(r["p_holm"]) for r in pairs] == pytest.approx(holm_adjust(p_all).tolist())
    assert [c["p_holm"] for c in report["paired_tests"]] == pytest.approx(holm_adjust(p_all).tolist())
