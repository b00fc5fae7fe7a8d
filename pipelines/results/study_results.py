"""What a finished study reports: its summary, the 95 % confidence intervals across reproductions
(docs/protocol.md §Test evaluation) and the tables printed at the end of a sweep.

Cost: ``cost`` holds the study run's ``cost.*`` metrics (without the prefix): resource-seconds summed over every fold
of its trials and reproductions (:func:`pipelines.execution.folds.trial.fold_cost`); the end-of-sweep table shows them
as CPU-hours and GPU-hours.

Intervals: Student-t across reproductions (``dml_core.evaluation.stats.confidence_interval``), for the *concatenated*
and the
*separated* evaluation of the test classes.

Results that look fine and are not: a study whose reproductions' folds all chose their epoch-0 checkpoint (the
untrained network, evaluated before any training step) as best is flagged (:func:`best_at_epoch_0`; tag
:data:`EPOCH0_TAG` on the study run, a mark in the end-of-sweep table, ``dmlrc report``).  The untrained network's own
test metrics (:mod:`pipelines.results.untrained`) are the table's reference row.

Provenance: a study the sweep did not train itself — a finished study of another sweep of the experiment (reused),
a results bundle's study (``compare_with``), a study read from records — carries a :class:`Provenance` (kind,
location with credentials redacted, date, protocol fingerprint hash).  The end-of-sweep table, ``dmlrc report`` and
the MLflow descriptions mark such rows with :func:`provenance_marks` (``bundle [1]``) and explain each mark once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dml_core.evaluation.stats import confidence_interval
from pipelines.config.redact import redact_uri
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
    "Provenance",
    "iso_time",
    "provenance_marks",
    "ranked_summaries",
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


def iso_time(ms: float | int | None) -> str:
    """An MLflow timestamp (milliseconds since the epoch) as ISO 8601 in UTC to the second; "" when unknown."""
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        return ""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Provenance:
    """Where a study's results come from.

    ``kind``: ``mlflow`` (a study run of the experiment: the sweep's own, or one it reused from another sweep),
    ``bundle`` (a results bundle's study; ``location`` its URI, credentials redacted) or ``records`` (a records
    folder; ``location`` the folder).  ``date``: ISO 8601 UTC — a bundle's ``created``, the records' last ``written``,
    a study run's end; "" when the source does not record it.  ``fingerprint``: the protocol fingerprint's hash."""

    kind: str
    location: str
    date: str = ""
    fingerprint: str = ""
    #: the sweep whose study run it is (kind ``mlflow``)
    sweep: str = ""
    #: the study's MLflow run id, in its own store
    run_id: str = ""

    @classmethod
    def of_source(
        cls, source: str, *, date: str = "", fingerprint: str = "", sweep: str = "", run_id: str = ""
    ) -> Provenance:
        """From a study's ``source`` as the report's Study holds it: ``mlflow``, ``bundle <uri>``, ``records
        <folder>``."""
        kind, _, location = source.partition(" ")
        if kind == "mlflow":
            location = f"MLflow run {run_id}" if run_id else "MLflow"
        return cls(kind, redact_uri(location.strip()), date, fingerprint, sweep, run_id)

    def taken_in(self, sweep: str | None) -> str:
        """What a table of sweep ``sweep`` calls the row: ``trained`` (its own study run), ``reused`` (a study run of
        another sweep of the experiment; every study run when ``sweep`` is None), ``bundle`` or ``records``."""
        if self.kind == "mlflow":
            return "trained" if sweep is not None and self.sweep == sweep else "reused"
        return self.kind

    def describe(self, sweep: str | None = None) -> str:
        """One line: what the source is, where, when and under which protocol fingerprint."""
        when = self.date or "not recorded"
        fp = f"protocol fingerprint {self.fingerprint or 'not recorded'}"
        if self.kind == "bundle":
            return f"results bundle {self.location} (created {when}); {fp}"
        if self.kind == "records":
            return f"records folder {self.location} (last record written {when}); {fp}"
        if self.kind == "mlflow":
            what = "reused: finished in" if self.taken_in(sweep) == "reused" else "trained in"
            return f"{what} sweep {self.sweep or '?'!r} of the experiment ({self.location}, ended {when}); {fp}"
        return f"{self.kind} {self.location} ({when}); {fp}"

    def to_json(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "location": self.location,
            "date": self.date,
            "fingerprint": self.fingerprint,
            "sweep": self.sweep,
            "run_id": self.run_id,
        }


def provenance_marks(provenances: list[Provenance | None], sweep: str | None = None) -> tuple[list[str], list[str]]:
    """Each study's mark (``""`` for one trained here, else ``reused [1]``, ``bundle [2]``, ``records [3]``) and the
    notes that explain the numbers (``[2] results bundle s3://… (created …); protocol fingerprint …``), one per
    distinct source, numbered in order of first use."""
    numbers: dict[str, int] = {}
    marks, notes = [], []
    for p in provenances:
        if p is None or p.taken_in(sweep) == "trained":
            marks.append("")
            continue
        text = p.describe(sweep)
        if text not in numbers:
            numbers[text] = len(numbers) + 1
            notes.append(f"[{numbers[text]}] {text}")
        marks.append(f"{p.taken_in(sweep)} [{numbers[text]}]")
    return marks, notes


#: What a fold run records as ``cost.<key>`` and trials, reproductions and studies sum
#: (pipelines.execution.folds.trial.fold_cost).
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
    #: where the results come from when this sweep did not train the study now (:class:`Provenance`); None: trained
    provenance: Provenance | None = None


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


def fmt_ci(t: tuple[float, float, float] | None) -> str:
    if t is None:  # the metric was not measured
        return "–"
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


def _headline(s: StudySummary) -> float:
    """The study's concatenated test MAP@R mean (what the tables rank by); NaN when it has none."""
    t = s.ci.get("concat", {}).get("map_at_r")
    return float(t[0]) if t is not None and isinstance(t[0], (int, float)) else math.nan


def ranked_summaries(studies: list[StudySummary]) -> list[StudySummary]:
    """``studies`` by dataset (name order), then by concatenated test MAP@R, best first; studies without it (failed)
    last, ties by loss name."""

    def key(s: StudySummary) -> tuple:
        v = _headline(s)
        return (s.dataset, not math.isfinite(v), -v if math.isfinite(v) else 0.0, s.loss)

    return sorted(studies, key=key)


def ci_table(studies: list[StudySummary], sweep: str | None = None) -> str:
    """The end-of-sweep table: one row per study, ranked per dataset by concatenated test MAP@R (best first), P@1 /
    RP / MAP@R concatenated and separated (×100, ± CI half-width), and what the study cost (CPU-hours, GPU-hours over
    all its folds).  A study whose best checkpoints are all at epoch 0 is marked ``*`` (explained under the table);
    each dataset's untrained network is a reference row under its studies (one network with its initial weights: the
    same values in both modes; one row per distinct network).

    A study that sweep ``sweep`` did not train (reused from another sweep of the experiment, a results bundle's,
    records') is marked in a last ``source`` column (``bundle [1]``); the notes under the table say where each mark's
    rows come from (URI or folder, date, protocol fingerprint).  The column appears only when some row has a mark."""
    head = (
        ["dataset", "loss"] + [f"{mode} {lab}" for mode in MODES for lab in ("P@1", "RP", "MAP@R")] + ["CPU-h", "GPU-h"]
    )
    ordered = ranked_summaries(studies)
    marks, notes = provenance_marks([s.provenance for s in ordered], sweep)
    refs = _untrained_rows(ordered)
    rows = []
    for s, mark in zip(ordered, marks):
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
        rows.append(row + ([mark or "trained"] if notes else []))
    for ref in refs:  # each dataset's reference rows right under its studies
        last = max(i for i, r in enumerate(rows) if r[0] == ref[0])
        rows.insert(last + 1, ref + ([""] if notes else []))
    if notes:
        head.append("source")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731 - a one-line formatter, used only here
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if refs:
        lines.append(
            f"{_UNTRAINED_ROW}: the study's network with its initial weights (seeded) on the same test classes, "
            "not trained: the floor the losses are measured against"
        )
    if any(s.best_at_epoch_0 for s in studies):
        lines.append(f"* best at epoch 0: {EPOCH0_NOTE}")
    if notes:
        lines.append("source: trained = trained by this sweep; the other rows were not trained here and come from:")
        lines += [f"  {n}" for n in notes]
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
