"""Everything that can fail before Ray starts: load each dataset, cut its folds, build each loss once.

:func:`preflight` turns a validated :class:`~pipelines.config.SweepConfig` into one :class:`StudyPlan` per
(dataset, loss) — the unit the sweep optimises (MLRC §2.1: one Bayesian optimisation per loss per dataset).
Failures are :class:`~pipelines.config.ConfigError` naming the field: storage or a sqlite tracking DB that cannot
be written (``storage``, ``tracking.uri``), a missing or unreadable dataset (``datasets[i].path``, naming the
file), an image row whose header does not parse (``datasets[i].path``), too few classes for the folds × batch
(``datasets[i]``), a loss that cannot be built with its parameters (``losses[j].params``), a batch that does not
split across the DDP workers (``resources.workers_per_fold``), a ``model.pretrained`` file that is not a state
dict of the trunk, GPUs asked for where there are none (``resources.use_gpu``).  Nothing is written here: the
checks only read, so a failing config leaves no folder and no MLflow experiment behind.

No Ray, no MLflow here (:func:`check_cluster_resources` takes Ray's resource dict from its caller).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.config import TRAIN_KEYS, ConfigError, DatasetSpec, LossSpec, SweepConfig, redact_uri
from pipelines.spaces import LOSS_LR

__all__ = ["DatasetData", "StudyPlan", "load_table", "preflight", "batch_of", "study_key", "check_locations",
           "check_local_gpus", "check_cluster_resources", "check_image_rows"]

try:  # boto3 is how dml_core.storage reaches S3; without it there is no s3:// dataset to fail on
    from botocore.exceptions import BotoCoreError, ClientError

    _S3_ERRORS: tuple[type[BaseException], ...] = (BotoCoreError, ClientError)
except ImportError:  # pragma: no cover
    _S3_ERRORS = ()
#: What a dataset reader raises for a bad file (readers are meant to raise ValueError/OSError naming the file;
#: the rest are wrapped too, so that a user's broken data is never a traceback).
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, zipfile.BadZipFile,
                *_S3_ERRORS)


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


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (KeyError, TypeError, IndexError, AttributeError, zipfile.BadZipFile, EOFError)):
        text = f"{type(e).__name__}: {text}"
    return redact_uri(text)


def _bad_zip(root: str) -> str | None:
    """The first zip under ``root`` that zipfile cannot open (BadZipFile does not say which file it was)."""
    for z in sorted(Path(root).rglob("*.zip")) if Path(root).is_dir() else [Path(root)]:
        try:
            with zipfile.ZipFile(z) as f:
                bad = f.testzip()
            if bad is not None:
                return f"{z}: entry {bad!r} fails its CRC check"
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"{z}: {_one_line(e)}"
    return None


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
    except MemoryError:
        raise ConfigError(where, "does not fit in memory") from None
    except _READ_ERRORS as e:
        field_name = f"{where}.path" if spec.kind != "synthetic" else where
        detail = _one_line(e)
        if spec.kind == "omniglot" and isinstance(e, (zipfile.BadZipFile, EOFError)):
            detail = _bad_zip(spec.path) or detail
        elif _S3_ERRORS and isinstance(e, _S3_ERRORS):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
            detail = (f"S3 at {endpoint} is not reachable or refuses access ({detail}); set AWS_ENDPOINT_URL and "
                      "credentials for a non-AWS server")
        raise ConfigError(field_name, f"cannot read the {spec.kind} dataset: {detail}") from None
    if spec.classes is not None:
        classes = np.unique(table.labels)
        if spec.classes > len(classes):
            raise ConfigError(f"{where}.classes", f"{spec.classes} > the dataset's {len(classes)} classes")
        table = table.subset(classes[: spec.classes])
    return table


def check_image_rows(uri: str, where: str) -> None:
    """Every row of a prepared parquet dataset, before any worker reads it: ``dml_core.shards.check_rows`` (the
    manifest, shard hashes, row-group layout, each row's index and image header).  A bad row would otherwise fail
    only inside a training worker, minutes in."""
    from dml_core.shards import DataError, check_rows

    try:
        check_rows(uri)
    except DataError as e:
        raise ConfigError(f"{where}.path", _one_line(e)) from None


def check_mlflow_server(uri: str, field_name: str) -> None:
    """An ``http(s)://`` MLflow server answers its ``/health`` (credentials stripped from the probe and from the
    message), else one ``ConfigError`` naming ``field_name`` — seconds, not MLflow's minutes of retries."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(health_url(uri), timeout=10) as r:
            r.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(field_name, f"MLflow server {redact_uri(uri)} is not reachable "
                                      f"({redact_uri(_one_line(e))})") from None


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


_PROTOCOL_TRAIN_FIELDS = ("iters_per_epoch", "max_epochs", "eval_every", "patience")


def _train_config_field(message: str) -> str:
    """The config field a :class:`dml_core.train.TrainConfig` error is about: it names ``TrainConfig.<field>``."""
    m = re.search(r"TrainConfig\.(\w+)", message)
    if m and m.group(1) in TRAIN_KEYS:
        return f"protocol.train.{m.group(1)}"
    if m and m.group(1) in _PROTOCOL_TRAIN_FIELDS:
        return f"protocol.{m.group(1)}"
    return "protocol.train"


def _nearest_existing(path: Path, field_name: str) -> Path:
    p = path
    while True:
        try:
            if p.exists():
                return p
            if p.is_symlink():
                raise ConfigError(field_name, f"{str(p)!r} is a broken symbolic link")
        except OSError as e:
            raise ConfigError(field_name, f"{str(p)!r}: {e.strerror or e}") from None
        if p.parent == p:
            return p
        p = p.parent


def _check_dir_writable(target: Path, field_name: str, what: str) -> None:
    """``target`` is, or can be created as, a writable directory — checked without creating anything."""
    p = _nearest_existing(target, field_name)
    if not p.is_dir():
        raise ConfigError(field_name, f"{what} {str(target)!r}: {str(p)!r} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(field_name, f"{what} {str(target)!r}: {str(p)!r} is not writable")


def health_url(uri: str) -> str:
    """``<server>/health`` without the credentials (urllib cannot take ``user:password@`` in a URL; the health
    endpoint needs none)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))


def check_locations(cfg: SweepConfig) -> None:
    """Storage and a sqlite tracking DB must be writable, a PostgreSQL driver installed — before anything is written
    (MLflow retries an unwritable sqlite DB for minutes before it gives up)."""
    storage_field = "storage" if not cfg.storage_is_s3 else "storage (its local folder ./runs)"
    _check_dir_writable(cfg.local_dir(), storage_field, "sweep folder")
    uri = cfg.tracking_uri()
    uri_field = "tracking.uri" if cfg.tracking.uri else (
        "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "storage")
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        try:
            exists = db.exists()
        except OSError as e:
            raise ConfigError(uri_field, f"sqlite DB {str(db)!r}: {e.strerror or e}") from None
        if exists:
            if not db.is_file():
                raise ConfigError(uri_field, f"sqlite DB {str(db)!r} is not a file")
            if not os.access(db, os.R_OK | os.W_OK) or not os.access(db.parent, os.W_OK | os.X_OK):
                raise ConfigError(uri_field, f"sqlite DB {str(db)!r} (or its folder) is not writable")
        else:
            _check_dir_writable(db.parent, uri_field, "folder of the sqlite DB")
    elif uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, uri_field)
    elif uri.startswith("postgresql"):
        import importlib.util

        driver = uri.split("://", 1)[0].partition("+")[2] or "psycopg"
        if importlib.util.find_spec(driver) is None:
            raise ConfigError(uri_field, f"{redact_uri(uri)}: the PostgreSQL driver {driver!r} is not installed "
                                         "(use postgresql+psycopg2:// with psycopg2)")


def check_pretrained(cfg: SweepConfig) -> None:
    """Build the trunk once with ``model.pretrained``: a missing file, one that ``torch.load(weights_only=True)``
    cannot read, or one that is not a state dict of this trunk fails here instead of in every fold's worker."""
    if cfg.model.pretrained is None:
        return
    from dml_core.models import build_model

    try:
        build_model(**cfg.model.kwargs())
    except (OSError, ValueError, RuntimeError, TypeError, EOFError) as e:
        raise ConfigError("model.pretrained", _one_line(e)) from None


def _gpu_error(cfg: SweepConfig, gpus: float, cpus: float | None, where: str) -> None:
    r = cfg.resources
    need = r.workers_per_fold * r.gpus_per_worker
    if r.use_gpu and gpus < need:
        has = f"{gpus:g} GPUs" + (f" and {cpus:g} CPUs" if cpus is not None else "")
        raise ConfigError("resources.use_gpu", f"one fold needs {r.workers_per_fold} workers × gpus_per_worker "
                                               f"{r.gpus_per_worker:g} = {need:g} GPUs; {where} has {has}")


def check_local_gpus(cfg: SweepConfig, address: str | None = None) -> None:
    """``use_gpu: true`` with an embedded Ray (no ``--address``, no ``RAY_ADDRESS``): its GPUs are this machine's,
    which torch.cuda knows before Ray starts.  (On a cluster, :func:`check_cluster_resources` after ``ray.init``.)"""
    if not cfg.resources.use_gpu or address or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _gpu_error(cfg, gpus, os.cpu_count(), "this machine (the local Ray's resources)")


def check_cluster_resources(cfg: SweepConfig, resources: Mapping[str, float]) -> None:
    """Call right after Ray starts, with ``ray.cluster_resources()``: a fold that cannot be placed would make Ray
    Train retry its worker-group start-up forever.  Names ``resources.use_gpu`` / ``resources.cpus_per_worker``
    and what the cluster has.  (An autoscaling cluster may grow later; this checks what it has now.)"""
    r = cfg.resources
    gpus, cpus = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    _gpu_error(cfg, gpus, cpus, "the Ray cluster")
    need = r.workers_per_fold * r.cpus_per_worker
    if cpus < need:
        raise ConfigError("resources.cpus_per_worker",
                          f"one fold needs {r.workers_per_fold} workers × {r.cpus_per_worker:g} CPUs = {need:g}; "
                          f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs")


def preflight(cfg: SweepConfig) -> list[StudyPlan]:
    """Check locations, load datasets, cut folds, check batches and build every loss; one :class:`StudyPlan` per
    (dataset, loss).  Reads only: nothing is created before the config is known good."""
    from dml_core.losses import MLRC_MODEL, loss_info
    from dml_core.splits import FoldManifest

    from dml_core.train import TrainConfig

    check_locations(cfg)
    try:
        TrainConfig(**cfg.protocol.train, iters_per_epoch=cfg.protocol.iters_per_epoch,
                    max_epochs=cfg.protocol.max_epochs, eval_every=cfg.protocol.eval_every,
                    patience=cfg.protocol.patience)
    except (TypeError, ValueError) as e:
        raise ConfigError(_train_config_field(str(e)), _one_line(e)) from None
    check_pretrained(cfg)
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
        if spec.kind == "parquet":
            check_image_rows(spec.path, where)
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
                f"{need[0]} × {need[1]} (loss {worst!r}): {_one_line(e)}",
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
