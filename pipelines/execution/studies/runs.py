"""A study's MLflow run as the sweep keeps it: opened (found again by tags on ``--resume``) with the study's
parameters, read back into a :class:`~pipelines.results.study_results.StudySummary` once it is done, its trials that
a restored search no longer knows retired, and its cost summed from its trials' and reproductions' Tune results."""

from __future__ import annotations

import math
from typing import Any

from pipelines.config.schema import SweepConfig
from pipelines.execution.preflight.study_plans import StudyPlan
from pipelines.names import study_key
from pipelines.results.fingerprint import ARTIFACT as FINGERPRINT_ARTIFACT
from pipelines.results.fingerprint import HASH_TAG, Fingerprint, fingerprint_tags
from pipelines.results.report_studies import Study
from pipelines.results.study_results import COST_KEYS, EPOCH0_TAG, Provenance, StudySummary, iso_time
from pipelines.results.untrained import untrained_metrics_of
from pipelines.tracking.runs import PARENT, git_commit

__all__ = ["open_study_run", "summary_from_run", "summary_from_study", "retire_lost_trials", "study_cost"]


def open_study_run(cfg: SweepConfig, tracker, plan: StudyPlan, fingerprint: Fingerprint) -> str:
    """The study's run (``stage=study``); a new one gets the study's tags (its protocol fingerprint among them),
    parameters, fold manifest, fingerprint and config."""
    run_id, created = tracker.get_or_create({"sweep": cfg.name, "study": plan.key, "stage": "study"}, run_name=plan.key)
    if not created:
        return run_id
    tracker.set_tags(
        run_id,
        {
            **fingerprint_tags(fingerprint),
            "loss": plan.loss.name,
            "dataset": plan.dataset.spec.name,
            "protocol": cfg.protocol.name,
            "fold_layout": cfg.protocol.fold_layout,
            "git_commit": git_commit(),
            "folds_hash": plan.dataset.manifest.content_hash,
            "sampler": cfg.protocol.sampler,
        },
    )
    tracker.log_params(
        run_id,
        {
            **{f"space.{k}": p.describe() for k, p in plan.searched.items()},
            **{f"fixed.{k}": v for k, v in plan.fixed.items()},
            "classes_per_batch": plan.classes_per_batch,
            "m": plan.m,
            "trials": cfg.protocol.trials,
            "startup_trials": cfg.protocol.startup_trials,
            "reproductions": cfg.protocol.reproductions,
            "workers_per_fold": cfg.resources.workers_per_fold,
            **{f"model.{k}": v for k, v in plan.model_kwargs.items()},
        },
    )
    tracker.log_text(run_id, plan.dataset.manifest.to_json(), "folds.json")
    tracker.log_json(run_id, fingerprint.to_json(), FINGERPRINT_ARTIFACT)
    tracker.log_json(run_id, cfg.model_dump(mode="json"), "sweep_config.json")
    return run_id


def summary_from_run(summary: StudySummary, run) -> StudySummary:
    """``summary`` filled from a finished study run (``--resume`` of a sweep whose study was done, or a finished
    study of the experiment that the sweep reuses); its provenance names the run's sweep, end and fingerprint, so
    the end-of-sweep table tells a reused study from one of its own sweep."""
    summary = summary_from_values(summary, run.data.metrics, run.data.tags, run.data.params)
    tags = run.data.tags
    summary.provenance = Provenance(
        "mlflow",
        f"MLflow run {run.info.run_id}",
        iso_time(run.info.end_time or run.info.start_time),
        tags.get(HASH_TAG, ""),
        sweep=tags.get("sweep", ""),
        run_id=run.info.run_id,
    )
    return summary


def summary_from_study(study: Study) -> StudySummary:
    """A study of a results bundle (or of the report's reading of MLflow) as the sweep's summary of a study, its
    provenance (the bundle's URI and date, the study's fingerprint) kept."""
    summary = StudySummary(study_key(study.dataset, study.loss), study.dataset, study.loss, study.run_id, "ok")
    tags = {EPOCH0_TAG: str(study.best_at_epoch_0).lower(), "best_trial_id": study.best_trial}
    summary = summary_from_values(summary, study.metrics, tags, {f"best.{k}": v for k, v in study.best_params.items()})
    summary.provenance = Provenance.of_source(
        study.source,
        date=study.source_date,
        fingerprint=study.fingerprint.hash if study.fingerprint is not None else "",
        sweep=study.sweep,
        run_id=study.run_id,
    )
    return summary


def summary_from_values(summary: StudySummary, m: dict[str, float], tags: dict[str, str], params: dict[str, str]):
    """``summary`` filled from a finished study's metrics, tags and parameters (as its MLflow run holds them)."""
    summary.status = tags.get("status", "ok")
    summary.reason = tags.get("reason", "")
    summary.best_trial = tags.get("best_trial_id")
    summary.best_params = {k[5:]: v for k, v in params.items() if k.startswith("best.")}
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


def study_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The study run's ``cost.*``: the sum over its trials' and reproductions' Tune results (each the sum of its
    folds, :func:`pipelines.execution.folds.trial.fold_cost`); ``cost.diverged.*`` is the part spent on diverged trials,
    ``cost.pruned.*`` (only when some trial was pruned) the part spent on trials the scheduler stopped."""
    out = {f"cost.{k}": 0.0 for k in COST_KEYS}
    out.update({f"cost.diverged.{k}": 0.0 for k in COST_KEYS})
    if any(r.get("status") == "pruned" for r in rows):
        out.update({f"cost.pruned.{k}": 0.0 for k in COST_KEYS})
    for r in rows:
        for k in COST_KEYS:
            v = r.get(f"cost_{k}")
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[f"cost.{k}"] += v
                if r.get("status") in ("diverged", "pruned"):
                    out[f"cost.{r['status']}.{k}"] += v
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
