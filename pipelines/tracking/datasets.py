"""Sweep datasets as MLflow dataset inputs (``mlflow.data``).

:func:`dataset_info` gives the MLflow dataset of a sweep dataset — digest = the first 32 hex digits of the sha256 of
the parquet manifest (canonical JSON), or of the synthetic generator's parameters — logged as a dataset input on
study runs (context ``trainval+test``) and fold runs (context ``train``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
from typing import Any

import numpy as np
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Dataset, DatasetInput, InputTag

__all__ = ["dataset_info", "log_dataset_input", "log_fold_dataset_input"]


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dataset_info(spec, table) -> dict[str, Any]:
    """``{name, digest (32 hex), sha256, uri, source, profile}`` of a sweep dataset (a ``DatasetSpec`` + its table)."""
    if spec.kind == "parquet":
        manifest = table.manifest
        full = _sha256_json(manifest)
        uri = spec.path
        profile = {
            "num_images": manifest["num_images"],
            "num_classes": len(manifest["classes"]),
            "shards": len(manifest["shards"]),
        }
    elif spec.kind == "synthetic":
        params = {
            "generator": "dml_core.data.synthetic",
            "num_classes": spec.num_classes,
            "per_class": spec.per_class,
            "image_size": spec.image_size,
            "seed": spec.seed,
        }
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
    return {"name": spec.name, "digest": full[:32], "sha256": full, "uri": uri, "kind": spec.kind, "profile": profile}


def _dataset_entity(info: dict[str, Any]) -> Dataset:
    source: DatasetSource
    if info["kind"] == "synthetic":
        source = CodeDatasetSource({"generator": info["uri"]})
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "can be interpreted in multiple ways": both are the local source
            source = resolve_dataset_source(info["uri"])

    # mlflow marks Dataset.profile abstract, but Dataset is no ABC and MetaDataset (its documented concrete class)
    # leaves profile out
    meta = MetaDataset(source, name=info["name"], digest=info["digest"])  # type: ignore[abstract]
    ent = meta._to_mlflow_entity()
    return Dataset(
        name=ent.name,
        digest=ent.digest,
        source_type=ent.source_type,
        source=ent.source,
        schema=ent.schema,
        profile=json.dumps({**info["profile"], "sha256": info["sha256"]}),
    )


#: Serialises this process's dataset logging: MLflow's SQL store looks a dataset up, then inserts it, so studies that
#: start at once on the same new dataset (threads of one driver) would race to the table's unique key.
_DATASET_LOCK = threading.Lock()


def log_dataset_input(client, run_id: str, info: dict[str, Any], context: str) -> None:
    """Log ``info`` as a dataset input of ``run_id`` (idempotent: MLflow dedups by (name, digest, context))."""
    with _DATASET_LOCK:
        client.log_inputs(
            run_id, datasets=[DatasetInput(_dataset_entity(info), tags=[InputTag("mlflow.data.context", context)])]
        )
    client.set_tag(run_id, "dataset_digest", info["sha256"])


_STUDY_DATASETS: dict[str, list] = {}


def log_fold_dataset_input(tracker, fold_run_id: str, study_run_id: str) -> None:
    """The study run's dataset input(s), logged on a fold run with context ``train`` (cached per study)."""
    if study_run_id not in _STUDY_DATASETS:
        run = tracker.client.get_run(study_run_id)
        _STUDY_DATASETS[study_run_id] = [d.dataset for d in (run.inputs.dataset_inputs if run.inputs else [])]
    datasets = _STUDY_DATASETS[study_run_id]
    if datasets:
        tracker.client.log_inputs(
            fold_run_id, datasets=[DatasetInput(d, tags=[InputTag("mlflow.data.context", "train")]) for d in datasets]
        )
