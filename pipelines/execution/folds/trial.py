"""A Bayesian-optimisation trial (or a reproduction): 4 concurrent folds on Ray, one objective.

:func:`run_trial` is the Ray Tune *function trainable* (the Train-V2 composition: a Tune trial is a light driver that
builds ``TorchTrainer``\\ s).  Per trial it

1. finds or creates its MLflow run (``stage=trial``, child of the study run; tags ``trial_id``, ``status``), or for a
   reproduction the ``stage=reproduction`` run (tags ``reproduction``, ``seed``), and one ``stage=fold`` child per fold;
2. runs the 4 folds concurrently through one of two executors (:func:`fold_executor`), both around the same
   :func:`pipelines.execution.folds.fold.run_fold`: **warm** — single-worker folds as Ray tasks on reused worker
   processes (:mod:`pipelines.execution.folds.warm`); **train** — one Ray Train ``TorchTrainer`` per fold, started from
   4 threads (DDP folds, ``workers_per_fold > 1``).  A fold whose resources do not fit yet waits in Ray's queue.  The
   trial itself reserves only the driver resource (see :mod:`pipelines.execution.sweep`);
3. reduces the folds (docs/protocol.md §Objective): objective = mean over folds of each fold's best-checkpoint val
   MAP@R, with its SEM (``dml_core.evaluation.stats.fold_summary``).  A fold that diverged (non-finite loss) makes the
   trial score 0 and the trial run records which fold and why (MLRC: "NaN loss: the run returns (0, 0)"); the study goes
   on;
4. for a reproduction, evaluates the best fold models on the test classes (docs/protocol.md §Test evaluation):
   *separated* = each fold model alone, metrics averaged over folds; *concatenated* = each fold's embedding
   L2-normalised, concatenated (4 × d) and normalised again (``retrieval_metrics(normalize=True)``);
5. reports once to Tune — and, with pruning on (``protocol.pruning``, search trials of warm folds), before that
   once per evaluation every fold reached (:class:`pipelines.execution.search.pruning.Rungs`, read from the fold runs'
   MLflow history); a trial the scheduler stops there has its running folds cancelled (``ray.cancel``).

A trial's driver loads torch only where it uses it: a search trial of warm folds submits Ray tasks and reduces their
``outcome.json`` (numpy, MLflow), so this module imports neither :mod:`pipelines.execution.folds.fold` nor anything of
``dml_core`` that imports torch at module level; Ray Train folds (``fold_worker``) and a reproduction's test
evaluation (``dml_core.evaluation.metrics``) import it where they run.  A trial driver is a Tune actor process of its
own, and ``import torch`` (a CUDA build) costs seconds of CPU and hundreds of MB of memory per process
(``tests/test_lean_imports.py``).

Why not ``ray.tune.integration.ray_train.TuneReportCallback``: it forwards every Train report through one
capacity-1 queue per Tune session and re-emits it as a Tune result.  With four Train runs in one trial their
reports interleave as one stream, and a report still in that queue when the trial calls ``tune.report`` with the
fold mean can land *after* it, making an intermediate value the trial's last result (read from
``ray/train/_internal/session.py::_get_result_from_queues``).  The per-evaluation history goes to MLflow instead
(rank 0, explicit run ids), and Tune sees one result per trial, the fold mean (with pruning, the intermediate fold
means before it: the trial reports them itself, from one thread, so no queue reorders them).
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
from ray import tune

from dml_core.evaluation.stats import fold_summary
from dml_core.splits import Fold, FoldManifest
from dml_core.storage import open_storage
from dml_core.training.config import TrainConfig
from pipelines.config.spaces import LOSS_LR
from pipelines.execution.folds.config import FoldClasses, FoldConfig, FoldOutcome, FoldStudyPart, s3_uri
from pipelines.execution.folds.warm import result_uri, warm_fold_ref
from pipelines.execution.runtime.interrupts import error_text
from pipelines.execution.search.pruning import EVALUATION, PRUNING_KEY, Rungs, mlflow_history
from pipelines.names import (
    HEADLINE_METRICS,
    OBJECTIVE,
    OUTCOME_FILE,
    PARAMS,
    REPRODUCTION,
    TEST_EMBEDDINGS,
    TEST_LABELS,
    reproduction_seed,
)
from pipelines.records.rows import FOLDS_KEY, fold_records
from pipelines.results.embeddings import details_to_bytes, reproduction_test_metrics
from pipelines.tracking.datasets import log_fold_dataset_input
from pipelines.tracking.evaluations import evaluation_metrics, logged_evaluations
from pipelines.tracking.runs import PARENT, Tracker

__all__ = ["StudyContext", "run_trial", "fold_executor", "fold_cost"]


@dataclass
class StudyContext:
    """Everything a trial of one (dataset, loss) study needs besides its hyperparameters (picklable).  What its folds
    get of it, :func:`_fold_config` builds (the study's part in :func:`_study_part`); the fields only the trial's
    driver uses are listed, with why, in :data:`DRIVER_ONLY`."""

    sweep: str
    study: str  # "<dataset>/<loss>"
    dataset: str
    loss: str
    tracking_uri: str  # absolute
    experiment_id: str
    study_run_id: str
    fold_storage: str  # where the folds' Ray Train runs persist (local path or s3://)
    table_ref: list  # [ObjectRef of the dataset table] (a list, so Tune does not resolve it)
    manifest_json: str
    model_kwargs: dict[str, Any]
    fixed_params: dict[str, Any]
    train: TrainConfig  # the study's training settings; each fold sets its seed and the searched loss_lr
    image_size: int
    workers_per_fold: int
    use_gpu: bool
    cpus_per_worker: float
    base_seed: int
    gpus_per_worker: float = 1.0
    fold_retries: int = 1  # restarts of a fold whose process died (Ray task retries / Train FailureConfig)
    fold_executor: str = "auto"  # auto | warm | train (resources.fold_executor)
    mid_fold_resume: bool = True  # a restarted fold continues from its last checkpoint (resources.mid_fold_resume)


def fold_executor(ctx: StudyContext) -> str:
    """``warm`` for single-worker folds (the reality check's own setting), ``train`` for DDP folds, unless forced."""
    if ctx.fold_executor != "auto":
        return ctx.fold_executor
    return "warm" if ctx.workers_per_fold == 1 else "train"


def fold_cost(outcome: FoldOutcome, cpus_per_worker: float, gpus_per_worker: float) -> dict[str, float]:
    """What a fold held and for how long (its run's ``cost.*``): the fold function's wall time (``time_start`` →
    ``time_end`` in ``outcome.json``, the attempt that finished) × its ``world_size`` workers × CPUs / GPUs per worker
    (``gpus_per_worker`` = 0 without GPUs).  Restarted work is counted apart, from the fields a restarting fold
    writes (0 in an outcome written without them): ``restarts`` (process restarts), ``resumes`` (mid-fold resumes,
    ``resumed_from``) and ``redone_iterations`` (iterations trained twice)."""
    wall = max(0.0, float(outcome.time_end) - float(outcome.time_start))
    workers = int(outcome.world_size or 1)
    return {
        "wall_seconds": wall,
        "cpu_seconds": wall * cpus_per_worker * workers,
        "gpu_seconds": wall * gpus_per_worker * workers,
        "restarts": float(outcome.restarts or 0),
        "resumes": float(len(outcome.resumed_from or [])),
        "redone_iterations": float(outcome.redone_iterations or 0),
    }


#: The :class:`StudyContext` fields no fold's process gets, and why: the trial's driver uses them itself, or passes
#: what it makes of them to :func:`_fold_config` as arguments.  Every other field reaches each fold's
#: :class:`FoldConfig` (tests/test_fold_config_derived.py holds both to this).
DRIVER_ONLY: dict[str, str] = {
    "dataset": "tags the trial's and fold runs; a fold gets it among the extra tags of its run",
    "study_run_id": "the parent of the trial's run, which the driver opens",
    "fold_storage": "where the driver has each fold's result and Ray Train run stored",
    "manifest_json": "parsed once per trial (a FoldManifest); its fold and test classes are passed to _fold_config",
    "base_seed": "the trial's seed derives from it (reproductions: reproduction_seed); _fold_config gets that seed",
    "workers_per_fold": "the executor and a Train fold's ScalingConfig, which the driver chooses",
    "gpus_per_worker": "the fold's Ray resources, which the driver requests",
    "fold_retries": "the fold's Ray task retries or Train FailureConfig, which the driver sets",
    "fold_executor": "how the driver runs the fold: a warm Ray task or a TorchTrainer",
}


def _study_part(ctx: StudyContext, manifest: FoldManifest) -> FoldStudyPart:
    """The part of every fold's configuration the study alone decides, from its context: the one place a study-level
    setting becomes a fold's (renamed or converted where the fold's process wants it another way)."""
    return FoldStudyPart(
        table_ref=ctx.table_ref,
        test_classes=tuple(manifest.test_classes),
        image_size=ctx.image_size,
        model=ctx.model_kwargs,
        loss=ctx.loss,
        use_gpu=ctx.use_gpu,
        threads=max(1, int(ctx.cpus_per_worker)),
        tracking_uri=ctx.tracking_uri,
        experiment_id=ctx.experiment_id,
        mid_fold_resume=ctx.mid_fold_resume,
        label=ctx.study,
    )


def _fold_config(
    ctx: StudyContext,
    fold: Fold,
    hparams: dict[str, Any],
    seed: int,
    fold_run_id: str,
    reproduction: bool,
    manifest: FoldManifest,
    parent_run_id: str,
    extra_tags: dict[str, Any] | None = None,
) -> FoldConfig:
    """One fold's configuration: the study's part (:func:`_study_part`), and what this fold of this trial adds: its
    classes, the trial's loss parameters, the training settings with the fold's seed, its runs."""
    values = {**ctx.fixed_params, **hparams}
    loss_params = {k: v for k, v in values.items() if k != LOSS_LR}
    loss_lr = float(values[LOSS_LR]) if LOSS_LR in values else ctx.train.loss_lr  # the loss's own, where searched
    return FoldConfig(
        **_study_part(ctx, manifest).study_values(),
        fold=FoldClasses(fold.index, tuple(fold.train_classes), tuple(fold.val_classes)),
        loss_params=loss_params,
        train=replace(ctx.train, seed=seed + fold.index, loss_lr=loss_lr),
        fold_run_id=fold_run_id,
        fold_run_tags=_fold_tags(ctx, fold.index),
        fold_run_extra_tags=extra_tags or {},
        parent_run_id=parent_run_id,
        evaluate_test=reproduction,
        save_model=reproduction,
    )


def _fold_tags(ctx: StudyContext, index: int) -> dict[str, Any]:
    return {"sweep": ctx.sweep, "study": ctx.study, "stage": "fold", "fold": index}


def _fit_train(ctx: StudyContext, name: str, cfg: FoldConfig) -> str:
    """One fold = one ``TorchTrainer.fit()`` (called from a thread of the trial driver); returns the URI of rank 0's
    result directory (the run's checkpoint)."""
    # torch (ray.train.torch and the fold code): only a driver that fits Train folds loads it (module docstring)
    from ray.train.torch import TorchTrainer

    # (as said above)
    from pipelines.execution.folds.fold import fold_worker

    resources = {"CPU": ctx.cpus_per_worker}
    if ctx.use_gpu:
        resources["GPU"] = ctx.gpus_per_worker
    trainer = TorchTrainer(
        functools.partial(fold_worker, cfg),  # the FoldConfig itself, pickled with the function, not a dict
        scaling_config=ray.train.ScalingConfig(
            num_workers=ctx.workers_per_fold, use_gpu=ctx.use_gpu, resources_per_worker=resources
        ),
        # (storage_path, name) must be stable across restarts (trial id, never a timestamp) so that a fold that
        # finished before a kill is restored rather than retrained: Ray Train hands the run's latest checkpoint
        # under that path to `fold_worker` (`ray.train.get_checkpoint()`).
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=ctx.fold_storage,
            failure_config=ray.train.FailureConfig(max_failures=ctx.fold_retries),
            # Train logs every worker-group start and report at INFO; progress is ours.
            # ray.train is Train v2's here (RAY_TRAIN_V2_ENABLED, runtime/environment.py); ray's stubs name v1's
            # RunConfig
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # type: ignore[call-arg]
        ),
    )
    ckpt = trainer.fit().checkpoint
    if ckpt is None:
        raise RuntimeError(f"fold run {name} finished without a checkpoint")
    return checkpoint_uri(ckpt)


#: Seconds between a pruned search trial's reads of its folds' evaluations (docs/protocol.md §Pruning).
RUNG_POLL_S = 2.0


def _run_folds(
    ctx: StudyContext, prefix: str, cfgs: dict[int, FoldConfig], rungs: Rungs | None = None
) -> tuple[dict[int, str], dict[int, tuple[float, float]], dict[int, BaseException]]:
    """Run every fold concurrently; ``(result URIs, (submit, done) wall times, errors)`` by fold index.  With
    ``rungs`` (pruning, warm folds) the folds' evaluations are reported as they come; when Tune stops the trial
    (``tune.report`` raises) the folds still running are cancelled."""
    uris: dict[int, str] = {}
    spans: dict[int, tuple[float, float]] = {}
    errors: dict[int, BaseException] = {}
    t_submit = time.time()
    if fold_executor(ctx) == "warm":
        gpus = ctx.gpus_per_worker if ctx.use_gpu else 0.0
        refs = {
            k: warm_fold_ref(
                cfg,
                result_uri(ctx.fold_storage, f"{prefix}-fold{k}"),
                cpus=ctx.cpus_per_worker,
                gpus=gpus,
                retries=ctx.fold_retries,
            )
            for k, cfg in cfgs.items()
        }
        pending = {ref: k for k, ref in refs.items()}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=RUNG_POLL_S if rungs else None)
            for ref in done:
                k = pending.pop(ref)
                try:
                    uris[k] = ray.get(ref)
                    spans[k] = (t_submit, time.time())
                except BaseException as e:  # collected, re-raised after the other folds finished
                    errors[k] = e
            if rungs is not None and pending and not errors:
                try:
                    rungs.poll(set(pending.values()))
                except BaseException:  # the scheduler stopped the trial (SystemExit from tune.report)
                    for ref in pending:
                        ray.cancel(ref)  # a KeyboardInterrupt in the fold's task; its warm process is kept
                    raise
        return uris, spans, errors

    lock = threading.Lock()

    def one(k: int) -> None:
        try:
            t_fit = time.time()
            uri = _fit_train(ctx, f"{prefix}-fold{k}", cfgs[k])
            with lock:
                uris[k], spans[k] = uri, (t_fit, time.time())
        except BaseException as e:  # collected, re-raised after the other folds finished
            with lock:
                errors[k] = e

    with ThreadPoolExecutor(max_workers=len(cfgs), thread_name_prefix="fold") as pool:
        list(pool.map(one, cfgs))
    return uris, spans, errors


def _read_outcome(uri: str) -> tuple[FoldOutcome, np.ndarray | None, np.ndarray | None]:
    """A fold's result directory (local path or ``s3://``), whichever executor wrote it."""
    with ray.train.Checkpoint(uri).as_directory() as directory:
        d = Path(directory)
        outcome = FoldOutcome.from_json((d / OUTCOME_FILE).read_text())
        emb = np.load(d / TEST_EMBEDDINGS) if (d / TEST_EMBEDDINGS).exists() else None
        labels = np.load(d / TEST_LABELS) if (d / TEST_LABELS).exists() else None
    return outcome, emb, labels


def checkpoint_uri(ckpt) -> str:
    """Where a Ray Train checkpoint lives, in a form ``ray.train.Checkpoint(uri)`` opens again anywhere:
    ``s3://bucket/key`` on S3 storage (``Checkpoint.path`` alone drops the scheme), else the local path."""
    return s3_uri(ckpt.filesystem, ckpt.path)


def reduce_folds(outcomes: list[FoldOutcome]) -> dict[str, Any]:
    """The trial's objective from its folds (docs/protocol.md §Objective): mean ± SEM of best val metrics; 0 if a fold
    diverged."""
    diverged = [o for o in outcomes if o.status != "ok"]
    out: dict[str, Any] = {}
    if diverged:
        out["status"] = "diverged"
        out["reason"] = "; ".join(f"fold {o.fold}: {o.reason}" for o in diverged)
        for k in HEADLINE_METRICS:
            out[f"val.{k}.mean"], out[f"val.{k}.sem"] = 0.0, 0.0
        return out
    out["status"], out["reason"] = "ok", ""
    for k in HEADLINE_METRICS:
        mean, sem = fold_summary([o.best_metrics[k] for o in outcomes])
        out[f"val.{k}.mean"], out[f"val.{k}.sem"] = mean, sem
    return out


@dataclass
class _Trial:
    """One trial or reproduction of a study, as :func:`run_trial` runs it."""

    ctx: StudyContext
    trial_id: str
    rep: int | None  # the reproduction's index, None for a search trial
    hparams: dict[str, Any]  # the trial's values (a reproduction's: the best trial's)
    seed: int
    manifest: FoldManifest
    tracker: Tracker

    @classmethod
    def of(cls, config: dict[str, Any], ctx: StudyContext, trial_id: str) -> _Trial:
        rep = config.get(REPRODUCTION)
        return cls(
            ctx=ctx,
            trial_id=trial_id,
            rep=None if rep is None else int(rep),
            # a search trial's config: the sampled values, and the search's own constants (``__``) that are not
            hparams=dict(config[PARAMS]) if rep is not None else {k: v for k, v in config.items() if k[:2] != "__"},
            seed=reproduction_seed(ctx.base_seed, int(rep)) if rep is not None else ctx.base_seed,
            manifest=FoldManifest.from_json(ctx.manifest_json),
            tracker=Tracker.from_uri(ctx.tracking_uri, ctx.experiment_id),
        )

    @property
    def reproduction(self) -> bool:
        return self.rep is not None

    @property
    def prefix(self) -> str:
        """The name its folds' runs and results are stored under."""
        return f"rep{self.rep}" if self.reproduction else self.trial_id

    def open_run(self, node_id: str) -> str:
        """Step 1: the trial's run (``stage=trial``) or the reproduction's (``stage=reproduction``), tagged."""
        ctx, base = self.ctx, {"sweep": self.ctx.sweep, "study": self.ctx.study}
        if self.reproduction:
            tags, name = (
                {**base, "stage": "reproduction", "reproduction": self.rep},
                f"{ctx.study} reproduction {self.rep}",
            )
        else:
            tags, name = {**base, "stage": "trial", "trial_id": self.trial_id}, f"{ctx.study} {self.trial_id}"
        run_id, _ = self.tracker.get_or_create(tags, parent=ctx.study_run_id, run_name=name)
        self.tracker.set_tags(
            run_id,
            {
                "loss": ctx.loss,
                "dataset": ctx.dataset,
                "trial_id": self.trial_id,
                "seed": self.seed,
                "status": "running",
                "driver_node_id": node_id,
            },
        )
        self.tracker.log_params(run_id, self.hparams)
        return run_id

    def extra_tags(self) -> dict[str, Any]:
        return {"loss": self.ctx.loss, "dataset": self.ctx.dataset, "trial_id": self.trial_id}

    def open_fold_runs(self, run_id: str) -> dict[int, str]:
        """Step 2: one ``stage=fold`` child run per fold, with the study's dataset as its MLflow input."""
        fold_runs = {}
        for fold in self.manifest.folds:
            # With mid-fold resume a fold left unfinished (sweep killed, --resume) continues in its own run, from
            # its checkpoint; without it the fold starts over, so its partial run is hidden and a fresh one made.
            fid, _ = self.tracker.get_or_create(
                _fold_tags(self.ctx, fold.index),
                parent=run_id,
                run_name=f"fold {fold.index}",
                reuse_unfinished=self.ctx.mid_fold_resume,
            )
            self.tracker.set_tags(fid, self.extra_tags())
            log_fold_dataset_input(self.tracker, fid, self.ctx.study_run_id)  # the study's dataset as MLflow input
            fold_runs[fold.index] = fid
        return fold_runs

    def fold_configs(self, fold_runs: dict[int, str], run_id: str) -> dict[int, FoldConfig]:
        m = self.manifest
        return {
            f.index: _fold_config(
                self.ctx,
                f,
                self.hparams,
                self.seed,
                fold_runs[f.index],
                self.reproduction,
                m,
                run_id,
                self.extra_tags(),
            )
            for f in m.folds
        }

    def live_fold_runs(self, fold_runs: dict[int, str], run_id: str) -> dict[int, str]:
        """A fold run again after its process died logs to a replacement run (see run_fold): the live ones."""
        out = dict(fold_runs)
        for fold in self.manifest.folds:
            live = self.tracker.find({**_fold_tags(self.ctx, fold.index), PARENT: run_id})
            if live:
                out[fold.index] = live[-1].info.run_id
        return out

    def fail(self, run_id: str, fold_runs: dict[int, str], errors: dict[int, BaseException]) -> None:
        """A fold raised: its runs and the trial's end FAILED with the first fold's error, which is raised."""
        k = min(errors)
        reason = f"fold {k}: {error_text(errors[k])}"
        for fid in fold_runs.values():
            if self.tracker.status(fid) == "RUNNING":
                self.tracker.finish(fid, "FAILED")
        self.tracker.set_tags(run_id, {"status": "failed", "reason": reason[:4000]})
        self.tracker.finish(run_id, "FAILED")
        raise RuntimeError(
            f"{self.ctx.study} {'reproduction ' + str(self.rep) if self.reproduction else self.trial_id}: {reason}"
        ) from errors[k]

    def collect(self, uris: dict[int, str], spans: dict[int, tuple[float, float]], fold_runs: dict[int, str]):
        """Step 4: every fold's outcome read and its run finished; ``(outcomes, embeddings, labels, cost)`` with the
        trial's cost the sum of its folds'."""
        ctx = self.ctx
        outcomes, embeddings, labels = [], [], []
        cost: dict[str, float] = {}
        gpus = ctx.gpus_per_worker if ctx.use_gpu else 0.0
        for fold in self.manifest.folds:
            outcome, emb, lab = _read_outcome(uris[fold.index])
            outcomes.append(outcome)
            if emb is not None:
                embeddings.append(emb)
                labels.append(lab)
            one = fold_cost(outcome, ctx.cpus_per_worker, gpus)
            _finish_fold_run(self.tracker, fold_runs[fold.index], outcome, uris[fold.index], spans[fold.index], one)
            for k, v in one.items():
                cost[k] = cost.get(k, 0.0) + v
        return outcomes, embeddings, labels, cost

    def finish(self, run_id: str, outcomes: list[FoldOutcome], embeddings, labels, cost: dict[str, float]):
        """Step 5: the folds reduced to the objective, a reproduction's test metrics, the trial's run finished;
        returns ``(summary, metrics, details URI)``."""
        summary = reduce_folds(outcomes)
        metrics = {k: v for k, v in summary.items() if k.startswith("val.")}
        metrics.update({f"cost.{k}": v for k, v in cost.items()})
        details_uri = None
        if self.reproduction and summary["status"] == "ok":
            docs = [o.as_dict() for o in outcomes]  # outcome.json's form, which the test evaluation reads
            test_metrics, details = reproduction_test_metrics(docs, embeddings, labels)
            metrics.update(test_metrics)
            details_uri = _store_details(self.ctx, self.prefix, details)
        self.tracker.log_metrics(run_id, metrics)
        self.tracker.set_tags(run_id, {"status": summary["status"], "reason": summary["reason"][:4000]})
        self.tracker.finish(run_id, "FINISHED")
        return summary, metrics, details_uri


def _report(trial: _Trial, run_id: str, summary, metrics, outcomes: list[FoldOutcome], folds: dict) -> dict[str, Any]:
    """The trial's one Tune result (``folds``: URIs, fit spans, details URI and start time)."""
    report = {k.replace(".", "_"): v for k, v in metrics.items()}
    indices = [f.index for f in trial.manifest.folds]
    report.update(
        {
            OBJECTIVE: summary["val.map_at_r.mean"],
            "status": summary["status"],
            "reason": summary["reason"],
            "mlflow_run_id": run_id,
            "fold_values": [o.best_metrics.get("map_at_r", 0.0) if o.status == "ok" else 0.0 for o in outcomes],
            "fold_spans": [[o.time_start, o.time_end] for o in outcomes],
            "fold_fit_spans": [list(folds["spans"][k]) for k in indices],
            "fold_train_seconds": [o.train_seconds for o in outcomes],
            "fold_checkpoints": [folds["uris"][k] for k in indices],
            "trial_seconds": time.time() - folds["t0"],
            "seed": trial.seed,
            FOLDS_KEY: fold_records(outcomes),  # each fold's curve and stop (the study's records)
        }
    )
    if trial.reproduction:
        report[REPRODUCTION] = trial.rep
        report["concat_details"] = folds["details_uri"]
    if folds.get("rungs") is not None:  # the scheduler's time attribute: the trial reached the full budget
        report[EVALUATION] = folds["rungs"].max_t
    return report


def run_trial(config: dict[str, Any], ctx: StudyContext) -> None:
    """Ray Tune function trainable (wrapped with ``tune.with_parameters(run_trial, ctx=...)``): the module
    docstring's steps."""
    trial = _Trial.of(config, ctx, tune.get_context().get_trial_id())
    run_id = trial.open_run(ray.get_runtime_context().get_node_id())
    fold_runs = trial.open_fold_runs(run_id)
    rungs = None
    if config.get(PRUNING_KEY) and not trial.reproduction and fold_executor(ctx) == "warm":
        extra = {"mlflow_run_id": run_id, "seed": trial.seed}
        rungs = Rungs(fold_runs, int(config[PRUNING_KEY]), mlflow_history(trial.tracker), tune.report, extra)
    t0 = time.time()
    uris, spans, errors = _run_folds(ctx, trial.prefix, trial.fold_configs(fold_runs, run_id), rungs)
    fold_runs = trial.live_fold_runs(fold_runs, run_id)
    if errors:
        trial.fail(run_id, fold_runs, errors)
    outcomes, embeddings, labels, cost = trial.collect(uris, spans, fold_runs)
    summary, metrics, details_uri = trial.finish(run_id, outcomes, embeddings, labels, cost)
    folds = {"uris": uris, "spans": spans, "t0": t0, "details_uri": details_uri, "rungs": rungs}
    tune.report(_report(trial, run_id, summary, metrics, outcomes, folds))


def _store_details(ctx: StudyContext, prefix: str, details) -> str:
    """The concatenated test search's neighbours, next to the folds' results, for the study's visuals."""
    folder = ctx.fold_storage.rstrip("/") + f"/{prefix}-concat"
    open_storage(folder).put_bytes(details_to_bytes(details), "details.npz")
    return folder + "/details.npz"


def _finish_fold_run(
    tracker,
    fold_run_id: str,
    outcome: FoldOutcome,
    checkpoint: str,
    fit_span: tuple[float, float],
    cost: dict[str, float],
) -> None:
    """Summary of a fold run, and the evaluations of its history that rank 0 could not log live (MLflow down while
    it trained, a restart): each one once, at its iteration."""
    run = tracker.run(fold_run_id)
    if run.info.status == "FINISHED" and "best_epoch" in run.data.metrics:
        return  # a fold that finished before a restart: already summarised
    logged = logged_evaluations(tracker, fold_run_id) if run.data.metrics else set()
    for rec in outcome.history:
        if rec["iteration"] not in logged:
            tracker.log_metrics(fold_run_id, evaluation_metrics(rec), step=rec["iteration"])
    summary: dict[str, float | None] = {
        f"best.val.{k}": v for k, v in outcome.best_metrics.items() if k in HEADLINE_METRICS
    }
    summary.update({f"test.{k}": v for k, v in (outcome.test_metrics or {}).items()})
    # Wall-clock marks (s since the epoch) for the overhead benchmark: fold submitted (fit() called) → fold function
    # starts → train_fold starts → fold function ends → the trial has its result.
    summary.update(
        {
            "best_epoch": outcome.best_epoch,
            "train_seconds": outcome.train_seconds,
            "time.fit_start": fit_span[0],
            "time.start": outcome.time_start,
            "time.train_start": outcome.time_train_start,
            "time.end": outcome.time_end,
            "time.fit_end": fit_span[1],
            "iterations": outcome.iterations,
            "process.rss_peak_mb": outcome.rss_peak_mb,
        }
    )
    summary.update({f"cost.{k}": v for k, v in cost.items()})  # what the fold held and for how long (fold_cost)
    tracker.log_metrics(fold_run_id, summary)
    tracker.set_tags(
        fold_run_id,
        {
            "status": outcome.status,
            "reason": outcome.reason[:4000],
            "checkpoint": checkpoint,
            "world_size": outcome.world_size,
            "pid": outcome.pid,
            "node_id": outcome.node_id,
        },
    )
    tracker.finish(fold_run_id, "FINISHED")
