"""What a finished study reports: its summary, the 95 % confidence intervals across reproductions
(docs/protocol.md §Test evaluation) and the tables printed at the end of a sweep.

Cost: ``cost`` holds the study run's ``cost.*`` metrics (without the prefix): resource-seconds summed over every fold
of its trials and reproductions (:func:`pipelines.execution.trial.fold_cost`); the end-of-sweep table shows them as
CPU-hours and GPU-hours.

Intervals: Student-t across reproductions (``dml_core.stats.confidence_interval``), for the *concatenated* and the
*separated* evaluation of the test classes.

Results that look fine and are not: a study whose reproductions' folds all chose their epoch-0 checkpoint (the
untrained network, evaluated before any training step) as best is flagged (:func:`best_at_epoch_0`; tag
:data:`EPOCH0_TAG` on the study run, a mark in the end-of-sweep table, ``dmlrc report``).  The untrained network's own
test metrics (:mod:`pipelines.results.untrained`) are the table's reference row.
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
    "EPOCH0_TAG",
    "EPOCH0_NOTE",
    "best_at_epoch_0",
]

#: Study-run tag: "true" when every fold of every reproduction chose its epoch-0 checkpoint (the untrained network) as
#: best, "false" otherwise.
EPOCH0_TAG = "best_at_epoch_0"

#: What a flagged study's mark means (the end-of-sweep table and ``dmlrc report``).
EPOCH0_NOTE = (
    "every fold of every reproduction chose the untrained network (its epoch-0 checkpoint) as best, so these are the "
    "untrained network's metrics; train longer or with larger learning rates"
)


def best_at_epoch_0(best_epochs) -> bool:
    """True when there is at least one fold and every fold's best checkpoint is its epoch-0 one."""
    best_epochs = list(best_epochs)
    return bool(best_epochs) and all(int(e) == 0 for e in best_epochs)


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
    #: every reproduction fold's best checkpoint at epoch 0 (:func:`best_at_epoch_0`)
    best_at_epoch_0: bool = False
    #: the untrained network's test metrics (pipelines.results.untrained), without the prefix; empty if unknown
    untrained: dict[str, float] = field(default_factory=dict)


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


_UNTRAINED_ROW = "untrained network"


def ci_table(studies: list[StudySummary]) -> str:
    """The end-of-sweep table: one row per study, P@1 / RP / MAP@R concatenated and separated (×100, ± CI
    half-width), and what the study cost (CPU-hours, GPU-hours over all its folds).  A study whose best checkpoints
    are all at epoch 0 is marked ``*`` (explained under the table); each dataset's untrained network is a reference
    row (one network with its initial weights: the same values in both modes; one row per distinct network)."""
    head = (
        ["dataset", "loss"] + [f"{mode} {lab}" for mode in MODES for lab in ("P@1", "RP", "MAP@R")] + ["CPU-h", "GPU-h"]
    )
    rows = []
    for s in studies:
        row = [s.dataset, s.loss + (" *" if s.best_at_epoch_0 else "")]
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
    refs = _untrained_rows(studies)
    rows += refs
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731 - a one-line formatter, used only here
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if refs:
        lines.append(
            f"{_UNTRAINED_ROW}: the study's network with its initial weights (seeded) on the same test classes, "
            "not trained: the floor the losses are measured against"
        )
    if any(s.best_at_epoch_0 for s in studies):
        lines.append(f"* best at epoch 0: {EPOCH0_NOTE}")
    return "\n".join(lines)


def _untrained_rows(studies: list[StudySummary]) -> list[list[str]]:
    """One reference row per dataset and distinct untrained score (studies of one network share it)."""
    rows, seen = [], set()
    for s in studies:
        if not s.untrained:
            continue
        key = (s.dataset, tuple(s.untrained.get(k) for k in ("precision_at_1", "r_precision", "map_at_r")))
        if key in seen:
            continue
        seen.add(key)
        cells = [f"{100 * v:.2f}" if isinstance(v, float) and math.isfinite(v) else "–" for v in key[1]]
        rows.append([s.dataset, _UNTRAINED_ROW] + cells * len(MODES) + ["", ""])
    return rows


def params_table(studies: list[StudySummary]) -> str:
    """One line per study: the winning trial's hyperparameters (what the reproductions retrained)."""
    lines = []
    for s in studies:
        params = ", ".join(f"{k}={_fmt_param(v)}" for k, v in sorted(s.best_params.items())) or "(nothing searched)"
        lines.append(f"  {s.dataset}/{s.loss}: " + (params if s.status == "ok" else s.status))
    return "\n".join(lines)


def _fmt_param(v: Any) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)
