"""Statistics against scipy itself: sem (ddof=1), the t-interval MLRC reports (docs/protocol.md §Intervals),
ttest_rel."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dml_core.evaluation.stats import confidence_interval, fold_summary, paired_t_test

SAMPLES = [
    [0.4368, 0.4244, 0.4326, 0.4298],  # four fold values (the MLRC case)
    [0.61, 0.63],
    np.random.default_rng(0).normal(0.5, 0.02, size=10).tolist(),  # ten reproductions
    [1.0, -2.0, 3.5, 0.0, 7.25],
]


@pytest.mark.parametrize("values", SAMPLES)
def test_fold_summary_equals_numpy_mean_and_scipy_sem(values):
    mean, sem = fold_summary(values)
    assert mean == pytest.approx(np.mean(values), rel=1e-15)
    assert sem == pytest.approx(stats.sem(values), rel=1e-12)
    assert sem == pytest.approx(np.std(values, ddof=1) / math.sqrt(len(values)), rel=1e-12)
    assert isinstance(mean, float) and isinstance(sem, float)


@pytest.mark.parametrize("values", SAMPLES)
@pytest.mark.parametrize("level", [0.95, 0.9, 0.99])
def test_confidence_interval_equals_scipy_t_interval(values, level):
    mean, low, high = confidence_interval(values, level)
    ref_low, ref_high = stats.t.interval(level, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values), rel=1e-15)
    assert low == pytest.approx(ref_low, rel=1e-12) and high == pytest.approx(ref_high, rel=1e-12)
    assert low < mean < high


def test_confidence_interval_known_value():
    # n = 4, sem = 0.1, t_{0.975, 3} = 3.182446305284263  -> half-width 0.3182446305284263
    a = math.sqrt(0.03)  # sample variance 4a^2/3 = 0.04, sd 0.2, sem 0.2/sqrt(4) = 0.1
    values = [1.0 - a, 1.0 - a, 1.0 + a, 1.0 + a]
    assert fold_summary(values)[1] == pytest.approx(0.1, rel=1e-12)
    mean, low, high = confidence_interval(values)
    assert (mean, low, high) == pytest.approx((1.0, 1.0 - 0.3182446305284263, 1.0 + 0.3182446305284263), rel=1e-12)


def test_single_value_has_undefined_sem_and_interval():
    mean, sem = fold_summary([0.42])
    assert mean == 0.42 and math.isnan(sem)
    mean, low, high = confidence_interval([0.42])
    assert mean == 0.42 and math.isnan(low) and math.isnan(high)


def test_zero_spread_gives_a_degenerate_interval_at_the_mean():
    values = [0.1, 0.1, 0.1]  # float mean is not exactly 0.1, but the values are identical
    mean, low, high = confidence_interval(values)
    assert low == mean == high
    assert fold_summary([0.25, 0.25]) == (0.25, 0.0)
    assert confidence_interval([0.25, 0.25]) == (0.25, 0.25, 0.25)


def test_inputs_may_be_numpy_or_torch():
    vals = [0.3, 0.5, 0.4]
    assert fold_summary(np.array(vals)) == fold_summary(vals)
    assert confidence_interval(torch.tensor(vals, dtype=torch.float64)) == confidence_interval(vals)


@pytest.mark.parametrize(
    "values, message",
    [
        ([], "empty"),
        ([0.1, float("nan"), 0.3, float("inf")], r"non-finite entries at positions \[1, 3\]"),
        ([[0.1, 0.2]], "1-D"),
        (["a", "b"], "numbers"),
    ],
)
def test_bad_values_are_clear_errors(values, message):
    with pytest.raises(ValueError, match=message):
        fold_summary(values)
    with pytest.raises(ValueError, match=message):
        confidence_interval(values)


@pytest.mark.parametrize("level", [0, 1, 1.5, -0.1, "0.95", True])
def test_bad_level(level):
    with pytest.raises(ValueError, match="level"):
        confidence_interval([0.1, 0.2, 0.3], level)


@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_paired_t_test_equals_scipy_ttest_rel(alternative):
    rng = np.random.default_rng(1)
    a = rng.normal(0.50, 0.02, size=10)
    b = a + rng.normal(0.01, 0.01, size=10)
    t, p = paired_t_test(a, b, alternative=alternative)
    ref = stats.ttest_rel(a, b, alternative=alternative)
    assert t == pytest.approx(ref.statistic, rel=1e-12) and p == pytest.approx(ref.pvalue, rel=1e-12)
    assert t < 0  # b is larger


def test_paired_t_test_edge_cases():
    assert all(math.isnan(x) for x in paired_t_test([0.5], [0.4]))  # one pair: undefined
    assert all(math.isnan(x) for x in paired_t_test([0.5, 0.6], [0.5, 0.6]))  # identical runs
    t, p = paired_t_test([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])  # constant difference: scipy's t = inf, p = 0
    assert t == math.inf and p == 0.0
    with pytest.raises(ValueError, match="same length"):
        paired_t_test([0.1, 0.2, 0.3], [0.1, 0.2])
    with pytest.raises(ValueError, match="alternative"):
        paired_t_test([0.1, 0.2], [0.1, 0.3], alternative="bigger")
    with pytest.raises(ValueError, match=r"b has non-finite entries at positions \[0\]"):
        paired_t_test([0.1, 0.2], [float("nan"), 0.3])
