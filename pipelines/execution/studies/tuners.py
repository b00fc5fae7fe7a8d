"""A study's Ray Tune side: its trainable registered under a name of its own, and its Tuners — one TuneConfig and one
RunConfig builder for both the search and the reproductions, each Tuner restored from its fixed path on
``--resume`` (``Tuner.restore``: finished trials kept with the searcher's history, unfinished ones rerun under the
same trial id)."""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray import tune
from ray.tune.execution.experiment_state import _find_newest_experiment_checkpoint

from pipelines.execution.folds.trial import StudyContext, run_trial
from pipelines.execution.runtime.environment import trial_bundle
from pipelines.execution.search.searcher import grid_rows
from pipelines.names import OBJECTIVE, study_dirname, tuner_name

__all__ = ["register_study_trainable", "tune_config", "run_config", "fit_tuner"]


#: Tune's registries (``ray.tune.registry``: trainables, ``with_parameters`` objects) are process-wide dicts that
#: are not safe to write from two threads at once (seen: "dictionary changed size during iteration" in
#: ``flush_values`` when two studies' ``Tuner.fit()`` registered their trainables together).
_REGISTRY_LOCK = threading.Lock()


def register_study_trainable(study: str, ctx: StudyContext) -> str:
    """Register ``run_trial`` bound to this study under a name of its own and return the name, which the study's
    Tuners are given instead of the function (so ``Tuner.fit()`` registers nothing itself).  Tune keys trainables by
    name in one job-wide registry: concurrent studies under one name would run each other's context."""

    def trial(config, ctx):
        return run_trial(config, ctx)

    name = "run_trial_" + study_dirname(study)
    trial.__name__ = trial.__qualname__ = name
    bundle = trial_bundle(ray.cluster_resources())  # on the driver's node when it declares the driver resource
    with _REGISTRY_LOCK:
        trainable = tune.with_resources(tune.with_parameters(trial, ctx=ctx), tune.PlacementGroupFactory([bundle]))
        tune.register_trainable(name, trainable)
    return name


def tune_config(cfg, num_samples: int, search_alg=None, scheduler=None) -> tune.TuneConfig:
    """The TuneConfig of a study's Tuners: maximise the objective, ``max_concurrent_trials`` at a time, trial actors
    reused (the trainable keeps no state); ``scheduler``: the search's ASHA with pruning on
    (:mod:`pipelines.execution.search.pruning`), never the reproductions' (they train to the full budget)."""
    return tune.TuneConfig(
        search_alg=search_alg,
        scheduler=scheduler,
        metric=OBJECTIVE,
        mode="max",
        num_samples=num_samples,
        max_concurrent_trials=cfg.resources.max_concurrent_trials,
        reuse_actors=True,
    )


def run_config(storage: str, name: str, progress, trial_retries: int):
    """The RunConfig of a study's Tuners: a fixed path ``<storage>/<name>`` (what ``--resume`` restores), Tune's own
    output off (``progress`` prints ours; a list: more callbacks, e.g. the pruned trials' closing), ``trial_retries``
    restarts of a failed trial."""
    return tune.RunConfig(
        name=name,
        storage_path=storage,
        verbose=0,
        callbacks=list(progress) if isinstance(progress, (list, tuple)) else [progress],
        failure_config=tune.FailureConfig(max_failures=trial_retries),
    )


def _restorable(path: str) -> bool:
    """Whether the Tuner at ``path`` has a snapshot to restore.  ``Tuner`` writes its ``tuner.pkl`` when built,
    Tune its first experiment-state snapshot moments into ``fit()``: a sweep stopped in between leaves a Tuner that
    ``Tuner.can_restore`` accepts and that Tune then fails to restore ("Failed to restore the run state", a traceback,
    then a fresh start).  Such a Tuner holds no trial: it is started anew, quietly."""
    return tune.Tuner.can_restore(path) and _find_newest_experiment_checkpoint(path) is not None


def fit_tuner(
    storage: str, kind: str, trainable: str, new, *, sweep: str, trial_retries: int, say
) -> list[dict[str, Any]]:
    """Run the study's Tuner ``kind`` in ``storage`` (named by :func:`pipelines.names.tuner_name`): restored when
    it was started before (with its scheduler's state and its callbacks), else built from ``new()`` →
    ``(param_space, TuneConfig, progress callback or callbacks)``; returns the rows of its results.  A Tuner at
    ``<storage>/<kind>``, the name every study's Tuner had before the names were unique, is restored from there."""
    name = tuner_name(sweep, storage, kind)
    for path in (f"{storage}/{name}", f"{storage}/{kind}"):
        if _restorable(path):
            say(f"resuming {kind} from {path}")
            tuner = tune.Tuner.restore(
                path, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
            )
            return grid_rows(tuner.fit())
    param_space, tune_cfg, progress = new()
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune_cfg,
        run_config=run_config(storage, name, progress, trial_retries),
    )
    return grid_rows(tuner.fit())
