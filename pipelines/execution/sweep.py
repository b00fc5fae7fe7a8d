"""The reality-check sweep: per (dataset, loss) study, Bayesian optimisation → best config → reproductions → CIs.

This module is the study loop; the parts it calls each live in their own module: Ray start-up, the searcher and
best-trial choice (:mod:`pipelines.execution.search`), one trial (:mod:`pipelines.execution.trial`), one fold
(:mod:`pipelines.execution.fold`, :mod:`pipelines.execution.warm_folds`), the intervals and tables
(:mod:`pipelines.results.study_results`).

For each study (docs/protocol.md):

1. **Search** — one Ray Tune ``Tuner`` (never nested: ray #36024) over :func:`pipelines.execution.trial.run_trial` with
   ``OptunaSearch`` (:func:`pipelines.execution.search.make_searcher`).  ``protocol.trials`` trials (MLRC: 50), at most
   ``max_concurrent_trials`` at a time.  Objective: mean over the folds of best-checkpoint val MAP@R (SEM
   recorded), docs/protocol.md §Objective.
2. **Best** — the trial with the highest *observed* mean (:func:`pipelines.execution.search.best_result`,
   docs/protocol.md §Best trial).
3. **Reproductions** — a second ``Tuner`` runs ``reproductions`` retrainings of the best config (grid over the
   reproduction index; each a full 4-fold trial with seed ``pipelines.execution.trial.reproduction_seed(seed, i)``),
   each tested on the test classes, separated and concatenated (docs/protocol.md §Test evaluation).
4. **CIs** — 95 % Student-t intervals across reproductions (``dml_core.stats.confidence_interval``), written to the
   study run with the CI report and the best fold models (reproduction 0's, from rank 0's checkpoints); a study whose
   reproductions' folds all chose their epoch-0 checkpoint is tagged ``best_at_epoch_0=true``.  Before its search,
   each study logs its network's untrained test metrics (``untrained.*``, computed once per dataset and network), the
   reference row of the end-of-sweep table (:mod:`pipelines.results.untrained`).

Resources: a trial is a driver reserving one unit of ``dmlrc_trial_driver`` on the driver's node, or 0.01 CPU
where no node declares it (:data:`pipelines.execution.ray_runtime.TRIAL_DRIVER_RESOURCE`; its Tune actor is reused from
trial to trial, which saves a process start and its imports per trial — the trainable keeps no state); each of its four
folds reserves ``cpus_per_worker`` CPUs (and a GPU with ``use_gpu``) per worker, as a warm Ray task or a Ray Train
worker group.  A local Ray gets ``num_cpus`` *logical* CPUs, by default enough for ``max_concurrent_trials`` × folds ×
workers — on a 2-core machine that oversubscribes the cores, which is fine for tiny models and is what lets the four
folds overlap.

Studies in parallel: every study runs in its own thread of the driver (:meth:`_Sweep.run_all`), each with its own
searcher, its two Tuners and its own trial concurrency, at most ``max_concurrent_studies`` at a time
(:func:`max_concurrent_studies`).  Their folds meet in Ray's one queue (a fold is a Ray task or a Train job reserving
its own resources; a trial reserves no fold resource), so a cluster smaller than the demand only queues folds.  Why
threads and not one Ray task per study driver: ``docs/architecture.md`` ("Studies in parallel").  Ctrl-C: Python
delivers the signal to the main thread only; the study threads get the same ``SweepInterrupted`` raised into them
(:func:`_raise_in_thread`), so each ``Tuner.fit()`` leaves exactly as the single one of a sequential sweep did.

Cost: every fold run records what it held and for how long (``cost.*``, :func:`pipelines.execution.trial.fold_cost`);
trials and reproductions sum their folds; the study run sums its trials and reproductions (:func:`study_cost`), diverged
trials' share also as ``cost.diverged.*``.

Resume: every Tuner lives at a fixed path under the sweep's storage, so ``--resume`` restores it
(``Tuner.restore``: finished trials are kept with the searcher's history, unfinished ones rerun under the same
trial id); MLflow runs are found again by tags; folds that finished keep their result directory (a warm fold's
``result/`` or a Ray Train checkpoint) and are not retrained.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config.schema import ConfigError, SweepConfig
from pipelines.execution.interrupts import (
    INTERRUPTED,
    SweepInterrupted,
    close_open_runs,
    failure_reason,
    install_startup_handlers,
    reopen_interrupted,
    resume_command,
    stop_on_sigint,
)
from pipelines.execution.preflight import StudyPlan, preflight
from pipelines.execution.ray_runtime import (
    check_storage_reachable,
    check_tracking_reachable,
    redact_uri,
    scrub,
    start_ray,
    stop_ray,
    trial_bundle,
    warn_multi_node,
)
from pipelines.execution.resources import check_cluster_resources
from pipelines.execution.search import best_result, grid_rows, make_searcher
from pipelines.execution.trial import StudyContext, run_trial
from pipelines.execution.worker_check import check_user_code_on_workers
from pipelines.names import OBJECTIVE, PARAMS, REPRODUCTION, study_dirname
from pipelines.results.bounds import ON_BOUND_TAG, format_tag, on_bound
from pipelines.results.study_results import (
    COST_KEYS,
    EPOCH0_NOTE,
    EPOCH0_TAG,
    StudySummary,
    best_at_epoch_0,
    ci_report,
    confidence_intervals,
    fmt_ci,
)
from pipelines.results.untrained import UNTRAINED_PREFIX, untrained_key, untrained_metrics_of, untrained_test_metrics
from pipelines.results.visuals import log_study_visuals
from pipelines.tracking.model_registry import on_study_end, on_study_start
from pipelines.tracking.outage import TrackingUnavailable, TrackingWatch
from pipelines.tracking.runs import PARENT, Tracker, git_commit
from pipelines.tracking.ui import experiment_url, set_experiment_ui

__all__ = ["run_sweep", "SweepOutcome", "max_concurrent_studies", "study_cost"]

#: How long an interrupted sweep waits for its study threads to leave their Tuners before Ray is shut down.
_STUDY_STOP_WAIT_S = 20.0

_CONFIG_FILE = "sweep_config.json"


@dataclass
class SweepOutcome:
    name: str
    local_dir: Path
    tracking_uri: str
    experiment: str
    experiment_id: str
    studies: list[StudySummary]
    seconds: float

    def mlflow_ui_command(self) -> str:
        """How to look at the runs; the link opens the experiment on MLflow 3's training-runs view."""
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"open {experiment_url(self.tracking_uri, self.experiment_id)}"
        return (
            f"mlflow ui --backend-store-uri {self.tracking_uri}  then open "
            f"{experiment_url('http://127.0.0.1:5000', self.experiment_id)}"
        )


# ------------------------------------------------------------------------------------------------------ set-up


def _artifact_location(cfg: SweepConfig) -> str | None:
    """Artifacts next to the sweep's storage (``<storage>/<name>/mlartifacts``, on S3 when it is ``s3://``) for a
    file/sqlite/postgres tracking DB; an HTTP server chooses its own (proxied) store."""
    if cfg.tracking_uri().startswith(("http://", "https://")):
        return None
    if cfg.storage_is_s3:
        return cfg.storage.rstrip("/") + "/" + cfg.name + "/mlartifacts"
    return (cfg.local_dir() / "mlartifacts").as_uri()


def _check_resume(cfg: SweepConfig, resume: bool) -> None:
    """A new sweep must not silently reuse an old one's folder; ``--resume`` must not change what is studied."""
    stored = cfg.local_dir() / _CONFIG_FILE
    if not stored.exists():
        return
    if not resume:
        raise ConfigError(
            "name",
            f"a sweep named {cfg.name!r} already exists in {cfg.local_dir()}; pass --resume to continue it, "
            "or choose another name",
        )
    old = json.loads(stored.read_text())
    new = json.loads(json.dumps(cfg.model_dump(mode="json")))
    for key in sorted(set(old) | set(new)):
        if key in ("resources", "tune_spaces", "runtime_env"):
            continue  # may change between restarts (a bigger cluster, a moved checkout, a fixed plugin)
        if old.get(key) != new.get(key):
            raise ConfigError(
                key,
                f"differs from the sweep being resumed (stored in {stored}); "
                "Tuner.restore cannot change what is searched",
            )


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


def study_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The study run's ``cost.*``: the sum over its trials' and reproductions' Tune results (each the sum of its
    folds, :func:`pipelines.execution.trial.fold_cost`); ``cost.diverged.*`` is the part spent on diverged trials."""
    out = {f"cost.{k}": 0.0 for k in COST_KEYS}
    out.update({f"cost.diverged.{k}": 0.0 for k in COST_KEYS})
    for r in rows:
        for k in COST_KEYS:
            v = r.get(f"cost_{k}")
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[f"cost.{k}"] += v
                if r.get("status") == "diverged":
                    out[f"cost.diverged.{k}"] += v
    return out


def retire_lost_trials(tracker, study_run_id: str, known: set[str]) -> int:
    """RUNNING trial runs of a study whose trial Tune no longer knows (``known``: the search's trial ids, or the
    trial directory names of trials that reported nothing): their trial started after the last experiment snapshot
    that reached storage before the sweep driver died, so the restored search asked its searcher again and ran a
    trial under a new id in its place (a seeded searcher: the same values).  Such a run (and its fold runs) would
    stay RUNNING and double the trial in the MLflow tree: it is ended KILLED, tagged with the reason, and hidden.
    Returns how many trials it retired."""

    def is_known(tid: str | None) -> bool:  # a row's id is the trial id, or its directory name that holds it
        return bool(tid) and any(tid == k or f"_{tid}_" in k for k in known)

    lost = [
        r
        for r in tracker.find({PARENT: study_run_id, "stage": "trial"})
        if r.info.status == "RUNNING" and not is_known(r.data.tags.get("trial_id"))
    ]
    for run in lost:
        reason = (
            f"trial {run.data.tags.get('trial_id')} started after the last Tune snapshot that reached storage "
            "before the sweep driver died; the resumed search did not know it and asked its searcher for a "
            "trial in its place (a seeded searcher: the same values under a new trial id)"
        )
        for fold in tracker.find({PARENT: run.info.run_id, "stage": "fold"}):
            tracker.retire(fold, reason)
        tracker.retire(run, reason)
    return len(lost)


def _raise_in_thread(ident: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in the thread ``ident`` at its next Python instruction (CPython's
    ``PyThreadState_SetAsyncExc``): how a study thread gets the Ctrl-C that only the main thread receives."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))


#: Tune's registries (``ray.tune.registry``: trainables, ``with_parameters`` objects) are process-wide dicts that
#: are not safe to write from two threads at once (seen: "dictionary changed size during iteration" in
#: ``flush_values`` when two studies' ``Tuner.fit()`` registered their trainables together).
_REGISTRY_LOCK = threading.Lock()


def _register_study_trainable(plan: StudyPlan, ctx: StudyContext) -> str:
    """Register ``run_trial`` bound to this study under a name of its own and return the name, which the study's
    Tuners are given instead of the function (so ``Tuner.fit()`` registers nothing itself).  Tune keys trainables by
    name in one job-wide registry: concurrent studies under one name would run each other's context."""
    # Ray: not at module level; the CLI imports this module before the config is checked, which must not load Ray
    import ray
    from ray import tune

    def trial(config, ctx):
        return run_trial(config, ctx)

    name = "run_trial_" + study_dirname(plan.key)
    trial.__name__ = trial.__qualname__ = name
    bundle = trial_bundle(ray.cluster_resources())  # on the driver's node when it declares the driver resource
    with _REGISTRY_LOCK:
        trainable = tune.with_resources(tune.with_parameters(trial, ctx=ctx), tune.PlacementGroupFactory([bundle]))
        tune.register_trainable(name, trainable)
    return name


# ------------------------------------------------------------------------------------------------------ the study


class _Sweep:
    def __init__(self, cfg: SweepConfig, plans: list[StudyPlan], tracker, out=None, watch=None):
        self.cfg = cfg
        self.plans = plans
        self.tracker = tracker
        self.out = out or sys.stdout
        #: the tracking store's health (pipelines.tracking.outage.TrackingWatch), or None (sqlite)
        self.watch = watch
        #: set when the sweep stops (Ctrl-C, a crash): a study thread whose Tuner returns then goes no further
        self.stopping = threading.Event()
        #: the study threads' idents, by study key, while they run a study
        self._threads: dict[str, int] = {}
        self._threads_lock = threading.Lock()
        #: study ends log models through MLflow's fluent API (one process-wide tracking URI) and draw with pyplot
        #: (process-wide state): one study end at a time
        self._end_lock = threading.Lock()
        #: the untrained network's test metrics by pipelines.results.untrained.untrained_key: once per sweep
        self._untrained: dict[tuple[str, str], dict[str, float]] = {}
        self._untrained_lock = threading.Lock()

    def run_all(self, limit: int) -> list[StudySummary]:
        """Every study, ``limit`` at a time, each in its own thread; the summaries in the plans' order.  On Ctrl-C
        or a study's crash the others are stopped (:meth:`_stop_studies`) and the exception goes on."""
        pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="study")
        futures = [pool.submit(self._study_thread, plan) for plan in self.plans]
        try:
            pending = set(futures)
            while pending:  # a timeout, so that the main thread stays responsive to SIGINT
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                self._check_tracking()
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
        except BaseException:
            self._stop_studies(futures)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [f.result() for f in futures]

    def _study_thread(self, plan: StudyPlan) -> StudySummary:
        if self.stopping.is_set():
            raise SweepInterrupted("stopped before it started")
        with self._threads_lock:
            self._threads[plan.key] = threading.get_ident()
        try:
            return self.run_study(plan)
        finally:
            with self._threads_lock:
                self._threads.pop(plan.key, None)

    def _stop_studies(self, futures) -> None:
        """Queued studies never start; running ones get ``SweepInterrupted`` raised in their thread (it leaves
        ``Tuner.fit()`` as Ctrl-C left it in a sequential sweep; Tune's state is its last periodic snapshot);
        wait a bounded time for them, then the caller shuts Ray down."""
        self.stopping.set()
        for f in futures:
            f.cancel()
        with self._threads_lock:
            idents = list(self._threads.values())
        for ident in idents:
            _raise_in_thread(ident, SweepInterrupted)
        _, left = wait([f for f in futures if not f.cancelled()], timeout=_STUDY_STOP_WAIT_S)
        if left:
            print(
                f"warning: {len(left)} studies still stopping after {_STUDY_STOP_WAIT_S:.0f} s; shutting Ray down",
                file=sys.stderr,
                flush=True,
            )

    def _check_tracking(self) -> None:
        """Stop the sweep (as Ctrl-C does: state kept) once MLflow has been unreachable for the configured time."""
        if self.watch is not None and self.watch.expired():
            raise TrackingUnavailable(
                f"MLflow at {redact_uri(self.tracker.uri)} unreachable for {self.watch.down_for():.0f} s "
                f"(tracking.outage_timeout_s: {self.watch.timeout_s:g}); the sweep stopped, its state is kept in "
                f"{self.cfg.ray_storage()}; once MLflow answers again, resume with: {resume_command(self.cfg)}"
            )

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise SweepInterrupted("the sweep is stopping")

    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def study_storage(self, plan: StudyPlan) -> str:
        return self.cfg.ray_storage().rstrip("/") + "/" + study_dirname(plan.key)

    def _context(self, plan: StudyPlan, study_run_id: str, table_ref) -> StudyContext:
        cfg = self.cfg
        train = {
            "classes_per_batch": plan.classes_per_batch,
            "m": plan.m,
            "iters_per_epoch": cfg.protocol.iters_per_epoch,
            "max_epochs": cfg.protocol.max_epochs,
            "eval_every": cfg.protocol.eval_every,
            "patience": cfg.protocol.patience,
            **{k: v for k, v in cfg.protocol.train.items() if k not in ("classes_per_batch", "m")},
        }
        return StudyContext(
            sweep=cfg.name,
            study=plan.key,
            dataset=plan.dataset.spec.name,
            loss=plan.loss.name,
            tracking_uri=self.tracker.uri,
            experiment_id=self.tracker.experiment_id,
            study_run_id=study_run_id,
            fold_storage=self.study_storage(plan) + "/folds",
            table_ref=[table_ref],
            manifest_json=plan.dataset.manifest.to_json(),
            model_kwargs=plan.model_kwargs,
            fixed_params=plan.fixed,
            train=train,
            image_size=plan.dataset.spec.image_size,
            workers_per_fold=cfg.resources.workers_per_fold,
            use_gpu=cfg.resources.use_gpu,
            cpus_per_worker=cfg.resources.cpus_per_worker,
            base_seed=cfg.protocol.seed,
            gpus_per_worker=cfg.resources.gpus_per_worker,
            fold_retries=cfg.resources.fold_retries,
            fold_executor=cfg.resources.fold_executor,
            mid_fold_resume=cfg.resources.mid_fold_resume,
        )

    def _open_study_run(self, plan: StudyPlan) -> str:
        t = self.tracker
        run_id, created = t.get_or_create(
            {"sweep": self.cfg.name, "study": plan.key, "stage": "study"}, run_name=plan.key
        )
        if created:
            t.set_tags(
                run_id,
                {
                    "loss": plan.loss.name,
                    "dataset": plan.dataset.spec.name,
                    "protocol": self.cfg.protocol.name,
                    "fold_layout": self.cfg.protocol.fold_layout,
                    "git_commit": git_commit(),
                    "folds_hash": plan.dataset.manifest.content_hash,
                    "sampler": self.cfg.protocol.sampler,
                },
            )
            t.log_params(
                run_id,
                {
                    **{f"space.{k}": p.describe() for k, p in plan.searched.items()},
                    **{f"fixed.{k}": v for k, v in plan.fixed.items()},
                    "classes_per_batch": plan.classes_per_batch,
                    "m": plan.m,
                    "trials": self.cfg.protocol.trials,
                    "startup_trials": self.cfg.protocol.startup_trials,
                    "reproductions": self.cfg.protocol.reproductions,
                    "workers_per_fold": self.cfg.resources.workers_per_fold,
                    **{f"model.{k}": v for k, v in plan.model_kwargs.items()},
                },
            )
            t.log_text(run_id, plan.dataset.manifest.to_json(), "folds.json")
            t.log_json(run_id, self.cfg.model_dump(mode="json"), "sweep_config.json")
        return run_id

    def _tuner(self, plan: StudyPlan, name: str, trainable, make):
        # Ray: see _register_study_trainable
        from ray import tune

        path = self.study_storage(plan) + "/" + name
        if tune.Tuner.can_restore(path):
            self.say(f"[{plan.key}] resuming {name} from {path}")
            return tune.Tuner.restore(
                path, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
            )
        return make(path)

    def run_study(self, plan: StudyPlan) -> StudySummary:
        # Ray: see _register_study_trainable
        import ray
        from ray import tune

        # it imports Ray Tune: see _register_study_trainable
        from pipelines.execution.progress import TrialProgress, format_duration

        cfg, t = self.cfg, self.tracker
        t0 = time.time()
        run_id = self._open_study_run(plan)
        summary = StudySummary(plan.key, plan.dataset.spec.name, plan.loss.name, run_id, "ok")
        run = t.run(run_id)
        if run.data.tags.get("done") == "true":
            self.say(f"[{plan.key}] already finished (MLflow run {run_id}); skipped")
            return self._summary_from_run(summary, run)
        t.set_tags(run_id, {"status": "running"})
        summary.untrained = self._untrained_reference(plan, run)

        on_study_start(t, run_id, plan)

        table_ref = ray.put(plan.dataset.table)
        ctx = self._context(plan, run_id, table_ref)
        trainable = _register_study_trainable(plan, ctx)
        storage = self.study_storage(plan)
        trials = cfg.protocol.trials if plan.searched else 1

        # 1. search --------------------------------------------------------------------------------------
        def new_search(path):
            self.say(
                f"[{plan.key}] search: {trials} trials, {cfg.protocol.startup_trials} random start-up, "
                f"sampler {cfg.protocol.sampler}, ≤ {cfg.resources.max_concurrent_trials} concurrent"
            )
            tune_cfg = tune.TuneConfig(
                search_alg=make_searcher(plan, cfg) if plan.searched else None,
                metric=OBJECTIVE,
                mode="max",
                num_samples=trials,
                max_concurrent_trials=cfg.resources.max_concurrent_trials,
                reuse_actors=True,
            )
            return tune.Tuner(
                trainable,
                param_space={},
                tune_config=tune_cfg,
                run_config=tune.RunConfig(
                    name="search",
                    storage_path=storage,
                    verbose=0,
                    callbacks=[TrialProgress(plan.key, trials)],
                    failure_config=tune.FailureConfig(max_failures=cfg.resources.trial_retries),
                ),
            )

        grid = self._tuner(plan, "search", trainable, new_search).fit()
        self._check_stopping()
        rows = grid_rows(grid)
        retire_lost_trials(t, run_id, {r["trial_id"] for r in rows})
        all_rows = list(rows)
        summary.trials = len(rows)
        best = best_result(rows)
        if best is None:
            self._log_cost(summary, all_rows)
            return self._fail(summary, f"no trial finished ok ({failure_reason(rows)})", t0)
        params = {k: v for k, v in best["config"].items() if not k.startswith("__")}
        summary.best_trial, summary.best_params = best["trial_id"], params
        summary.best_val = (best[OBJECTIVE], best.get("val_map_at_r_sem", float("nan")))
        t.log_params(run_id, {f"best.{k}": v for k, v in params.items()})
        t.log_metrics(
            run_id,
            {
                "best.val.map_at_r.mean": summary.best_val[0],
                "best.val.map_at_r.sem": summary.best_val[1],
                "trials.ok": sum(r.get("status") == "ok" for r in rows),
                "trials.diverged": sum(r.get("status") == "diverged" for r in rows),
                "trials.failed": sum(r.get("error") is not None for r in rows),
            },
        )
        bounds = format_tag(on_bound(plan.searched, params))  # winners on an edge of their range, for the report
        t.set_tags(
            run_id,
            {"best_trial_id": best["trial_id"], "best_run_id": best.get("mlflow_run_id", ""), ON_BOUND_TAG: bounds},
        )

        # 2. reproductions ----------------------------------------------------------------------------------
        n = cfg.protocol.reproductions

        def new_reps(path):
            self.say(f"[{plan.key}] best trial {best['trial_id']} (val MAP@R {best[OBJECTIVE]:.4f}); {n} reproductions")
            return tune.Tuner(
                trainable,
                param_space={REPRODUCTION: tune.grid_search(list(range(n))), PARAMS: params},
                tune_config=tune.TuneConfig(
                    num_samples=1,
                    metric=OBJECTIVE,
                    mode="max",
                    max_concurrent_trials=cfg.resources.max_concurrent_trials,
                    reuse_actors=True,
                ),
                run_config=tune.RunConfig(
                    name="reproductions",
                    storage_path=storage,
                    verbose=0,
                    callbacks=[TrialProgress(plan.key, n, "reproduction")],
                    failure_config=tune.FailureConfig(max_failures=cfg.resources.trial_retries),
                ),
            )

        rep_rows = grid_rows(self._tuner(plan, "reproductions", trainable, new_reps).fit())
        self._check_stopping()
        all_rows += rep_rows
        self._log_cost(summary, all_rows)
        reps = [r for r in rep_rows if r.get("status") == "ok" and any(k.startswith("test_concat_") for k in r)]
        reps.sort(key=lambda r: r[REPRODUCTION])
        summary.n_reproductions = len(reps)
        if not reps:
            return self._fail(summary, "no reproduction finished ok", t0)

        # 3. confidence intervals, report, models -----------------------------------------------------------
        summary.ci = confidence_intervals(reps)
        metrics = {"test.n_reproductions": len(reps)}
        for mode, d in summary.ci.items():
            for k, (m, lo, hi) in d.items():
                metrics.update(
                    {f"test.{mode}.{k}.mean": m, f"test.{mode}.{k}.ci_low": lo, f"test.{mode}.{k}.ci_high": hi}
                )
        t.log_metrics(run_id, metrics)
        self._flag_epoch_0(summary, reps)
        md, doc = ci_report(summary, reps)
        t.log_text(run_id, md, "ci_report.md")
        t.log_json(run_id, doc, "ci_report.json")
        with self._end_lock:
            self._log_models(run_id, reps[0])
            log_study_visuals(t, run_id, plan, reps)  # gallery, per-class metrics, embedding map
            # the reproductions as MLflow pyfunc models, one registered version per study
            on_study_end(
                t,
                study_run_id=run_id,
                experiment=cfg.experiment_name(),
                sweep=cfg.name,
                plan=plan,
                reps=reps,
                ci=summary.ci,
                say=self.say,
            )
        summary.seconds = time.time() - t0
        t.set_tags(run_id, {"done": "true", "status": "ok", "seconds": round(summary.seconds, 1)})
        t.finish(run_id, "FINISHED")
        c, s_ = summary.ci["concat"].get("map_at_r"), summary.ci["separated"].get("map_at_r")
        self.say(
            f"[{plan.key}] done in {format_duration(summary.seconds)}: best val MAP@R {summary.best_val[0]:.4f} "
            f"(trial {summary.best_trial}); test MAP@R concat {fmt_ci(c)}, separated {fmt_ci(s_)} "
            f"({len(reps)} reproductions)"
        )
        return summary

    def _log_cost(self, summary: StudySummary, rows: list[dict[str, Any]]) -> None:
        cost = study_cost(rows)
        self.tracker.log_metrics(summary.run_id, cost)
        summary.cost = {k[len("cost.") :]: v for k, v in cost.items()}

    def _untrained_reference(self, plan: StudyPlan, run) -> dict[str, float]:
        """The study's network with its initial weights on the same test classes (pipelines.results.untrained),
        logged on the study run as ``untrained.<metric>``: read back from the run on ``--resume``, else computed once
        per (dataset, network) for the whole sweep, on the driver (one embedding pass of the test classes; on its GPU
        when the sweep uses GPUs and the driver has one)."""
        logged = untrained_metrics_of(run.data.metrics)
        if logged:
            return logged
        key = untrained_key(plan)
        with self._untrained_lock:
            if key not in self._untrained:
                # torch: the study threads' driver already holds it (preflight built the models)
                import torch

                device = "cuda" if self.cfg.resources.use_gpu and torch.cuda.is_available() else "cpu"
                batch = int(self.cfg.protocol.train.get("eval_batch_size", 128))
                t0 = time.time()
                self._untrained[key] = untrained_test_metrics(
                    plan, self.cfg.protocol.seed, batch_size=batch, device=device
                )
                self.say(
                    f"[{plan.key}] untrained network on the test classes: MAP@R "
                    f"{self._untrained[key]['map_at_r']:.4f} (reference, {time.time() - t0:.1f} s)"
                )
            metrics = dict(self._untrained[key])
        self.tracker.log_metrics(run.info.run_id, {UNTRAINED_PREFIX + k: v for k, v in metrics.items()})
        return metrics

    def _flag_epoch_0(self, summary: StudySummary, reps: list[dict[str, Any]]) -> None:
        """Tag the study run :data:`EPOCH0_TAG` from its reproductions' fold runs (``best_epoch``): "true" when every
        fold chose its epoch-0 checkpoint, the untrained network, as best; said in the study's progress too."""
        epochs = [
            fold.data.metrics["best_epoch"]
            for r in reps
            for fold in self.tracker.find({PARENT: r["mlflow_run_id"], "stage": "fold"})
            if "best_epoch" in fold.data.metrics
        ]
        summary.best_at_epoch_0 = best_at_epoch_0(epochs)
        self.tracker.set_tags(summary.run_id, {EPOCH0_TAG: str(summary.best_at_epoch_0).lower()})
        if summary.best_at_epoch_0:
            self.say(f"[{summary.study}] warning: best at epoch 0: {EPOCH0_NOTE}")

    def _log_models(self, run_id: str, rep: dict[str, Any]) -> None:
        """Reproduction ``rep``'s fold models (written by rank 0 into its result directory or Ray Train checkpoint) →
        ``models/``."""
        # Ray: see _register_study_trainable
        import ray.train

        for k, path in enumerate(rep.get("fold_checkpoints", [])):
            ckpt = ray.train.Checkpoint(path)
            with ckpt.as_directory() as d:
                model = Path(d) / "model.pt"
                if model.exists():
                    self.tracker.log_bytes(run_id, model.read_bytes(), f"models/fold_{k}.pt")

    def _fail(self, summary: StudySummary, reason: str, t0: float) -> StudySummary:
        summary.status, summary.reason = "failed", reason
        summary.seconds = time.time() - t0
        self.tracker.set_tags(summary.run_id, {"status": "failed", "reason": reason[:4000], "done": "true"})
        self.tracker.finish(summary.run_id, "FAILED")
        self.say(f"[{summary.study}] FAILED: {reason}")
        return summary

    def _summary_from_run(self, summary: StudySummary, run) -> StudySummary:
        m, tags = run.data.metrics, run.data.tags
        summary.status = tags.get("status", "ok")
        summary.reason = tags.get("reason", "")
        summary.best_trial = tags.get("best_trial_id")
        summary.best_params = {k[5:]: v for k, v in run.data.params.items() if k.startswith("best.")}
        if "best.val.map_at_r.mean" in m:
            summary.best_val = (m["best.val.map_at_r.mean"], m.get("best.val.map_at_r.sem", float("nan")))
        summary.n_reproductions = int(m.get("test.n_reproductions", 0))
        summary.cost = {k[len("cost.") :]: v for k, v in m.items() if k.startswith("cost.")}
        summary.best_at_epoch_0 = tags.get(EPOCH0_TAG) == "true"
        summary.untrained = untrained_metrics_of(m)
        for key, v in m.items():
            parts = key.split(".")
            if len(parts) == 4 and parts[0] == "test" and parts[3] == "mean":
                mode, metric = parts[1], parts[2]
                summary.ci.setdefault(mode, {})[metric] = (
                    v,
                    m.get(f"test.{mode}.{metric}.ci_low", float("nan")),
                    m.get(f"test.{mode}.{metric}.ci_high", float("nan")),
                )
        return summary


# ------------------------------------------------------------------------------------------------------ entry


def run_sweep(cfg: SweepConfig, *, resume: bool = False, address: str | None = None, out=None) -> SweepOutcome:
    """Run (or with ``resume`` continue) a whole sweep.  Raises :class:`ConfigError` before anything starts.

    Ctrl-C stops it within seconds, closes the runs it leaves (``KILLED``, reason ``interrupted``) and raises
    :class:`pipelines.execution.interrupts.SweepInterrupted`; a crash closes them ``FAILED`` with the error; a failed
    study's leftover runs are closed ``FAILED`` with the study's reason (:mod:`pipelines.execution.interrupts`).
    """
    out = out or sys.stdout
    t0 = time.time()
    _check_resume(cfg, resume)
    plans = preflight(cfg)
    uri = cfg.tracking_uri()
    shown = redact_uri(uri)  # what is printed: never a password
    check_tracking_reachable(uri)
    check_storage_reachable(cfg)

    local = cfg.local_dir()
    local.mkdir(parents=True, exist_ok=True)

    tracker = Tracker.open(uri, cfg.experiment_name(), _artifact_location(cfg))
    if not resume and tracker.find({"sweep": cfg.name, "stage": "study"}):
        raise ConfigError(
            "name",
            f"MLflow experiment {cfg.experiment_name()!r} at {shown} already has runs of a "
            f"sweep named {cfg.name!r}; pass --resume to continue it, or choose another name",
        )
    set_experiment_ui(tracker.client, tracker.experiment_id)  # once, before the studies run concurrently

    watch = TrackingWatch(uri, cfg.tracking.outage_timeout_s).start()
    try:
        started = start_ray(cfg, address)
        install_startup_handlers()  # Ray's driver installs a native SIGTERM handler: ours again, until stop_on_sigint
    except BaseException:
        watch.stop()
        stop_ray(False)  # undo what it changed in this process (credentials, loopback switch, MLflow retries)
        raise
    try:
        check_cluster_resources(cfg)  # before the sweep's config or any run is written, before any trial
        check_user_code_on_workers(cfg, min(len(f.train_classes) for p in plans for f in p.dataset.manifest.folds))
        if not (local / _CONFIG_FILE).exists():
            if resume:
                print(f"--resume: no sweep {cfg.name!r} in {local} yet; starting it", file=out, flush=True)
            (local / _CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
        elif resume:
            reopen_interrupted(tracker, cfg.name)
        warn_multi_node(cfg, uri, out)
        # Ray: started by start_ray above; see _register_study_trainable
        import ray

        limit = max_concurrent_studies(cfg, address, ray.cluster_resources(), len(plans))
        print(
            f"sweep {cfg.name!r}: {len(plans)} studies ({', '.join(p.key for p in plans)}), ≤ {limit} at once; "
            f"MLflow {shown} experiment {cfg.experiment_name()!r}; storage {cfg.ray_storage()}",
            file=out,
            flush=True,
        )
        message = f"interrupted: stopping trials, state is kept; resume with: {resume_command(cfg)}"
        with stop_on_sigint(message, out):
            sweep = _Sweep(cfg, plans, tracker, out, watch)
            studies = sweep.run_all(limit)
    except BaseException as e:
        # Stop Ray first: no worker may write to a run after it is closed.
        stop_ray(started)
        started = False
        # With MLflow down the runs cannot be closed: they stay RUNNING, which is what --resume reuses.
        if not isinstance(e, (ConfigError, TrackingUnavailable)):
            try:
                if isinstance(e, KeyboardInterrupt):
                    close_open_runs(tracker, cfg.name, reason=INTERRUPTED, status="KILLED")
                else:
                    close_open_runs(tracker, cfg.name, reason=scrub(f"{type(e).__name__}: {e}", uri))
            except Exception as close_error:  # e.g. the tracking store is what failed: report e
                print(
                    f"warning: could not close the sweep's MLflow runs ({type(close_error).__name__})",
                    file=out,
                    flush=True,
                )
        raise
    finally:
        watch.stop()
        stop_ray(started)
    for s in studies:
        if s.status != "ok":
            close_open_runs(tracker, cfg.name, study=s.study, reason=f"study failed: {s.reason}")
    return SweepOutcome(cfg.name, local, shown, cfg.experiment_name(), tracker.experiment_id, studies, time.time() - t0)
