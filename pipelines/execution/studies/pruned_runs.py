"""A pruned search trial's MLflow runs closed on the sweep driver (docs/protocol.md §Pruning): the trial run and its
fold runs tagged ``status=pruned`` (MLflow status FINISHED: stopping it was the search's decision), each fold run with
its ``cost.*`` so far and the trial run with their sum; the study counts them (``trials.pruned``) and its cost
includes them (``cost.pruned.*``).

Two places call :func:`close_pruned`, both on the driver, so nothing depends on the stopped trial's thread outliving
the stop: :class:`PrunedTrials`, a Tune callback, when the scheduler stops a trial (its runs close at once, the end of
its cost is that moment), and :func:`close_pruned_rows` once the search is over (a trial whose runs are still open —
the driver died between the stop and the callback, and ``--resume`` restored the search — ends at its last report;
every pruned trial's fold checkpoints are deleted there, its folds being cancelled by then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ray.tune import Callback

from dml_core.storage import open_storage
from pipelines.execution.folds.config import FoldOutcome
from pipelines.execution.folds.trial import fold_cost
from pipelines.execution.search.pruning import EVALUATION, PRUNED
from pipelines.names import FOLD_STARTED_TAG, OBJECTIVE, OUTCOME_FILE
from pipelines.results.study_results import COST_KEYS
from pipelines.tracking.runs import PARENT, Tracker

__all__ = ["PrunedRuns", "PrunedTrials", "close_pruned", "close_pruned_rows"]


@dataclass(frozen=True)
class PrunedRuns:
    """Where a study's pruned trials live and what their folds held (picklable: plain values only)."""

    tracking_uri: str
    experiment_id: str
    fold_storage: str  # the folds' result and checkpoint directories: <fold_storage>/<trial id>-fold<k>/
    cpus_per_worker: float
    gpus_per_worker: float  # 0 without GPUs
    workers_per_fold: int

    @classmethod
    def of(cls, cfg, tracker: Tracker, fold_storage: str) -> PrunedRuns:
        """A study's, from the sweep config, its tracker and its folds' storage."""
        r = cfg.resources
        gpus = r.gpus_per_worker if r.use_gpu else 0.0
        return cls(tracker.uri, tracker.experiment_id, fold_storage, r.cpus_per_worker, gpus, r.workers_per_fold)

    def tracker(self) -> Tracker:
        return Tracker.from_uri(self.tracking_uri, self.experiment_id)

    def fold_dir(self, trial_id: str, k: int) -> str:
        return self.fold_storage.rstrip("/") + f"/{trial_id}-fold{k}"


def _fold_cost(where: PrunedRuns, fold_run, trial_id: str, end: float) -> dict[str, float]:
    """A fold's cost: a fold that finished before the stop, from its ``outcome.json``; a cancelled one from its start
    (its ``started_at`` tag, set when the fold began) to ``end``; one that never started costs nothing."""
    k = int(fold_run.data.tags["fold"])
    result = open_storage(where.fold_dir(trial_id, k) + "/result")
    if result.exists(OUTCOME_FILE):
        outcome = FoldOutcome.from_json(result.get_bytes(OUTCOME_FILE).decode())
    else:
        tag = fold_run.data.tags.get(FOLD_STARTED_TAG)
        if tag is None:
            return {key: 0.0 for key in COST_KEYS}
        start = float(tag)
        outcome = FoldOutcome(
            fold=k, status=PRUNED, time_start=start, time_end=max(start, end), world_size=where.workers_per_fold
        )
    return fold_cost(outcome, where.cpus_per_worker, where.gpus_per_worker)


def close_pruned(where: PrunedRuns, tracker: Tracker, result: dict[str, Any], trial_id: str, end: float):
    """Close a pruned trial's runs (``result``: its last Tune result, the report it was stopped at) with their cost
    up to ``end``; returns the trial's ``cost.*`` (read back when its runs were closed before)."""
    run_id = result.get("mlflow_run_id")
    if not run_id:
        return {}
    run = tracker.run(run_id)
    if run.info.status != "RUNNING" and run.data.tags.get("status") == PRUNED:
        return {k[len("cost.") :]: v for k, v in run.data.metrics.items() if k.startswith("cost.")}
    evaluation, value = result[EVALUATION], result[OBJECTIVE]  # the report ASHA stopped it at: it decided on both
    reason = f"stopped by the ASHA scheduler at evaluation {evaluation} (fold-mean val MAP@R so far {value:.4f})"
    cost = {k: 0.0 for k in COST_KEYS}
    for fold in tracker.find({PARENT: run_id, "stage": "fold"}):
        one = _fold_cost(where, fold, trial_id, end)
        for k, v in one.items():
            cost[k] += v
        if fold.info.status == "RUNNING":
            tracker.log_metrics(fold.info.run_id, {f"cost.{k}": v for k, v in one.items()})
            tracker.set_tags(fold.info.run_id, {"status": PRUNED, "reason": reason})
            tracker.finish(fold.info.run_id, "FINISHED")
    metrics = {f"cost.{k}": v for k, v in cost.items()}
    metrics.update({"val.map_at_r.mean": value, "pruned.evaluation": evaluation})
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(run_id, {"status": PRUNED, "reason": reason})
    tracker.finish(run_id, "FINISHED")
    return cost


class PrunedTrials(Callback):
    """On the sweep driver (Tune's controller): a search trial stopped by the scheduler — its last result an
    intermediate report — gets its runs closed at once.  Pickled with the experiment state: plain values only."""

    def __init__(self, where: PrunedRuns):
        self.where = where

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        result = trial.last_result or {}
        if result.get("status") != PRUNED:
            return
        try:
            close_pruned(self.where, self.where.tracker(), result, trial.trial_id, time.time())
        except Exception as e:  # MLflow trouble: the search goes on; close_pruned_rows closes it at the end
            print(f"warning: closing the runs of pruned trial {trial.trial_id} failed: {e}", flush=True)


def close_pruned_rows(where: PrunedRuns, tracker: Tracker, rows: list[dict[str, Any]]) -> int:
    """After the search: every pruned row's runs closed (if still open), its ``cost_*`` filled from them (what the
    study's cost sums) and its folds' checkpoints deleted; returns how many trials were pruned."""
    n = 0
    for r in rows:
        if r.get("status") != PRUNED or r.get("error") is not None:
            continue
        n += 1
        end = float(r.get("reported_at") or time.time())
        cost = close_pruned(where, tracker, r, r["trial_id"], end)
        r.update({f"cost_{k}": v for k, v in cost.items()})
        if not r.get("mlflow_run_id"):
            continue
        for fold in tracker.find({PARENT: r["mlflow_run_id"], "stage": "fold"}):
            # the fold's mid-fold states (pipelines.execution.folds.fold.CHECKPOINT_DIR; that module loads torch)
            ckpt = where.fold_dir(r["trial_id"], int(fold.data.tags["fold"])) + "/ckpt"
            try:
                open_storage(ckpt).delete_tree()
            except Exception as e:  # stale checkpoints cost space, not correctness
                print(f"warning: could not delete the checkpoints in {ckpt}: {e}", flush=True)
    return n
