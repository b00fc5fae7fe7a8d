"""The studies ``dmlrc report`` reads from MLflow: each finished (dataset, loss) study run with its reproduction runs,
how its folds ended and its visuals, and the order every part of the report lists them in.

The run tree it reads is documented in ``docs/architecture.md`` ("MLflow tree").
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from pipelines.names import study_key
from pipelines.results.bounds import ON_BOUND_TAG, BoundHit, on_bound, params_from_descriptions, parse_tag
from pipelines.results.fingerprint import Fingerprint, fingerprint_of_tags
from pipelines.results.study_results import EPOCH0_TAG, iso_time
from pipelines.results.untrained import untrained_metrics_of
from pipelines.tracking.runs import search_all

__all__ = ["Study", "TRIAL_OBJECTIVE", "collect_studies", "collect_visuals", "grid", "ranked"]

#: the metric of a trial run that holds its objective (docs/protocol.md §Objective: the fold mean of val MAP@R)
TRIAL_OBJECTIVE = "val.map_at_r.mean"


@dataclass
class Study:
    """One (dataset, loss) study run and its reproduction runs."""

    run_id: str
    dataset: str
    loss: str
    metrics: dict[str, float]
    #: reproduction index → {"test.concat.map_at_r": ..., ...}
    reproductions: dict[int, dict[str, float]] = field(default_factory=dict)
    #: reproduction index → seed (pairing requires equal seeds)
    seeds: dict[int, str] = field(default_factory=dict)
    #: the study's ``visuals/`` artifacts (pipelines.results.visuals), if it has them: gallery/per_class (parsed JSON),
    #: gallery_png/map_png (bytes)
    visuals: dict[str, Any] = field(default_factory=dict)
    #: the winning trial's hyperparameters (the study run's ``best.<name>`` params)
    best_params: dict[str, str] = field(default_factory=dict)
    #: the ``sweep`` tag of the study run (fold runs are matched to it by ``sweep`` and ``study``)
    sweep: str = ""
    #: how its finished fold runs (trials' and reproductions') ended: ``folds``, ``improving`` (best validation at the
    #: last evaluation: still improving when the epoch cap ended it), ``epochs`` (mean epochs trained)
    training: dict[str, float] = field(default_factory=dict)
    #: every reproduction fold's best checkpoint at epoch 0 (the sweep's tag, pipelines.results.study_results)
    best_at_epoch_0: bool = False
    #: the untrained network's test metrics (``untrained.*`` of the study run, pipelines.results.untrained)
    untrained: dict[str, float] = field(default_factory=dict)
    #: the winning values on a bound of their searched range (pipelines.results.bounds)
    on_bound: list[BoundHit] = field(default_factory=list)
    #: the study's protocol fingerprint (pipelines.results.fingerprint); None for a run that predates them
    fingerprint: Fingerprint | None = None
    #: the winning trial's id (the study run's ``best_trial_id`` tag)
    best_trial: str = ""
    #: where the study comes from: "mlflow" (the experiment's own run) or "bundle <uri>" (a results bundle)
    source: str = "mlflow"
    #: when its source was written (ISO 8601, UTC): the study run's end, the bundle's ``created``, the records' last
    #: ``written``; "" when the source does not record it
    source_date: str = ""
    #: the search trials' objectives (fold-mean val MAP@R of each finished trial run, ``stage=trial``; a diverged trial
    #: counts as the 0 the protocol gives it; pruned trials left out), for the expected validation performance
    trial_values: list[float] = field(default_factory=list)

    def by_seed(self, key: str) -> dict[str, float]:
        """Reproduction seed → that reproduction's value of ``key`` (what paired tests pair on); a reproduction
        without a recorded seed pairs by its index."""
        return {self.seeds.get(i) or f"index {i}": r[key] for i, r in self.reproductions.items() if key in r}

    def cell(self, mode: str, metric: str) -> tuple[float, float, float]:
        key = f"test.{mode}.{metric}"
        get = self.metrics.get
        return get(f"{key}.mean", math.nan), get(f"{key}.ci_low", math.nan), get(f"{key}.ci_high", math.nan)


def collect_studies(client: MlflowClient, experiment: str) -> list[Study]:
    """Every finished study of ``experiment`` (newest first wins if a (dataset, loss) repeats)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = sorted(e.name for e in client.search_experiments())
        raise ValueError(
            f"--experiment: no MLflow experiment named {experiment!r} (have: {', '.join(known) or 'none'})"
        )
    studies: dict[tuple[str, str], Study] = {}
    for run in sorted(search_all(client, exp.experiment_id, "tags.stage = 'study'"), key=lambda r: -r.info.start_time):
        tags = run.data.tags
        key = (tags.get("dataset", "?"), tags.get("loss", "?"))
        if key in studies or not any(k.startswith("test.") for k in run.data.metrics):
            continue
        studies[key] = Study(
            run.info.run_id,
            key[0],
            key[1],
            dict(run.data.metrics),
            best_params={k[len("best.") :]: v for k, v in sorted(run.data.params.items()) if k.startswith("best.")},
            sweep=tags.get("sweep", ""),
            best_at_epoch_0=tags.get(EPOCH0_TAG) == "true",
            untrained=untrained_metrics_of(run.data.metrics),
            on_bound=_bound_hits(run),
            fingerprint=fingerprint_of_tags(tags),
            best_trial=tags.get("best_trial_id", ""),
            source_date=iso_time(run.info.end_time or run.info.start_time),
        )
    by_id = {s.run_id: s for s in studies.values()}
    for run in search_all(client, exp.experiment_id, "tags.stage = 'reproduction'"):
        study = by_id.get(run.data.tags.get("mlflow.parentRunId", ""))
        if study is None or "reproduction" not in run.data.tags:
            continue
        i = int(run.data.tags["reproduction"])
        study.reproductions[i] = {k: v for k, v in run.data.metrics.items() if k.startswith("test.")}
        study.seeds[i] = run.data.tags.get("seed", "")
    for run in search_all(client, exp.experiment_id, "tags.stage = 'trial'"):
        study = by_id.get(run.data.tags.get("mlflow.parentRunId", ""))
        value = run.data.metrics.get(TRIAL_OBJECTIVE)
        if study is None or run.data.tags.get("status") not in ("ok", "diverged") or value is None:
            continue
        if math.isfinite(value):
            study.trial_values.append(float(value))
    _collect_training(client, exp.experiment_id, list(studies.values()))
    return sorted(studies.values(), key=lambda s: (s.dataset, s.loss))


def _bound_hits(run) -> list[BoundHit]:
    """A study run's winning values on a bound: the sweep's tag, else (runs that predate it) recomputed from the
    logged ``space.<name>`` and ``best.<name>`` params."""
    if ON_BOUND_TAG in run.data.tags:
        return parse_tag(run.data.tags[ON_BOUND_TAG])
    params = run.data.params
    space = params_from_descriptions({k[len("space.") :]: v for k, v in params.items() if k.startswith("space.")})
    return on_bound(space, {k[len("best.") :]: v for k, v in params.items() if k.startswith("best.")})


def _collect_training(client: MlflowClient, experiment_id: str, studies: list[Study]) -> None:
    """Fill ``study.training`` from the finished fold runs: a fold whose best validation MAP@R came at its last
    evaluation (``best_epoch == epoch``) was still improving when the epoch cap stopped it; the others were stopped
    by ``patience`` (or peaked earlier)."""
    by_key = {(s.sweep, study_key(s.dataset, s.loss)): s for s in studies}
    folds: dict[int, list[tuple[float, float]]] = {}
    for run in search_all(client, experiment_id, "tags.stage = 'fold' and tags.status = 'ok'"):
        s = by_key.get((run.data.tags.get("sweep", ""), run.data.tags.get("study", "")))
        m = run.data.metrics
        if s is not None and "epoch" in m and "best_epoch" in m:
            folds.setdefault(id(s), []).append((m["epoch"], m["best_epoch"]))
    for s in studies:
        rows = folds.get(id(s))
        if rows:
            s.training = {
                "folds": len(rows),
                "improving": sum(1 for epoch, best in rows if best >= epoch),
                "epochs": float(np.mean([epoch for epoch, _ in rows])),
            }


_VISUALS = {
    "gallery": "visuals/gallery.json",
    "per_class": "visuals/per_class.json",
    "gallery_png": "visuals/gallery.png",
    "map_png": "visuals/embedding_map.png",
}


def collect_visuals(client: MlflowClient, studies: list[Study]) -> None:
    """Fill ``study.visuals`` from each study run's ``visuals/`` artifacts (absent for sweeps that predate them)."""
    for s in studies:
        if s.source != "mlflow":
            continue  # a bundle's study: its visuals stayed in its own experiment
        have = {a.path for a in client.list_artifacts(s.run_id, "visuals")}
        with tempfile.TemporaryDirectory() as tmp:
            for key, path in _VISUALS.items():
                if path not in have:
                    continue
                data = Path(client.download_artifacts(s.run_id, path, tmp)).read_bytes()
                s.visuals[key] = json.loads(data) if path.endswith(".json") else data


def grid(studies: list[Study]) -> tuple[list[str], list[str]]:
    """Datasets by name; losses ranked by their mean concatenated test MAP@R over the datasets (best first, ties and
    losses without the metric by name), so that a sweep of many losses reads as a ranking."""
    scores: dict[str, list[float]] = {}
    for s in studies:
        v = s.cell("concat", "map_at_r")[0]
        scores.setdefault(s.loss, [])
        if math.isfinite(v):
            scores[s.loss].append(v)
    rank = {loss: -float(np.mean(v)) if v else math.inf for loss, v in scores.items()}
    return sorted({s.dataset for s in studies}), sorted(scores, key=lambda loss: (rank[loss], loss))


def ranked(studies: list[Study]) -> list[Study]:
    """``studies`` by dataset, then in the losses' ranking (:func:`grid`)."""
    _, losses = grid(studies)
    order = {loss: i for i, loss in enumerate(losses)}
    return sorted(studies, key=lambda s: (s.dataset, order[s.loss]))
