"""Models in MLflow's own format, registered; datasets as MLflow dataset inputs; the experiment's UI kind.

At the end of every study (:func:`register_study`, called by the sweep):

* each reproduction's 4 fold models become one MLflow **pyfunc model** (:mod:`pipelines.pyfunc_model`, a model
  from code + state-dict artifacts: nothing is unpickled), logged on the study run as ``reproduction_<i>``, with a
  signature (images ``(B, 3, S, S)`` float32 in, embeddings ``(B, 4·d)`` out, parameter ``output``);
* the study becomes **one version** of the registered model :func:`registered_model_name` =
  ``dmlrc.<experiment>.<dataset>.<loss>`` (characters outside ``[A-Za-z0-9_.-]`` become ``-``).  The version's
  source is reproduction 0's model; its tags carry everything a re-evaluation compares against
  (:data:`VERSION_TAGS`, and ``reproductions``: JSON list of ``{reproduction, seed, model_uri, metrics}``);
* the alias ``reality-check`` moves to that version (the latest sweep's).

Datasets: :func:`dataset_info` gives the MLflow dataset of a sweep dataset — digest = the first 32 hex digits of
the sha256 of the parquet manifest (canonical JSON), or of the synthetic generator's parameters — logged as a
dataset input on study runs (context ``trainval+test``) and fold runs (context ``train``).

UI: :func:`set_experiment_kind` tags the experiment ``mlflow.experimentKind = custom_model_development`` (the
value MLflow 3.17's UI reads, else it may open a new experiment on the GenAI overview), and the study run's
description (``mlflow.note.content``) is its headline test table, which the run page shows without any column set-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["registered_model_name", "dataset_info", "log_dataset_input", "log_fold_dataset_input",
           "register_study", "set_experiment_kind", "ALIAS", "VERSION_TAGS", "HEADLINE"]

ALIAS = "reality-check"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
HEADLINE = ("precision_at_1", "r_precision", "map_at_r")
MODES = ("concat", "separated")
#: Tags every registered version carries (besides the metric tags ``test.<mode>.<metric>.{mean,ci_low,ci_high}``).
VERSION_TAGS = ("sweep", "experiment", "study", "dataset", "loss", "study_run_id", "git_commit", "folds_hash",
                "dataset_digest", "dataset_uri", "seed", "seeds", "n_reproductions", "image_size", "reproductions")


def registered_model_name(experiment: str, dataset: str, loss: str) -> str:
    """``dmlrc.<experiment>.<dataset>.<loss>``, unsafe characters → ``-`` (``/`` would break ``models:/`` URIs)."""
    safe = lambda s: re.sub(r"[^A-Za-z0-9_.-]", "-", str(s))  # noqa: E731
    return f"dmlrc.{safe(experiment)}.{safe(dataset)}.{safe(loss)}"


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dataset_info(spec, table) -> dict[str, Any]:
    """``{name, digest (32 hex), sha256, uri, source, profile}`` of a sweep dataset (a ``DatasetSpec`` + its table)."""
    if spec.kind == "parquet":
        manifest = table.manifest
        full = _sha256_json(manifest)
        uri = spec.path
        profile = {"num_images": manifest["num_images"], "num_classes": len(manifest["classes"]),
                   "shards": len(manifest["shards"])}
    elif spec.kind == "synthetic":
        params = {"generator": "dml_core.data.synthetic", "num_classes": spec.num_classes,
                  "per_class": spec.per_class, "image_size": spec.image_size, "seed": spec.seed}
        full = _sha256_json(params)
        uri = "synthetic:" + json.dumps(params, sort_keys=True)
        profile = params
    else:  # omniglot zips / image folder: the rows' names and labels identify the content well enough
        h = hashlib.sha256(np.asarray(table.labels, dtype=np.int64).tobytes())
        for i in range(len(table)):
            h.update(table.row_name(i).encode())
        full, uri = h.hexdigest(), str(spec.path)
        profile = {"num_images": len(table), "num_classes": int(len(np.unique(table.labels)))}
    if spec.classes:
        profile["classes"] = spec.classes
    return {"name": spec.name, "digest": full[:32], "sha256": full, "uri": uri, "kind": spec.kind,
            "profile": profile}


def _dataset_entity(info: dict[str, Any]):
    from mlflow.data.meta_dataset import MetaDataset

    if info["kind"] == "synthetic":
        from mlflow.data.code_dataset_source import CodeDatasetSource

        source = CodeDatasetSource({"generator": info["uri"]})
    else:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "can be interpreted in multiple ways": both are the local source
            source = resolve_dataset_source(info["uri"])
    from mlflow.entities import Dataset

    ent = MetaDataset(source, name=info["name"], digest=info["digest"])._to_mlflow_entity()
    return Dataset(name=ent.name, digest=ent.digest, source_type=ent.source_type, source=ent.source,
                   schema=ent.schema, profile=json.dumps({**info["profile"], "sha256": info["sha256"]}))


#: Serialises this process's dataset logging: MLflow's SQL store looks a dataset up, then inserts it, so studies that
#: start at once on the same new dataset (threads of one driver) would race to the table's unique key.
_DATASET_LOCK = threading.Lock()


def log_dataset_input(client, run_id: str, info: dict[str, Any], context: str) -> None:
    """Log ``info`` as a dataset input of ``run_id`` (idempotent: MLflow dedups by (name, digest, context))."""
    from mlflow.entities import DatasetInput, InputTag

    with _DATASET_LOCK:
        client.log_inputs(run_id, datasets=[DatasetInput(_dataset_entity(info),
                                                         tags=[InputTag("mlflow.data.context", context)])])
    client.set_tag(run_id, "dataset_digest", info["sha256"])


_STUDY_DATASETS: dict[str, list] = {}


def log_fold_dataset_input(tracker, fold_run_id: str, study_run_id: str) -> None:
    """The study run's dataset input(s), logged on a fold run with context ``train`` (cached per study)."""
    from mlflow.entities import DatasetInput, InputTag

    if study_run_id not in _STUDY_DATASETS:
        run = tracker.client.get_run(study_run_id)
        _STUDY_DATASETS[study_run_id] = [d.dataset for d in (run.inputs.dataset_inputs if run.inputs else [])]
    datasets = _STUDY_DATASETS[study_run_id]
    if datasets:
        tracker.client.log_inputs(fold_run_id, datasets=[
            DatasetInput(d, tags=[InputTag("mlflow.data.context", "train")]) for d in datasets])


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's page on its training-runs view.  MLflow 3.17's UI keeps a per-browser GenAI / Model training
    switch (localStorage ``mlflow.workflowType``, GenAI by default) that the experiment kind tag does not override;
    the ``workflowType=machine_learning`` query parameter does, so this is the link to print and share."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def set_experiment_kind(client, experiment_id: str) -> None:
    """Open the experiment on the training-runs view in MLflow 3's UI (not the GenAI overview)."""
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


# ------------------------------------------------------------------------------------------------ models


def _read_fold_checkpoint(uri: str) -> dict[str, Any]:
    """``model.pt`` of a reproduction fold's Ray Train checkpoint (local path or s3://), weights-only."""
    import ray.train
    import torch

    with ray.train.Checkpoint(uri).as_directory() as d:
        path = Path(d) / "model.pt"
        if not path.exists():
            raise FileNotFoundError(f"no model.pt in fold checkpoint {uri}")
        return torch.load(path, map_location="cpu", weights_only=True)


def _signature(image_size: int, out_dim: int):
    from mlflow.models import ModelSignature
    from mlflow.types import ParamSchema, ParamSpec, Schema, TensorSpec

    return ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, image_size, image_size), "images")]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, out_dim), "embeddings")]),
        params=ParamSchema([ParamSpec("output", "string", "concatenated"), ParamSpec("batch_size", "long", 256)]))


def log_reproduction_model(run_id: str, reproduction: int, fold_checkpoints: list[str], image_size: int,
                           seed: int | None, *, tracker_uri: str) -> tuple[str, str]:
    """Log reproduction ``reproduction``'s fold models as a pyfunc model on ``run_id`` (tracking store
    ``tracker_uri``); return its ``models:/`` URI and model id."""
    import mlflow
    import torch

    from pipelines import pyfunc_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        artifacts, spec = {}, None
        for k, uri in enumerate(fold_checkpoints):
            ckpt = _read_fold_checkpoint(uri)
            torch.save(ckpt["model"], tmp / f"fold_{k}.pt")
            artifacts[pyfunc_model.fold_artifact(k)] = str(tmp / f"fold_{k}.pt")
            spec = spec or {"model_kwargs": ckpt["model_kwargs"], "loss": ckpt.get("loss_name")}
        spec.update({"folds": len(fold_checkpoints), "image_size": int(image_size),
                     "embedding_dim": int(spec["model_kwargs"].get("embedding_dim", 128)), "seed": seed,
                     "reproduction": reproduction})
        (tmp / pyfunc_model.EMBEDDER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        artifacts["embedder"] = str(tmp / pyfunc_model.EMBEDDER_FILE)
        with _fluent_tracking(tracker_uri), mlflow.start_run(run_id=run_id), warnings.catch_warnings():
            # the embedder's predict takes a tensor-shaped array; MLflow's hints about type hints and input
            # examples are for other kinds of models
            warnings.filterwarnings("ignore", message=".*(type hints|input example).*", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=f"reproduction_{reproduction}", python_model=pyfunc_model.__file__, artifacts=artifacts,
                signature=_signature(image_size, spec["folds"] * spec["embedding_dim"]),
                pip_requirements=["torch", "torchvision", "numpy", "mlflow"],
                tags={"reproduction": str(reproduction), "seed": str(seed)})
    return info.model_uri, info.model_id


@contextlib.contextmanager
def _fluent_tracking(uri: str):
    """``pyfunc.log_model`` only speaks MLflow's fluent API: point it at ``uri`` for the call alone, then restore the
    process's tracking URI and ``MLFLOW_TRACKING_URI`` (the driver may run further sweeps with other stores)."""
    import mlflow

    old_env, old = os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def _metric_tags(ci: dict[str, dict[str, tuple[float, float, float]]]) -> dict[str, str]:
    tags = {}
    for mode in MODES:
        for metric in HEADLINE:
            t = ci.get(mode, {}).get(metric)
            if t:
                for part, v in zip(("mean", "ci_low", "ci_high"), t):
                    tags[f"test.{mode}.{metric}.{part}"] = repr(float(v))
    return tags


def study_note(study: str, ci: dict, n: int) -> str:
    """The study run's description: its headline test metrics, shown on the run page without any set-up."""
    lines = [f"**{study}** — test metrics ×100 over {n} reproductions (mean, 95 % t-interval)", "",
             "| metric | concatenated | separated |", "|---|---|---|"]
    for metric in HEADLINE:
        cells = []
        for mode in MODES:
            t = ci.get(mode, {}).get(metric)
            if not t:
                cells.append("–")
            elif np.isfinite(t[1]):
                cells.append(f"{100 * t[0]:.2f} [{100 * t[1]:.2f}, {100 * t[2]:.2f}]")
            else:
                cells.append(f"{100 * t[0]:.2f}")
        lines.append(f"| {metric} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def register_study(tracker, *, study_run_id: str, experiment: str, sweep: str, plan, reps: list[dict[str, Any]],
                   ci: dict, say: Callable[[str], None] = print) -> str | None:
    """Log every reproduction's pyfunc model on the study run and register the study as one model version.

    ``reps``: the reproductions' Tune results (``fold_checkpoints``, ``seed``, ``__reproduction__``, ``test_*``).
    Returns ``"<name>/<version>"`` (None when no reproduction has fold checkpoints).
    """
    with _fluent_tracking(tracker.uri):  # MLflow resolves the logged models' URIs through the fluent store
        return _register_study(tracker, study_run_id=study_run_id, experiment=experiment, sweep=sweep, plan=plan,
                               reps=reps, ci=ci, say=say)


def _register_study(tracker, *, study_run_id: str, experiment: str, sweep: str, plan, reps: list[dict[str, Any]],
                    ci: dict, say: Callable[[str], None]) -> str | None:
    from mlflow.tracking import MlflowClient

    from pipelines.trial import REPRODUCTION

    client: MlflowClient = tracker.client
    run = client.get_run(study_run_id)
    tags = run.data.tags
    spec = plan.dataset.spec
    info = dataset_info(spec, plan.dataset.table)
    entries = []
    for rep in reps:
        if not rep.get("fold_checkpoints"):
            continue
        i = int(rep[REPRODUCTION])
        uri, model_id = log_reproduction_model(study_run_id, i, rep["fold_checkpoints"], spec.image_size, rep.get("seed"),
                                               tracker_uri=tracker.uri)
        entries.append({"reproduction": i, "seed": rep.get("seed"), "model_uri": uri, "model_id": model_id,
                        "metrics": {k.replace("_", ".", 2): float(v) for k, v in rep.items()
                                    if k.startswith("test_") and isinstance(v, (int, float))}})
    if not entries:
        return None
    name = registered_model_name(experiment, spec.name, plan.loss.name)
    try:
        client.create_registered_model(name, tags={"experiment": experiment, "dataset": spec.name,
                                                   "loss": plan.loss.name},
                                       description=f"Reality-check models of {plan.key} in experiment {experiment!r}: "
                                                   "one version per sweep (dmlrc sweep), re-evaluated by dmlrc reeval.")
    except Exception as e:  # noqa: BLE001 - it exists already (the error type differs between stores)
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    vtags = {"sweep": sweep, "experiment": experiment, "study": plan.key, "dataset": spec.name,
             "loss": plan.loss.name, "study_run_id": study_run_id, "git_commit": tags.get("git_commit", "unknown"),
             "folds_hash": tags.get("folds_hash", ""), "dataset_digest": info["sha256"], "dataset_uri": info["uri"],
             "seed": str(entries[0]["seed"]), "seeds": ",".join(str(e["seed"]) for e in entries),
             "n_reproductions": str(len(entries)), "image_size": str(spec.image_size),
             "reproductions": json.dumps(entries, sort_keys=True), **_metric_tags(ci)}
    mv = client.create_model_version(name, source=entries[0]["model_uri"], run_id=study_run_id, tags=vtags,
                                     model_id=entries[0]["model_id"],
                                     description=study_note(plan.key, ci, len(entries)))
    client.set_registered_model_alias(name, ALIAS, mv.version)
    client.set_tag(study_run_id, "registered_model", f"{name}/{mv.version}")
    say(f"[{plan.key}] registered {len(entries)} reproduction models as {name} version {mv.version} "
        f"(alias {ALIAS!r})")
    return f"{name}/{mv.version}"


def on_study_start(tracker, study_run_id: str, plan) -> None:
    """Hook at a study's start: the dataset input of the study run.  (The experiment kind is set once per sweep,
    before its studies start: concurrent studies setting the same experiment tag race in MLflow's SQL store —
    a unique-key violation on PostgreSQL.)"""
    log_dataset_input(tracker.client, study_run_id, dataset_info(plan.dataset.spec, plan.dataset.table),
                      "trainval+test")


def experiment_note(tracker) -> str:
    """The experiment's description: one row per study run with test metrics (shown above the runs table)."""
    from pipelines.tracking import search_all

    runs = search_all(tracker.client, tracker.experiment_id, "tags.stage = 'study'")
    lines = ["Reality-check studies — test metrics ×100, mean over reproductions (95 % t-intervals on each study "
             "run's page). Models: Models tab / registered models `dmlrc.<experiment>.<dataset>.<loss>`.", "",
             "| sweep | study | " + " | ".join(f"concat {m}" for m in HEADLINE) + " | registered model |",
             "|---|---|" + "---|" * (len(HEADLINE) + 1)]
    for r in sorted(runs, key=lambda r: (r.data.tags.get("sweep", ""), r.data.tags.get("study", ""))):
        m = r.data.metrics
        if "test.concat.map_at_r.mean" not in m:
            continue
        cells = [f"{100 * m[f'test.concat.{k}.mean']:.2f}" if f"test.concat.{k}.mean" in m else "–" for k in HEADLINE]
        lines.append(f"| {r.data.tags.get('sweep', '')} | {r.data.tags.get('study', '')} | " + " | ".join(cells)
                     + f" | {r.data.tags.get('registered_model', '–')} |")
    return "\n".join(lines) + "\n"


def on_study_end(tracker, *, study_run_id: str, experiment: str, sweep: str, plan, reps, ci,
                 say: Callable[[str], None] = print) -> str | None:
    """Hook at a study's end: the description tables (run, experiment) and the registered models."""
    tracker.set_tags(study_run_id, {NOTE_TAG: study_note(plan.key, ci, len(reps))})
    try:
        ref = register_study(tracker, study_run_id=study_run_id, experiment=experiment, sweep=sweep, plan=plan,
                             reps=reps, ci=ci, say=say)
    except Exception as e:  # noqa: BLE001 - the study's results are logged; a registry problem must not undo them
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        say(f"[{plan.key}] WARNING: models not registered ({reason})")
        tracker.set_tags(study_run_id, {"registered_model": f"failed: {reason}"})
        ref = None
    tracker.client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, experiment_note(tracker))
    return ref
