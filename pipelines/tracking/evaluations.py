"""A fold run's evaluation history in MLflow: what one evaluation logs (:func:`evaluation_metrics`, at step = its
iteration), which evaluations a run already holds (:func:`logged_evaluations`), and which metric values MLflow and a
results table can hold (:func:`finite_metrics`).

Rank 0 of a fold logs each evaluation live; the trial's driver logs those that could not be (MLflow down while the
fold trained, a restart) from the fold's ``outcome.json``, each once.  Both sides read these two functions, and the
driver's side stays free of torch: a search trial's driver only submits folds and reduces their results.
"""

from __future__ import annotations

import math
from typing import Any

from pipelines.names import HEADLINE_METRICS

__all__ = ["STEP_METRIC", "evaluation_metrics", "finite_metrics", "logged_evaluations"]

#: The metric logged at every evaluation (``epoch``): its steps are the evaluations the run holds.
STEP_METRIC = "epoch"


def finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric values of ``metrics`` as floats (a metric undefined on some data, NaN, or a non-numeric
    entry is left out rather than logged as NaN)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


def evaluation_metrics(record: dict[str, Any]) -> dict[str, float]:
    """What a fold run logs for one evaluation (at step = its iteration): ``val.<metric>``, ``train.loss``, and
    the epoch (the step metric that tells which evaluations a run holds)."""
    metrics = {f"val.{k}": v for k, v in record["metrics"].items() if k in HEADLINE_METRICS}
    if record.get("train_loss") is not None:
        metrics["train.loss"] = record["train_loss"]
    metrics[STEP_METRIC] = record["epoch"]
    return metrics


def logged_evaluations(tracker, fold_run_id: str) -> set[int]:
    """The iterations whose evaluation the fold run already holds."""
    return {m.step for m in tracker.client.get_metric_history(fold_run_id, STEP_METRIC)}
