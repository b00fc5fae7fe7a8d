"""The reality-check sweep: per (dataset, loss) study, Bayesian optimisation → best config → reproductions → CIs.

This module checks a sweep and starts it; the study loop is :mod:`pipelines.execution.studies.sweep_studies`, and the
parts it calls each live in their own module: Ray start-up (:mod:`pipelines.execution.runtime.session`), the searcher
and best-trial choice (:mod:`pipelines.execution.search.searcher`), one trial (:mod:`pipelines.execution.folds.trial`),
one fold (:mod:`pipelines.execution.folds.fold`, :mod:`pipelines.execution.folds.warm`), the intervals and tables
(:mod:`pipelines.results.study_results`).

For each study (docs/protocol.md):

1. **Search** — one Ray Tune ``Tuner`` (never nested: ray #36024) over :func:`pipelines.execution.folds.trial.run_trial`
   with ``OptunaSearch`` (:func:`pipelines.execution.search.searcher.make_searcher`).  ``protocol.trials`` trials (MLRC:
   50), at most ``max_concurrent_trials`` at a time.  Objective: mean over the folds of best-checkpoint val MAP@R (SEM
   recorded), docs/protocol.md §Objective.
2. **Best** — the trial with the highest *observed* mean (:func:`pipelines.execution.search.searcher.best_result`,
   docs/protocol.md §Best trial).
3. **Reproductions** — a second ``Tuner`` runs ``reproductions`` retrainings of the best config (grid over the
   reproduction index; each a full 4-fold trial with seed ``pipelines.names.reproduction_seed(seed, i)``),
   each tested on the test classes, separated and concatenated (docs/protocol.md §Test evaluation).
4. **CIs** — 95 % Student-t intervals across reproductions (``dml_core.evaluation.stats.confidence_interval``), written
   to the study run with the CI report and the best fold models (reproduction 0's, from rank 0's checkpoints); a study
   whose reproductions' folds all chose their epoch-0 checkpoint is tagged ``best_at_epoch_0=true``.  Before its search,
   each study logs its network's untrained test metrics (``untrained.*``, computed once per dataset and network), the
   reference row of the end-of-sweep table (:mod:`pipelines.results.untrained`).

Resources: a trial is a driver reserving one unit of ``dmlrc_trial_driver`` on the driver's node, or 0.01 CPU
where no node declares it (:data:`pipelines.execution.runtime.environment.TRIAL_DRIVER_RESOURCE`; its Tune actor is
reused from trial to trial, which saves a process start and its imports per trial — the trainable keeps no state); each
of its four folds reserves ``cpus_per_worker`` CPUs (and a GPU with ``use_gpu``) per worker, as a warm Ray task or a Ray
Train worker group.  A local Ray gets ``num_cpus`` *logical* CPUs, by default this machine's usable cores
(:func:`~pipelines.execution.runtime.resources.default_num_cpus`): on a 2-core machine a trial's four folds run two at
a time, which takes less CPU than four sharing the cores.

Studies in parallel: every study runs in its own thread of the driver
(:meth:`pipelines.execution.studies.sweep_studies.SweepStudies.run_all`), each with its own searcher, its two Tuners and
its own trial concurrency, at most ``max_concurrent_studies`` at a time (:func:`max_concurrent_studies`).  Their folds
meet in Ray's one queue (a fold is a Ray task or a Train job reserving its own resources; a trial reserves no fold
resource), so a cluster smaller than the demand only queues folds.  Why threads and not one Ray task per study driver:
``docs/architecture.md`` ("Studies in parallel").  Ctrl-C: Python delivers the signal to the main thread only; the
study threads get the same ``SweepInterrupted`` raised into them (``interrupts.stop_threads``), so each
``Tuner.fit()`` leaves exactly as the single one of a sequential sweep did.

Cost: every fold run records what it held and for how long (``cost.*``,
:func:`pipelines.execution.folds.trial.fold_cost`); trials and reproductions sum their folds; the study run sums its
trials and reproductions (:func:`pipelines.execution.studies.runs.study_cost`), diverged trials' share also as
``cost.diverged.*``.

Resume: every Tuner lives at a fixed path under the sweep's storage, so ``--resume`` restores it
(``Tuner.restore``: finished trials are kept with the searcher's history, unfinished ones rerun under the same
trial id); MLflow runs are found again by tags; folds that finished keep their result directory (a warm fold's
``result/`` or a Ray Train checkpoint) and are not retrained.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.config.schema import ConfigError, SweepConfig
from pipelines.execution.preflight.study_plans import preflight
from pipelines.execution.runtime.environment import (
    check_storage_reachable,
    check_tracking_reachable,
    redact_uri,
    scrub,
)
from pipelines.execution.runtime.interrupts import (
    INTERRUPTED,
    close_open_runs,
    resume_command,
    stop_on_sigint,
)
from pipelines.execution.studies.continuation import (
    check_continuation,
    check_restart,
    check_resume,
    open_tracker,
    store_config_or_reopen,
)
from pipelines.execution.studies.reuse import find_reuse
from pipelines.records.study import open_records
from pipelines.results.study_results import StudySummary
from pipelines.tracking.outage import TrackingUnavailable, TrackingWatch
from pipelines.tracking.runs import Tracker, search_all
from pipelines.tracking.ui import experiment_url, record_taken_studies, ui_command

__all__ = ["run_sweep", "SweepOutcome", "max_concurrent_studies"]


@dataclass
class SweepOutcome:
    name: str
    local_dir: Path
    tracking_uri: str
    experiment: str
    experiment_id: str
    studies: list[StudySummary]
    seconds: float
    #: study -> its registered model version (the study run's ``registered_model`` tag: ``<name>/<version>``)
    registered: dict[str, str] = field(default_factory=dict)

    def ui_command(self) -> str:
        """How to look at the runs: a server's link (the experiment on MLflow 3's training-runs view), or the
        ``dmlrc ui`` command that serves the store and opens that view."""
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"open {experiment_url(self.tracking_uri, self.experiment_id)}"
        return ui_command(self.tracking_uri, self.experiment)


# ------------------------------------------------------------------------------------------------------ set-up


def max_concurrent_studies(cfg: SweepConfig, address: str | None, resources: dict[str, float], n_studies: int) -> int:
    """``resources.max_concurrent_studies``, or its default: no limit on a cluster (``--address``: Ray queues the
    folds that do not fit); on the embedded local Ray as many studies as its CPUs (and GPUs) hold at full demand
    (``max_concurrent_trials`` × folds × ``workers_per_fold`` × per-worker CPUs/GPUs), at least one."""
    r = cfg.resources
    if r.max_concurrent_studies is not None:
        return max(1, min(r.max_concurrent_studies, n_studies))
    if address:
        return max(1, n_studies)
    workers = r.max_concurrent_trials * cfg.protocol.folds * r.workers_per_fold
    n = math.floor(resources.get("CPU", 1.0) / (workers * r.cpus_per_worker) + 1e-9)
    if r.use_gpu:
        n = min(n, math.floor(resources.get("GPU", 0.0) / (workers * r.gpus_per_worker) + 1e-9))
    return max(1, min(n, n_studies))


def _close_after(e: BaseException, tracker: Tracker | None, cfg: SweepConfig, uri: str, out) -> None:
    """The sweep's open runs after it stopped on ``e``: ``KILLED`` (interrupted) or ``FAILED`` with the error.  With
    MLflow down they cannot be closed: they stay RUNNING, which is what ``--resume`` reuses."""
    if tracker is None or isinstance(e, (ConfigError, TrackingUnavailable)):
        return
    try:
        if isinstance(e, KeyboardInterrupt):
            close_open_runs(tracker, cfg.name, reason=INTERRUPTED, status="KILLED")
        else:
            close_open_runs(tracker, cfg.name, reason=scrub(f"{type(e).__name__}: {e}", uri))
    except Exception as close_error:  # e.g. the tracking store is what failed: report e
        print(f"warning: could not close the sweep's MLflow runs ({type(close_error).__name__})", file=out, flush=True)


def run_sweep(
    cfg: SweepConfig,
    *,
    resume: bool = False,
    address: str | None = None,
    out=None,
    rerun: set[str] | frozenset[str] = frozenset(),
) -> SweepOutcome:
    """Run (or with ``resume`` continue) a whole sweep.  Raises :class:`ConfigError` before anything is written.

    Studies that finished in the experiment (this sweep's or another's) or that a ``compare_with`` bundle holds are
    not run again but enter the results, once their protocol fingerprint equals the config's
    (:mod:`pipelines.execution.studies.reuse`); ``rerun`` names losses whose finished study runs again.

    Ctrl-C stops it within seconds, closes the runs it leaves (``KILLED``, reason ``interrupted``) and raises
    :class:`pipelines.execution.runtime.interrupts.SweepInterrupted`; a crash closes them ``FAILED`` with the error; a
    failed study's leftover runs are closed ``FAILED`` with the study's reason
    (:mod:`pipelines.execution.runtime.interrupts`).
    """
    out = out or sys.stdout
    t0 = time.time()
    check_restart(cfg, resume, rerun)
    plans = preflight(cfg)
    uri = cfg.tracking_uri()
    shown = redact_uri(uri)  # what is printed: never a password
    check_tracking_reachable(uri)
    check_storage_reachable(cfg)
    reuse = find_reuse(cfg, plans, rerun)  # fingerprints compared first: they name a differing field precisely
    check_resume(cfg)
    check_continuation(cfg, resume, plans, reuse, shown)
    records = open_records(cfg, plans, reuse.fingerprints)  # every record checked before Ray starts
    # Ray and the study loop (Ray Tune and Train: seconds of imports) load only once every check above has passed;
    # runtime.session first: it sets the environment Ray reads as it is imported
    from pipelines.execution.runtime.session import cluster_resources, start_sweep_ray, stop_ray, warn_multi_node
    from pipelines.execution.studies.sweep_studies import SweepStudies

    started = start_sweep_ray(cfg, address, min(len(f.train_classes) for p in plans for f in p.dataset.manifest.folds))
    tracker = watch = None
    try:
        tracker = open_tracker(cfg, uri)
        watch = TrackingWatch(uri, cfg.tracking.outage_timeout_s).start()
        store_config_or_reopen(cfg, resume, tracker, out)
        warn_multi_node(cfg, uri, out)
        limit = max_concurrent_studies(cfg, address, cluster_resources(), len(plans))
        print(
            f"sweep {cfg.name!r}: {len(plans)} studies ({', '.join(p.key for p in plans)}), ≤ {limit} at once; "
            f"MLflow {shown} experiment {cfg.experiment_name()!r}; storage {cfg.ray_storage()}",
            file=out,
            flush=True,
        )
        message = f"interrupted: stopping trials, state is kept; resume with: {resume_command(cfg)}"
        with stop_on_sigint(message, out):
            sweep = SweepStudies(cfg, plans, tracker, out, watch, reuse, records)
            studies = sweep.run_all(limit) + sweep.extra_studies()
    except BaseException as e:
        stop_ray(started)  # first: no worker may write to a run after it is closed
        started = False
        _close_after(e, tracker, cfg, uri, out)
        raise
    finally:
        if watch is not None:
            watch.stop()
        stop_ray(started)
    record_taken_studies(tracker, cfg.name, studies, out)  # reused and bundled studies say so in MLflow's UI
    for s in studies:
        if s.status != "ok":
            close_open_runs(tracker, cfg.name, study=s.study, reason=f"study failed: {s.reason}")
    return SweepOutcome(
        cfg.name,
        cfg.local_dir(),
        shown,
        cfg.experiment_name(),
        tracker.experiment_id,
        studies,
        time.time() - t0,
        _registered_models(tracker, studies),
    )


def _registered_models(tracker: Tracker, studies: list[StudySummary]) -> dict[str, str]:
    """Each finished study's registered model version, for the end-of-sweep lines (one search of the study runs;
    a bundled study's run lives in another store and is left out)."""
    try:
        runs = search_all(tracker.client, tracker.experiment_id, "tags.stage = 'study'")
    except Exception:  # the store is unreachable at the very end: the results are printed without the names
        return {}
    tags = {r.info.run_id: r.data.tags for r in runs}
    out = {}
    for s in studies:
        ref = tags.get(s.run_id, {}).get("registered_model")
        if s.status == "ok" and ref:
            out[s.study] = ref
    return out
