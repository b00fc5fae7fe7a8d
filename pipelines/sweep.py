"""The reality-check sweep: per (dataset, loss) study, Bayesian optimisation → best config → reproductions → CIs.

For each study (MLRC §2, spec protocol_reality_check.md):

1. **Search** — one Ray Tune ``Tuner`` (never nested: ray #36024) over :func:`pipelines.trial.run_trial` with
   ``OptunaSearch``; sampler ``optuna.samplers.GPSampler`` (a GP with expected-improvement-type acquisition, the
   closest Optuna analogue of MLRC's Ax GPEI) after ``startup_trials`` random trials (MLRC: 5 Sobol trials), seeded;
   ``TPESampler`` selectable.  ``protocol.trials`` trials (MLRC: 50), at most ``max_concurrent_trials`` at a time.
   Objective: mean over the folds of best-checkpoint val MAP@R (SEM recorded), MLRC §1.6.
2. **Best** — the trial with the highest *observed* mean (MLRC §2.2: a SQL max over raw values, not the GP's
   prediction); ties go to the earlier trial.
3. **Reproductions** — a second ``Tuner`` runs ``reproductions`` retrainings of the best config (grid over the
   reproduction index; each a full 4-fold trial with seed ``pipelines.trial.reproduction_seed(seed, i)``), each tested
   on the test classes, separated and concatenated (MLRC §2.3).
4. **CIs** — 95 % Student-t intervals across reproductions (``dml_core.stats.confidence_interval``), written to the
   study run with the CI report and the best fold models (reproduction 0's, from rank 0's checkpoints).

Resources: a trial is a driver reserving 0.01 CPU (its Tune actor is reused from trial to trial, which saves a
process start and its imports per trial — the trainable keeps no state); its four folds' ``TorchTrainer`` workers reserve
``cpus_per_worker`` CPUs (and a GPU each with ``use_gpu``).  A local Ray gets ``num_cpus`` *logical* CPUs, by default
enough for ``max_concurrent_trials`` × folds × workers — on a 2-core machine that oversubscribes the cores, which
is fine for tiny models and is what lets the four folds overlap.

Resume: every Tuner lives at a fixed path under the sweep's storage, so ``--resume`` restores it
(``Tuner.restore``: finished trials are kept with the searcher's history, unfinished ones rerun under the same
trial id); MLflow runs are found again by tags; fold runs that finished keep their Ray Train checkpoint and are
not retrained.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.config import ConfigError, SweepConfig
from pipelines.preflight import StudyPlan, preflight, study_dirname
from pipelines.trial import OBJECTIVE, PARAMS, REPRODUCTION, StudyContext, run_trial

__all__ = ["run_sweep", "StudySummary", "SweepOutcome", "ci_table", "RAY_ENV", "CI_MODES"]

CI_MODES = ("concat", "separated")
#: Set before Ray is imported/started: Train V2, quiet start-up, no usage stats, all worker lines shown.
RAY_ENV = {
    "RAY_TRAIN_V2_ENABLED": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "TUNE_GLOBAL_CHECKPOINT_S": "2",
    "RAY_TRAIN_ENABLE_STATE_TRACKING": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_AIR_NEW_OUTPUT": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "60",
}
_CONFIG_FILE = "sweep_config.json"


@dataclass
class StudySummary:
    study: str
    dataset: str
    loss: str
    run_id: str
    status: str  # ok | failed
    reason: str = ""
    best_trial: str | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    best_val: tuple[float, float] | None = None  # (mean, sem)
    ci: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)  # mode -> metric -> (m, lo, hi)
    n_reproductions: int = 0
    trials: int = 0
    seconds: float = 0.0


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
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"open {self.tracking_uri} (experiment {self.experiment!r})"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"


# ------------------------------------------------------------------------------------------------------ set-up


#: S3 settings the driver hands to its Ray workers.  Credentials are not among them: local workers inherit the
#: driver's environment, and a remote cluster's nodes use their own (instance roles, pod secrets).
S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "MLFLOW_S3_ENDPOINT_URL",
          "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")


def s3_compat_env() -> None:
    """With a non-AWS S3 endpoint, send request checksums only where the API requires them.

    Recent AWS SDKs (the C++ one inside pyarrow, which Ray uses for its storage) default to streaming
    checksum trailers on uploads; S3-compatible servers that predate them (SeaweedFS, older MinIO/Ceph)
    reject those multipart uploads with a misleading auth error.  An explicit setting in the environment wins.
    """
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")


def check_storage_reachable(cfg: SweepConfig) -> None:
    """Fail before Ray starts when ``storage: s3://bucket/...`` cannot be reached (names ``storage``)."""
    if not cfg.storage_is_s3:
        return
    import boto3
    import botocore.exceptions

    from dml_core.storage import split_s3_uri

    bucket, _ = split_s3_uri(cfg.storage)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
    try:
        boto3.client("s3").head_bucket(Bucket=bucket)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise ConfigError("storage", f"S3 bucket {bucket!r} at {endpoint} is not reachable ({e}); set "
                                     "AWS_ENDPOINT_URL and credentials for a non-AWS server") from None


def _default_num_cpus(cfg: SweepConfig) -> int:
    r = cfg.resources
    need = r.max_concurrent_trials * cfg.protocol.folds * r.workers_per_fold * r.cpus_per_worker
    return int(max(os.cpu_count() or 1, math.ceil(need) + 1))


def start_ray(cfg: SweepConfig, address: str | None) -> bool:
    """Start (or connect to) Ray; returns whether we started it (and so must shut it down)."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    s3_compat_env()
    import ray

    from pipelines.fold import worker_env

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        # Workers, Train controllers and their placement-group cleaners log at INFO/WARNING a lot (the cleaners
        # poll the State API, which needs the dashboard we do not start); our progress lines are prints.
        logging_config=ray.LoggingConfig(log_level=os.environ.get("DMLRC_RAY_LOG_LEVEL", "ERROR")),
        runtime_env={"env_vars": {**worker_env(), **{k: os.environ[k] for k in RAY_ENV},
                                  **{k: os.environ[k] for k in S3_ENV if k in os.environ}}},
    )
    if address:
        ray.init(address=address, **kwargs)
    else:
        # One machine cannot be preempted node by node: skip Train's per-run preemption-watcher actor.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        kwargs["runtime_env"]["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        for attempt in range(3):
            try:
                ray.init(num_cpus=cfg.resources.num_cpus or _default_num_cpus(cfg), **kwargs)
                break
            except Exception as e:  # noqa: BLE001 - only Ray's start-up timeout is retried
                # Ray waits a fixed 30 s for its raylet to register; a saturated machine can miss that.
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                ray.shutdown()
                time.sleep(5)
    for name in ("ray.tune", "ray.train", "ray.air", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return True


def _artifact_location(cfg: SweepConfig) -> str | None:
    """Artifacts next to the sweep's storage (``<storage>/<name>/mlartifacts``, on S3 when it is ``s3://``) for a
    file/sqlite/postgres tracking DB; an HTTP server chooses its own (proxied) store."""
    if cfg.tracking_uri().startswith(("http://", "https://")):
        return None
    if cfg.storage_is_s3:
        return cfg.storage.rstrip("/") + "/" + cfg.name + "/mlartifacts"
    return (cfg.local_dir() / "mlartifacts").as_uri()


def check_tracking_reachable(uri: str) -> None:
    """Fail before Ray starts when an HTTP tracking server does not answer (names ``tracking.uri``)."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as r:
            r.read()
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError("tracking.uri", f"MLflow server {uri} is not reachable ({e})") from None


def _check_resume(cfg: SweepConfig, resume: bool) -> None:
    """A new sweep must not silently reuse an old one's folder; ``--resume`` must not change what is studied."""
    stored = cfg.local_dir() / _CONFIG_FILE
    if not stored.exists():
        return
    if not resume:
        raise ConfigError(
            "name", f"a sweep named {cfg.name!r} already exists in {cfg.local_dir()}; pass --resume to continue it, "
                    "or choose another name")
    old = json.loads(stored.read_text())
    new = json.loads(json.dumps(cfg.to_dict()))
    for key in sorted(set(old) | set(new)):
        if key in ("resources", "tune_spaces"):
            continue  # may change between restarts (a bigger cluster, a moved checkout)
        if old.get(key) != new.get(key):
            raise ConfigError(key, f"differs from the sweep being resumed (stored in {stored}); "
                                   "Tuner.restore cannot change what is searched")


# ------------------------------------------------------------------------------------------------------ search


def optuna_space(searched: dict) -> dict:
    """``pipelines.spaces.Param`` → Optuna distributions (log-uniform / uniform / int / categorical)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out = {}
    for name, p in searched.items():
        if p.type == "categorical":
            out[name] = CategoricalDistribution(list(p.choices))
        elif p.type == "int":
            out[name] = IntDistribution(int(p.low), int(p.high), log=p.log)
        else:
            out[name] = FloatDistribution(float(p.low), float(p.high), log=p.log)
    return out


def make_searcher(plan: StudyPlan, cfg: SweepConfig):
    """OptunaSearch with GPSampler (default) or TPESampler; ``startup_trials`` random trials first; seeded."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

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
    """Highest observed objective among trials that finished ``ok`` (MLRC §2.2); earliest trial wins ties."""
    ok = [r for r in results if r.get("status") == "ok" and isinstance(r.get(OBJECTIVE), (int, float))]
    if not ok:
        return None
    return max(sorted(ok, key=lambda r: r["trial_id"]), key=lambda r: r[OBJECTIVE])


def _grid_rows(grid) -> list[dict[str, Any]]:
    rows = []
    for r in grid:
        m = dict(r.metrics or {})
        m["trial_id"] = m.get("trial_id") or (r.path.rstrip("/").split("/")[-1] if r.path else "")
        m["config"] = dict(r.config or {})
        m["error"] = r.error
        rows.append(m)
    return rows


# ------------------------------------------------------------------------------------------------------ CIs


def confidence_intervals(reps: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """mode → metric → (mean, ci_low, ci_high) across reproductions (MLRC §2.3: t-interval across runs)."""
    from dml_core.stats import confidence_interval

    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for mode in CI_MODES:
        prefix = f"test_{mode}_"
        keys = sorted(set.intersection(*(
            {k[len(prefix):] for k in r if k.startswith(prefix)} for r in reps))) if reps else []
        out[mode] = {k: confidence_interval([r[prefix + k] for r in reps]) for k in keys}
    return out


def ci_report(summary: StudySummary, reps: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The study's CI report as markdown and JSON."""
    doc = {
        "study": summary.study, "dataset": summary.dataset, "loss": summary.loss, "level": 0.95,
        "interval": "Student-t across reproductions: scipy.stats.t.interval(0.95, n-1, mean, sem)",
        "best_trial": summary.best_trial, "best_params": summary.best_params,
        "best_val_map_at_r": {"mean": summary.best_val[0], "sem": summary.best_val[1]} if summary.best_val else None,
        "n_reproductions": len(reps),
        "reproductions": [{"reproduction": r[REPRODUCTION], "seed": r.get("seed"),
                           **{k: v for k, v in r.items() if k.startswith("test_")}} for r in reps],
        "metrics": {mode: {k: {"mean": m, "ci_low": lo, "ci_high": hi} for k, (m, lo, hi) in d.items()}
                    for mode, d in summary.ci.items()},
    }
    lines = [f"# {summary.study}: test-set results", "",
             f"Best configuration: trial {summary.best_trial} — "
             + ", ".join(f"`{k}={v}`" for k, v in summary.best_params.items()), "",
             f"{len(reps)} reproductions; values ×100, mean ± half-width of the 95 % Student-t interval [low, high].",
             "", "| metric | concatenated | separated |", "|---|---|---|"]
    metrics = sorted(set(summary.ci.get("concat", {})) | set(summary.ci.get("separated", {})),
                     key=lambda k: (k not in ("precision_at_1", "r_precision", "map_at_r"), k))
    for k in metrics:
        cells = []
        for mode in CI_MODES:
            t = summary.ci.get(mode, {}).get(k)
            cells.append(_fmt_ci(t) if t else "–")
        lines.append(f"| {k} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n", doc


def _fmt_ci(t: tuple[float, float, float]) -> str:
    m, lo, hi = t
    if not (isinstance(lo, float) and math.isfinite(lo)):
        return f"{100 * m:.2f} (n < 2: no interval)"
    return f"{100 * m:.2f} ± {100 * (hi - lo) / 2:.2f} [{100 * lo:.2f}, {100 * hi:.2f}]"


def ci_table(studies: list[StudySummary]) -> str:
    """The end-of-sweep table: one row per study, P@1 / RP / MAP@R concatenated and separated (×100, ± CI half-width)."""
    head = ["dataset", "loss"] + [f"{mode} {lab}" for mode in CI_MODES for lab in ("P@1", "RP", "MAP@R")]
    rows = []
    for s in studies:
        row = [s.dataset, s.loss]
        for mode in CI_MODES:
            for k in ("precision_at_1", "r_precision", "map_at_r"):
                t = s.ci.get(mode, {}).get(k)
                if t is None:
                    row.append("–" if s.status == "ok" else s.status)
                elif isinstance(t[1], float) and math.isfinite(t[1]):
                    row.append(f"{100 * t[0]:.2f} ± {100 * (t[2] - t[1]) / 2:.2f}")
                else:
                    row.append(f"{100 * t[0]:.2f}")
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


# ------------------------------------------------------------------------------------------------------ the study


class _Sweep:
    def __init__(self, cfg: SweepConfig, plans: list[StudyPlan], tracker, out=None):
        self.cfg = cfg
        self.plans = plans
        self.tracker = tracker
        self.out = out or sys.stdout

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
            sweep=cfg.name, study=plan.key, dataset=plan.dataset.spec.name, loss=plan.loss.name,
            tracking_uri=self.tracker.uri, experiment_id=self.tracker.experiment_id, study_run_id=study_run_id,
            fold_storage=self.study_storage(plan) + "/folds", table_ref=[table_ref],
            manifest_json=plan.dataset.manifest.to_json(), model_kwargs=plan.model_kwargs,
            fixed_params=plan.fixed, train=train, image_size=plan.dataset.spec.image_size,
            workers_per_fold=cfg.resources.workers_per_fold, use_gpu=cfg.resources.use_gpu,
            cpus_per_worker=cfg.resources.cpus_per_worker, base_seed=cfg.protocol.seed,
            gpus_per_worker=cfg.resources.gpus_per_worker, fold_retries=cfg.resources.fold_retries,
        )

    def _open_study_run(self, plan: StudyPlan) -> str:
        from pipelines.tracking import git_commit

        t = self.tracker
        run_id, created = t.get_or_create({"sweep": self.cfg.name, "study": plan.key, "stage": "study"},
                                          run_name=plan.key)
        if created:
            t.set_tags(run_id, {"loss": plan.loss.name, "dataset": plan.dataset.spec.name,
                                "protocol": self.cfg.protocol.name, "fold_layout": self.cfg.protocol.fold_layout,
                                "git_commit": git_commit(), "folds_hash": plan.dataset.manifest.content_hash,
                                "sampler": self.cfg.protocol.sampler})
            t.log_params(run_id, {
                **{f"space.{k}": p.describe() for k, p in plan.searched.items()},
                **{f"fixed.{k}": v for k, v in plan.fixed.items()},
                "classes_per_batch": plan.classes_per_batch, "m": plan.m,
                "trials": self.cfg.protocol.trials, "startup_trials": self.cfg.protocol.startup_trials,
                "reproductions": self.cfg.protocol.reproductions, "workers_per_fold": self.cfg.resources.workers_per_fold,
                **{f"model.{k}": v for k, v in plan.model_kwargs.items()},
            })
            t.log_text(run_id, plan.dataset.manifest.to_json(), "folds.json")
            t.log_json(run_id, self.cfg.to_dict(), "sweep_config.json")
        return run_id

    def _tuner(self, plan: StudyPlan, name: str, trainable, make):
        from ray import tune

        path = self.study_storage(plan) + "/" + name
        if tune.Tuner.can_restore(path):
            self.say(f"[{plan.key}] resuming {name} from {path}")
            return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=False,
                                      restart_errored=False)
        return make(path)

    def run_study(self, plan: StudyPlan) -> StudySummary:
        import ray
        from ray import tune

        from pipelines.progress import TrialProgress, format_duration

        cfg, t = self.cfg, self.tracker
        t0 = time.time()
        run_id = self._open_study_run(plan)
        summary = StudySummary(plan.key, plan.dataset.spec.name, plan.loss.name, run_id, "ok")
        run = t.run(run_id)
        if run.data.tags.get("done") == "true":
            self.say(f"[{plan.key}] already finished (MLflow run {run_id}); skipped")
            return self._summary_from_run(summary, run)
        t.set_tags(run_id, {"status": "running"})
        from pipelines.registry import on_study_end, on_study_start  # reg hook (#10)

        on_study_start(t, run_id, plan)

        table_ref = ray.put(plan.dataset.table)
        ctx = self._context(plan, run_id, table_ref)
        trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx),
                                        tune.PlacementGroupFactory([{"CPU": 0.01}]))
        storage = self.study_storage(plan)
        trials = cfg.protocol.trials if plan.searched else 1

        # 1. search --------------------------------------------------------------------------------------
        def new_search(path):
            self.say(f"[{plan.key}] search: {trials} trials, {cfg.protocol.startup_trials} random start-up, "
                     f"sampler {cfg.protocol.sampler}, ≤ {cfg.resources.max_concurrent_trials} concurrent")
            tune_cfg = tune.TuneConfig(
                search_alg=make_searcher(plan, cfg) if plan.searched else None,
                metric=OBJECTIVE, mode="max", num_samples=trials,
                max_concurrent_trials=cfg.resources.max_concurrent_trials, reuse_actors=True)
            return tune.Tuner(trainable, param_space={}, tune_config=tune_cfg, run_config=tune.RunConfig(
                name="search", storage_path=storage, verbose=0,
                callbacks=[TrialProgress(plan.key, trials)],
                failure_config=tune.FailureConfig(max_failures=0)))

        grid = self._tuner(plan, "search", trainable, new_search).fit()
        rows = _grid_rows(grid)
        summary.trials = len(rows)
        best = best_result(rows)
        if best is None:
            reasons = "; ".join(sorted({str(r.get("reason") or r.get("error") or "?")[:200] for r in rows}))
            return self._fail(summary, f"no trial finished ok ({reasons})", t0)
        params = {k: v for k, v in best["config"].items() if not k.startswith("__")}
        summary.best_trial, summary.best_params = best["trial_id"], params
        summary.best_val = (best[OBJECTIVE], best.get("val_map_at_r_sem", float("nan")))
        t.log_params(run_id, {f"best.{k}": v for k, v in params.items()})
        t.log_metrics(run_id, {"best.val.map_at_r.mean": summary.best_val[0],
                               "best.val.map_at_r.sem": summary.best_val[1],
                               "trials.ok": sum(r.get("status") == "ok" for r in rows),
                               "trials.diverged": sum(r.get("status") == "diverged" for r in rows),
                               "trials.failed": sum(r.get("error") is not None for r in rows)})
        t.set_tags(run_id, {"best_trial_id": best["trial_id"], "best_run_id": best.get("mlflow_run_id", "")})

        # 2. reproductions ----------------------------------------------------------------------------------
        n = cfg.protocol.reproductions

        def new_reps(path):
            self.say(f"[{plan.key}] best trial {best['trial_id']} (val MAP@R {best[OBJECTIVE]:.4f}); "
                     f"{n} reproductions")
            return tune.Tuner(trainable, param_space={REPRODUCTION: tune.grid_search(list(range(n))), PARAMS: params},
                              tune_config=tune.TuneConfig(num_samples=1, metric=OBJECTIVE, mode="max",
                                                          max_concurrent_trials=cfg.resources.max_concurrent_trials,
                                                          reuse_actors=True),
                              run_config=tune.RunConfig(name="reproductions", storage_path=storage, verbose=0,
                                                        callbacks=[TrialProgress(plan.key, n, "reproduction")],
                                                        failure_config=tune.FailureConfig(max_failures=0)))

        reps = [r for r in _grid_rows(self._tuner(plan, "reproductions", trainable, new_reps).fit())
                if r.get("status") == "ok" and any(k.startswith("test_concat_") for k in r)]
        reps.sort(key=lambda r: r[REPRODUCTION])
        summary.n_reproductions = len(reps)
        if not reps:
            return self._fail(summary, "no reproduction finished ok", t0)

        # 3. confidence intervals, report, models -----------------------------------------------------------
        summary.ci = confidence_intervals(reps)
        metrics = {"test.n_reproductions": len(reps)}
        for mode, d in summary.ci.items():
            for k, (m, lo, hi) in d.items():
                metrics.update({f"test.{mode}.{k}.mean": m, f"test.{mode}.{k}.ci_low": lo,
                                f"test.{mode}.{k}.ci_high": hi})
        t.log_metrics(run_id, metrics)
        md, doc = ci_report(summary, reps)
        t.log_text(run_id, md, "ci_report.md")
        t.log_json(run_id, doc, "ci_report.json")
        self._log_models(run_id, reps[0])
        on_study_end(t, study_run_id=run_id, experiment=cfg.experiment_name(), sweep=cfg.name, plan=plan,
                     reps=reps, ci=summary.ci, say=self.say)  # reg hook (#10): pyfunc models, registry
        summary.seconds = time.time() - t0
        t.set_tags(run_id, {"done": "true", "status": "ok", "seconds": round(summary.seconds, 1)})
        t.finish(run_id, "FINISHED")
        c, s_ = summary.ci["concat"].get("map_at_r"), summary.ci["separated"].get("map_at_r")
        self.say(f"[{plan.key}] done in {format_duration(summary.seconds)}: best val MAP@R {summary.best_val[0]:.4f} "
                 f"(trial {summary.best_trial}); test MAP@R concat {_fmt_ci(c)}, separated {_fmt_ci(s_)} "
                 f"({len(reps)} reproductions)")
        return summary

    def _log_models(self, run_id: str, rep: dict[str, Any]) -> None:
        """Reproduction ``rep``'s fold models (written by rank 0 into its Ray Train checkpoint) → ``models/``."""
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
        for key, v in m.items():
            parts = key.split(".")
            if len(parts) == 4 and parts[0] == "test" and parts[3] == "mean":
                mode, metric = parts[1], parts[2]
                summary.ci.setdefault(mode, {})[metric] = (
                    v, m.get(f"test.{mode}.{metric}.ci_low", float("nan")),
                    m.get(f"test.{mode}.{metric}.ci_high", float("nan")))
        return summary


# ------------------------------------------------------------------------------------------------------ entry


def _warn_multi_node(cfg: SweepConfig, uri: str, out) -> None:
    """On a multi-node cluster, local storage and a sqlite/file tracking store only work through a shared mount."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    if not cfg.storage_is_s3:
        print(f"warning: storage: {cfg.ray_storage()} is a local path on a {len(nodes)}-node cluster; it must be a "
              "shared mount (NFS) on every node, else use s3://", file=out, flush=True)
    if not uri.startswith(("http://", "https://", "postgresql")):
        print(f"warning: tracking.uri: {uri} on a {len(nodes)}-node cluster; fold workers on other nodes log to "
              "MLflow too — use an MLflow server (http(s)://)", file=out, flush=True)


def run_sweep(cfg: SweepConfig, *, resume: bool = False, address: str | None = None, out=None) -> SweepOutcome:
    """Run (or with ``resume`` continue) a whole sweep.  Raises :class:`ConfigError` before anything starts."""
    out = out or sys.stdout
    t0 = time.time()
    _check_resume(cfg, resume)
    plans = preflight(cfg)
    uri = cfg.tracking_uri()
    check_tracking_reachable(uri)
    check_storage_reachable(cfg)

    local = cfg.local_dir()
    local.mkdir(parents=True, exist_ok=True)

    from pipelines.tracking import Tracker

    tracker = Tracker.open(uri, cfg.experiment_name(), _artifact_location(cfg))
    if not resume and tracker.find({"sweep": cfg.name, "stage": "study"}):
        raise ConfigError("name", f"MLflow experiment {cfg.experiment_name()!r} at {uri} already has runs of a sweep "
                                  f"named {cfg.name!r}; pass --resume to continue it, or choose another name")
    if not (local / _CONFIG_FILE).exists():
        if resume:
            print(f"--resume: no sweep {cfg.name!r} in {local} yet; starting it", file=out, flush=True)
        (local / _CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    started = start_ray(cfg, address)
    _warn_multi_node(cfg, uri, out)
    print(f"sweep {cfg.name!r}: {len(plans)} studies ({', '.join(p.key for p in plans)}); "
          f"MLflow {uri} experiment {cfg.experiment_name()!r}; storage {cfg.ray_storage()}", file=out, flush=True)
    try:
        sweep = _Sweep(cfg, plans, tracker, out)
        studies = [sweep.run_study(plan) for plan in plans]
    finally:
        if started:
            import ray

            ray.shutdown()
    return SweepOutcome(cfg.name, local, uri, cfg.experiment_name(), tracker.experiment_id, studies, time.time() - t0)
