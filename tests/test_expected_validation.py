"""Expected validation performance (dml_core.evaluation.expected_validation.expected_max): hand-computed cases, the two
identities of the unbiased estimator (k = 1 → mean, k = N → max), and brute force over every subset / tuple."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dml_core.evaluation.expected_validation import expected_max


def test_hand_computed_without_replacement():
    # values 1..4.  k = 2: the 6 pairs have maxima 2, 3, 4, 3, 4, 4 → 20/6.
    # k = 3: the 4 triples have maxima 3, 4, 4, 4 → 15/4.  k = 1: the mean 2.5; k = 4: the maximum 4.
    assert expected_max([3.0, 1.0, 4.0, 2.0]) == pytest.approx([2.5, 20 / 6, 3.75, 4.0], abs=1e-12)


def test_hand_computed_with_replacement():
    # P(max of 2 = v_(i)) = (i² − (i − 1)²) / 16 = (2i − 1) / 16 → (1·1 + 3·2 + 5·3 + 7·4) / 16 = 50/16.
    got = expected_max([1.0, 2.0, 3.0, 4.0], n_max=2, replacement=True)
    assert got == pytest.approx([2.5, 50 / 16], abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_first_is_the_mean_and_last_is_the_max(seed):
    values = np.random.default_rng(seed).normal(0.4, 0.05, size=int(5 + 7 * seed)).tolist()
    curve = expected_max(values)
    assert len(curve) == len(values)
    assert curve[0] == pytest.approx(np.mean(values), abs=1e-12)
    assert curve[-1] == pytest.approx(max(values), abs=1e-12)
    assert all(b >= a - 1e-12 for a, b in zip(curve, curve[1:])), "expected maximum must not fall with more trials"


@pytest.mark.parametrize("seed", range(3))
def test_equals_brute_force_over_subsets_and_tuples(seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 5, size=7).astype(float).tolist()  # ties on purpose
    without = expected_max(values)
    for k in range(1, len(values) + 1):
        maxima = [max(c) for c in itertools.combinations(values, k)]
        assert without[k - 1] == pytest.approx(np.mean(maxima), abs=1e-12)
    with_ = expected_max(values, n_max=4, replacement=True)
    for k in range(1, 5):
        maxima = [max(c) for c in itertools.product(values, repeat=k)]
        assert with_[k - 1] == pytest.approx(np.mean(maxima), abs=1e-12)


def test_with_replacement_stays_below_the_max_at_n_and_may_go_beyond_n():
    values = [0.1, 0.2, 0.3]
    dodge = expected_max(values, n_max=6, replacement=True)
    assert len(dodge) == 6 and dodge[2] < 0.3 and dodge[-1] < 0.3
    assert expected_max(values, n_max=2) == pytest.approx([0.2, (0.2 + 0.3 + 0.3) / 3])


def test_many_trials_do_not_overflow():
    values = np.linspace(0.0, 1.0, 2000)
    curve = expected_max(values, n_max=2000)
    assert np.isfinite(curve).all() and curve[-1] == pytest.approx(1.0) and curve[0] == pytest.approx(0.5)
    # E[max of k of a uniform grid on [0, 1]] ≈ k / (k + 1)
    assert curve[9] == pytest.approx(10 / 11, abs=2e-3)


@pytest.mark.parametrize(
    "values, kwargs, message",
    [
        ([], {}, "empty"),
        ([0.1, float("nan")], {}, r"non-finite entries at positions \[1\]"),
        ([0.1, 0.2], {"n_max": 3}, "exceeds the 2 observed values"),
        ([0.1, 0.2], {"n_max": 0}, "positive integer"),
        ([0.1, 0.2], {"n_max": 1.5}, "positive integer"),
    ],
)
def test_bad_input_is_one_clear_error(values, kwargs, message):
    with pytest.raises(ValueError, match=message):
        expected_max(values, **kwargs)
