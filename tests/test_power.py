"""Power of the paired t-test (dml_core.evaluation.stats.paired_detectable_difference): the normal-theory formula for
large n, the defining property (power at the returned difference), a Monte-Carlo check at n = 3, and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dml_core.evaluation.stats import paired_detectable_difference


def test_large_n_matches_the_normal_formula():
    # n → ∞: δ = (z_{1−α/2} + z_{power}) · σ / √n = (1.959964 + 0.841621) / √10000
    delta = paired_detectable_difference(1.0, 10_000)
    assert delta == pytest.approx((stats.norm.isf(0.025) + stats.norm.ppf(0.8)) / 100, rel=2e-3)
    one_sided = paired_detectable_difference(1.0, 10_000, alternative="greater", alpha=0.01, power=0.9)
    assert one_sided == pytest.approx((stats.norm.isf(0.01) + stats.norm.ppf(0.9)) / 100, rel=2e-3)


@pytest.mark.parametrize(
    "n, alpha, alternative", [(3, 0.05, "two-sided"), (5, 0.01, "greater"), (3, 0.05 / 27, "greater")]
)
def test_power_at_the_returned_difference_is_the_asked_power(n, alpha, alternative):
    sd = 0.7
    delta = paired_detectable_difference(sd, n, alpha=alpha, alternative=alternative)
    df, nc = n - 1, delta * math.sqrt(n) / sd
    crit = stats.t.isf(alpha / 2 if alternative == "two-sided" else alpha, df)
    power = stats.nct.sf(crit, df, nc) + (stats.nct.cdf(-crit, df, nc) if alternative == "two-sided" else 0.0)
    assert power == pytest.approx(0.8, abs=1e-8)
    # scales linearly with σ
    assert paired_detectable_difference(2 * sd, n, alpha=alpha, alternative=alternative) == pytest.approx(2 * delta)


def test_monte_carlo_rejection_rate_at_n_3():
    """Simulated paired differences with mean δ and σ = 1 at n = 3: ttest_rel rejects in about 80 % of draws."""
    delta = paired_detectable_difference(1.0, 3)
    rng = np.random.default_rng(11)
    d = rng.normal(delta, 1.0, size=(20_000, 3))
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    assert np.mean(p < 0.05) == pytest.approx(0.8, abs=0.012)


def test_edge_cases():
    assert math.isnan(paired_detectable_difference(1.0, 1))
    assert paired_detectable_difference(0.0, 3) == 0.0
    with pytest.raises(ValueError, match="alternative"):
        paired_detectable_difference(1.0, 3, alternative="less")
    with pytest.raises(ValueError, match="power"):
        paired_detectable_difference(1.0, 3, power=1.0)
    with pytest.raises(ValueError, match="sd_diff"):
        paired_detectable_difference(math.nan, 3)
