"""``dmlrc report``: one table of every study in an MLflow experiment.

Rows are losses; columns are dataset × metric, each as ``mean ± half-width`` of the 95 % t-interval
across reproductions, for the concatenated and the separated evaluation (docs/protocol.md §Test evaluation).
Written as markdown, CSV, HTML and a PNG bar chart with CI whiskers, and logged to MLflow as a
``stage=report`` run.  Where two losses were reproduced on the same folds and seeds, a paired t-test
on the reproduction runs gives a p-value per pair (``dml_core.evaluation.stats.paired_t_test``).

Where the study runs carry the visuals of :mod:`pipelines.results.visuals`, the HTML gets one page (section) per
dataset: the losses' retrieval galleries side by side on the same queries, their embedding maps and their worst classes
(with the classes they are confused with); the markdown lists the worst classes.  Images are embedded as data URIs,
so the HTML stays one file that works offline.

Cost: a table of CPU-hours and GPU-hours per loss and dataset (the study runs' ``cost.cpu_seconds`` /
``cost.gpu_seconds``, summed over every fold of the study's trials and reproductions; the diverged trials' share
in brackets), in every format.

The run tree it reads is documented in ``docs/architecture.md`` ("MLflow tree").  This module writes the files and
logs them; the studies are read by :mod:`pipelines.results.report_studies`, compared by
:mod:`pipelines.results.report_paired` and rendered by :mod:`pipelines.results.report_markdown` and
:mod:`pipelines.results.report_html` (their cells: :mod:`pipelines.results.report_cells`).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.tracking import MlflowClient

from pipelines.names import COMPARE_WITH_TAG, HEADLINE_METRICS, METRIC_LABELS, MODES
from pipelines.results.bundle import BUNDLE_FILE, comparable_studies, read_bundles, write_bundle
from pipelines.results.report_cells import bound_text, cost_json, json_safe, study_provenance, worst_classes
from pipelines.results.report_expected import expected_chart, expected_curves
from pipelines.results.report_html import render_html
from pipelines.results.report_markdown import render_markdown
from pipelines.results.report_paired import best_groups, paired_comparisons, paired_summary, top_group
from pipelines.results.report_studies import Study, collect_studies, collect_visuals, grid

__all__ = ["Study", "collect_studies", "render_markdown", "write_report", "paired_comparisons", "paired_summary"]


def _write_paired_csv(comparisons: list[dict[str, Any]], path: Path) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    keys = (
        "dataset",
        "loss_a",
        "loss_b",
        "metric",
        "n",
        "mean_diff",
        "sd_diff",
        "t",
        "p",
        "p_holm",
        "detectable_diff",
        "untestable",
    )
    w.writerow(keys)
    for c in comparisons:  # an undefined value (no test) is an empty cell, its reason in `untestable`
        w.writerow(["" if isinstance(c[k], float) and not math.isfinite(c[k]) else c[k] for k in keys])
    path.write_text(buf.getvalue())


def _write_csv(studies: list[Study], path: Path) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    header = ["dataset", "loss", "mode", "metric", "mean", "ci_low", "ci_high", "n_reproductions", "study_run_id"]
    # where the row comes from: kind (mlflow | bundle | records), the bundle's URI or records folder or the run, the
    # source's date, the protocol fingerprint hash (pipelines.results.report_cells.study_provenance)
    w.writerow(header + ["on_bound", "source", "source_location", "source_date", "fingerprint"])
    for s in studies:
        p = study_provenance(s)
        for mode in MODES:
            for m in HEADLINE_METRICS:
                row = [s.dataset, s.loss, mode, m, *s.cell(mode, m), len(s.reproductions), s.run_id, bound_text(s)]
                w.writerow(row + [p.kind, p.location, p.date, p.fingerprint])
    path.write_text(buf.getvalue())


def _bar_chart(studies: list[Study], path: Path, metric: str = "map_at_r") -> None:
    # matplotlib (a second to import) only for the chart: the CLI imports this module to build its parser
    from pipelines.results.plotting import plt

    # Horizontal bars, best loss on top: the figure grows in height with the number of losses, and the loss names
    # stay horizontal and readable however many there are.
    datasets, losses = grid(studies)
    index = {(s.dataset, s.loss): s for s in studies}
    panels = len(MODES) * len(datasets)
    fig, axes = plt.subplots(
        1, panels, figsize=(1.5 + 4.5 * panels, 1.2 + 0.32 * len(losses)), squeeze=False, sharey=True
    )
    y = np.arange(len(losses))[::-1]
    for ax, (mode, d) in zip(axes[0], itertools.product(MODES, datasets)):
        cells = [index[(d, l)].cell(mode, metric) if (d, l) in index else (math.nan,) * 3 for l in losses]
        means = np.array([c[0] for c in cells]) * 100
        err = np.array([[c[0] - c[1], c[2] - c[0]] for c in cells]).T * 100
        ax.barh(y, means, xerr=np.nan_to_num(err), capsize=3, color="#4c72b0")
        ax.set_yticks(y, losses)
        ax.set_title(f"{d} · {mode}")
        ax.set_xlabel(f"{METRIC_LABELS[metric]} (×100, 95 % CI)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _with_bundles(client: MlflowClient, experiment: str, studies: list[Study], extra: list[str]) -> list[Study]:
    """``studies`` and the studies of the bundles the experiment's sweeps compared with (its ``dmlrc.compare_with``
    tag) and of ``extra``, on the experiment's datasets, each with the fingerprint of the experiment's studies;
    a (dataset, loss) in two places is refused."""
    exp = client.get_experiment_by_name(experiment)
    uris = json.loads(exp.tags.get(COMPARE_WITH_TAG, "[]")) if exp is not None else []
    uris += [u for u in extra if u not in uris]
    if not uris:
        return studies
    field = "--compare-with" if extra else "compare_with"
    reference = {s.dataset: s.fingerprint for s in studies}
    merged = list(studies) + comparable_studies(
        read_bundles(uris, field),
        field,
        set(reference),
        lambda dataset, loss: reference[dataset],
        {(s.dataset, s.loss): f"MLflow run {s.run_id}" for s in studies},
    )
    return sorted(merged, key=lambda s: (s.dataset, s.loss))


def write_report(
    tracking_uri: str,
    experiment: str,
    out_dir: str | Path,
    *,
    log_to_mlflow: bool = True,
    compare_with: list[str] | None = None,
) -> dict[str, Path]:
    """Write report.{md,csv,html,json,png}, paired_tests.csv, results-bundle.json and (where the studies' search
    trials were found) expected_validation.png into ``out_dir`` and
    (optionally) log them as a ``stage=report`` run.  The studies of the bundles the experiment's sweeps compared
    with, and of ``compare_with``, take part like the experiment's own."""
    client = MlflowClient(tracking_uri=tracking_uri)
    studies = collect_studies(client, experiment)
    if not studies:
        raise ValueError(
            f"--experiment {experiment!r}: no finished study runs (tag stage=study with test.* metrics) yet"
        )
    studies = _with_bundles(client, experiment, studies, list(compare_with or []))
    collect_visuals(client, studies)
    paths = write_report_files(experiment, studies, out_dir)
    if log_to_mlflow:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:  # it had studies above: deleted while the report was being written
            raise ValueError(f"--experiment {experiment!r}: deleted while the report was being written")
        run = client.create_run(exp.experiment_id, run_name="report", tags={"stage": "report"})
        for p in paths.values():
            client.log_artifact(run.info.run_id, str(p), artifact_path="report")
        client.set_terminated(run.info.run_id)
    return paths


def write_report_files(experiment: str, studies: list[Study], out_dir: str | Path) -> dict[str, Path]:
    """The report's files for ``studies`` (from MLflow, bundles or records) in ``out_dir``; their paths by kind."""
    comparisons = paired_comparisons(studies)
    summary = paired_summary(studies, comparisons)
    groups = best_groups(studies)
    curves = expected_curves(studies)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"report.{ext}" for ext in ("md", "csv", "html", "json", "png")}
    paths["paired_csv"] = out / "paired_tests.csv"
    paths["bundle"] = write_bundle(experiment, studies, out / BUNDLE_FILE)
    paths["md"].write_text(render_markdown(studies, comparisons))
    paths["html"].write_text(render_html(studies, comparisons))
    _write_csv(studies, paths["csv"])
    _write_paired_csv(comparisons, paths["paired_csv"])
    if expected_chart(curves, out / "expected_validation.png"):
        paths["expected_png"] = out / "expected_validation.png"
    doc = json_safe(
        {
            "experiment": experiment,
            "studies": [
                {
                    "dataset": s.dataset,
                    "loss": s.loss,
                    "run_id": s.run_id,
                    "test": {k: v for k, v in s.metrics.items() if k.startswith("test.")},
                    "n_reproductions": len(s.reproductions),
                    "best_params": s.best_params,
                    "on_bound": [{"param": h.param, "bound": h.side, "value": h.bound} for h in s.on_bound],
                    "cost": cost_json(s),
                    "training": s.training,
                    "best_at_epoch_0": s.best_at_epoch_0,
                    "untrained": s.untrained,
                    "source": study_provenance(s).to_json(),
                    "fingerprint": s.fingerprint.to_json() if s.fingerprint is not None else None,
                    **({"worst_classes": worst_classes(s, 10)} if worst_classes(s, 1) else {}),
                }
                for s in studies
            ],
            "paired_tests": comparisons,
            "paired_summary": summary,
            "best_group": groups,
            "top_group": top_group(groups),
            "expected_validation": {"estimator": "without replacement (Tang et al. 2020)", "curves": curves},
        }
    )
    # allow_nan=False: standard JSON only (json_safe turned every undefined number into null)
    paths["json"].write_text(json.dumps(doc, indent=2, allow_nan=False))
    _bar_chart(studies, paths["png"])
    return paths


def add_report_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="table of every study in an MLflow experiment (md, csv, html, png)")
    p.add_argument("--experiment", default=None, help="MLflow experiment name (one per sweep; required)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--out", default="report", help="output directory (default: ./report)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    p.add_argument(
        "--compare-with",
        action="append",
        default=[],
        metavar="BUNDLE",
        help="a results-bundle.json (file or s3://) whose studies join the table (repeatable; the bundles the "
        "experiment's sweeps named in compare_with are read anyway)",
    )
    p.set_defaults(func=run_report)


def run_report(args) -> int:
    # One progress bar per downloaded artifact would bury the table under two bars per study.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = args.tracking_uri or mlflow.get_tracking_uri()
    paths = write_report(
        uri, args.experiment, args.out, log_to_mlflow=not args.no_log, compare_with=list(args.compare_with)
    )
    print(paths["md"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
