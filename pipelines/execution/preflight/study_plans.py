"""Everything that can fail before Ray starts: load each dataset, cut its folds, build each loss once.

:func:`preflight` turns a validated :class:`~pipelines.config.SweepConfig` into one :class:`StudyPlan` per
(dataset, loss) — the unit the sweep optimises (docs/protocol.md §Search: one Bayesian optimisation per loss per
dataset).  Failures are :class:`~pipelines.config.ConfigError` naming the field: storage or a sqlite tracking DB that
cannot be written (``storage``, ``tracking.uri``), a missing or unreadable dataset (``datasets[i].path``, naming the
file), an image row whose header does not parse (``datasets[i].path``), too few classes for the folds × batch
(``datasets[i]``), a loss that cannot be built with its parameters (``losses[j].params``), a batch that does not
split across the DDP workers (``resources.workers_per_fold``), a ``model.pretrained`` file that is not a state
dict of the trunk, GPUs asked for where there are none (``resources.use_gpu``), a ``runtime_env`` folder over Ray's
upload limit (:func:`check_package_sizes`, by Ray's own packaging rules).  Nothing is written here: the
checks only read, so a failing config leaves no folder and no MLflow experiment behind.

No Ray started and no MLflow here: of Ray only its packaging rules are read (the resources are checked against
Ray's by :mod:`pipelines.execution.runtime.resources`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dml_core.losses import build_loss, check_plugin_losses, loss_info
from dml_core.models import build_model
from dml_core.protocol import MLRC_BATCH, MLRC_MODEL
from dml_core.splits import FoldManifest
from dml_core.training.config import TrainConfig
from pipelines.config.schema import TRAIN_KEYS, ConfigError, LossSpec, SweepConfig
from pipelines.config.spaces import LOSS_LR, Param
from pipelines.execution.preflight.datasets import DatasetData, check_image_rows, load_table, one_line
from pipelines.execution.preflight.locations import check_locations
from pipelines.names import study_key

__all__ = ["StudyPlan", "study_train_config", "preflight", "batch_of", "check_pretrained", "check_package_sizes"]


@dataclass
class StudyPlan:
    """One (dataset, loss) study: what the trial drivers need besides the sampled hyperparameters."""

    dataset: DatasetData
    loss: LossSpec
    loss_index: int
    classes_per_batch: int
    m: int
    model_kwargs: dict[str, Any]
    searched: dict[str, Param] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return study_key(self.dataset.spec.name, self.loss.name)


def study_train_config(cfg: SweepConfig, plan: StudyPlan | None = None) -> TrainConfig:
    """The :class:`~dml_core.training.config.TrainConfig` every fold of ``plan``'s study starts from: ``protocol.train``
    with the protocol's schedule and the study's batch (without a plan, ``protocol.train``'s own batch or
    TrainConfig's).  A fold then sets its seed and the loss's own learning rate; a calibration shortens the
    schedule; the study's fingerprint records it.  One definition, so that each of them means the same folds."""
    p = cfg.protocol
    train = dict(p.train)
    if plan is not None:
        train.update(classes_per_batch=plan.classes_per_batch, m=plan.m)
    return TrainConfig(
        **train,
        iters_per_epoch=p.iters_per_epoch,
        max_epochs=p.max_epochs,
        eval_every=p.eval_every,
        patience=p.patience,
    )


def batch_of(cfg: SweepConfig, loss: LossSpec) -> tuple[int, int]:
    """``(classes_per_batch, m)``: ``protocol.train`` if set; else the protocol's shared batch (MLRC: 8 × 4 for
    every loss — the point of a fair comparison), or the loss paper's own batch with ``protocol.recipe: paper``."""
    spec = loss_info(loss.name).batch if cfg.protocol.recipe == "paper" else MLRC_BATCH
    return (
        int(cfg.protocol.train.get("classes_per_batch", spec.classes_per_batch)),
        int(cfg.protocol.train.get("m", spec.m)),
    )


def _check_loss_builds(cfg: SweepConfig, loss: LossSpec, where: str, num_classes: int, batch: tuple[int, int]) -> None:
    """Build the loss at its defaults and at each bound of its search space (pinned params applied): unknown names,
    parameters the factory does not take and values it refuses fail here, not in a worker.  The loss built at its
    defaults is then called once on a batch of the study's shape (:func:`_check_loss_value`)."""
    space = loss.search_space
    for label, values in space.corners():
        kwargs = {k: v for k, v in {**values, **loss.params}.items() if k != LOSS_LR}
        try:
            with warnings.catch_warnings():  # a loss's warnings about a bound the user did not pick: not here
                if label != "defaults":
                    warnings.simplefilter("ignore")
                built = build_loss(loss.name, num_classes=num_classes, embedding_dim=cfg.model.embedding_dim, **kwargs)
        except (Exception, SystemExit) as e:  # a plugin may raise anything: one line naming the field
            if loss_info(loss.name).origin == "builtin" and not isinstance(e, (ValueError, TypeError)):
                raise
            text = " ".join(str(e).split()) or type(e).__name__
            if not isinstance(e, (ValueError, TypeError)):
                text = f"{type(e).__name__}: {text}"
            raise ConfigError(
                _param_field(loss, where, text), f"loss {loss.name!r} rejects its parameters ({label}): {text}"
            ) from None
        if label == "defaults":
            _check_loss_value(built, loss.name, f"{where}.name", cfg.model.embedding_dim, batch)


def _check_loss_value(built, name: str, field: str, embedding_dim: int, batch: tuple[int, int]) -> None:
    """Call the loss once, as training does, on one batch of the study's shape (``classes_per_batch × m`` random
    embeddings, ``m`` per class): it must return a finite scalar tensor that carries a gradient back to the
    embeddings.  A vector, a detached tensor or a Python number would otherwise fail inside every fold."""
    classes_per_batch, m = batch
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(classes_per_batch * m, embedding_dim, generator=g).requires_grad_()
    labels = torch.arange(classes_per_batch).repeat_interleave(m)
    what = f"loss {name!r} on a batch of {classes_per_batch} classes × {m} images"
    try:
        with warnings.catch_warnings():
            # a loss that returns float(tensor) makes torch warn first; the line below says what is wrong instead
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
            value = built(emb, labels)
    except (Exception, SystemExit) as e:  # a plugin may raise anything: one line naming the field
        raise ConfigError(field, f"{what} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    if not torch.is_tensor(value):
        raise ConfigError(
            field,
            f"{what} returned a {type(value).__name__}, not a tensor (a loss returns a scalar "
            "tensor that training can back-propagate)",
        )
    if value.dim() != 0:
        raise ConfigError(
            field,
            f"{what} returned a tensor of shape {tuple(value.shape)}, not a scalar (reduce it, e.g. with .mean())",
        )
    if not value.requires_grad:
        raise ConfigError(
            field,
            f"{what} returned a tensor without a gradient (detached, or not computed from the "
            "embeddings): training would not learn",
        )
    if not bool(torch.isfinite(value)):
        raise ConfigError(field, f"{what} returned {value.item()} on finite embeddings")


def _param_field(loss: LossSpec, where: str, message: str) -> str:
    """The config field a loss's parameter error is about: a pinned parameter, else the user's own space, else the
    loss (whose space it is)."""
    named = [k for k in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message)]
    for k in loss.params:
        if k in named:
            return f"{where}.params.{k}"
    if loss.space is not None:
        return f"{where}.space"
    return f"{where}.name"


def _check_model_fits(model_kwargs: dict, image_size: int, where: str, seen: set) -> None:
    """One forward pass of a random batch at the dataset's image size: a trunk too deep for the images (its feature map
    shrinks to nothing), K-max pooling with K > H·W, a fixed-size timm model at another size, or a pooling that
    overflows to inf/NaN fail here, not in every fold's first iteration (``seen``: models already checked)."""
    key = (tuple(sorted((k, str(v)) for k, v in model_kwargs.items() if k != "pretrained")), image_size)
    if key in seen:
        return
    seen.add(key)
    field = "model.pooling" if str(model_kwargs["pooling"]).startswith(("kmax", "gem")) else "model.trunk"
    try:
        model = build_model(**{**model_kwargs, "pretrained": None}).eval()
    except (Exception, SystemExit) as e:  # a trunk plug-in may raise anything: one line, no traceback
        raise ConfigError(
            field if "pooling" in str(e) else "model.trunk",  # a pooling the trunk does not take is the pooling's
            f"{model_kwargs['trunk']} with {model_kwargs['pooling']} pooling cannot be built: {_one_line(e)}",
        ) from None
    with torch.no_grad():
        try:
            out = model(torch.rand(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(0)))
        except (Exception, SystemExit) as e:  # "Output size is too small", a fixed-size timm model
            raise ConfigError(
                field,
                f"{model_kwargs['trunk']} with {model_kwargs['pooling']} pooling cannot embed "
                f"the images at {where}.image_size {image_size}: {_one_line(e)}",
            ) from None
    if not torch.isfinite(out).all():
        raise ConfigError(
            field,
            f"{model_kwargs['trunk']} with {model_kwargs['pooling']} pooling gives non-finite "
            f"embeddings at {where}.image_size {image_size}: every metric would be at chance "
            "level",
        )
    if torch.equal(out[0], out[1]):  # two different random images: the pooled features vanished (under/overflow)
        raise ConfigError(
            field,
            f"{model_kwargs['trunk']} with {model_kwargs['pooling']} pooling gives the same embedding for different "
            f"images at {where}.image_size {image_size}: every metric would be at chance level",
        )


def _one_line(e: BaseException) -> str:
    """An exception of the user's model as one short line: its message (its type where that says more)."""
    text = " ".join(str(e).split())[:300]
    return text if isinstance(e, (ValueError, RuntimeError)) and text else f"{type(e).__name__}: {text}".rstrip(": ")


def _check_classes(table, manifest, m: int, where: str) -> None:
    """Folds whose validation classes are one class (MAP@R trivially 1.0: the search would optimise noise) are a
    config error; train classes with fewer images than ``m`` (batches then repeat images) are a warning."""
    for fold in manifest.folds:
        if len(fold.val_classes) < 2:
            raise ConfigError(
                "protocol.folds",
                f"{where}: fold {fold.index} validates on {len(fold.val_classes)} "
                "class: its MAP@R is 1.0 whatever the model (fewer folds, or more "
                "classes)",
            )
    labels = np.asarray(table.labels)
    classes, counts = np.unique(labels, return_counts=True)
    train = set().union(*(set(f.train_classes) for f in manifest.folds))
    small = [int(c) for c, n in zip(classes, counts) if int(c) in train and n < m]
    if small:
        print(
            f"warning: {where}: {len(small)} training classes have fewer than m = {m} images (e.g. class "
            f"{small[0]}); their batches repeat images (docs/reliability.md, bad input)",
            file=sys.stderr,
            flush=True,
        )


_PROTOCOL_TRAIN_FIELDS = ("iters_per_epoch", "max_epochs", "eval_every", "patience")


def _train_config_field(message: str) -> str:
    """The config field a :class:`dml_core.training.loop.TrainConfig` error is about: it names
    ``TrainConfig.<field>``."""
    m = re.search(r"TrainConfig\.(\w+)", message)
    if m and m.group(1) in TRAIN_KEYS:
        return f"protocol.train.{m.group(1)}"
    if m and m.group(1) in _PROTOCOL_TRAIN_FIELDS:
        return f"protocol.{m.group(1)}"
    return "protocol.train"


def _check_environment() -> None:
    """Environment variables the sweep reads when it starts Ray, checked before anything is written."""
    level = os.environ.get("DMLRC_RAY_LOG_LEVEL")
    if level is not None and not isinstance(logging.getLevelName(level), int):  # what ray.init's setLevel takes
        raise ConfigError(
            "DMLRC_RAY_LOG_LEVEL (environment)",
            f"{level[:40]!r} is not a log level (one of DEBUG, INFO, WARNING, ERROR, CRITICAL)",
        )


def check_pretrained(cfg: SweepConfig) -> None:
    """Build the trunk once with ``model.pretrained``: a missing file, one that ``torch.load(weights_only=True)``
    cannot read, or one that is not a state dict of this trunk fails here instead of in every fold's worker."""
    if cfg.model.pretrained is None:
        return

    try:
        build_model(**cfg.model.kwargs())
    except (OSError, ValueError, RuntimeError, TypeError, EOFError) as e:
        raise ConfigError("model.pretrained", one_line(e)) from None


def _check_plugins_and_training(cfg: SweepConfig) -> None:
    """No ambiguous plugin loss name is installed, and the protocol's training settings make a TrainConfig."""
    try:
        check_plugin_losses()  # an installed entry point shadowed by a built-in or exported twice: ambiguous names
    except ValueError as e:
        raise ConfigError("losses", " ".join(str(e).split())) from None
    try:
        study_train_config(cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(_train_config_field(str(e)), one_line(e)) from None


def _check_batches(cfg: SweepConfig) -> dict[str, tuple[int, int]]:
    """Each loss's (classes_per_batch, m), its global batch split evenly over the fold's workers, with at least 2
    images per rank when BatchNorm trains."""
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
        if cpb * m // w < 2 and not cfg.model.freeze_bn:
            raise ConfigError(
                "resources.workers_per_fold",
                f"{w} DDP ranks would each train on {cpb * m // w} image of the global batch of losses[{j}] "
                f"{ls.name!r} (classes_per_batch × m = {cpb} × {m} = {cpb * m}): BatchNorm in training mode needs "
                "at least 2 images per rank; use fewer workers_per_fold or a larger batch (or model.freeze_bn: true)",
            )
    return batches


def _load_dataset(cfg: SweepConfig, i: int, spec: Any, batches: dict[str, tuple[int, int]]) -> DatasetData:
    """``datasets[i]`` loaded and cut into the protocol's folds, each fold able to feed every loss's batches."""
    w = cfg.resources.workers_per_fold
    where = f"datasets[{i}]"
    table = load_table(spec, where)
    if spec.kind == "parquet":
        check_image_rows(spec.path, where)
    need = max(batches.values())
    try:
        with warnings.catch_warnings():  # single-class folds: _check_classes says it once, as a config error
            warnings.filterwarnings("ignore", message=".*single val class.*")
            manifest = FoldManifest.from_labels(
                table.labels,
                cfg.protocol.folds,
                cfg.protocol.fold_layout,
                min_val_samples=2,
                min_train_classes=need[0],
            )
    except ValueError as e:
        n = len(np.unique(table.labels))
        worst = max(batches, key=lambda k: batches[k][0])
        raise ConfigError(
            where,
            f"{n} classes are too few for {cfg.protocol.folds} folds × batches of classes_per_batch × m = "
            f"{need[0]} × {need[1]} (loss {worst!r}): {one_line(e)}",
        ) from None
    for fold in manifest.folds:
        if len(table.subset(fold.val_classes)) < w:
            raise ConfigError(where, f"fold {fold.index} has fewer val images than the {w} workers embedding them")
    _check_classes(table, manifest, max(m for _, m in batches.values()), where)
    if len(manifest.test_classes) < 2:
        raise ConfigError(where, f"only {len(manifest.test_classes)} test classes; need >= 2")
    return DatasetData(spec, i, table, manifest)


def _plan_studies(
    cfg: SweepConfig, datasets: list[DatasetData], batches: dict[str, tuple[int, int]]
) -> list[StudyPlan]:
    """One :class:`StudyPlan` per (dataset, loss), every loss built and every model checked to fit first."""
    plans = []
    checked_models: set = set()
    for d in datasets:
        n_train = min(len(f.train_classes) for f in d.manifest.folds)
        for j, ls in enumerate(cfg.losses):
            cpb, m = batches[ls.name]
            _check_loss_builds(cfg, ls, f"losses[{j}]", n_train, (cpb, m))
            model_kwargs = cfg.model.kwargs(loss_info(ls.name).model if cfg.protocol.recipe == "paper" else MLRC_MODEL)
            _check_model_fits(model_kwargs, d.spec.image_size, f"datasets[{d.index}]", checked_models)
            plans.append(
                StudyPlan(
                    dataset=d,
                    loss=ls,
                    loss_index=j,
                    classes_per_batch=cpb,
                    m=m,
                    model_kwargs=model_kwargs,
                    searched=ls.searched(),
                    fixed=ls.fixed_values(),
                )
            )
    return plans


def _package_bytes(path: Path, excludes: list[str], working_dir: bool) -> int | None:
    """The bytes Ray would upload for one ``working_dir`` or ``py_modules`` folder: its files that neither the
    config's ``excludes``, Ray's default excludes (``working_dir`` only) nor ``.gitignore`` / ``.rayignore`` files
    leave out, walked by Ray's own packaging code (Ray stores the files uncompressed).  ``None`` where that code is
    not there to ask."""
    try:
        # Ray's packaging module only (nothing starts): the rules must be exactly the ones the upload applies
        from ray._private import ray_constants
        from ray._private.runtime_env import packaging
    except ImportError:
        return None
    patterns = list(excludes)
    if working_dir:
        patterns += ray_constants.get_runtime_env_default_excludes()
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    total = 0

    def add(p: Path) -> None:
        nonlocal total
        if p.is_file():
            total += p.stat().st_size

    try:
        packaging._dir_travel(path, [packaging._get_excludes(path, patterns)], add, include_gitignore=include_gitignore)
    except (AttributeError, TypeError):  # Ray's private packaging API changed: Ray's own check remains
        return None
    return total


def check_package_sizes(cfg: SweepConfig) -> None:
    """A ``working_dir`` or ``py_modules`` folder larger than Ray's upload limit (512 MiB) is refused before Ray
    starts, naming the folder, instead of failing in ``ray.init`` with a traceback."""
    env = cfg.runtime_env
    folders = [("runtime_env.working_dir", env.working_dir, True)] if env.working_dir else []
    folders += [(f"runtime_env.py_modules[{i}]", p, False) for i, p in enumerate(env.py_modules) if Path(p).is_dir()]
    if not folders:
        return
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE  # the limit the upload enforces

    for name, folder, is_working_dir in folders:
        size = _package_bytes(Path(folder), list(env.excludes), is_working_dir)
        if size is not None and size >= GCS_STORAGE_MAX_SIZE:
            raise ConfigError(
                name,
                f"{folder} holds {size / 2**20:.0f} MiB to upload, over Ray's limit of "
                f"{GCS_STORAGE_MAX_SIZE / 2**20:.0f} MiB: leave data and environments out (runtime_env.excludes, "
                ".gitignore or .rayignore) or install the code on the nodes",
            )


def preflight(cfg: SweepConfig) -> list[StudyPlan]:
    """Check locations, load datasets, cut folds, check batches and build every loss; one :class:`StudyPlan` per
    (dataset, loss).  Reads only: nothing is created before the config is known good."""
    check_locations(cfg)
    _check_environment()
    check_package_sizes(cfg)
    _check_plugins_and_training(cfg)
    check_pretrained(cfg)
    batches = _check_batches(cfg)
    datasets = [_load_dataset(cfg, i, spec, batches) for i, spec in enumerate(cfg.datasets)]
    return _plan_studies(cfg, datasets, batches)
