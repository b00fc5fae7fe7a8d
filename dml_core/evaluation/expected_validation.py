"""Expected validation performance: the expected best validation score after ``k`` search trials.

Dodge et al. 2019 ("Show your work: improved reporting of experimental results", EMNLP) report, for a budget of ``k``
hyperparameter trials, the expected maximum of the validation score over ``k`` trials, estimated from the ``N``
trials that were run.  With the observed scores sorted, ``v_(1) ≤ … ≤ v_(N)``:

* with replacement (Dodge et al. 2019): the ``k`` trials are drawn i.i.d. from the empirical distribution, so
  ``P(max = v_(i)) = (i/N)^k − ((i−1)/N)^k`` and ``E[max_k] = Σ_i v_(i) · ((i/N)^k − ((i−1)/N)^k)``.  It is biased
  low: at ``k = N`` it stays below the observed maximum although ``N`` trials did reach it (Tang et al. 2020).
* without replacement (Tang et al. 2020, "Showing your work doesn't always work", ACL): the ``k`` trials are a
  random ``k``-subset of the ``N`` observed ones, so ``P(max = v_(i)) = C(i−1, k−1) / C(N, k)`` and
  ``E[max_k] = Σ_{i ≥ k} v_(i) · C(i−1, k−1) / C(N, k)``.  This is the unbiased estimator of the expected maximum of
  ``k`` i.i.d. trials (the U-statistic of the kernel ``max``): ``k = 1`` gives the mean, ``k = N`` the maximum.

Ties need no special care: both sums are over positions in the sorted order, and tied values contribute the same
value whichever position wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dml_core.evaluation.stats import _values

__all__ = ["expected_max"]


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def expected_max(values: Sequence[float], n_max: int | None = None, *, replacement: bool = False) -> list[float]:
    """Expected maximum of ``k`` draws from ``values`` for ``k = 1 … n_max``; element ``k − 1`` is ``E[max of k]``.

    ``replacement=False`` (default): draws without replacement, the unbiased estimator of Tang et al. 2020;
    ``n_max`` defaults to ``len(values)`` and may not exceed it (a ``k``-subset of ``N`` values needs ``k ≤ N``).
    ``replacement=True``: draws with replacement, the estimator of Dodge et al. 2019; ``n_max`` (default
    ``len(values)``) may exceed ``len(values)``.

    Values must be finite numbers (a NaN objective is an error naming its position, not a silently dropped trial).
    """
    v = np.sort(_values(values, "values"))
    n = v.size
    k_max = n if n_max is None else _positive_int(n_max, "n_max")
    if not replacement and k_max > n:
        raise ValueError(
            f"n_max = {k_max} exceeds the {n} observed values: without replacement at most {n} draws exist "
            "(pass replacement=True for the with-replacement estimator)"
        )
    i = np.arange(1, n + 1, dtype=np.float64)
    out: list[float] = []
    if replacement:
        for k in range(1, k_max + 1):
            weights = (i / n) ** k - ((i - 1) / n) ** k
            out.append(float(np.dot(weights, v)))
        return out
    # log C(i−1, k−1) − log C(N, k) through lgamma: exact enough for thousands of trials, no overflow
    lg = np.array([math.lgamma(x) for x in range(1, n + 2)])  # lg[x] = log Γ(x + 1) = log x!

    def log_comb(a: np.ndarray, b: int) -> np.ndarray:
        return lg[a] - lg[b] - lg[a - b]

    idx = np.arange(n)  # i − 1 for i = 1 … N
    for k in range(1, k_max + 1):
        usable = idx >= k - 1  # positions i ≥ k: C(i − 1, k − 1) > 0
        log_w = log_comb(idx[usable], k - 1) - (lg[n] - lg[k] - lg[n - k])
        weights = np.exp(log_w)
        # the weights sum to 1 in exact arithmetic; dividing by their float sum keeps the result inside [min, max]
        out.append(float(np.dot(weights, v[usable]) / weights.sum()))
    return out
