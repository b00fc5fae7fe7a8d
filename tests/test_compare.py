"""`dmlrc report --compare`: two runs of one preset, each in its own MLflow store, compared ranking by ranking."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main
from tests.test_report import _populate

NOISE = ([0.001, -0.001, 0.002, -0.002], [-0.002, 0.001, 0.0, 0.001], [0.0, 0.002, -0.001, -0.001])

# Run A: w > x > y > z, every pair far apart for its noise (all 6 paired tests significant after Holm).
RUN_A = {
    loss: [m + e for e in NOISE[i % 3]] for i, (loss, m) in enumerate({"w": 0.6, "x": 0.5, "y": 0.4, "z": 0.3}.items())
}
# Run B: x (0.601) just ahead of w (0.600), their difference buried in noise; y and z as in A.
RUN_B = {
    "w": [0.62, 0.57, 0.61, 0.60],
    "x": [0.581, 0.631, 0.601, 0.591],
    "y": RUN_A["y"],
    "z": RUN_A["z"],
}


def _refuse(name):
    raise AssertionError(f"compare.json holds {name}: not standard JSON")


@pytest.fixture
def two_runs(tmp_path):
    uri_a, uri_b = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    _populate(uri_a, "zoo-seed1", RUN_A)
    _populate(uri_b, "zoo-seed2", RUN_B)
    return uri_a, uri_b


def test_rank_correlations_top_group_and_flips(tmp_path, two_runs, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri_a, uri_b = two_runs
    out = tmp_path / "cmp"
    argv = ["report", "--compare", "zoo-seed1", "zoo-seed2", "--tracking-uri", uri_a]
    rc = main([*argv, "--compare-tracking-uri", uri_b, "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    result = json.loads((out / "compare.json").read_text(), parse_constant=_refuse)
    (d,) = result["datasets"]
    assert d["dataset"] == "synthetic" and d["losses"] == 4 and d["pairs"] == 6
    # Rankings (1, 2, 3, 4) and (2, 1, 3, 4): of the 6 pairs, 5 concordant and 1 discordant, so
    # τ = (5 − 1) / 6 = 2/3;  Σ d² = 1 + 1 = 2, so ρ = 1 − 6 · 2 / (4 · (4² − 1)) = 0.8.
    assert d["kendall_tau"] == pytest.approx(2 / 3)
    assert d["spearman_rho"] == pytest.approx(0.8)
    assert {loss: (r["zoo-seed1"]["rank"], r["zoo-seed2"]["rank"]) for loss, r in d["ranking"].items()} == {
        "w": (1, 2),
        "x": (2, 1),
        "y": (3, 3),
        "z": (4, 4),
    }
    # A: w is better than everyone; B: x and w cannot be told apart, so both are in B's top group
    assert d["top_group"] == {"zoo-seed1": ["w"], "zoo-seed2": ["x", "w"]}
    assert d["best_group_not_established"] == ["x"]
    assert d["top_group_agrees"] is False
    # the one conclusion that flips
    assert d["flips"] == [
        {"pair": ["w", "x"], "zoo-seed1": "w better", "zoo-seed2": "not distinguishable", "status": "not established"}
    ]
    # the fixture gives both runs reproduction seeds 100…103: said, since that is no seed-stability check
    assert any("same reproduction seeds" in n for n in result["notes"])

    md = (out / "compare.md").read_text()
    assert "Kendall's τ = 0.667 (no interval: the Fisher-z interval needs at least 5 losses (have 4)" in md
    assert "Spearman's ρ = 0.800" in md
    assert "Best group differs: zoo-seed1: w; zoo-seed2: x, w — not established: x" in md
    assert "| w vs x | w better | not distinguishable | not established |" in md
    assert "Pairwise conclusions that flip (not established): 1 of 6 pairs" in printed


def test_identical_runs_agree_completely(tmp_path, capsys):
    from pipelines.results.compare import compare_experiments

    uri = f"sqlite:///{tmp_path / 'a.db'}"
    _populate(uri, "one", RUN_A)
    _populate(uri, "two", RUN_A)
    (d,) = compare_experiments(uri, "one", "two")["datasets"]
    assert d["kendall_tau"] == pytest.approx(1.0) and d["spearman_rho"] == pytest.approx(1.0)
    assert d["top_group_agrees"] and d["flips"] == []


def test_compare_input_errors_are_one_config_error(tmp_path, two_runs, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri_a, uri_b = two_runs
    capsys.readouterr()

    def cli(*argv):
        rc = main(["report", *argv, "--out", str(tmp_path / "r")])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        return err

    assert cli("--tracking-uri", uri_a).startswith("config error: --experiment: required")
    err = cli("--compare", "zoo-seed1", "zoo-seed1", "--tracking-uri", uri_a)
    assert err.startswith("config error: --compare: EXP_A and EXP_B are the same experiment")
    err = cli("--compare", "zoo-seed1", "nope", "--tracking-uri", uri_a)
    assert err.startswith("config error: --compare: no MLflow experiment named 'nope'"), err
    err = cli("--compare", "zoo-seed1", "x", "--tracking-uri", uri_a, "--compare-tracking-uri", f"{uri_b}.missing")
    assert err.startswith("config error: --compare-tracking-uri: no sqlite DB")
    err = cli("--experiment", "zoo-seed1", "--compare", "zoo-seed1", "zoo-seed2", "--tracking-uri", uri_a)
    assert err.startswith("config error: --compare: give either --experiment")
    assert not (tmp_path / "r" / "compare.json").exists()
