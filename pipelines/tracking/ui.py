"""What the MLflow UI shows a user: the experiment opened on its training-runs view, links that keep it there, and the
study and experiment descriptions (headline test tables shown without any column set-up).

:func:`set_experiment_kind` tags the experiment ``mlflow.experimentKind = custom_model_development`` (the value MLflow
3.17's UI reads, else it may open a new experiment on the GenAI overview); the study run's description
(``mlflow.note.content``) is its headline test table.
"""

from __future__ import annotations

import numpy as np

from pipelines.names import HEADLINE_METRICS, MODES
from pipelines.tracking.runs import search_all

__all__ = ["experiment_url", "set_experiment_kind", "study_note", "experiment_note", "NOTE_TAG"]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's page on its training-runs view.  MLflow 3.17's UI keeps a per-browser GenAI / Model training
    switch (localStorage ``mlflow.workflowType``, GenAI by default) that the experiment kind tag does not override;
    the ``workflowType=machine_learning`` query parameter does, so this is the link to print and share."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def set_experiment_kind(client, experiment_id: str) -> None:
    """Open the experiment on the training-runs view in MLflow 3's UI (not the GenAI overview)."""
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


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
