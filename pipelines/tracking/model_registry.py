"""Models in MLflow's own format, registered.

At the end of every study (:func:`register_study`, called by the sweep):

* each reproduction's 4 fold models become one MLflow **pyfunc model** (:mod:`pipelines.tracking.pyfunc_model`, a model
  from code + state-dict artifacts: nothing is unpickled), logged on the study run as ``reproduction_<i>``, with a
  signature (embeddings ``(B, 4·d)`` out, parameters ``output`` and ``batch_size``; no input schema: ``predict``
  takes encoded images, paths, arrays, PIL images or preprocessed tensors and checks them itself) and what it needs
  to load elsewhere (:mod:`pipelines.tracking.model_env`: the wheels of this package and of its plugins, requirements
  naming them by file and sha256);
* the study becomes **one version** of the registered model :func:`registered_model_name` =
  ``dmlrc.<experiment>.<dataset>.<loss>`` (characters outside ``[A-Za-z0-9_.-]`` become ``-``).  The version's
  source is reproduction 0's model; its tags carry everything a re-evaluation compares against
  (:data:`VERSION_TAGS`, and ``reproductions``: JSON list of ``{reproduction, seed, model_uri, metrics}``);
* the alias ``reality-check`` moves to that version (the latest sweep's).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import mlflow
import numpy as np
import ray.train
import torch
from mlflow.models import ModelSignature
from mlflow.types import ParamSchema, ParamSpec, Schema, TensorSpec

from dml_core.training.checkpoint import load_weights_only
from dml_core.trunks import trunk_preprocessing
from pipelines.names import ALIAS, HEADLINE_METRICS, MODES, REPRODUCTION
from pipelines.tracking import pyfunc_model
from pipelines.tracking.datasets import dataset_info, log_dataset_input
from pipelines.tracking.model_env import DISTRIBUTION, model_environment
from pipelines.tracking.ui import NOTE_TAG, experiment_note, study_note

__all__ = [
    "registered_model_name",
    "as_registered_name",
    "register_study",
    "log_reproduction_model",
    "on_study_start",
    "on_study_end",
    "fluent_tracking",
    "VERSION_TAGS",
    "DISTRIBUTION",
]

#: Tags every registered version carries (besides the metric tags ``test.<mode>.<metric>.{mean,ci_low,ci_high}``).
VERSION_TAGS = (
    "sweep",
    "experiment",
    "study",
    "dataset",
    "loss",
    "study_run_id",
    "git_commit",
    "folds_hash",
    "dataset_digest",
    "dataset_uri",
    "seed",
    "seeds",
    "n_reproductions",
    "image_size",
    "reproductions",
)


#: What a registered model name keeps; every other character becomes ``-`` (``/`` would break ``models:/`` URIs).
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def registered_model_name(experiment: str, dataset: str, loss: str) -> str:
    """``dmlrc.<experiment>.<dataset>.<loss>``, unsafe characters → ``-`` (``sec:triplet`` → ``sec-triplet``)."""
    return as_registered_name(f"dmlrc.{experiment}.{dataset}.{loss}")


def as_registered_name(name: str) -> str:
    """A model name as the user spells it, with the loss as the sweep config names it
    (``dmlrc.mlrc.cub200.sec:triplet``), as it is registered (``dmlrc.mlrc.cub200.sec-triplet``); a registered name
    is returned unchanged."""
    return _UNSAFE.sub("-", str(name))


# ------------------------------------------------------------------------------------------------ models


def _read_fold_checkpoint(uri: str) -> dict[str, Any]:
    """``model.pt`` of a reproduction fold's result (a warm fold's ``result/`` directory or a Ray Train checkpoint;
    local path or s3://), weights-only."""

    with ray.train.Checkpoint(uri).as_directory() as d:
        path = Path(d) / "model.pt"
        if not path.exists():
            raise FileNotFoundError(f"no model.pt in fold checkpoint {uri}")
        return load_weights_only(path)


def _signature(image_size: int, out_dim: int):
    """Outputs and parameters only: the input is one image or a batch of them in several forms (bytes, paths, uint8
    arrays, PIL images, a preprocessed float32 ``(B, 3, S, S)`` tensor), which no MLflow input schema can state;
    ``predict`` checks it (:func:`pipelines.tracking.pyfunc_model.as_batch`).  ``image_size``: the model's ``S``."""
    del image_size  # the input side is described by the model's metadata (``input``), not enforced by MLflow
    return ModelSignature(
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, out_dim), "embeddings")]),
        params=ParamSchema([ParamSpec("output", "string", "concatenated"), ParamSpec("batch_size", "long", 256)]),
    )


def log_reproduction_model(
    run_id: str, reproduction: int, fold_checkpoints: list[str], image_size: int, seed: int | None, *, tracker_uri: str
) -> tuple[str, str]:
    """Log reproduction ``reproduction``'s fold models as a pyfunc model on ``run_id`` (tracking store
    ``tracker_uri``); return its ``models:/`` URI and model id."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        artifacts: dict[str, str] = {}
        spec: dict[str, Any] = {}  # embedder.json: the first fold's model, then the reproduction's facts
        for k, uri in enumerate(fold_checkpoints):
            ckpt = _read_fold_checkpoint(uri)
            torch.save(ckpt["model"], tmp / f"fold_{k}.pt")
            artifacts[pyfunc_model.fold_artifact(k)] = str(tmp / f"fold_{k}.pt")
            # The fold state dicts hold every weight: a registered model never reads the trunk's pretrained file.
            spec = spec or {"model_kwargs": {**ckpt["model_kwargs"], "pretrained": None}, "loss": ckpt.get("loss_name")}
        environment = model_environment(spec["model_kwargs"]["trunk"])
        for key, wheel in environment.wheels.items():  # copies: MLflow records each artifact's source path
            (tmp / "wheels").mkdir(exist_ok=True)
            artifacts[key] = str(shutil.copy2(wheel, tmp / "wheels" / Path(wheel).name))
        spec.update(
            {
                "folds": len(fold_checkpoints),
                "image_size": int(image_size),
                "embedding_dim": int(spec["model_kwargs"].get("embedding_dim", 128)),
                "seed": seed,
                "reproduction": reproduction,
                "preprocessing": trunk_preprocessing(spec["model_kwargs"]["trunk"]).as_dict(),
            }
        )
        (tmp / pyfunc_model.EMBEDDER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        artifacts["embedder"] = str(tmp / pyfunc_model.EMBEDDER_FILE)
        with fluent_tracking(tracker_uri), mlflow.start_run(run_id=run_id), warnings.catch_warnings():
            # predict checks its own input (images in several forms); MLflow's hints about type hints and input
            # examples are for models whose input a schema can state
            warnings.filterwarnings("ignore", message=".*(type hints|input example).*", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=f"reproduction_{reproduction}",
                python_model=pyfunc_model.__file__,
                artifacts=artifacts,
                signature=_signature(image_size, spec["folds"] * spec["embedding_dim"]),
                pip_requirements=environment.requirements,
                code_paths=environment.code_paths or None,
                metadata={"input": pyfunc_model.INPUT_DESCRIPTION.format(size=int(image_size))},
                tags={"reproduction": str(reproduction), "seed": str(seed)},
            )
    return info.model_uri, info.model_id


@contextlib.contextmanager
def fluent_tracking(uri: str):
    """``pyfunc.log_model`` and ``models:/`` URIs only speak MLflow's fluent API: point it at ``uri`` for the block
    alone, then restore the process's tracking URI and ``MLFLOW_TRACKING_URI`` (which ``mlflow.set_tracking_uri``
    also sets: the driver may run further sweeps or re-evaluations with other stores)."""
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
        for metric in HEADLINE_METRICS:
            t = ci.get(mode, {}).get(metric)
            if t:
                for part, v in zip(("mean", "ci_low", "ci_high"), t):
                    tags[f"test.{mode}.{metric}.{part}"] = repr(float(v))
    return tags


def register_study(
    tracker,
    *,
    study_run_id: str,
    experiment: str,
    sweep: str,
    plan,
    reps: list[dict[str, Any]],
    ci: dict,
    say: Callable[[str], None] = print,
) -> str | None:
    """Log every reproduction's pyfunc model on the study run and register the study as one model version.

    ``reps``: the reproductions' Tune results (``fold_checkpoints``, ``seed``, ``__reproduction__``, ``test_*``).
    Returns ``"<name>/<version>"`` (None when no reproduction has fold checkpoints).
    """
    with fluent_tracking(tracker.uri):  # MLflow resolves the logged models' URIs through the fluent store
        return _register_study(
            tracker, study_run_id=study_run_id, experiment=experiment, sweep=sweep, plan=plan, reps=reps, ci=ci, say=say
        )


def _register_study(
    tracker,
    *,
    study_run_id: str,
    experiment: str,
    sweep: str,
    plan,
    reps: list[dict[str, Any]],
    ci: dict,
    say: Callable[[str], None],
) -> str | None:
    client = tracker.client
    run = client.get_run(study_run_id)
    tags = run.data.tags
    spec = plan.dataset.spec
    info = dataset_info(spec, plan.dataset.table)
    entries = []
    for rep in reps:
        if not rep.get("fold_checkpoints"):
            continue
        i = int(rep[REPRODUCTION])
        uri, model_id = log_reproduction_model(
            study_run_id, i, rep["fold_checkpoints"], spec.image_size, rep.get("seed"), tracker_uri=tracker.uri
        )
        entries.append(
            {
                "reproduction": i,
                "seed": rep.get("seed"),
                "model_uri": uri,
                "model_id": model_id,
                "metrics": {
                    k.replace("_", ".", 2): float(v)
                    for k, v in rep.items()
                    if k.startswith("test_") and isinstance(v, (int, float))
                },
            }
        )
    if not entries:
        return None
    name = registered_model_name(experiment, spec.name, plan.loss.name)
    try:
        client.create_registered_model(
            name,
            tags={"experiment": experiment, "dataset": spec.name, "loss": plan.loss.name},
            description=f"Reality-check models of {plan.key} in experiment {experiment!r}: "
            "one version per sweep (dmlrc sweep), re-evaluated by dmlrc reeval.",
        )
    except Exception as e:  # it exists already (the error type differs between stores)
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    vtags = {
        "sweep": sweep,
        "experiment": experiment,
        "study": plan.key,
        "dataset": spec.name,
        "loss": plan.loss.name,
        "study_run_id": study_run_id,
        "git_commit": tags.get("git_commit", "unknown"),
        "folds_hash": tags.get("folds_hash", ""),
        "dataset_digest": info["sha256"],
        "dataset_uri": info["uri"],
        "seed": str(entries[0]["seed"]),
        "seeds": ",".join(str(e["seed"]) for e in entries),
        "n_reproductions": str(len(entries)),
        "image_size": str(spec.image_size),
        "reproductions": json.dumps(entries, sort_keys=True),
        **_metric_tags(ci),
    }
    mv = client.create_model_version(
        name,
        source=entries[0]["model_uri"],
        run_id=study_run_id,
        tags=vtags,
        model_id=entries[0]["model_id"],
        description=study_note(plan.key, ci, len(entries)),
    )
    client.set_registered_model_alias(name, ALIAS, mv.version)
    client.set_tag(study_run_id, "registered_model", f"{name}/{mv.version}")
    say(f"[{plan.key}] registered {len(entries)} reproduction models as {name} version {mv.version} (alias {ALIAS!r})")
    return f"{name}/{mv.version}"


def on_study_start(tracker, study_run_id: str, plan) -> None:
    """Hook at a study's start: the dataset input of the study run.  (The experiment kind is set once per sweep,
    before its studies start: concurrent studies setting the same experiment tag race in MLflow's SQL store —
    a unique-key violation on PostgreSQL.)"""
    log_dataset_input(
        tracker.client, study_run_id, dataset_info(plan.dataset.spec, plan.dataset.table), "trainval+test"
    )


def on_study_end(
    tracker, *, study_run_id: str, experiment: str, sweep: str, plan, reps, ci, say: Callable[[str], None] = print
) -> str | None:
    """Hook at a study's end: the description tables (run, experiment) and the registered models."""
    tracker.set_tags(study_run_id, {NOTE_TAG: study_note(plan.key, ci, len(reps))})
    try:
        ref = register_study(
            tracker, study_run_id=study_run_id, experiment=experiment, sweep=sweep, plan=plan, reps=reps, ci=ci, say=say
        )
    except Exception as e:  # the study's results are logged; a registry problem must not undo them
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        say(f"[{plan.key}] WARNING: models not registered ({reason})")
        tracker.set_tags(study_run_id, {"registered_model": f"failed: {reason}"})
        ref = None
    tracker.client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, experiment_note(tracker))
    return ref
