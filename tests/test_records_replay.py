"""Pruning rules replayed on recorded curves (pipelines/records/replay.py) with Ray Tune's own schedulers."""

from __future__ import annotations

import pytest

from pipelines.records.replay import Rule, choose_rule, fold_mean_curve, replay_all, replay_study
from pipelines.records.rows import trial_record


def _trial(i: int, curve: list[float], cpu: float = 80.0):
    """A 2-fold trial whose folds both follow ``curve`` (evaluations 1..n, every 10 iterations)."""
    points = [[0, 0.1]] + [[10 * (e + 1), v] for e, v in enumerate(curve)]
    fold = {
        "curve": points,
        "stopped": "cap",
        "iterations": 10 * len(curve),
        "best_iteration": 10 * len(curve),
        "best_val": {"map_at_r": max(curve)},
        "cpu_seconds": cpu,
        "numerics": "fp32",
        "cpu_model": "test",
    }
    row = {
        "trial_id": f"t{i}",
        "config": {"x": i},
        "val_map_at_r_mean": max(curve),
        "val_map_at_r_sem": 0.0,
        "status": "ok",
        "seed": 0,
        "fold_records": [{**fold, "fold": 0}, {**fold, "fold": 1}],
    }
    return trial_record(row, "d/l", "h", i)


def _flat(v: float) -> list[float]:
    return [v] * 8


def test_the_fold_mean_curve_is_the_best_so_far_as_a_pruned_search_reports_it():
    t = _trial(0, [0.3, 0.2, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4])
    assert fold_mean_curve(t, 4) == [0.3, 0.3, 0.5, 0.5]


def test_asha_prunes_the_weak_trials_keeps_the_winner_and_counts_the_cpu_saved():
    # async ASHA compares a trial with those that reached the rung before it: the winner first, weaker ones after
    trials = [_trial(0, _flat(0.8))] + [_trial(i, _flat(0.4 - 0.01 * i)) for i in range(1, 7)]
    r = replay_study("d/l", trials, Rule("asha", 1, 2.0), max_t=8)
    assert r.pruned >= 2 and r.replayed_winner == r.winner == "t0" and r.kept
    # a trial stopped at evaluation e saves each fold's iterations after it: (80 - 10 e) / 80 of its CPU
    assert 0 < r.cpu_saved < r.cpu_seconds


def test_a_late_bloomer_lost_to_pruning_is_reported_and_no_rule_that_loses_it_is_chosen():
    late = [0.1, 0.1, 0.1, 0.1, 0.2, 0.5, 0.9, 0.95]
    trials = [_trial(i, _flat(0.44 - 0.01 * i)) for i in range(5)] + [_trial(5, late)]
    results = replay_all([("d/l", trials, 8)], [Rule("asha", 1, 2.0), Rule("asha", 8, 2.0)])
    aggressive, never = results[Rule("asha", 1, 2.0)][0], results[Rule("asha", 8, 2.0)][0]
    assert aggressive.replayed_winner != "t5" and aggressive.gap == pytest.approx(0.95 - 0.44) and not aggressive.kept
    assert never.pruned == 0 and never.kept and never.cpu_saved == 0
    assert choose_rule(results) == Rule("asha", 8, 2.0)
    assert choose_rule({Rule("asha", 1, 2.0): [aggressive]}) is None


def test_the_median_rule_replays_too():
    trials = [_trial(i, _flat(0.5)) for i in range(4)] + [_trial(4, _flat(0.2))]
    r = replay_study("d/l", trials, Rule("median", 2), max_t=8)
    assert r.pruned == 1 and r.kept
