"""The report's paired t-tests: every two losses of a dataset over reproductions with the same seeds, each loss against
the best and against the baseline, Holm–Bonferroni families, the top group and the verdict printed for a comparison.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Any

from dml_core.stats import holm_adjust, paired_t_test, paired_untestable
from pipelines.names import METRIC_LABELS
from pipelines.results.report_studies import Study, ranked

__all__ = ["ALPHA", "BASELINE", "paired_comparisons", "paired_summary", "top_group", "verdict"]


def paired_comparisons(studies: list[Study], mode: str = "concat", metric: str = "map_at_r") -> list[dict[str, Any]]:
    """Paired t-tests between every two losses of a dataset over their reproductions, paired by reproduction seed;
    ``p_holm`` is p adjusted by Holm–Bonferroni over every pair of the dataset (the family of ``paired_tests.csv``)."""
    out = []
    for dataset, group in itertools.groupby(studies, key=lambda s: s.dataset):
        for a, b in itertools.combinations(list(group), 2):
            key = f"test.{mode}.{metric}"
            va, vb = a.by_seed(key), b.by_seed(key)
            common = sorted(set(va) & set(vb), key=lambda seed: (len(seed), seed))  # paired by reproduction seed
            if len(common) < 2:
                continue
            xa = [va[seed] for seed in common]
            xb = [vb[seed] for seed in common]
            t, p = paired_t_test(xa, xb)
            out.append(
                {
                    "dataset": dataset,
                    "loss_a": a.loss,
                    "loss_b": b.loss,
                    "metric": key,
                    "n": len(common),
                    "mean_diff": sum(x - y for x, y in zip(xa, xb)) / len(common),
                    "t": t,
                    "p": p,
                    "untestable": paired_untestable(xa, xb),  # why t and p are NaN, else None
                }
            )
    _add_holm(out, lambda c: c["dataset"])
    return out


def _add_holm(rows: list[dict[str, Any]], family) -> None:
    """Set ``p_holm`` of every row: its p adjusted by Holm–Bonferroni over the rows with the same ``family(row)``
    (NaN p-values stay NaN and are not counted: :func:`dml_core.stats.holm_adjust`)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for c in rows:
        groups.setdefault(family(c), []).append(c)
    for group in groups.values():
        for c, adjusted in zip(group, holm_adjust([c["p"] for c in group])):
            c["p_holm"] = float(adjusted)


#: The reality check's reference loss: every loss is also compared with it.
BASELINE = "contrastive"


def paired_summary(
    studies: list[Study], comparisons: list[dict[str, Any]], baseline: str = BASELINE
) -> list[dict[str, Any]]:
    """Per dataset, each loss against the dataset's best loss (highest mean concatenated test MAP@R) and against
    ``baseline``: ``{dataset, loss, reference, mean_diff (loss − reference), p, p_holm, family, n}`` — the two
    questions a table of many losses is read for (which losses cannot be told apart from the best, which beat the
    baseline), instead of every pair (all pairs stay in the JSON and in ``paired_tests.csv``).  Each reference's
    comparisons on a dataset are one Holm–Bonferroni family (``family`` names it): the comparisons against the best
    and those against the baseline answer separate questions, so each is corrected for its own size."""
    index = {(c["dataset"], c["loss_a"], c["loss_b"]): c for c in comparisons}
    out = []
    for dataset in sorted({s.dataset for s in studies}):
        group = [s for s in ranked(studies) if s.dataset == dataset]
        refs = [group[0].loss] + ([baseline] if any(s.loss == baseline for s in group) else [])
        for ref in dict.fromkeys(refs):
            for s in group:
                if s.loss == ref:
                    continue
                c = index.get((dataset, s.loss, ref))
                sign = 1
                if c is None:
                    c, sign = index.get((dataset, ref, s.loss)), -1
                if c is None:
                    continue
                out.append(
                    {
                        "dataset": dataset,
                        "loss": s.loss,
                        "reference": ref,
                        "kind": "best" if ref == group[0].loss else "baseline",
                        "metric": c["metric"],
                        "n": c["n"],
                        "mean_diff": sign * c["mean_diff"],
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
            f"on {c['dataset']}, {_metric_text(c['metric'])}"
        )
    return out


def _metric_text(key: str) -> str:
    """``test.concat.map_at_r`` → ``concatenated test MAP@R``."""
    _, mode, metric = key.split(".", 2)
    return f"{'concatenated' if mode == 'concat' else mode} test {METRIC_LABELS.get(metric, metric)}"


#: The level at which a (Holm-adjusted) p-value tells two losses apart.
ALPHA = 0.05


def top_group(studies: list[Study], summary: list[dict[str, Any]], alpha: float = ALPHA) -> dict[str, list[str]]:
    """Per dataset, the best loss and the losses *not distinguishable* from it: Holm-adjusted p ≥ ``alpha`` against
    the best, or no p at all because the two losses' values are identical.  A loss without a paired test against
    the best (fewer than 2 reproductions with common seeds) is not in it."""
    out = {d: [next(group).loss] for d, group in itertools.groupby(ranked(studies), key=lambda s: s.dataset)}
    for c in summary:
        if c["kind"] == "best" and not (math.isfinite(c["p_holm"]) and c["p_holm"] < alpha):
            out[c["dataset"]].append(c["loss"])
    return out


def verdict(c: dict[str, Any], alpha: float = ALPHA) -> str:
    if c.get("untestable"):
        return f"not testable ({c['untestable']})"
    p = c.get("p_holm", c["p"])  # judged on the adjusted p where the row is part of a family
    if not (isinstance(p, float) and math.isfinite(p)) or p >= alpha:
        return "not distinguishable"
    return "better" if c["mean_diff"] > 0 else "worse"
