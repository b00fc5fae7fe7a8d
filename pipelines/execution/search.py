"""The Bayesian optimisation of one study (docs/protocol.md §Search, §Best trial): the searcher and the choice of the
best trial.

* :func:`make_searcher` — Ray Tune's ``OptunaSearch`` with ``optuna.samplers.GPSampler`` (a GP with an
  expected-improvement-type acquisition, the closest Optuna analogue of MLRC's Ax GPEI) after ``startup_trials``
  random trials (MLRC: 5 Sobol trials), seeded; ``TPESampler`` selectable.
* :func:`best_result` — the trial with the highest *observed* mean (docs/protocol.md §Best trial: a SQL max over raw
  values, not the GP's prediction); ties go to the earlier trial.
"""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from ray.tune.search.optuna import OptunaSearch

from pipelines.names import OBJECTIVE

__all__ = ["optuna_space", "make_searcher", "best_result", "grid_rows"]


def optuna_space(searched: dict) -> dict:
    """``pipelines.config.spaces.Param`` → Optuna distributions (log-uniform / uniform / int / categorical)."""
    out = {}
    for name, p in searched.items():
        if p.type == "categorical":
            out[name] = CategoricalDistribution(list(p.choices))
        elif p.type == "int":
            out[name] = IntDistribution(int(p.low), int(p.high), log=p.log)
        else:
            out[name] = FloatDistribution(float(p.low), float(p.high), log=p.log)
    return out


def make_searcher(plan, cfg):
    """OptunaSearch with GPSampler (default) or TPESampler; ``startup_trials`` random trials first; seeded."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    seed = cfg.protocol.seed
    n0 = cfg.protocol.startup_trials
    if cfg.protocol.sampler == "gp":
        sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=n0)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n0)
    return OptunaSearch(space=optuna_space(plan.searched), metric=OBJECTIVE, mode="max", sampler=sampler)


def best_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Highest observed objective among trials that finished ``ok`` (docs/protocol.md §Best trial); earliest trial wins
    ties."""
    ok = [r for r in results if r.get("status") == "ok" and isinstance(r.get(OBJECTIVE), (int, float))]
    if not ok:
        return None
    return max(sorted(ok, key=lambda r: r["trial_id"]), key=lambda r: r[OBJECTIVE])


def grid_rows(grid) -> list[dict[str, Any]]:
    rows = []
    for r in grid:
        m = dict(r.metrics or {})
        m["trial_id"] = m.get("trial_id") or (r.path.rstrip("/").split("/")[-1] if r.path else "")
        m["config"] = dict(r.config or {})
        m["error"] = r.error
        rows.append(m)
    return rows
