"""Everything that can fail before Ray starts: load each dataset, cut its folds, build each loss once.

:func:`preflight` turns a validated :class:`~pipelines.config.SweepConfig` into one :class:`StudyPlan` per
(dataset, loss) — the unit the sweep optimises (MLRC §2.1: one Bayesian optimisation per loss per dataset).
Failures are :class:`~pipelines.config.ConfigError` naming the field: a missing dataset (``datasets[i].path``), too
few classes for the folds × batch (``datasets[i]``), a loss that cannot be built with its parameters
(``losses[j].params``), a batch that does not split across the DDP workers (``resources.workers_per_fold``).

No Ray, no MLflow here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.config import ConfigError, DatasetSpec, LossSpec, SweepConfig
from pipelines.spaces import LOSS_LR

__all__ = ["DatasetData", "StudyPlan", "load_table", "preflight", "batch_of", "study_key"]


@dataclass
class DatasetData:
    spec: DatasetSpec
    index: int
    table: Any  # dml_core.data.ImageTable or dml_core.shards.ShardedTable
    manifest: Any  # dml_core.splits.FoldManifest

    @property
    def num_classes(self) -> int:
        return int(len(np.unique(self.table.labels)))


@dataclass
class StudyPlan:
    """One (dataset, loss) study: what the trial drivers need besides the sampled hyperparameters."""

    dataset: DatasetData
    loss: LossSpec
    loss_index: int
    classes_per_batch: int
    m: int
    model_kwargs: dict[str, Any]
    searched: dict[str, Any] = field(default_factory=dict)  # name -> pipelines.spaces.Param
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return study_key(self.dataset.spec.name, self.loss.name)


def study_key(dataset: str, loss: str) -> str:
    """``<dataset>/<loss>``: the MLflow ``study`` tag and (with ':' made safe) the study's storage folder."""
    return f"{dataset}/{loss}"


def study_dirname(key: str) -> str:
    return key.replace("/", "__").replace(":", "-")


def load_table(spec: DatasetSpec, where: str):
    """The dataset's rows (engineer C's readers), its first ``spec.classes`` classes if set."""
    from dml_core import data

    try:
        if spec.kind == "synthetic":
            table = data.synthetic(spec.num_classes, spec.per_class, spec.image_size, spec.seed)
        else:
            if not spec.path.startswith("s3://") and not Path(spec.path).exists():
                raise ConfigError(f"{where}.path", f"{spec.path!r} does not exist (cwd {os.getcwd()})")
            if spec.kind == "omniglot":
                table = data.read_omniglot(spec.path)
            elif spec.kind == "folder":
                table = data.read_image_folder(spec.path)
            else:
                table = data.read_parquet_manifest(spec.path)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        field_name = f"{where}.path" if spec.kind != "synthetic" else where
        raise ConfigError(field_name, f"cannot read the {spec.kind} dataset: {e}") from None
    if spec.classes is not None:
        classes = np.unique(table.labels)
        if spec.classes > len(classes):
            raise ConfigError(f"{where}.classes", f"{spec.classes} > the dataset's {len(classes)} classes")
        table = table.subset(classes[: spec.classes])
    return table


def batch_of(cfg: SweepConfig, loss: LossSpec) -> tuple[int, int]:
    """``(classes_per_batch, m)``: ``protocol.train`` if set; else the protocol's shared batch (MLRC: 8 × 4 for
    every loss — the point of a fair comparison), or the loss paper's own batch with ``protocol.recipe: paper``."""
    from dml_core.losses import MLRC_BATCH, loss_info

    spec = loss_info(loss.name).batch if cfg.protocol.recipe == "paper" else MLRC_BATCH
    return (int(cfg.protocol.train.get("classes_per_batch", spec.classes_per_batch)),
            int(cfg.protocol.train.get("m", spec.m)))


def _check_loss_builds(cfg: SweepConfig, loss: LossSpec, where: str, num_classes: int) -> None:
    """Build the loss at its defaults + pinned params: unknown names and bad values fail here, not in a worker."""
    from dml_core.losses import build_loss

    values = {**loss.space.defaults(), **loss.params}
    kwargs = {k: v for k, v in values.items() if k != LOSS_LR}
    try:
        build_loss(loss.name, num_classes=num_classes, embedding_dim=cfg.model.embedding_dim, **kwargs)
    except (ValueError, TypeError) as e:
        unknown = [k for k in loss.params if k not in loss.space.params and k != LOSS_LR and k in str(e)]
        field_name = f"{where}.params.{unknown[0]}" if unknown else f"{where}.params"
        raise ConfigError(field_name, f"loss {loss.name!r} rejects its parameters: {e}") from None


def _check_model_fits(model_kwargs: dict, image_size: int, where: str) -> None:
    """K-max pooling needs K ≤ H·W of the trunk's feature map, which depends on the trunk and the image size:
    one forward pass of a blank batch here rather than an error in every fold's first evaluation."""
    import torch

    from dml_core.models import build_model

    if not str(model_kwargs["pooling"]).startswith("kmax"):
        return
    model = build_model(**{**model_kwargs, "pretrained": None}).eval()
    with torch.no_grad():
        try:
            model(torch.zeros(2, 3, image_size, image_size))
        except ValueError as e:
            raise ConfigError("model.pooling", f"{e} at {where}.image_size {image_size}") from None


def preflight(cfg: SweepConfig) -> list[StudyPlan]:
    """Load datasets, cut folds, check batches and build every loss; one :class:`StudyPlan` per (dataset, loss)."""
    from dml_core.losses import MLRC_MODEL, loss_info
    from dml_core.splits import FoldManifest

    from dml_core.train import TrainConfig

    try:
        TrainConfig(**cfg.protocol.train, iters_per_epoch=cfg.protocol.iters_per_epoch,
                    max_epochs=cfg.protocol.max_epochs, eval_every=cfg.protocol.eval_every,
                    patience=cfg.protocol.patience)
    except (TypeError, ValueError) as e:
        key = next((k for k in cfg.protocol.train if k in str(e)), None)
        raise ConfigError(f"protocol.train.{key}" if key else "protocol.train", str(e)) from None
    w = cfg.resources.workers_per_fold
    batches = {ls.name: batch_of(cfg, ls) for ls in cfg.losses}
    for j, ls in enumerate(cfg.losses):
        cpb, m = batches[ls.name]
        if (cpb * m) % w:
            raise ConfigError(
                "resources.workers_per_fold",
                f"{w} workers cannot split the global batch of losses[{j}] {ls.name!r}: "
                f"classes_per_batch × m = {cpb} × {m} = {cpb * m} is not divisible by {w}",
            )
    datasets: list[DatasetData] = []
    for i, spec in enumerate(cfg.datasets):
        where = f"datasets[{i}]"
        table = load_table(spec, where)
        need = max(batches.values())
        try:
            manifest = FoldManifest.from_labels(
                table.labels, cfg.protocol.folds, cfg.protocol.fold_layout, min_val_samples=2,
                min_train_classes=need[0],
            )
        except ValueError as e:
            n = len(np.unique(table.labels))
            worst = max(batches, key=lambda k: batches[k][0])
            raise ConfigError(
                where,
                f"{n} classes are too few for {cfg.protocol.folds} folds × batches of classes_per_batch × m = "
                f"{need[0]} × {need[1]} (loss {worst!r}): {e}",
            ) from None
        for fold in manifest.folds:
            if len(table.subset(fold.val_classes)) < w:
                raise ConfigError(where, f"fold {fold.index} has fewer val images than the {w} workers embedding them")
        if len(manifest.test_classes) < 2:
            raise ConfigError(where, f"only {len(manifest.test_classes)} test classes; need >= 2")
        datasets.append(DatasetData(spec, i, table, manifest))

    plans = []
    for d in datasets:
        n_train = min(len(f.train_classes) for f in d.manifest.folds)
        for j, ls in enumerate(cfg.losses):
            _check_loss_builds(cfg, ls, f"losses[{j}]", n_train)
            cpb, m = batches[ls.name]
            model_kwargs = cfg.model.kwargs(loss_info(ls.name).model if cfg.protocol.recipe == "paper" else MLRC_MODEL)
            _check_model_fits(model_kwargs, d.spec.image_size, f"datasets[{d.index}]")
            plans.append(StudyPlan(
                dataset=d, loss=ls, loss_index=j, classes_per_batch=cpb, m=m, model_kwargs=model_kwargs,
                searched=ls.searched(), fixed=ls.fixed(),
            ))
    return plans
