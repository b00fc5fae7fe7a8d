"""The protocol fingerprint of a study, built from the sweep's config and the study's plan.

The fields (:mod:`pipelines.results.fingerprint`, which holds the record and how it is compared): the dataset's content,
class split and folds and what an image goes through; the network with its pretrained weights' hash; the protocol
(search, budget, folds); the resolved training recipe; the reproduction seeds; the metric code's version.  Only the
sweep builds fingerprints (here, with the dataset, torch and MLflow its driver holds); the report only reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from dml_core.data import eval_transform, train_transform
from dml_core.evaluation.metrics import METRICS_VERSION
from dml_core.trunks import trunk_preprocessing
from dml_core.trunks.weights import local_weights
from pipelines.config.schema import SweepConfig
from pipelines.execution.preflight.study_plans import StudyPlan, study_train_config
from pipelines.names import reproduction_seed
from pipelines.results.fingerprint import Fingerprint
from pipelines.tracking.datasets import dataset_info

__all__ = ["study_fingerprint", "study_fingerprints"]

#: TrainConfig fields that belong to the loss or the process, not to the protocol: a loss's own learning rate and
#: weight decay are searched or set per loss; the seed is recorded as the reproduction seeds; the device is where a
#: fold ran.
_NOT_PROTOCOL_TRAIN = frozenset({"loss_lr", "loss_weight_decay", "seed", "device"}) | frozenset(
    # how fast, not what: the evaluation batch, DataLoader processes and the memory layout leave the results as
    # they are (within float rounding), so a run on other hardware stays comparable
    {"eval_batch_size", "num_workers", "channels_last"}
    # the machine's numerics: bf16 where the CPU has it ("auto"), within the seeds' noise; each fold records its own
    | {"cpu_amp"}
)


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _weights_hash(pretrained: str | None, trunk: str) -> str | None:
    """sha256 of the pretrained weights file (a local copy of an s3:// file), or None without one."""
    if pretrained is None:
        return None
    with local_weights(pretrained, trunk) as path:
        return None if path is None else _sha256_file(path)


def _train_fields(cfg: SweepConfig, plan: StudyPlan) -> dict[str, Any]:
    """The resolved training recipe and budget of the study's folds: TrainConfig with the protocol's values, its
    defaults where the config is silent, so that a value written out and the same value left unset agree."""
    resolved = dataclasses.asdict(study_train_config(cfg, plan))
    if cfg.protocol.recipe == "paper":  # each loss has its own batch (the recipe says so), unless the config sets one
        for k in ("classes_per_batch", "m"):
            resolved[k] = cfg.protocol.train.get(k, "the loss paper's")
    in_protocol = set(cfg.protocol.model_dump())  # iters_per_epoch, max_epochs, ...: recorded as protocol.<name>
    return {
        f"protocol.train.{k}": v
        for k, v in sorted(resolved.items())
        if k not in _NOT_PROTOCOL_TRAIN and k not in in_protocol
    }


def _protocol_fields(cfg: SweepConfig) -> dict[str, Any]:
    """The protocol section (search, budget, folds), the training recipe aside; its seed is recorded as the
    reproduction seeds."""
    doc = cfg.protocol.model_dump(mode="json")
    doc.pop("train", None)
    doc.pop("seed", None)
    return {f"protocol.{k}": v for k, v in sorted(doc.items())}


def _model_fields(cfg: SweepConfig, plan: StudyPlan) -> dict[str, Any]:
    """The network: the study's resolved model, or with ``recipe: paper`` the config's (each loss its paper's model
    is then the recipe both studies share)."""
    kwargs = cfg.model.kwargs() if cfg.protocol.recipe == "paper" else dict(plan.model_kwargs)
    pretrained = kwargs.pop("pretrained", None)
    out = {f"model.{k}": v for k, v in sorted(kwargs.items())}
    out["model.pretrained_sha256"] = _weights_hash(pretrained, kwargs["trunk"])
    return out


def _content_sha256(plan: StudyPlan) -> str:
    """The dataset's content: prepared shards by their images (the same wherever and however they were prepared),
    other kinds by the MLflow dataset digest (a generator's parameters, or the rows' names and labels)."""
    table = plan.dataset.table
    if hasattr(table, "content_sha256"):
        return table.content_sha256()
    return dataset_info(plan.dataset.spec, table)["sha256"]


def _data_fields(plan: StudyPlan) -> dict[str, Any]:
    """The dataset's content, its class split and folds, and what an image goes through."""
    spec, manifest = plan.dataset.spec, plan.dataset.manifest
    prep = trunk_preprocessing(plan.model_kwargs["trunk"])
    return {
        "dataset.name": spec.name,
        "dataset.content_sha256": _content_sha256(plan),
        "dataset.classes": spec.classes,
        "split.fold_layout": manifest.layout,
        "split.folds_sha256": manifest.content_hash,  # the trainval/test split and every fold's classes
        "split.trainval_classes": len(manifest.trainval_classes),
        "split.test_classes": len(manifest.test_classes),
        "image.size": spec.image_size,
        "image.train_transform": repr(train_transform(spec.image_size, prep)),
        "image.eval_transform": repr(eval_transform(spec.image_size, prep)),
    }


def study_fingerprints(cfg: SweepConfig, plans: list[StudyPlan]) -> dict[str, Fingerprint]:
    """Study key → its fingerprint, for every plan (each dataset's content hashed once)."""
    data: dict[int, dict[str, Any]] = {}
    out = {}
    for plan in plans:
        if plan.dataset.index not in data:
            data[plan.dataset.index] = _data_fields(plan)
        out[plan.key] = study_fingerprint(cfg, plan, data[plan.dataset.index])
    return out


def study_fingerprint(cfg: SweepConfig, plan: StudyPlan, data: dict[str, Any] | None = None) -> Fingerprint:
    """The protocol fingerprint of ``plan``'s study under ``cfg`` (module docstring); ``data``: its dataset's fields
    when already known."""
    base = cfg.protocol.seed if cfg.protocol.seed is not None else cfg.seed
    fields: dict[str, Any] = {
        **(data if data is not None else _data_fields(plan)),
        **_model_fields(cfg, plan),
        **_protocol_fields(cfg),
        **_train_fields(cfg, plan),
        # their count is protocol.reproductions
        "reproduction.seeds": [reproduction_seed(base, i) for i in range(cfg.protocol.reproductions)],
        "metrics.version": METRICS_VERSION,
    }
    # JSON's own types only (tuples → lists ...), so that a fingerprint read back from JSON compares equal
    return Fingerprint(json.loads(json.dumps(fields, default=str)))
