"""Multi-fidelity search (``protocol.pruning``, off by default; docs/protocol.md §Pruning): Ray Tune's
``ASHAScheduler`` stops clearly worse search trials early, from the fold-mean val MAP@R at each evaluation.

* :func:`pruning_on` / :func:`make_scheduler` / :func:`search_space` — the search Tuner's side: the scheduler (never
  the reproductions'), and the constant :data:`PRUNING_KEY` in every search trial's config that tells the trial how
  many evaluations a fold makes (ASHA's ``max_t``) and so that it reports at each one;
* :class:`Rungs` — the trial's side: while its folds train, it reads their evaluations back from their MLflow runs
  (rank 0 logs each one live) and, once every fold reached evaluation ``e`` (or finished), reports to Tune the mean
  over folds of each fold's best val MAP@R so far — the objective as it stands at ``e``
  (docs/protocol.md §Objective).  Each report carries ``status: "pruned"``: it is a trial's last result only when
  the scheduler stopped the trial there, so the best-trial rule (``status == "ok"``) never picks it.

When Tune stops a trial, ``tune.report`` raises ``SystemExit`` in the trial's thread (Ray's function trainable);
:func:`pipelines.execution.folds.trial.run_trial` then cancels the folds still running.  Closing the pruned trial's
MLflow runs with their cost is the sweep driver's side (:mod:`pipelines.execution.studies.pruned_runs`): it does not
depend on the trial's thread outliving the stop.

Pruning needs folds that a trial can cancel: the warm executor's Ray tasks.  Ray Train folds (DDP) are not
cancelled, so a study whose folds run on Ray Train searches unpruned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray.tune.schedulers import ASHAScheduler

from pipelines.names import OBJECTIVE

__all__ = [
    "PRUNING_KEY",
    "EVALUATION",
    "PRUNED",
    "evaluations_per_fold",
    "pruning_on",
    "make_scheduler",
    "search_space",
    "Rungs",
    "mlflow_history",
]

#: A search trial's config key (a constant of the search's param space): the evaluations per fold, ASHA's max_t.
PRUNING_KEY = "__pruning__"
#: ASHA's time attribute: how many evaluations (after the untrained one at epoch 0) every fold of the trial reached.
EVALUATION = "evaluation"
#: The trial status of a search trial that the scheduler stopped (its MLflow runs' ``status`` tag).
PRUNED = "pruned"
#: The val metric the rungs compare (the objective's metric).
RUNG_METRIC = "val.map_at_r"


def evaluations_per_fold(max_epochs: int, eval_every: int) -> int:
    """Evaluations a fold makes after the untrained one (``dml_core.training.loop``: every ``eval_every`` epochs up to
    ``max_epochs``), unless patience stops it earlier."""
    return max_epochs // eval_every


def pruning_on(cfg) -> bool:
    """``protocol.pruning`` is set and the folds run on the warm executor (Ray tasks a trial can cancel)."""
    r = cfg.resources
    executor = r.fold_executor if r.fold_executor != "auto" else ("warm" if r.workers_per_fold == 1 else "train")
    return cfg.protocol.pruning is not None and executor == "warm"


def make_scheduler(cfg):
    """Ray Tune's ``ASHAScheduler`` on :data:`EVALUATION`; the metric and mode are the TuneConfig's (the objective,
    max)."""
    p = cfg.protocol
    return ASHAScheduler(
        time_attr=EVALUATION,
        max_t=evaluations_per_fold(p.max_epochs, p.eval_every),
        grace_period=p.pruning_grace_period,
        reduction_factor=p.pruning_reduction_factor,
    )


def search_space(cfg) -> dict[str, Any]:
    """The search Tuner's param space: empty without pruning, else the constant that switches the trials' rung
    reports on (Tune merges it into every config the searcher suggests)."""
    if not pruning_on(cfg):
        return {}
    return {PRUNING_KEY: evaluations_per_fold(cfg.protocol.max_epochs, cfg.protocol.eval_every)}


class Rungs:
    """A search trial's reports to the scheduler, one per evaluation that every fold reached.

    ``history(run_id)`` returns a fold run's logged ``(step, value)`` of :data:`RUNG_METRIC`; ``report`` is
    ``tune.report``.  A fold that finished (it may have stopped early on patience) counts as having reached every
    evaluation, with its best value.
    """

    def __init__(
        self,
        fold_runs: dict[int, str],
        max_t: int,
        history: Callable[[str], list[tuple[int, float]]],
        report: Callable[[dict[str, Any]], None],
        extra: dict[str, Any] | None = None,
    ):
        self.fold_runs = dict(fold_runs)
        self.max_t = int(max_t)
        self.history = history
        self.report = report
        self.extra = dict(extra or {})
        self.reported = 0  # the last evaluation reported
        self._values: dict[int, list[float]] = {}  # a finished fold's values, read once

    def _fold_values(self, k: int, running: bool) -> list[float]:
        if k in self._values:
            return self._values[k]
        values = [v for _, v in sorted(self.history(self.fold_runs[k]))]
        if not running and values:  # read again while empty: MLflow may not have answered
            self._values[k] = values
        return values

    def poll(self, running: set[int]) -> None:
        """Report every evaluation that all folds reached since the last poll (``running``: the folds not done).
        The last evaluation is not reported here: the trial's final result follows it."""
        values = {k: self._fold_values(k, k in running) for k in self.fold_runs}
        # values[0] is the untrained evaluation (epoch 0): evaluation e is values[e]
        reached = min((len(v) - 1 if k in running else self.max_t) for k, v in values.items())
        while self.reported < min(reached, self.max_t - 1):
            e = self.reported + 1
            best = [max(v[: e + 1]) if v else 0.0 for v in values.values()]
            self.report(
                {
                    **self.extra,
                    OBJECTIVE: sum(best) / len(best),
                    EVALUATION: e,
                    "status": PRUNED,
                    "reported_at": time.time(),
                }
            )
            self.reported = e


def mlflow_history(tracker) -> Callable[[str], list[tuple[int, float]]]:
    """:class:`Rungs`' ``history`` from a fold run's MLflow metric (what rank 0 logs at every evaluation)."""

    def history(run_id: str) -> list[tuple[int, float]]:
        try:
            return [(m.step, m.value) for m in tracker.client.get_metric_history(run_id, RUNG_METRIC)]
        except Exception:  # MLflow trouble: no rung this poll; the next one reads again
            return []

    return history
