"""The report's paired t-tests: every two losses of a dataset over reproductions with the same seeds, the best group of
each dataset (a confidence set for the best, :func:`dml_core.evaluation.selection.best_group`), each loss against the
baseline, Holm–Bonferroni families, the power of every comparison and the verdict printed for a comparison.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Any

import numpy as np

from dml_core.evaluation.selection import METHOD as BEST_GROUP_METHOD
from dml_core.evaluation.selection import best_group
from dml_core.evaluation.stats import holm_adjust, paired_detectable_difference, paired_t_test, paired_untestable
from pipelines.names import METRIC_LABELS
from pipelines.results.report_studies import Study

__all__ = [
    "ALPHA",
    "BASELINE",
    "BEST_GROUP_METHOD",
    "POWER",
    "best_groups",
    "paired_comparisons",
    "paired_summary",
    "top_group",
    "below_text",
    "metric_text",
    "verdict",
]


#: The level at which a (Holm-adjusted) p-value tells two losses apart.
ALPHA = 0.05
#: The power at which the report states the smallest difference a comparison would have found.
POWER = 0.8
#: The reality check's reference loss: every loss is also compared with it.
BASELINE = "contrastive"


def _by_dataset(studies: list[Study]) -> dict[str, list[Study]]:
    """Studies per dataset, each dataset's in descending order of its own mean concatenated test MAP@R (ties and
    missing values by name): every "best" is a dataset's own, never one ranking across datasets."""
    out: dict[str, list[Study]] = {}
    for s in studies:
        out.setdefault(s.dataset, []).append(s)

    def score(s: Study) -> float:
        v = s.cell("concat", "map_at_r")[0]
        return -v if math.isfinite(v) else math.inf

    return {d: sorted(group, key=lambda s: (score(s), s.loss)) for d, group in sorted(out.items())}


def _sd(diffs: list[float]) -> float:
    return float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan


def _detectable(sd: float, n: int, alpha: float, alternative: str) -> float:
    if not math.isfinite(sd):
        return math.nan
    return paired_detectable_difference(sd, n, alpha=alpha, power=POWER, alternative=alternative)


def paired_comparisons(studies: list[Study], mode: str = "concat", metric: str = "map_at_r") -> list[dict[str, Any]]:
    """Paired t-tests between every two losses of a dataset over their reproductions, paired by reproduction seed;
    ``p_holm`` is p adjusted by Holm–Bonferroni over every pair of the dataset (the family of ``paired_tests.csv``);
    ``sd_diff`` the spread of the paired differences and ``detectable_diff`` the smallest true difference the
    two-sided test finds with 80 % power at the family's Bonferroni level ``α / m`` (Holm rejects at least what that
    level rejects, so its power is at least this)."""
    out = []
    key = f"test.{mode}.{metric}"
    for dataset, group in _by_dataset(studies).items():
        for a, b in itertools.combinations(sorted(group, key=lambda s: s.loss), 2):
            va, vb = a.by_seed(key), b.by_seed(key)
            common = sorted(set(va) & set(vb), key=lambda seed: (len(seed), seed))  # paired by reproduction seed
            if len(common) < 2:
                continue
            xa = [va[seed] for seed in common]
            xb = [vb[seed] for seed in common]
            t, p = paired_t_test(xa, xb)
            diffs = [x - y for x, y in zip(xa, xb)]
            out.append(
                {
                    "dataset": dataset,
                    "loss_a": a.loss,
                    "loss_b": b.loss,
                    "metric": key,
                    "n": len(common),
                    "mean_diff": sum(diffs) / len(common),
                    "sd_diff": _sd(diffs),
                    "t": t,
                    "p": p,
                    "untestable": paired_untestable(xa, xb),  # why t and p are NaN, else None
                }
            )
    _add_holm(out, lambda c: c["dataset"])
    return out


def _add_holm(rows: list[dict[str, Any]], family) -> None:
    """Set ``p_holm`` of every row: its p adjusted by Holm–Bonferroni over the rows with the same ``family(row)``
    (NaN p-values stay NaN and are not counted: :func:`dml_core.evaluation.stats.holm_adjust`), and ``detectable_diff``:
    the smallest true difference found with :data:`POWER` at the family's Bonferroni level (two-sided)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for c in rows:
        groups.setdefault(family(c), []).append(c)
    for group in groups.values():
        m = sum(1 for c in group if not math.isnan(c["p"]))
        for c, adjusted in zip(group, holm_adjust([c["p"] for c in group])):
            c["p_holm"] = float(adjusted)
            c["detectable_diff"] = _detectable(c["sd_diff"], c["n"], ALPHA / max(m, 1), "two-sided")


def paired_summary(
    studies: list[Study], comparisons: list[dict[str, Any]], baseline: str = BASELINE
) -> list[dict[str, Any]]:
    """Per dataset, each loss against ``baseline`` (a reference fixed before the data are seen, so an ordinary
    family): ``{dataset, loss, reference, kind, mean_diff (loss − baseline), sd_diff, t, p, p_holm, detectable_diff,
    family, n}``.  The comparisons on a dataset are one Holm–Bonferroni family (``family`` names it).  Which losses
    may be the best is :func:`best_groups`' question, not a comparison with the observed best: that reference is
    chosen by the same data, and its tests would find "worse" losses too often."""
    index = {(c["dataset"], c["loss_a"], c["loss_b"]): c for c in comparisons}
    out = []
    for dataset, group in _by_dataset(studies).items():
        if not any(s.loss == baseline for s in group):
            continue
        for s in group:
            if s.loss == baseline:
                continue
            c = index.get((dataset, s.loss, baseline))
            sign = 1
            if c is None:
                c, sign = index.get((dataset, baseline, s.loss)), -1
            if c is None:
                continue
            out.append(
                {
                    "dataset": dataset,
                    "loss": s.loss,
                    "reference": baseline,
                    "kind": "baseline",
                    "metric": c["metric"],
                    "n": c["n"],
                    "mean_diff": sign * c["mean_diff"],
                    "sd_diff": c["sd_diff"],
                    "t": sign * c["t"],
                    "p": c["p"],
                    "untestable": c["untestable"],
                }
            )
    _add_holm(out, lambda c: (c["dataset"], c["reference"]))
    sizes = collections.Counter((c["dataset"], c["reference"]) for c in out if not math.isnan(c["p"]))
    for c in out:
        c["family"] = (
            f"Holm–Bonferroni over the {sizes[(c['dataset'], c['reference'])]} comparisons against {c['reference']} "
            f"on {c['dataset']}, {metric_text(c['metric'])}"
        )
    return out


def metric_text(key: str) -> str:
    """``test.concat.map_at_r`` → ``concatenated test MAP@R``."""
    _, mode, metric = key.split(".", 2)
    return f"{'concatenated' if mode == 'concat' else mode} test {METRIC_LABELS.get(metric, metric)}"


def best_groups(
    studies: list[Study], mode: str = "concat", metric: str = "map_at_r", alpha: float = ALPHA
) -> dict[str, dict[str, Any]]:
    """Per dataset, its best group (:func:`dml_core.evaluation.selection.best_group`) over the reproduction seeds every
    study of the dataset shares, JSON-ready: ``method``, ``alpha``, ``n`` (common seeds), ``family_size`` (ordered pairs
    tested), ``members`` (descending mean: ``loss``, ``mean``, ``in_group``, ``verdict``, ``p_adjusted``,
    ``beaten_by``, and against the dataset's observed leader ``mean_diff``, ``sd_diff`` and ``detectable_diff``:
    the gap a one-sided test at the family's Bonferroni level α / m would find with 80 % power) and ``left_out``
    (studies without those seeds, with the reason).  A dataset whose studies share fewer than 2 seeds has
    ``members: []`` and a ``reason``."""
    key = f"test.{mode}.{metric}"
    out: dict[str, dict[str, Any]] = {}
    for dataset, group in _by_dataset(studies).items():
        by_seed = {s.loss: s.by_seed(key) for s in group}
        usable = [s for s in group if len(by_seed[s.loss]) >= 2]
        seeds = set.intersection(*(set(by_seed[s.loss]) for s in usable)) if usable else set()
        common = sorted(seeds, key=lambda seed: (len(seed), seed))
        entry: dict[str, Any] = {
            "method": BEST_GROUP_METHOD,
            "metric": key,
            "alpha": alpha,
            "power": POWER,
            "n": len(common),
            "members": [],
            "left_out": [
                {"loss": s.loss, "reason": f"{len(by_seed[s.loss])} reproduction(s) with {key}: a paired test needs 2"}
                for s in group
                if s not in usable
            ],
        }
        out[dataset] = entry
        if len(common) < 2:
            entry["family_size"] = 0
            entry["reason"] = (
                f"the studies of {dataset} share {len(common)} reproduction seed(s): a paired test needs 2"
                if usable
                else f"no study of {dataset} has 2 reproductions"
            )
            entry["left_out"] = [{"loss": s.loss, "reason": entry["reason"]} for s in group]
            continue
        values = {s.loss: [by_seed[s.loss][seed] for seed in common] for s in usable}
        result = best_group(values, alpha)
        m = max(result.family_size, 1)
        leader = result.members[0].name
        entry["family_size"] = result.family_size
        entry["leader"] = leader
        for member in result.members:
            diffs = [x - y for x, y in zip(values[member.name], values[leader])]
            sd = _sd(diffs)
            entry["members"].append(
                {
                    "loss": member.name,
                    "mean": member.mean,
                    "in_group": member.in_group,
                    "verdict": "in the best group" if member.in_group else "worse than the best group",
                    "p_adjusted": member.p_adjusted,
                    "beaten_by": member.beaten_by,
                    "mean_diff": sum(diffs) / len(diffs),
                    "sd_diff": sd,
                    "detectable_diff": _detectable(sd, len(diffs), alpha / m, "greater")
                    if member.name != leader
                    else math.nan,
                    "detectable_diff_uncorrected": _detectable(sd, len(diffs), alpha, "two-sided")
                    if member.name != leader
                    else math.nan,
                }
            )
    return out


def top_group(groups: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Per dataset, the names in its best group (:func:`best_groups`), by descending mean."""
    return {d: [m["loss"] for m in g["members"] if m["in_group"]] for d, g in groups.items()}


def verdict(c: dict[str, Any], alpha: float = ALPHA) -> str:
    """A comparison's conclusion; "not distinguishable" names the gap the test would have found with 80 % power
    (``detectable_diff``), so that it is never read as "equal"."""
    if c.get("untestable"):
        return f"not testable ({c['untestable']})"
    p = c.get("p_holm", c["p"])  # judged on the adjusted p where the row is part of a family
    if not (isinstance(p, float) and math.isfinite(p)) or p >= alpha:
        return "not distinguishable" + below_text(c.get("detectable_diff", math.nan))
    return "better" if c["mean_diff"] > 0 else "worse"


def below_text(detectable: float) -> str:
    """`` below X.XX points`` (×100) where a test's 80 %-power gap is known, else ``""``."""
    return f" below {100 * detectable:.2f} points" if math.isfinite(detectable) else ""
