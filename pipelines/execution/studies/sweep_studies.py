"""The studies of a sweep, run in threads of the driver: each study's search, reproductions and summary.

:func:`pipelines.execution.sweep.run_sweep` checks the config, starts Ray and then hands its plans to
:class:`SweepStudies`; this module is where Ray Tune and Ray Train are used, so the sweep imports it only once every
check has passed (a bad config is refused without loading them).  The steps of a study are described in
:mod:`pipelines.execution.sweep`.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from ray import tune
from ray.tune import Callback

from pipelines.config.schema import SweepConfig
from pipelines.execution.folds.trial import StudyContext
from pipelines.execution.preflight.study_plans import StudyPlan, study_train_config
from pipelines.execution.runtime.environment import (
    redact_uri,
)
from pipelines.execution.runtime.interrupts import (
    SweepInterrupted,
    failure_reason,
    resume_command,
    stop_threads,
)
from pipelines.execution.search.pruning import make_scheduler, pruning_on, search_space
from pipelines.execution.search.searcher import best_result, make_searcher
from pipelines.execution.studies.progress import TrialProgress, format_duration
from pipelines.execution.studies.pruned_runs import PrunedRuns, PrunedTrials, close_pruned_rows
from pipelines.execution.studies.reuse import Reuse
from pipelines.execution.studies.runs import (
    open_study_run,
    retire_lost_trials,
    study_cost,
    summary_from_run,
    summary_from_study,
)
from pipelines.execution.studies.tuners import fit_tuner, register_study_trainable, tune_config
from pipelines.execution.studies.untrained_reference import untrained_test_metrics
from pipelines.names import OBJECTIVE, PARAMS, REPRODUCTION, SUPERSEDED_STAGE, study_dirname
from pipelines.records.callbacks import RecordReproductions, RecordTrials
from pipelines.records.rows import FOLDS_KEY, row_of_reproduction, row_of_trial
from pipelines.records.store import RecordsError, StudyRecords
from pipelines.results.bounds import ON_BOUND_TAG, format_tag, on_bound
from pipelines.results.study_results import (
    EPOCH0_NOTE,
    EPOCH0_TAG,
    StudySummary,
    best_at_epoch_0,
    ci_report,
    confidence_intervals,
    fmt_ci,
)
from pipelines.results.untrained import UNTRAINED_PREFIX, untrained_key, untrained_metrics_of
from pipelines.results.visuals import log_study_visuals
from pipelines.tracking.model_registry import on_study_end, on_study_start
from pipelines.tracking.outage import TrackingUnavailable
from pipelines.tracking.runs import PARENT

__all__ = ["SweepStudies"]

#: How long an interrupted sweep waits for its study threads to leave their Tuners before Ray is shut down.
_STUDY_STOP_WAIT_S = 20.0


class SweepStudies:
    def __init__(
        self, cfg: SweepConfig, plans: list[StudyPlan], tracker, out=None, watch=None, reuse=None, records=None
    ):
        self.cfg = cfg
        #: study key → its records (pipelines.records), checked before Ray started; {} without ``records:``
        self.records: dict[str, StudyRecords] = records or {}
        self.plans = plans
        self.tracker = tracker
        #: finished and bundled studies the sweep takes instead of running (pipelines.execution.studies.reuse)
        self.reuse: Reuse = reuse if reuse is not None else Reuse({})
        #: study key → the suffix of its storage folder (".rerun<N>" after N --rerun replacements)
        self._storage_suffix: dict[str, str] = {}
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
        futures: list = []
        try:  # a stop that lands while the studies are submitted stops those already submitted
            futures.extend(pool.submit(self._study_thread, plan) for plan in self.plans)
            pending = set(futures)
            while pending:  # a timeout, so that the main thread stays responsive to SIGINT
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                self._check_tracking()
                for f in done:
                    error = f.exception()
                    if error is not None:
                        raise error
        except BaseException:
            self._stop_studies(futures)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [f.result() for f in futures]

    def _study_thread(self, plan: StudyPlan) -> StudySummary:
        with self._threads_lock:  # either a stop sees this thread, or this thread sees the stop
            if self.stopping.is_set():
                raise SweepInterrupted("stopped before it started")
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

        def running() -> list[int]:
            with self._threads_lock:
                return list(self._threads.values())

        left = stop_threads(running, futures, _STUDY_STOP_WAIT_S)
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
        """The study's Tuners and folds: a fixed path (what --resume restores), a new one per --rerun."""
        suffix = self._storage_suffix.get(plan.key, "")
        return self.cfg.ray_storage().rstrip("/") + "/" + study_dirname(plan.key) + suffix

    def _context(self, plan: StudyPlan, study_run_id: str, table_ref) -> StudyContext:
        cfg = self.cfg
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
            train=study_train_config(cfg, plan),
            image_size=plan.dataset.spec.image_size,
            workers_per_fold=cfg.resources.workers_per_fold,
            use_gpu=cfg.resources.use_gpu,
            cpus_per_worker=cfg.resources.cpus_per_worker,
            base_seed=cfg.protocol_seed(),
            gpus_per_worker=cfg.resources.gpus_per_worker,
            fold_retries=cfg.resources.fold_retries,
            fold_executor=cfg.resources.fold_executor,
            mid_fold_resume=cfg.resources.mid_fold_resume,
        )

    def run_study(self, plan: StudyPlan) -> StudySummary:
        """One study: search, its best trial, reproductions of it, then the intervals, report and models — or, for
        a study finished in another sweep of the experiment or held by a bundle, that study's result."""
        t0 = time.time()
        taken = self._taken(plan)
        if taken is not None:
            return taken
        self._storage_suffix[plan.key] = self._supersede(plan)
        run_id = open_study_run(self.cfg, self.tracker, plan, self.reuse.fingerprints[plan.key])
        summary = StudySummary(plan.key, plan.dataset.spec.name, plan.loss.name, run_id, "ok")
        run = self.tracker.run(run_id)
        if run.data.tags.get("done") == "true":
            self.say(f"[{plan.key}] already finished (MLflow run {run_id}); skipped")
            return summary_from_run(summary, run)
        trainable = self._prepare(plan, run, summary)
        rows = self._search(plan, trainable, run_id)
        summary.trials = len(rows)
        best = best_result(rows)
        if best is None:
            self._log_cost(summary, rows)
            return self._fail(summary, f"no trial finished ok ({failure_reason(rows)})", t0)
        self._record_best(plan, summary, best, rows)
        rep_rows = self._reproductions(plan, trainable, best, summary.best_params)
        self._log_cost(summary, rows + rep_rows)
        reps = [r for r in rep_rows if r.get("status") == "ok" and any(k.startswith("test_concat_") for k in r)]
        reps.sort(key=lambda r: r[REPRODUCTION])
        summary.n_reproductions = len(reps)
        if not reps:
            return self._fail(summary, "no reproduction finished ok", t0)
        return self._summarise(plan, summary, reps, t0)

    def _taken(self, plan: StudyPlan) -> StudySummary | None:
        """The study's result from a bundle or from a finished study of another sweep of the experiment (its
        fingerprint checked before the sweep started), or None when this sweep runs (or ran) it."""
        bundled = self.reuse.from_bundles.get(plan.key)
        if bundled is not None:
            self.say(f"[{plan.key}] from {bundled.source}; not run")
            return summary_from_study(bundled)
        run = self.reuse.finished.get(plan.key)
        if run is None or plan.key in self.reuse.rerun or run.data.tags.get("sweep") == self.cfg.name:
            return None
        self.say(
            f"[{plan.key}] finished in sweep {run.data.tags.get('sweep', '?')} (MLflow run {run.info.run_id}); reused"
        )
        summary = StudySummary(plan.key, plan.dataset.spec.name, plan.loss.name, run.info.run_id, "ok")
        return summary_from_run(summary, run)

    def _supersede(self, plan: StudyPlan) -> str:
        """``--rerun``: the study's finished run leaves every table (``stage`` → superseded, kept in the store and
        the UI); returns the suffix of the rerun's storage folder (one per replaced run of this sweep)."""
        old = self.reuse.rerun.get(plan.key)
        if old is not None and self.tracker.run(old.info.run_id).data.tags.get("stage") == "study":
            self.tracker.set_tags(
                old.info.run_id,
                {"stage": SUPERSEDED_STAGE, "superseded_reason": f"--rerun {plan.loss.name} (sweep {self.cfg.name})"},
            )
            self.say(f"[{plan.key}] --rerun: MLflow run {old.info.run_id} superseded; the study runs again")
        replaced = self.tracker.find({"sweep": self.cfg.name, "study": plan.key, "stage": SUPERSEDED_STAGE})
        return f".rerun{len(replaced)}" if replaced else ""

    def extra_studies(self) -> list[StudySummary]:
        """Finished studies of the experiment and bundled studies on the sweep's datasets whose loss the config does
        not list: they join the final table."""
        planned = {p.key for p in self.plans}
        out = [
            summary_from_run(StudySummary(k, r.data.tags["dataset"], r.data.tags["loss"], r.info.run_id, "ok"), r)
            for k, r in sorted(self.reuse.finished.items())
            if k not in planned
        ]
        out += [summary_from_study(s) for k, s in sorted(self.reuse.from_bundles.items()) if k not in planned]
        return out

    def _prepare(self, plan: StudyPlan, run, summary: StudySummary) -> str:
        """The study run marked running, its untrained reference, the model registry's start, the dataset table in
        Ray's object store and the study's trainable registered; returns the trainable's name."""
        run_id = run.info.run_id
        self.tracker.set_tags(run_id, {"status": "running"})
        summary.untrained = self._untrained_reference(plan, run)
        records = self.records.get(plan.key)
        if records is not None and not records.header.untrained:  # the records' reference row, with their header
            records.header = records.header.model_copy(update={"untrained": dict(summary.untrained)})
        on_study_start(self.tracker, run_id, plan)
        table_ref = ray.put(plan.dataset.table)
        return register_study_trainable(plan.key, self._context(plan, run_id, table_ref))

    def _fit(self, plan: StudyPlan, kind: str, trainable: str, new) -> list[dict[str, Any]]:
        """The study's Tuner ``kind`` (:func:`pipelines.execution.studies.tuners.fit_tuner`); stops here if the sweep
        is."""
        rows = fit_tuner(
            self.study_storage(plan),
            kind,
            trainable,
            new,
            sweep=self.cfg.name,
            trial_retries=self.cfg.resources.trial_retries,
            say=lambda m: self.say(f"[{plan.key}] {m}"),
        )
        self._check_stopping()
        return rows

    def _search(self, plan: StudyPlan, trainable: str, run_id: str) -> list[dict[str, Any]]:
        """1. The Bayesian search: ``protocol.trials`` trials (one without a searched parameter); with records, the
        recorded trials are replayed into the searcher and only the rest run."""
        cfg = self.cfg
        trials = cfg.protocol.trials if plan.searched else 1
        records = self.records.get(plan.key)
        done = [row_of_trial(t) for t in records.trials] if records is not None else []
        if records is not None and done:
            self.say(f"[{plan.key}] {len(done)} of {trials} trials from the records in {records.folder}")
        if len(done) >= trials:
            return done

        pruned = PrunedRuns.of(cfg, self.tracker, self.study_storage(plan) + "/folds") if pruning_on(cfg) else None

        def new() -> tuple[dict[str, Any], tune.TuneConfig, list[Callback]]:
            p, n = cfg.protocol, trials - len(done)
            pruning = f", pruning {p.pruning} (grace {p.pruning_grace_period}, ×{p.pruning_reduction_factor:g})"
            self.say(
                f"[{plan.key}] search: {n} trials, {p.startup_trials} random start-up, "
                f"sampler {p.sampler}, ≤ {cfg.resources.max_concurrent_trials} concurrent{pruning if pruned else ''}"
            )
            if p.pruning and not pruned:
                self.say(f"[{plan.key}] pruning off: its folds run on Ray Train, which a trial cannot cancel")
            searcher = make_searcher(plan, cfg, done) if plan.searched else None
            callbacks: list[Callback] = [TrialProgress(plan.key, trials, done=done)]
            if records is not None:
                callbacks.append(RecordTrials(records.folder, records.header))
            if pruned is None:
                return {}, tune_config(cfg, n, searcher), callbacks
            callbacks.append(PrunedTrials(pruned))
            return search_space(cfg), tune_config(cfg, n, searcher, make_scheduler(cfg)), callbacks

        rows = self._fit(plan, "search", trainable, new)
        retire_lost_trials(self.tracker, run_id, {r["trial_id"] for r in rows})
        if pruned is not None:
            close_pruned_rows(pruned, self.tracker, rows)  # runs still open, the rows' cost, the folds' checkpoints
        ran = {r["trial_id"] for r in rows}
        return [r for r in done if r["trial_id"] not in ran] + rows

    def _record_best(
        self, plan: StudyPlan, summary: StudySummary, best: dict[str, Any], rows: list[dict[str, Any]]
    ) -> None:
        """2. The best trial (the highest observed mean) on the study run: its parameters and value, the search's
        trial counts, and its parameters on an edge of their range (for the report)."""
        t, run_id = self.tracker, summary.run_id
        pruning = self.cfg.protocol.pruning is not None  # trials.pruned only where the search could prune
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
                **({"trials.pruned": sum(r.get("status") == "pruned" for r in rows)} if pruning else {}),
            },
        )
        bounds = format_tag(on_bound(plan.searched, params))  # winners on an edge of their range, for the report
        t.set_tags(
            run_id,
            {"best_trial_id": best["trial_id"], "best_run_id": best.get("mlflow_run_id", ""), ON_BOUND_TAG: bounds},
        )

    def _reproductions(
        self, plan: StudyPlan, trainable: str, best: dict[str, Any], params: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """3. ``protocol.reproductions`` retrainings of the best configuration, a grid over the reproduction index;
        with records, the recorded reproductions are taken and only the rest run."""
        n = self.cfg.protocol.reproductions
        records = self.records.get(plan.key)
        done: list[dict[str, Any]] = []
        if records is not None:
            done = [row_of_reproduction(r) for _, r in sorted(records.reproductions.items())]
            for r in done:
                if r["config"][PARAMS] != params:
                    raise RecordsError(
                        f"{records.folder}: reproduction {r[REPRODUCTION]} was recorded with {r['config'][PARAMS]}, "
                        f"not the recorded search's best {params}"
                    )
        todo = [i for i in range(n) if i not in {r[REPRODUCTION] for r in done}]
        if records is not None and done:
            self.say(f"[{plan.key}] {len(done)} of {n} reproductions from the records in {records.folder}")
        if not todo:
            return done

        def new() -> tuple[dict[str, Any], tune.TuneConfig, list[Callback]]:
            self.say(
                f"[{plan.key}] best trial {best['trial_id']} (val MAP@R {best[OBJECTIVE]:.4f}); "
                f"{len(todo)} reproductions"
            )
            space = {REPRODUCTION: tune.grid_search(todo), PARAMS: params}
            callbacks: list[Callback] = [TrialProgress(plan.key, len(todo), "reproduction")]
            if records is not None:
                callbacks.append(RecordReproductions(records.folder, records.header, params))
            return space, tune_config(self.cfg, 1), callbacks

        rows = self._fit(plan, "reproductions", trainable, new)
        ran = {r.get(REPRODUCTION) for r in rows}
        return [r for r in done if r[REPRODUCTION] not in ran] + rows

    def _summarise(self, plan: StudyPlan, summary: StudySummary, reps: list[dict[str, Any]], t0: float):
        """4. Confidence intervals across the reproductions, the CI report, the fold models and the registered model
        on the study run, which is then finished."""
        t, run_id = self.tracker, summary.run_id
        summary.ci = confidence_intervals(reps)
        metrics: dict[str, float] = {"test.n_reproductions": len(reps)}
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
        trained = [r for r in reps if r.get("fold_checkpoints")]  # records hold no weights
        if len(trained) < len(reps):
            self.say(
                f"[{plan.key}] {len(reps) - len(trained)} reproductions from records (no weights): "
                + ("the models and visuals are of the others" if trained else "no models or visuals")
            )
        with self._end_lock:
            if trained:
                self._log_models(run_id, trained[0])
                log_study_visuals(t, run_id, plan, trained)  # gallery, per-class metrics, embedding map
                # the reproductions as MLflow pyfunc models, one registered version per study
                on_study_end(
                    t,
                    study_run_id=run_id,
                    experiment=self.cfg.experiment_name(),
                    sweep=self.cfg.name,
                    plan=plan,
                    reps=trained,
                    ci=summary.ci,
                    say=self.say,
                )
        summary.seconds = time.time() - t0
        t.set_tags(run_id, {"done": "true", "status": "ok", "seconds": round(summary.seconds, 1)})
        t.finish(run_id, "FINISHED")
        c, s_ = summary.ci["concat"].get("map_at_r"), summary.ci["separated"].get("map_at_r")
        best_val = summary.best_val[0] if summary.best_val is not None else float("nan")  # _record_best set it
        self.say(
            f"[{plan.key}] done in {format_duration(summary.seconds)}: best val MAP@R {best_val:.4f} "
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
                device = "cuda" if self.cfg.resources.use_gpu and torch.cuda.is_available() else "cpu"
                batch = study_train_config(self.cfg, plan).eval_batch_size  # the folds' own, TrainConfig's default
                t0 = time.time()
                self._untrained[key] = untrained_test_metrics(
                    plan, self.cfg.protocol_seed(), batch_size=batch, device=device
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
            if r.get("mlflow_run_id")
            for fold in self.tracker.find({PARENT: r["mlflow_run_id"], "stage": "fold"})
            if "best_epoch" in fold.data.metrics
        ]
        # a reproduction from records: its folds' best iteration (0: the untrained network)
        epochs += [0 if f["best_iteration"] == 0 else 1 for r in reps if r.get("from_records") for f in r[FOLDS_KEY]]
        summary.best_at_epoch_0 = best_at_epoch_0(epochs)
        self.tracker.set_tags(summary.run_id, {EPOCH0_TAG: str(summary.best_at_epoch_0).lower()})
        if summary.best_at_epoch_0:
            self.say(f"[{summary.study}] warning: best at epoch 0: {EPOCH0_NOTE}")

    def _log_models(self, run_id: str, rep: dict[str, Any]) -> None:
        """Reproduction ``rep``'s fold models (written by rank 0 into its result directory or Ray Train checkpoint) →
        ``models/``."""
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


# ------------------------------------------------------------------------------------------------------ entry
