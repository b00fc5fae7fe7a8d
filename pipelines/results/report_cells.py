"""The text of the report's table cells and rows, shared by its markdown, HTML, CSV and JSON: results as
``mean ± half-width``, the reference row and marks, cost, winning hyperparameters, worst classes and test statistics.

Where a row comes from: the experiment's own study runs are unmarked; a results bundle's or a records folder's study
is marked (``bundle [1]``) in the results tables, and :func:`flag_notes` explains each mark (URI or folder, date,
protocol fingerprint); :func:`study_provenance` is the same in the CSV's and the JSON's ``source``.
"""

from __future__ import annotations

import math
from typing import Any

from pipelines.names import HEADLINE_METRICS, METRIC_LABELS
from pipelines.results.report_studies import Study, grid, ranked
from pipelines.results.study_results import EPOCH0_NOTE, Provenance, provenance_marks

__all__ = [
    "BOUND_NOTE",
    "bound_text",
    "confused_text",
    "cost_json",
    "cost_rows",
    "flag_notes",
    "fmt_ci",
    "json_safe",
    "num_text",
    "params_text",
    "result_rows",
    "source_marks",
    "study_provenance",
    "worst_classes",
]


def _training_cell(s: Study | None) -> str:
    if s is None or not s.training:
        return "–"
    t = s.training
    return f"{t['improving']}/{t['folds']} ({100 * t['improving'] / t['folds']:.0f} %), {t['epochs']:.2f} epochs"


def worst_classes(s: Study, n: int) -> list[dict[str, Any]]:
    pc = s.visuals.get("per_class") or {}
    by_label = {c["label"]: c for c in pc.get("classes", [])}
    return [by_label[l] for l in pc.get("worst", [])[:n] if l in by_label]


def confused_text(c: dict[str, Any]) -> str:
    return ", ".join(f"{x['class_name']} ({x['count']})" for x in c.get("confused_with", [])) or "–"


def fmt_ci(mean: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "–"
    if math.isnan(low) or math.isnan(high):
        return f"{100 * mean:.2f} (CI undefined)"
    return f"{100 * mean:.2f} ± {100 * (high - low) / 2:.2f}"


def study_provenance(s: Study) -> Provenance:
    """Where ``s`` comes from: its source (the experiment's MLflow run, a bundle's URI, a records folder), the
    source's date and the study's protocol fingerprint hash."""
    return Provenance.of_source(
        s.source,
        date=s.source_date,
        fingerprint=s.fingerprint.hash if s.fingerprint is not None else "",
        sweep=s.sweep,
        run_id=s.run_id,
    )


def source_marks(studies: list[Study]) -> tuple[dict[tuple[str, str], str], list[str]]:
    """(dataset, loss) → the mark of a study that is not the experiment's own (``bundle [1]``, ``records [2]``), and
    the notes that explain the marks, numbered in the report's order (:func:`ranked`)."""
    order = ranked(studies)
    marks, notes = provenance_marks([study_provenance(s) if s.source != "mlflow" else None for s in order])
    return {(s.dataset, s.loss): m for s, m in zip(order, marks) if m}, notes


def result_rows(studies: list[Study], mode: str) -> tuple[list[str], list[list[str]]]:
    """The results table of ``mode``: one row per loss (ranked), per dataset its P@1 / RP / MAP@R.  A loss whose
    studies all come from one source other than the experiment (a bundle, records) has that mark by its name; where
    its datasets' sources differ, each such dataset's cells carry their own."""
    datasets, losses = grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    marks, _ = source_marks(studies)
    header = ["loss"] + [f"{d} {METRIC_LABELS[m]}" for d in datasets for m in HEADLINE_METRICS]
    rows = []
    for loss in losses:
        own = {marks.get((d, loss), "") for d in datasets if (d, loss) in index}
        whole = own.pop() if len(own) == 1 else ""
        row = [f"{loss} ({whole})" if whole else loss]
        for d in datasets:
            s = index.get((d, loss))
            mark = "" if whole or s is None else marks.get((d, loss), "")
            row += [_marked(_flagged(fmt_ci(*s.cell(mode, m)), s), mark) if s else "–" for m in HEADLINE_METRICS]
        rows.append(row)
    if any(s.untrained for s in studies):
        rows.append([_UNTRAINED_ROW] + [_untrained_cell(studies, d, m) for d in datasets for m in HEADLINE_METRICS])
    return header, rows


_EPOCH0_MARK = "best at epoch 0"
_UNTRAINED_ROW = "untrained network (reference)"


def _flagged(cell: str, s: Study) -> str:
    """A results cell of ``s``, marked when its best checkpoints are all the untrained network's."""
    return f"{cell} ({_EPOCH0_MARK})" if s.best_at_epoch_0 and cell != "–" else cell


def _marked(cell: str, mark: str) -> str:
    return f"{cell} ({mark})" if mark else cell


def _untrained_cell(studies: list[Study], dataset: str, metric: str) -> str:
    """The untrained network's ``metric`` on ``dataset`` ×100; "–" when unknown, "varies" when the dataset's studies
    used different networks (each study's value is in the JSON)."""
    values = {s.untrained[metric] for s in studies if s.dataset == dataset and metric in s.untrained}
    return "–" if not values else f"{100 * values.pop():.2f}" if len(values) == 1 else "varies by loss"


def flag_notes(studies: list[Study]) -> list[str]:
    """What the results tables' reference row and marks mean (one paragraph each), as markdown."""
    lines = []
    if any(s.untrained for s in studies):
        lines += [
            f"*{_UNTRAINED_ROW}*: the studies' network with its initial weights on the same test classes, not trained "
            "(one network, the same value in both modes): the floor the losses are measured against.",
            "",
        ]
    flagged = [f"{s.dataset} / {s.loss}" for s in ranked(studies) if s.best_at_epoch_0]
    if flagged:
        lines += [f"**{_EPOCH0_MARK.capitalize()}** ({', '.join(flagged)}): {EPOCH0_NOTE}.", ""]
    _, notes = source_marks(studies)
    if notes:
        lines += [
            "**Where rows come from**: a row without a mark is a study run of this experiment; a marked row was not "
            "trained here, its source is:",
            "",
            *[f"- {n}" for n in notes],
            "",
        ]
    return lines


def num_text(v: float, spec: str) -> str:
    """A test statistic or p-value as printed; "–" where the test gave none (NaN)."""
    return "–" if isinstance(v, float) and math.isnan(v) else format(v, spec)


def _hours(s: Study, kind: str, part: str = "") -> float:
    v = s.metrics.get(f"cost.{part}{kind}_seconds")
    return v / 3600 if isinstance(v, (int, float)) else math.nan


def _cost_cell(s: Study | None) -> str:
    """``CPU-h / GPU-h`` of a study, the diverged trials' share in brackets; "–" for a study without cost metrics."""
    if s is None or math.isnan(_hours(s, "cpu")):
        return "–"
    cell = f"{_hours(s, 'cpu'):.3g} / {_hours(s, 'gpu'):.3g}"
    div = _hours(s, "cpu", "diverged.")
    return cell + (f" ({div:.3g} / {_hours(s, 'gpu', 'diverged.'):.3g} diverged)" if div > 0 else "")


def cost_rows(studies: list[Study]) -> tuple[list[str], list[list[str]]]:
    """One row per loss; per dataset its cost (CPU-hours / GPU-hours) and, where fold runs were found, how many of
    its folds were still improving when training ended (with the mean epochs trained)."""
    datasets, losses = grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    training = any(s.training for s in studies)
    header = ["loss"]
    for d in datasets:
        header += [f"{d} cost (CPU-h / GPU-h)"] + ([f"{d} folds still improving at the end"] if training else [])
    rows = []
    for loss in losses:
        row = [loss]
        for d in datasets:
            s = index.get((d, loss))
            row += [_cost_cell(s)] + ([_training_cell(s)] if training else [])
        rows.append(row)
    return header, rows


def cost_json(s: Study) -> dict[str, float]:
    out = {k[len("cost.") :]: v for k, v in s.metrics.items() if k.startswith("cost.")}
    if out:
        out.update(cpu_hours=_hours(s, "cpu"), gpu_hours=_hours(s, "gpu"))
    return out


def _short_value(v: str) -> str:
    """A parameter as logged (MLflow params are strings) with floats cut to 4 significant digits for reading."""
    try:
        return v if float(v).is_integer() and "." not in v else f"{float(v):.4g}"
    except ValueError:
        return v


BOUND_NOTE = (
    "*On a bound*: the winning value lies on an edge of its searched range (within 0.1 % of the range, on the "
    "search's scale), so the best value may lie outside the range searched."
)


def bound_text(s: Study, prefix: str = "") -> str:
    """``prefix`` + the study's winning values on a bound (``loss_lr at lower bound 1e-06; …``), or ``""``."""
    return prefix + "; ".join(h.describe() for h in s.on_bound) if s.on_bound else ""


def params_text(s: Study) -> str:
    return ", ".join(f"{k}={_short_value(v)}" for k, v in s.best_params.items()) or "(nothing searched)"


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) as ``None`` and numpy scalars as Python numbers, so that
    ``json.dumps(..., allow_nan=False)`` writes standard JSON: a reader's ``json.loads`` never meets ``NaN``.  Where a
    number is undefined, a neighbouring field says why (``untestable``, ``reason``, ``n_reproductions`` < 2)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if hasattr(value, "item") and not isinstance(value, (int, float)):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
