"""What the MLflow UI shows a user: the experiment opened on its training-runs view, links that keep it there, and the
study and experiment descriptions (headline test tables shown without any column set-up).

:func:`set_experiment_ui` tags the experiment ``mlflow.experimentKind = custom_model_development`` (the value MLflow
3.17's UI reads, else it may open a new experiment on the GenAI overview) and stores the *studies view*: a shared
view state (MLflow's "Share" button stores the same, as the experiment tag ``mlflow.sharedViewState.<key>``) that
lists the study runs only, sorted by test MAP@R (best first), with the headline test metrics as the first columns.
:func:`experiment_url` opens it (``viewStateShareKey``), so a sweep of 20+ studies reads as a ranking without the user
adding columns.  The study run's description (``mlflow.note.content``) is its headline test table.

Where a study comes from: the experiment's description table has a ``source`` column.  A study run is ``trained`` in
its sweep; when a later sweep took it instead of running it (:func:`record_taken_studies`), the run is tagged
:data:`REUSED_BY_TAG` and both its description and the table say ``reused by sweep …``.  A results bundle's study has
no run in this store: the sweep that compared with it keeps its row (:data:`BUNDLED_TAG_PREFIX` + the sweep's name,
an experiment tag) and the table shows it as ``bundle`` with the bundle's URI (credentials redacted), date and
protocol fingerprint.
"""

from __future__ import annotations

import json
import shlex
import sys

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
    "record_taken_studies",
    "NOTE_TAG",
    "REUSED_BY_TAG",
    "BUNDLED_TAG_PREFIX",
]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
#: The studies view's share key and the experiment tag MLflow's UI reads it from (``mlflow.sharedViewState.<key>``).
STUDIES_VIEW_KEY = "dmlrc-studies"
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
#: Study-run tag: the sweeps (comma-separated) that took this finished study instead of running it.
REUSED_BY_TAG = "dmlrc.reused_by"
#: Experiment tag ``dmlrc.bundled.<sweep>``: the results bundles' studies that sweep took, as JSON rows.
BUNDLED_TAG_PREFIX = "dmlrc.bundled."
#: MLflow's limit on an experiment tag's value (characters).
_EXPERIMENT_TAG_MAX = 20000


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
    (:mod:`pipelines.ui_serve`), quoted for a POSIX shell; pass a redacted URI where it holds a password."""
    return f"dmlrc ui --tracking-uri {shlex.quote(tracking_uri)} --experiment {shlex.quote(experiment)}"


def set_experiment_ui(client, experiment_id: str) -> None:
    """Open the experiment on the training-runs view in MLflow 3's UI (not the GenAI overview) and store the studies
    view that :func:`experiment_url` opens."""
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    client.set_experiment_tag(
        experiment_id, SHARED_VIEW_TAG_PREFIX + STUDIES_VIEW_KEY, json.dumps(studies_view_state())
    )


def study_note(study: str, ci: dict, n: int, source: str = "") -> str:
    """The study run's description: its headline test metrics, shown on the run page without any set-up; ``source``
    (where the results come from, e.g. which sweeps reused them) as a line under the title."""
    lines = [
        f"**{study}** — test metrics ×100 over {n} reproductions (mean, 95 % t-interval)",
        "",
        *([_one_line(source), ""] if source else []),
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


def _one_line(text: str) -> str:
    """``text`` as one line of a markdown table cell (its own ``|`` escaped)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _reused_text(sweeps: str) -> str:
    return f"reused by sweep {', '.join(repr(s) for s in sweeps.split(',') if s)} (not run again there)"


def experiment_note(tracker) -> str:
    """The experiment's description: one row per study with test metrics (shown above the runs table) and where it
    comes from: ``trained`` (in its sweep; ``reused by sweep …`` when later sweeps took it) or, for the studies of a
    results bundle a sweep compared with, ``bundle`` with the bundle's URI, date and protocol fingerprint."""
    runs = search_all(tracker.client, tracker.experiment_id, "tags.stage = 'study'")
    lines = [
        "Reality-check studies — test metrics ×100, mean over reproductions (95 % t-intervals on each study "
        "run's page). Models: Models tab / registered models `dmlrc.<experiment>.<dataset>.<loss>`. Source: "
        "`trained` in that sweep, `reused` by later sweeps instead of running it again, or a results `bundle`'s "
        "study (no run in this store).",
        "",
        "| sweep | study | " + " | ".join(f"concat {m}" for m in HEADLINE_METRICS) + " | registered model | source |",
        "|---|---|" + "---|" * (len(HEADLINE_METRICS) + 2),
    ]
    rows = []
    for r in runs:
        m = r.data.metrics
        if "test.concat.map_at_r.mean" not in m:
            continue
        tags = r.data.tags
        source = "trained" + (f"; {_reused_text(tags[REUSED_BY_TAG])}" if tags.get(REUSED_BY_TAG) else "")
        metrics = {k: m.get(f"test.concat.{k}.mean") for k in HEADLINE_METRICS}
        rows.append((tags.get("sweep", ""), tags.get("study", ""), metrics, tags.get("registered_model", "–"), source))
    exp_tags = tracker.client.get_experiment(tracker.experiment_id).tags
    for key, value in exp_tags.items():
        if not key.startswith(BUNDLED_TAG_PREFIX):
            continue
        try:
            bundled = json.loads(value)
        except ValueError:
            continue  # not a tag this module wrote
        for b in bundled if isinstance(bundled, list) else []:
            if isinstance(b, dict):
                concat = b.get("concat") or {}
                metrics = {k: concat.get(k) for k in HEADLINE_METRICS}
                rows.append((key[len(BUNDLED_TAG_PREFIX) :], b.get("study", "?"), metrics, "–", b.get("source", "")))
    for sweep, study, metrics, model, source in sorted(rows, key=lambda r: (r[0], r[1])):
        cells = [f"{100 * v:.2f}" if isinstance(v, (int, float)) else "–" for v in metrics.values()]
        lines.append(
            f"| {_one_line(sweep)} | {_one_line(study)} | "
            + " | ".join(cells)
            + f" | {_one_line(model)} | {_one_line(source)} |"
        )
    return "\n".join(lines) + "\n"


def _bundled_rows(studies) -> str:
    """The experiment tag's value for the bundled ``studies`` (JSON rows); rows that would pass MLflow's limit on a
    tag's value are left out and counted in a last row."""
    rows = [
        {
            "study": s.study,
            "concat": {k: v[0] for k, v in s.ci.get("concat", {}).items() if k in HEADLINE_METRICS},
            "source": f"bundle: {s.provenance.describe()}",
        }
        for s in studies
    ]
    for kept in range(len(rows), -1, -1):
        left = len(rows) - kept
        more = [{"study": f"({left} more bundled studies: see the end-of-sweep table)", "source": "bundle"}]
        text = json.dumps(rows[:kept] + (more if left else []))
        if len(text) <= _EXPERIMENT_TAG_MAX:
            return text
    return "[]"


def record_taken_studies(tracker, sweep: str, studies, out=None) -> None:
    """After sweep ``sweep``: the studies it took instead of running them (``studies``: its
    :class:`~pipelines.results.study_results.StudySummary` list, each with its ``provenance``) said so where the
    MLflow UI shows them — a reused study run of another sweep gets :data:`REUSED_BY_TAG` and a description that
    names the sweeps; a results bundle's studies are kept on the experiment (:data:`BUNDLED_TAG_PREFIX`); then the
    experiment's description table is written again.  A tracking store that fails here costs a warning line, not the
    sweep's results."""
    out = out or sys.stdout
    try:
        for s in studies:
            p = s.provenance
            if p is None or p.kind != "mlflow" or not p.run_id or p.sweep == sweep:
                continue
            tags = tracker.run(p.run_id).data.tags
            sweeps = [x for x in tags.get(REUSED_BY_TAG, "").split(",") if x]
            if sweep not in sweeps:
                sweeps.append(sweep)
            text = ",".join(sweeps)
            note = study_note(s.study, s.ci, s.n_reproductions, f"Trained in sweep {p.sweep!r}; {_reused_text(text)}.")
            tracker.set_tags(p.run_id, {REUSED_BY_TAG: text, NOTE_TAG: note})
        bundled = [s for s in studies if s.provenance is not None and s.provenance.kind == "bundle"]
        if bundled:
            tracker.client.set_experiment_tag(tracker.experiment_id, BUNDLED_TAG_PREFIX + sweep, _bundled_rows(bundled))
        tracker.client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, experiment_note(tracker))
    except Exception as e:  # the results are in; the descriptions are what is missing
        print(
            f"warning: the MLflow descriptions do not say which studies were reused or bundled ({type(e).__name__})",
            file=out,
            flush=True,
        )
