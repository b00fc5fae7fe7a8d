"""What a finished study reports: its summary, the 95 % confidence intervals across reproductions
(docs/protocol.md §Test evaluation) and the tables printed at the end of a sweep.

Cost: ``cost`` holds the study run's ``cost.*`` metrics (without the prefix): resource-seconds summed over every fold
of its trials and reproductions (:func:`pipelines.execution.trial.fold_cost`); the end-of-sweep table shows them as
CPU-hours and GPU-hours.

Intervals: Student-t across reproductions (``dml_core.stats.confidence_interval``), for the *concatenated* and the
*separated* evaluation of the test classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dml_core.stats import confidence_interval
from pipelines.names import MODES, REPRODUCTION

__all__ = [
    "StudySummary",
    "COST_KEYS",
    "cost_hours",
    "confidence_intervals",
    "ci_report",
    "ci_table",
    "params_table",
    "fmt_ci",
]

#: What a fold run records as ``cost.<key>`` and trials, reproductions and studies sum
#: (pipelines.execution.trial.fold_cost).
COST_KEYS = ("wall_seconds", "cpu_seconds", "gpu_seconds", "restarts", "resumes", "redone_iterations")


@dataclass
class StudySummary:
    study: str
    dataset: str
    loss: str
    run_id: str
    status: str  # ok | failed
    reason: str = ""
    best_trial: str | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    best_val: tuple[float, float] | None = None  # (mean, sem)
    ci: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)  # mode -> metric -> (m, lo, hi)
    n_reproductions: int = 0
    trials: int = 0
    seconds: float = 0.0
    #: the study run's cost.* metrics without the prefix (wall_seconds, cpu_seconds, ..., diverged.cpu_seconds, ...)
    cost: dict[str, float] = field(default_factory=dict)


def confidence_intervals(reps: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """mode → metric → (mean, ci_low, ci_high) across reproductions (docs/protocol.md §Intervals: t-interval across
    runs)."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for mode in MODES:
        prefix = f"test_{mode}_"
        keys = (
            sorted(set.intersection(*({k[len(prefix) :] for k in r if k.startswith(prefix)} for r in reps)))
            if reps
            else []
        )
        out[mode] = {k: confidence_interval([r[prefix + k] for r in reps]) for k in keys}
    return out


def ci_report(summary: StudySummary, reps: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The study's CI report as markdown and JSON."""
    doc = {
        "study": summary.study,
        "dataset": summary.dataset,
        "loss": summary.loss,
        "level": 0.95,
        "interval": "Student-t across reproductions: scipy.stats.t.interval(0.95, n-1, mean, sem)",
        "best_trial": summary.best_trial,
        "best_params": summary.best_params,
        "best_val_map_at_r": {"mean": summary.best_val[0], "sem": summary.best_val[1]} if summary.best_val else None,
        "n_reproductions": len(reps),
        "reproductions": [
            {
                "reproduction": r[REPRODUCTION],
                "seed": r.get("seed"),
                **{k: v for k, v in r.items() if k.startswith("test_")},
            }
            for r in reps
        ],
        "metrics": {
            mode: {k: {"mean": m, "ci_low": lo, "ci_high": hi} for k, (m, lo, hi) in d.items()}
            for mode, d in summary.ci.items()
        },
    }
    lines = [
        f"# {summary.study}: test-set results",
        "",
        f"Best configuration: trial {summary.best_trial} — "
        + ", ".join(f"`{k}={v}`" for k, v in summary.best_params.items()),
        "",
        f"{len(reps)} reproductions; values ×100, mean ± half-width of the 95 % Student-t interval [low, high].",
        "",
        "| metric | concatenated | separated |",
        "|---|---|---|",
    ]
    metrics = sorted(
        set(summary.ci.get("concat", {})) | set(summary.ci.get("separated", {})),
        key=lambda k: (k not in ("precision_at_1", "r_precision", "map_at_r"), k),
    )
    for k in metrics:
        cells = []
        for mode in MODES:
            t = summary.ci.get(mode, {}).get(k)
            cells.append(fmt_ci(t) if t else "–")
        lines.append(f"| {k} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n", doc


def fmt_ci(t: tuple[float, float, float]) -> str:
    m, lo, hi = t
    if not (isinstance(lo, float) and math.isfinite(lo)):
        return f"{100 * m:.2f} (n < 2: no interval)"
    return f"{100 * m:.2f} ± {100 * (hi - lo) / 2:.2f} [{100 * lo:.2f}, {100 * hi:.2f}]"


def cost_hours(cost: dict[str, float], kind: str) -> str:
    """``cost[f"{kind}_seconds"]`` in hours (``kind`` = cpu | gpu), 3 significant digits; "–" when unknown."""
    v = cost.get(f"{kind}_seconds")
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "–"
    return f"{v / 3600:.3g}"


def ci_table(studies: list[StudySummary]) -> str:
    """The end-of-sweep table: one row per study, P@1 / RP / MAP@R concatenated and separated (×100, ± CI
    half-width), and what the study cost (CPU-hours, GPU-hours over all its folds)."""
    head = (
        ["dataset", "loss"] + [f"{mode} {lab}" for mode in MODES for lab in ("P@1", "RP", "MAP@R")] + ["CPU-h", "GPU-h"]
    )
    rows = []
    for s in studies:
        row = [s.dataset, s.loss]
        for mode in MODES:
            for k in ("precision_at_1", "r_precision", "map_at_r"):
                t = s.ci.get(mode, {}).get(k)
                if t is None:
                    row.append("–" if s.status == "ok" else s.status)
                elif isinstance(t[1], float) and math.isfinite(t[1]):
                    row.append(f"{100 * t[0]:.2f} ± {100 * (t[2] - t[1]) / 2:.2f}")
                else:
                    row.append(f"{100 * t[0]:.2f}")
        row += [cost_hours(s.cost, "cpu"), cost_hours(s.cost, "gpu")]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def params_table(studies: list[StudySummary]) -> str:
    """One line per study: the winning trial's hyperparameters (what the reproductions retrained)."""
    lines = []
    for s in studies:
        params = ", ".join(f"{k}={_fmt_param(v)}" for k, v in sorted(s.best_params.items())) or "(nothing searched)"
        lines.append(f"  {s.dataset}/{s.loss}: " + (params if s.best_trial else s.status))
    return "\n".join(lines)


def _fmt_param(v: Any) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)
