"""Statistics of the Metric Learning Reality Check (docs/protocol.md §Objective and §Intervals).

* :func:`fold_summary` — mean and standard error of the mean over the cross-validation folds.  The MLRC
  Bayesian optimiser receives exactly this pair as its objective: the fold mean of best-epoch val MAP@R and
  ``scipy.stats.sem`` across folds (docs/protocol.md §Objective).
* :func:`confidence_interval` — the 95% Student-t interval across independent training runs (the best trial
  and its reproductions) that the paper reports:
  ``scipy.stats.t.interval(level, n − 1, loc=mean, scale=sem)`` (docs/protocol.md §Intervals).  The interval is across
  *runs*, not folds.
* :func:`paired_t_test` — ``scipy.stats.ttest_rel`` on two losses run on the same folds and seeds
  (reproduction ``i`` of every loss uses the same seed and folds), so differences can be tested pairwise.
* :func:`holm_adjust` — Holm–Bonferroni step-down adjusted p-values for a family of such tests (the report
  judges "not distinguishable" on them; the family each report table adjusts over is named in the report).
* :func:`paired_detectable_difference` — the smallest true mean difference a paired t-test at a given level finds
  with a given power (80 % by default) from the spread of the paired differences, through the noncentral t
  distribution: what "not distinguishable" can and cannot exclude.

Edge cases are decided here, once, rather than left to scipy's warnings:

* fewer than 2 values: SEM and the interval are undefined and returned as NaN, never a made-up number;
* zero spread (all values equal): SEM is 0 and the interval is the degenerate ``[mean, mean]``.  scipy
  returns NaN bounds there because a t distribution with scale 0 is invalid; an interval of width 0 at the
  mean is the limit of the t-interval as the spread goes to 0, so we report that;
* non-finite values (NaN/inf, e.g. a diverged run that was not filtered) are an error naming the positions.
"""

from __future__ import annotations

import math
import warnings
from types import ModuleType

import numpy as np

__all__ = [
    "fold_summary",
    "confidence_interval",
    "paired_t_test",
    "paired_untestable",
    "holm_adjust",
    "paired_detectable_difference",
]


def _scipy() -> tuple[ModuleType, ModuleType]:
    """``(scipy.stats, scipy.optimize)``, for the intervals and tests (scipy.stats imports scipy.optimize itself)."""
    # scipy.stats (~0.5 s of imports) loads where an interval or a test is computed: a search trial's driver imports
    # this module for fold_summary (numpy only), and the dmlrc CLI imports it with the report's parser
    from scipy import optimize, stats

    return stats, optimize


def _values(values, name: str = "values") -> np.ndarray:
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch.Tensor, without importing torch here
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numbers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"{name} has non-finite entries at positions {bad.tolist()}: {arr[bad].tolist()}")
    return arr


def fold_summary(values) -> tuple[float, float]:
    """``(mean, sem)`` with ``sem = scipy.stats.sem(values)`` (ddof = 1: ``std(ddof=1) / sqrt(n)``, scipy's own
    formula, computed here without scipy: a trial's driver reports its fold summary without loading scipy.stats);
    sem is NaN for a single value."""
    arr = _values(values)
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, math.nan
    return mean, float(arr.std(ddof=1) / math.sqrt(arr.size))


def confidence_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Student-t interval ``t.interval(level, n − 1, mean, sem)``
    (docs/protocol.md §Intervals).

    ``n < 2`` → ``(mean, nan, nan)``; zero spread → ``(mean, mean, mean)`` (see the module docstring).
    """
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be a number strictly between 0 and 1, got {level!r}")
    arr = _values(values)
    mean, sem = fold_summary(arr)
    if arr.size < 2:
        return mean, math.nan, math.nan
    if sem == 0.0 or np.ptp(arr) == 0.0:
        return mean, mean, mean
    _st, _ = _scipy()

    low, high = _st.t.interval(float(level), arr.size - 1, loc=mean, scale=sem)
    return mean, float(low), float(high)


def paired_t_test(a, b, *, alternative: str = "two-sided") -> tuple[float, float]:
    """``(t, p)`` of the paired t-test of ``a`` against ``b`` (``scipy.stats.ttest_rel`` semantics).

    ``a[i]`` and ``b[i]`` must come from the same fold/seed.  Fewer than 2 pairs → ``(nan, nan)``
    (:func:`paired_untestable` says why a pair gives NaN).
    scipy's conventions are kept for zero spread of the differences: all differences 0 → ``(nan, nan)``;
    all equal and non-zero → ``t = ±inf``, ``p = 0`` (two-sided).
    """
    if alternative not in ("two-sided", "less", "greater"):
        raise ValueError(f"alternative must be 'two-sided', 'less' or 'greater', got {alternative!r}")
    x, y = _values(a, "a"), _values(b, "b")
    if x.size != y.size:
        raise ValueError(f"a and b must be paired (same length), got {x.size} and {y.size} values")
    if x.size < 2:
        return math.nan, math.nan
    _st, _ = _scipy()

    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        # scipy warns about the zero-spread cases documented above; the values it returns are the contract.
        warnings.simplefilter("ignore", RuntimeWarning)
        res = _st.ttest_rel(x, y, alternative=alternative)
    return float(res.statistic), float(res.pvalue)


def paired_untestable(a, b) -> str | None:
    """Why :func:`paired_t_test` of ``a`` against ``b`` cannot be computed (it returns ``(nan, nan)``), or ``None``
    when it can: ``"fewer than 2 pairs"``, or ``"identical values"`` when every difference is 0 (t = 0 / 0: the two
    samples cannot be told apart, and no test says so)."""
    x, y = _values(a, "a"), _values(b, "b")
    if x.size != y.size:
        raise ValueError(f"a and b must be paired (same length), got {x.size} and {y.size} values")
    if x.size < 2:
        return "fewer than 2 pairs"
    if np.all(x == y):
        return "identical values"
    return None


def holm_adjust(p_values) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (Holm 1979, step-down), in the order given.

    With the ``m`` finite p-values sorted ascending, ``p_(1) ≤ … ≤ p_(m)``, the adjusted value of ``p_(i)`` is
    ``min(1, max_{j ≤ i} (m − j + 1) · p_(j))``: monotone in the raw p-values and capped at 1.  Rejecting where the
    adjusted value is at most α controls the family-wise error rate at α over the whole family, under any dependence
    between the tests.  (``scipy.stats.false_discovery_control`` is Benjamini–Hochberg, which controls the false
    discovery rate instead; statsmodels' ``multipletests(method="holm")`` computes these same values.)

    A NaN p-value (a test that could not be computed, e.g. identical values in both samples) stays NaN and is not a
    member of the family: ``m`` counts only the non-NaN p-values, so an untestable pair does not weaken the others.
    Ties keep their input order.  Anything else outside [0, 1] is an error; an empty family gives an empty array.
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"p_values must be a 1-D sequence, got shape {p.shape}")
    tested = np.flatnonzero(~np.isnan(p))
    bad = tested[(p[tested] < 0.0) | (p[tested] > 1.0)]
    if bad.size:
        raise ValueError(f"p_values outside [0, 1] at positions {bad.tolist()}: {p[bad].tolist()}")
    out = np.full(p.shape, math.nan)
    order = tested[np.argsort(p[tested], kind="stable")]
    m = order.size
    out[order] = np.minimum(np.maximum.accumulate((m - np.arange(m)) * p[order]), 1.0)
    return out


def paired_detectable_difference(
    sd_diff: float, n: int, *, alpha: float = 0.05, power: float = 0.8, alternative: str = "two-sided"
) -> float:
    """The smallest true mean difference ``δ ≥ 0`` that the paired t-test of ``n`` pairs at level ``alpha`` detects
    with probability ``power``, when the paired differences have standard deviation ``sd_diff``.

    Under a true difference ``δ`` the statistic ``t = mean(d) / (sd(d)/√n)`` follows the noncentral t distribution
    with ``n − 1`` degrees of freedom and noncentrality ``δ·√n / σ`` (``scipy.stats.nct``); ``δ`` is found where the
    rejection probability equals ``power`` (``scipy.optimize.brentq``).  ``alternative="two-sided"`` rejects beyond
    ``t_{1−α/2}`` in either tail; ``"greater"`` beyond ``t_{1−α}`` (a one-sided test).  ``sd_diff`` is the sample
    spread of the observed differences, so the value is an estimate (the usual plug-in power calculation).

    ``n < 2`` → NaN (no test); ``sd_diff == 0`` → 0.0 (any difference is found).
    """
    if alternative not in ("two-sided", "greater"):
        raise ValueError(f"alternative must be 'two-sided' or 'greater', got {alternative!r}")
    for name, v in (("alpha", alpha), ("power", power)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) < 1.0:
            raise ValueError(f"{name} must be a number strictly between 0 and 1, got {v!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(sd_diff, bool) or not isinstance(sd_diff, (int, float)) or not math.isfinite(sd_diff) or sd_diff < 0:
        raise ValueError(f"sd_diff must be a finite number ≥ 0, got {sd_diff!r}")
    if n < 2:
        return math.nan
    if sd_diff == 0:
        return 0.0
    _st, _opt = _scipy()

    df = int(n) - 1
    tail = alpha / 2 if alternative == "two-sided" else alpha
    crit = float(_st.t.isf(tail, df))

    def rejection(nc: float) -> float:
        p = float(_st.nct.sf(crit, df, nc))
        if alternative == "two-sided":
            lower = float(_st.nct.cdf(-crit, df, nc))
            # scipy's nct.cdf can return NaN far in the lower tail of a large noncentrality, where the probability
            # is below that at nc = 0 (α/2) and falls with nc: a vanishing term there
            p += lower if math.isfinite(lower) else 0.0
        return p

    if rejection(0.0) >= power:  # only when power ≤ the level itself
        return 0.0
    high = crit + 10.0
    while rejection(high) < power:
        high *= 2.0
    nc = _opt.brentq(lambda v: rejection(v) - power, 0.0, high, xtol=1e-10)
    return float(nc * sd_diff / math.sqrt(n))
