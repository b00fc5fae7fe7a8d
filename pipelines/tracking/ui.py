"""What the MLflow UI shows a user: the experiment opened on its training-runs view, links that keep it there, and the
study and experiment descriptions (headline test tables shown without any column set-up).

:func:`set_experiment_ui` tags the experiment ``mlflow.experimentKind = custom_model_development`` (the value MLflow
3.17's UI reads, else it may open a new experiment on the GenAI overview) and stores the *studies view*: a shared
view state (MLflow's "Share" button stores the same, as the experiment tag ``mlflow.sharedViewState.<key>``) that
lists the study runs only, sorted by test MAP@R (best first), with the headline test metrics as the first columns.
:func:`experiment_url` opens it (``viewStateShareKey``), so a sweep of 20+ studies reads as a ranking without the user
adding columns.  The study run's description (``mlflow.note.content``) is its headline test table.
"""

from __future__ import annotations

import json
import shlex

import numpy as np

from pipelines.names import HEADLINE_METRICS, MODES
from pipelines.tracking.runs import search_all

__all__ = [
    "experiment_url",
    "ui_command",
    "set_experiment_ui",
    "studies_view_state",
    "study_note",
    "experiment_note",
    "NOTE_TAG",
]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
#: The studies view's share key and the experiment tag MLflow's UI reads it from (``mlflow.sharedViewState.<key>``).
STUDIES_VIEW_KEY = "dmlrc-studies"
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."


def _metric_column(key: str) -> str:
    return f"metrics.`{key}`"  # the UI's column id: <type>.`<key>`


def studies_view_state() -> dict:
    """The studies view: study runs only, best test MAP@R (concatenated) first, the headline test metrics as the first
    columns (then the registered model).  Keys are those of MLflow's runs-view state: search facets (``searchFilter``,
    ``orderByKey``, ``orderByAsc``) and UI state (``selectedColumns``, ``columnOrder``, ``columnWidths``)."""
    rank_by = "map_at_r"
    order = [rank_by] + [m for m in HEADLINE_METRICS if m != rank_by]
    metrics = [_metric_column(f"test.concat.{m}.mean") for m in order]
    columns = metrics + ["attributes.`Models`"]
    return {
        "searchFilter": "tags.stage = 'study'",
        "orderByKey": metrics[0],
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": columns,
        "columnWidths": {c: 150 for c in metrics},  # three fit beside the run names in a 1500-px window
    }


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's studies view (:func:`studies_view_state`) on the training-runs tab.  MLflow 3.17's UI keeps a
    per-browser GenAI / Model training switch (localStorage ``mlflow.workflowType``, GenAI by default) that the
    experiment kind tag does not override; the ``workflowType=machine_learning`` query parameter does.  The share key
    is only read on the ``/runs`` route (``/experiments/<id>`` redirects there without it)."""
    return (
        f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs"
        f"?viewStateShareKey={STUDIES_VIEW_KEY}&workflowType=machine_learning"
    )


def ui_command(tracking_uri: str, experiment: str) -> str:
    """The ``dmlrc ui`` command that serves the store ``tracking_uri`` and opens ``experiment``'s studies view
    (:mod:`pipelines.ui_cli`), quoted for a POSIX shell; pass a redacted URI where it holds a password."""
    return f"dmlrc ui --tracking-uri {shlex.quote(tracking_uri)} --experiment {shlex.quote(experiment)}"


def set_experiment_ui(client, experiment_id: str) -> None:
    """Open the experiment on the training-runs view in MLflow 3's UI (not the GenAI overview) and store the studies
    view that :func:`experiment_url` opens."""
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    client.set_experiment_tag(
        experiment_id, SHARED_VIEW_TAG_PREFIX + STUDIES_VIEW_KEY, json.dumps(studies_view_state())
    )


def study_note(study: str, ci: dict, n: int) -> str:
    """The study run's description: its headline test metrics, shown on the run page without any set-up."""
    lines = [
        f"**{study}** — test metrics ×100 over {n} reproductions (mean, 95 % t-interval)",
        "",
        "| metric | concatenated | separated |",
        "|---|---|---|",
    ]
    for metric in HEADLINE_METRICS:
        cells = []
        for mode in MODES:
            t = ci.get(mode, {}).get(metric)
            if not t:
                cells.append("–")
            elif np.isfinite(t[1]):
                cells.append(f"{100 * t[0]:.2f} [{100 * t[1]:.2f}, {100 * t[2]:.2f}]")
            else:
                cells.append(f"{100 * t[0]:.2f}")
        lines.append(f"| {metric} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def experiment_note(tracker) -> str:
    """The experiment's description: one row per study run with test metrics (shown above the runs table)."""
    runs = search_all(tracker.client, tracker.experiment_id, "tags.stage = 'study'")
    lines = [
        "Reality-check studies — test metrics ×100, mean over reproductions (95 % t-intervals on each study "
        "run's page). Models: Models tab / registered models `dmlrc.<experiment>.<dataset>.<loss>`.",
        "",
        "| sweep | study | " + " | ".join(f"concat {m}" for m in HEADLINE_METRICS) + " | registered model |",
        "|---|---|" + "---|" * (len(HEADLINE_METRICS) + 1),
    ]
    for r in sorted(runs, key=lambda r: (r.data.tags.get("sweep", ""), r.data.tags.get("study", ""))):
        m = r.data.metrics
        if "test.concat.map_at_r.mean" not in m:
            continue
        cells = [
            f"{100 * m[f'test.concat.{k}.mean']:.2f}" if f"test.concat.{k}.mean" in m else "–" for k in HEADLINE_METRICS
        ]
        lines.append(
            f"| {r.data.tags.get('sweep', '')} | {r.data.tags.get('study', '')} | "
            + " | ".join(cells)
            + f" | {r.data.tags.get('registered_model', '–')} |"
        )
    return "\n".join(lines) + "\n"
