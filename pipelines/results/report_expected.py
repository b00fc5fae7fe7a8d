"""Expected validation performance (Dodge et al. 2019, "Show your work"): per study, the expected best validation
MAP@R after k = 1 … N search trials, from the N trials its search ran, with the unbiased estimator of Tang et al.
2020 (draws without replacement, :func:`dml_core.evaluation.expected_validation.expected_max`); as a table and one
figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dml_core.evaluation.expected_validation import expected_max
from pipelines.results.report_studies import Study, ranked

__all__ = ["expected_curves", "expected_rows", "expected_chart", "EXPECTED_NOTE"]

EXPECTED_NOTE = (
    "Expected best validation MAP@R ×100 after k search trials (Dodge et al. 2019), estimated from the study's N "
    "finished trials without replacement (Tang et al. 2020; unbiased, k = 1 is the trials' mean and k = N their "
    "best). A curve still rising at N says more trials would probably have found a better configuration. Validation "
    "values: the fold mean the search maximised, not the test metric of the tables above."
)

#: the trial counts shown as table columns (those up to a study's N, and N itself)
_SHOWN = (1, 2, 3, 5, 10, 20, 30, 50, 100, 200)


def expected_curves(studies: list[Study]) -> list[dict[str, Any]]:
    """``[{dataset, loss, trials, curve}]`` for every study with recorded trial objectives, ranked as the tables."""
    return [
        {"dataset": s.dataset, "loss": s.loss, "trials": len(s.trial_values), "curve": expected_max(s.trial_values)}
        for s in ranked(studies)
        if s.trial_values
    ]


def expected_rows(curves: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The table: one row per (dataset, loss), columns k for the shown trial counts up to the largest N."""
    if not curves:
        return [], []
    n_max = max(c["trials"] for c in curves)
    ks = sorted({k for k in _SHOWN if k <= n_max} | {n_max})
    header = ["dataset", "loss", "N"] + [f"k = {k}" for k in ks]
    rows = [
        [c["dataset"], c["loss"], str(c["trials"])]
        + [f"{100 * c['curve'][k - 1]:.2f}" if k <= c["trials"] else "–" for k in ks]
        for c in curves
    ]
    return header, rows


def expected_chart(curves: list[dict[str, Any]], path: Path) -> bool:
    """One figure, a panel per dataset, a line per loss; ``False`` (nothing written) without curves."""
    if not curves:
        return False
    from pipelines.results.plotting import plt  # matplotlib (a second of imports) only where a report draws

    datasets = sorted({c["dataset"] for c in curves})
    fig, axes = plt.subplots(1, len(datasets), figsize=(7.5 * len(datasets), 5.5), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        mine = [c for c in curves if c["dataset"] == d]
        for c in mine:
            ks = range(1, c["trials"] + 1)
            ax.plot(ks, [100 * v for v in c["curve"]], marker="." if c["trials"] < 30 else None, label=c["loss"])
        ax.set_title(f"{d}: expected best validation MAP@R")
        ax.set_xlabel("search trials k")
        ax.set_ylabel("E[max of k trials] ×100 (without replacement)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=max(1, math.ceil(len(mine) / 16)), loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
