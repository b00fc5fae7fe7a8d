"""The Bayesian optimisation of one study (docs/protocol.md §Search, §Best trial): the searcher and the choice of the
best trial.

* :func:`make_searcher` — Ray Tune's ``OptunaSearch`` with ``optuna.samplers.GPSampler`` (a GP with an
  expected-improvement-type acquisition, the closest Optuna analogue of MLRC's Ax GPEI) after ``startup_trials``
  random trials (MLRC: 5 Sobol trials), seeded; ``TPESampler`` selectable.
  Each trial's proposal is drawn by a sampler seeded from (seed, trial number) (:class:`TrialSeededSampler`), so
  it depends only on the trials before it: a search continued from its records (their values and results replayed
  into Optuna) proposes what the uninterrupted search would have.
* :func:`best_result` — the trial with the highest *observed* mean (docs/protocol.md §Best trial: a SQL max over raw
  values, not the GP's prediction); ties go to the earlier trial.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from ray.tune.search.optuna import OptunaSearch

from pipelines.config.spaces import Param
from pipelines.names import OBJECTIVE

__all__ = ["optuna_space", "make_searcher", "best_result", "grid_rows", "TrialSeededSampler", "SamplerFactory"]


def optuna_space(searched: dict[str, Param]) -> dict[str, BaseDistribution]:
    """``pipelines.config.spaces.Param`` → Optuna distributions (log-uniform / uniform / int / categorical)."""
    out: dict[str, BaseDistribution] = {}
    for name, p in searched.items():
        if p.type == "categorical":
            out[name] = CategoricalDistribution(list(p.options))
        elif p.type == "int":
            low, high = p.bounds
            out[name] = IntDistribution(int(low), int(high), log=p.log)
        else:
            low, high = p.bounds
            out[name] = FloatDistribution(float(low), float(high), log=p.log)
    return out


class SamplerFactory:
    """``factory(seed)`` → a new GPSampler or TPESampler with ``startup`` random trials (picklable: Tune snapshots
    the searcher with it)."""

    def __init__(self, kind: str, startup: int) -> None:
        self.kind, self.startup = kind, startup

    def __call__(self, seed: int) -> optuna.samplers.BaseSampler:
        if self.kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=self.startup)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.startup)


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler whose every trial is proposed by a fresh sampler seeded from (seed, trial number).

    One sampler over a whole search draws from one random stream, so its n-th proposal depends on how many draws came
    before in this process: a search continued in a new process (its finished trials added to the study) would draw
    trial n from the stream's start.  Seeding per trial number makes a proposal a function of the study's history
    alone.  Trials proposed concurrently each get their own sampler (kept by trial number until it ends)."""

    def __init__(self, make: SamplerFactory, seed: int) -> None:
        self._make, self._seed = make, seed
        self._by_trial: dict[int, optuna.samplers.BaseSampler] = {}

    def _for(self, number: int) -> optuna.samplers.BaseSampler:
        if number not in self._by_trial:
            derived = int(np.random.SeedSequence([self._seed, number]).generate_state(1)[0])
            self._by_trial[number] = self._make(derived)
        return self._by_trial[number]

    def infer_relative_search_space(self, study, trial):
        return self._for(trial.number).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._for(trial.number).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._for(trial.number).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._for(trial.number).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._for(trial.number).after_trial(study, trial, state, values)
        self._by_trial.pop(trial.number, None)

    def reseed_rng(self) -> None:  # the seeds are the point: nothing to reseed
        pass


def make_searcher(plan, cfg, done: list[dict[str, Any]] | None = None):
    """OptunaSearch with GPSampler (default) or TPESampler; ``startup_trials`` random trials first; seeded per trial.
    ``done``: finished trials (result rows from the study's records) replayed into Optuna first, in order."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    sampler = TrialSeededSampler(SamplerFactory(cfg.protocol.sampler, cfg.protocol.startup_trials), cfg.protocol.seed)
    searcher = OptunaSearch(space=optuna_space(plan.searched), metric=OBJECTIVE, mode="max", sampler=sampler)
    for row in done or []:  # complete, as Tune told them: a diverged trial scores 0, a pruned one its last rung
        params = {k: v for k, v in row["config"].items() if k in plan.searched}
        searcher.add_evaluated_point(params, float(row[OBJECTIVE]))
    return searcher


def best_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Highest observed objective among trials that finished ``ok`` (docs/protocol.md §Best trial); earliest trial wins
    ties (a trial continued from records by its place in the search)."""
    ok = [r for r in results if r.get("status") == "ok" and isinstance(r.get(OBJECTIVE), (int, float))]
    if not ok:
        return None
    return max(
        sorted(ok, key=lambda r: (r.get("record_index", len(results)), r["trial_id"])), key=lambda r: r[OBJECTIVE]
    )


def grid_rows(grid) -> list[dict[str, Any]]:
    rows = []
    for r in grid:
        m = dict(r.metrics or {})
        m["trial_id"] = m.get("trial_id") or (r.path.rstrip("/").split("/")[-1] if r.path else "")
        m["config"] = dict(r.config or {})
        m["error"] = r.error
        rows.append(m)
    return rows
