"""Which losses may be the best one: a confidence set for the best that stays valid after the best is read off the
data.

Testing every loss against "the observed best" picks the reference from the same reproductions that the tests then
use: the observed leader is, by selection, the one whose noise happened to be highest, so its comparisons find
"worse" losses too often (on 28 equal losses with 3 reproductions, about one sweep in nine names a loss worse at a
nominal 5 %).  :func:`best_group` instead tests every *ordered* pair.

Method (a confidence set for the best by inverting pairwise tests; Holm 1979 for the step-down adjustment, the
construction as in Mogstad, Romano, Shaikh & Wilhelm 2024, "Inference for ranks"):

* for every ordered pair ``(j, i)``, the one-sided paired t-test of ``H0: μ_j ≤ μ_i`` against ``μ_j > μ_i`` over the
  reproductions (value ``r`` of every name comes from the same seed and folds, so seed effects cancel);
* Holm–Bonferroni step-down over all ``K(K − 1)`` ordered pairs;
* loss ``i`` is *worse than the best group* iff some ``j`` is better than it at adjusted ``p ≤ α``; every other loss
  is *in the best group*.

Error rate: a true best loss ``i*`` has ``μ_j ≤ μ_{i*}`` for every ``j``, so excluding it means rejecting a true null;
Holm keeps the probability of rejecting any true null at or below ``α`` under any dependence between the tests.
Hence ``P(some true best is excluded) ≤ α`` — whichever loss the data make look best, and with ties at the top.  The
t-test of each pair uses that pair's own spread, so losses with unequal noise need no pooled variance (unlike Hsu's
MCB in the two-way model).  The price is power: with few reproductions and many losses, the group is large.

A pair whose differences are all zero has no test (t = 0/0): its p-value is NaN, it is left out of the family, and it
excludes neither loss (:func:`dml_core.evaluation.stats.holm_adjust`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from dml_core.evaluation.stats import _scipy, _values, holm_adjust

__all__ = ["BestGroup", "GroupMember", "best_group", "METHOD"]

#: The method's name as the report prints it.
METHOD = (
    "confidence set for the best: one-sided paired t-tests of every ordered pair, Holm–Bonferroni over all of them "
    "(Holm 1979; Mogstad, Romano, Shaikh & Wilhelm 2024); a loss is worse than the best group iff another loss is "
    "better than it at adjusted p ≤ α, so P(a true best is excluded) ≤ α"
)


@dataclass(frozen=True)
class GroupMember:
    """One name's place: ``in_group``; ``p_adjusted``: the smallest Holm-adjusted p of "another name is better" (NaN
    when no pair with it could be tested); ``beaten_by``: the name of that smallest p (``None`` if none)."""

    name: str
    mean: float
    in_group: bool
    p_adjusted: float
    beaten_by: str | None


@dataclass(frozen=True)
class BestGroup:
    """The result of :func:`best_group`: ``members`` by descending mean (ties by name)."""

    members: list[GroupMember]
    alpha: float
    n: int
    #: how many ordered pairs the Holm family holds (those with a computable test)
    family_size: int
    method: str = field(default=METHOD)

    @property
    def group(self) -> list[str]:
        """The names in the best group, by descending mean."""
        return [m.name for m in self.members if m.in_group]

    def __getitem__(self, name: str) -> GroupMember:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)


def _one_sided_p(diffs: np.ndarray) -> np.ndarray:
    """``P(T ≥ t)`` of the paired t-test of each row of ``diffs`` (``d = x_j − x_i``; ``H0: mean ≤ 0``), with
    ``scipy.stats.ttest_rel``'s conventions: all differences 0 → NaN; all equal and non-zero → 0 or 1."""
    _st, _ = _scipy()

    n = diffs.shape[1]
    mean = diffs.mean(axis=1)
    sd = diffs.std(axis=1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = mean / (sd / math.sqrt(n))
    # float rounding can leave a tiny spread on differences that are equal in exact arithmetic; scipy's ttest_rel
    # would report a huge t there too, so the convention is only applied where the spread is exactly zero
    p = _st.t.sf(t, n - 1)
    p = np.where((sd == 0) & (mean == 0), np.nan, p)
    return np.where((sd == 0) & (mean != 0), np.where(mean > 0, 0.0, 1.0), p)


def best_group(values: Mapping[str, object], alpha: float = 0.05) -> BestGroup:
    """The best group of ``values`` (name → its per-reproduction values, paired by position: entry ``r`` of every
    name comes from the same seed and folds).  See the module docstring for the method and its error rate.

    Every name needs the same number ``n ≥ 2`` of finite values; anything else is one ``ValueError`` naming the name.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must be a number strictly between 0 and 1, got {alpha!r}")
    if not values:
        raise ValueError("values is empty: no names to choose the best from")
    names = list(values)
    arrays = [_values(values[name], f"values[{name!r}]") for name in names]
    n = arrays[0].size
    for name, arr in zip(names, arrays):
        if arr.size != n:
            raise ValueError(
                f"values[{name!r}] has {arr.size} values, values[{names[0]!r}] {n}: every name needs one value per "
                "reproduction, paired by position"
            )
    if n < 2:
        raise ValueError(f"every name has {n} value: a paired test needs at least 2 reproductions")
    x = np.stack(arrays)  # (K, n)
    k = len(names)
    means = x.mean(axis=1)
    better, worse = np.array([(j, i) for j in range(k) for i in range(k) if i != j], dtype=np.int64).reshape(-1, 2).T
    p = _one_sided_p(x[better] - x[worse]) if k > 1 else np.empty(0)
    adjusted = holm_adjust(p)
    order = sorted(range(k), key=lambda i: (-means[i], names[i]))
    members = []
    for i in order:
        mine = np.flatnonzero((worse == i) & ~np.isnan(adjusted))
        if mine.size:
            at = mine[np.argmin(adjusted[mine])]
            p_i, by = float(adjusted[at]), names[int(better[at])]
        else:
            p_i, by = math.nan, None
        excluded = math.isfinite(p_i) and p_i <= alpha
        members.append(GroupMember(names[i], float(means[i]), not excluded, p_i, by))
    return BestGroup(members, float(alpha), int(n), int(np.count_nonzero(~np.isnan(p))))
