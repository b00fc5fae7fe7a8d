"""The typed records a fold crosses process boundaries with: :class:`FoldConfig` (what a trial's driver hands to the
fold's Ray task or Ray Train workers; what all folds of a study share is its base, :class:`FoldStudyPart`) and
:class:`FoldOutcome` (what rank 0 writes as ``outcome.json`` and the driver reads back).  All are plain dataclasses:
picklable for Ray, and cheap to import — a search trial's driver loads no torch (tests/test_lean_imports.py).

``outcome.json`` keeps its format: :meth:`FoldOutcome.to_json` writes the same keys in the same order as before (fields
added since come last), and :meth:`FoldOutcome.from_json` reads files written by earlier versions (fields added since
have defaults)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dml_core.training.config import TrainConfig

__all__ = ["FoldClasses", "FoldConfig", "FoldOutcome", "FoldStudyPart", "s3_uri"]


def s3_uri(filesystem, path: str) -> str:
    """``path`` on a pyarrow ``filesystem`` as a URI that opens anywhere: ``s3://bucket/key`` on S3 (pyarrow's paths
    drop the scheme), else the local path unchanged."""
    if filesystem is not None and "s3" in filesystem.type_name:
        return "s3://" + path.lstrip("/")
    return path


@dataclass(frozen=True)
class FoldClasses:
    """One fold of the manifest, as a fold's process needs it."""

    index: int  # the fold's number in the study's fold manifest
    train_classes: tuple[Any, ...]  # class labels the fold trains on
    val_classes: tuple[Any, ...]  # class labels it validates on (best checkpoint, early stopping)

    def as_dict(self) -> dict[str, Any]:
        """The fold as stored in ``model.pt`` (``"fold"``): index and class lists."""
        return {"index": self.index, "train_classes": list(self.train_classes), "val_classes": list(self.val_classes)}


@dataclass(frozen=True, kw_only=True)  # keywords only: a default in the base may come first
class FoldStudyPart:
    """What every fold of one study gets alike: the data, model, loss and tracking it trains with (built from the
    study's context by ``pipelines.execution.folds.trial._study_part``).  :class:`FoldConfig` extends it with what
    differs per fold and trial, so a field of the study's part is declared once and reaches every fold as it is."""

    table_ref: list  # [ObjectRef of the study's dataset table] (a list: Ray passes it on unresolved)
    test_classes: tuple[Any, ...]  # the study's test classes (evaluated by reproductions only)
    image_size: int  # the dataset's input size for the train and eval transforms
    model: dict[str, Any]  # keyword arguments of dml_core.models.build_model
    loss: str  # loss name, as dml_core.losses.build_loss takes it
    use_gpu: bool  # the fold trains on a GPU Ray assigned
    threads: int  # torch threads per worker process (the worker's CPUs)
    tracking_uri: str  # the MLflow tracking URI (absolute)
    experiment_id: str  # the sweep's MLflow experiment
    mid_fold_resume: bool  # a restarted fold continues from its last checkpoint
    label: str  # the study, "<dataset>/<loss>", for progress lines

    def study_values(self) -> dict[str, Any]:
        """The study's part by field name, for a :class:`FoldConfig` built on it; shallow, so the table reference
        is passed on, never copied (``dataclasses.asdict`` would deep-copy it)."""
        return {f.name: getattr(self, f.name) for f in fields(FoldStudyPart)}


@dataclass(frozen=True, kw_only=True)  # keywords only: a default in the base may come first
class FoldConfig(FoldStudyPart):
    """Everything one fold's training needs (built by ``pipelines.execution.folds.trial``, run by
    ``pipelines.execution.folds.fold.run_fold`` on every rank): the study's part (:class:`FoldStudyPart`) and the fields
    below, which differ per fold and trial."""

    fold: FoldClasses  # the fold's index and classes
    loss_params: dict[str, Any]  # the loss's parameters (fixed and searched; loss_lr excluded)
    train: TrainConfig  # the fold's training settings, its seed included (the device is set where the fold runs)
    fold_run_id: str  # the fold's MLflow run, where rank 0 logs every evaluation
    fold_run_tags: dict[str, Any]  # the tags that find the fold run again (a replacement run gets them too)
    fold_run_extra_tags: dict[str, Any]  # further tags of a replacement run (loss, dataset, trial id)
    parent_run_id: str  # the trial's or reproduction's run, the fold run's parent
    evaluate_test: bool  # embed the test classes with the best model (reproductions)
    save_model: bool  # store the best model state as model.pt (reproductions)
    checkpoint_uri: str | None = None  # the fold's mid-fold checkpoint directory (set where the fold runs)

    def with_checkpoint_uri(self, uri: str) -> FoldConfig:
        """This configuration with its checkpoint directory set, unless it already has one."""
        return self if self.checkpoint_uri else replace(self, checkpoint_uri=uri)


@dataclass
class FoldOutcome:
    """A finished fold's result, ``outcome.json`` in its result directory (written by rank 0, ``outcome.json``
    last: a directory holding it is complete)."""

    fold: int  # the fold's index
    status: str  # "ok", or "diverged" (a non-finite loss)
    reason: str = ""  # why it diverged
    best_epoch: int = 0  # the epoch of the best checkpoint (0: the untrained network)
    best_metrics: dict[str, float] = field(default_factory=dict)  # val metrics of the best checkpoint (finite)
    iterations: int = 0  # iterations trained
    epochs: int = 0  # epochs trained
    stopped_early: bool = False  # training ended by patience, before max_epochs
    train_seconds: float = 0.0  # train_fold's own time
    time_start: float = 0.0  # the fold function started (s since the epoch)
    time_train_start: float | None = None  # train_fold started (absent in early files: time_start)
    time_end: float = 0.0  # the fold function ended
    world_size: int = 1  # workers of the fold (DDP ranks)
    pid: int | str = ""  # rank 0's process id
    node_id: str = ""  # rank 0's Ray node
    device: str = ""  # rank 0's torch device
    rss_peak_mb: float | None = None  # rank 0's peak resident memory
    restarts: int = 0  # process restarts of the fold
    resumed_from: list[int] = field(default_factory=list)  # the iteration each restart continued from
    redone_iterations: int = 0  # iterations trained twice because of restarts
    history: list[dict[str, Any]] = field(default_factory=list)  # every evaluation: epoch, iteration, loss, metrics
    test_metrics: dict[str, float] | None = None  # the best model alone on the test classes (reproductions)
    cpu_seconds: float | None = None  # CPU time of the fold's process (and its reaped children) in the fold function
    # what the fold trained in (dml_core.training.loop.FoldResult.numerics), e.g. "bf16+channels_last"
    numerics: str = ""
    cpu_model: str = ""  # the CPU of the fold's machine (dml_core.training.numerics.cpu_model)

    def as_dict(self) -> dict[str, Any]:
        """``outcome.json``'s document; ``test_metrics`` only where the test classes were evaluated."""
        doc = asdict(self)
        if doc["test_metrics"] is None:
            del doc["test_metrics"]
        return doc

    def to_json(self) -> str:
        """``outcome.json``'s text."""
        return json.dumps(self.as_dict())

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> FoldOutcome:
        known = {f.name for f in fields(cls)}
        out = cls(**{k: v for k, v in doc.items() if k in known})
        if out.time_train_start is None:
            out.time_train_start = out.time_start
        return out

    @classmethod
    def from_json(cls, text: str) -> FoldOutcome:
        """An ``outcome.json`` of this or an earlier version (keys it does not know are ignored)."""
        return cls.from_dict(json.loads(text))
