"""Sweep configuration: the YAML schema of ``dmlrc sweep CONFIG.yaml`` and its validation.

A config names the datasets, the losses, the model, the protocol (MLRC §1–§2: 4 class-disjoint folds in the
``mlrc`` layout, 50 Bayesian-optimisation trials of which 5 random start-up trials, 10 reproductions, 100-iteration
"epochs", evaluation interval and patience), the resources, MLflow tracking and storage.  The documented examples
are ``configs/{demo,omniglot,mlrc-cub200}.yaml``; the ``demo`` preset is also built in (:mod:`pipelines.presets`).

:func:`parse_config` checks *shape* (keys, types, ranges, URIs) and never touches the disk or the network;
:func:`pipelines.preflight.preflight` then loads the datasets and builds every loss once.  Both raise
:class:`ConfigError` whose message names the field, e.g.
``losses[1].name: unknown loss 'mpaa' (known: ...)``.  Nothing (no Ray, no MLflow run) starts before both pass.

This module imports neither Ray nor MLflow.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.spaces import LOSS_LR, SearchSpace, SpaceError, load_space, spaces_dir

__all__ = [
    "ConfigError",
    "DatasetSpec",
    "LossSpec",
    "ModelSpec",
    "ProtocolSpec",
    "ResourcesSpec",
    "TrackingSpec",
    "SweepConfig",
    "parse_config",
    "load_config",
    "DATASET_KINDS",
    "TRAIN_KEYS",
]

#: Dataset kinds: generated data, the Omniglot zips, a prepared parquet manifest (engineer C's format), an image folder.
DATASET_KINDS = ("synthetic", "omniglot", "parquet", "folder")
#: ``protocol.train`` keys forwarded to :class:`dml_core.train.TrainConfig` (MLRC §3 defaults where they exist).
TRAIN_KEYS = (
    "classes_per_batch",
    "m",
    "trunk_lr",
    "embedder_lr",
    "weight_decay",
    "momentum",
    "eval_batch_size",
    "num_workers",
    "loss_weight_decay",
    "optimizer",
    "amp",
    "amp_dtype",
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "file")


class ConfigError(ValueError):
    """One bad field.  ``str(e)`` is ``"<field>: <what is wrong>"``; the CLI prints ``config error: <that>``."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"{field_path}: {message}" if field_path else message)


_REQUIRED = object()


def _get(d: dict, key: str, where: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
    """``d[key]`` checked against ``kind`` (bools are not ints; ints are accepted as floats)."""
    path = f"{where}.{key}" if where else key
    if key not in d or d[key] is None:
        if default is _REQUIRED:
            raise ConfigError(path, "is required")
        return default
    v = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and bool not in kinds:
        raise ConfigError(path, f"expected {_kind_name(kinds)}, got {v!r}")
    if not isinstance(v, kinds):
        raise ConfigError(path, f"expected {_kind_name(kinds)}, got {v!r}")
    return v


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", dict: "a mapping", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _int(d: dict, key: str, where: str, default: Any = _REQUIRED, lo: int | None = None, hi: int | None = None) -> int:
    v = _get(d, key, where, int, default)
    if v is not None:
        _range(v, f"{where}.{key}", lo, hi)
    return v


def _float(d: dict, key: str, where: str, default: Any = _REQUIRED, lo: float | None = None, hi: float | None = None,
           open_lo: bool = False) -> float:
    v = _get(d, key, where, float, default)
    if v is not None:
        _range(v, f"{where}.{key}", lo, hi, open_lo)
    return v


def _range(v: float, path: str, lo: float | None, hi: float | None, open_lo: bool = False) -> None:
    if lo is not None and (v < lo or (open_lo and v == lo)):
        raise ConfigError(path, f"{v!r} must be {'>' if open_lo else '>='} {lo}")
    if hi is not None and v > hi:
        raise ConfigError(path, f"{v!r} must be <= {hi}")


def _no_unknown(d: dict, allowed: set[str] | tuple[str, ...], where: str) -> None:
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        first = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(first, f"unknown key (allowed here: {', '.join(sorted(allowed))})")


def _mapping(v: Any, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(where, f"expected a mapping, got {v!r}")
    return v


def check_uri(uri: str, where: str, *, allow_s3: bool = True) -> str:
    """A local path or ``s3://bucket[/prefix]``; any other ``scheme://`` is an error naming ``where``."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(where, f"expected a path or URI, got {uri!r}")
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", uri)
    if not m:
        return uri
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "s3" and allow_s3:
        if not rest or rest.startswith("/") or not re.match(r"^[a-z0-9][a-z0-9.-]{1,62}(/|$)", rest):
            raise ConfigError(where, f"{uri!r} is not a valid s3://bucket/prefix URI")
        return uri
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(where, f"{uri!r}: a file:// URI must be absolute (file:///...)")
        return rest
    allowed = "a local path or s3://bucket/prefix" if allow_s3 else "a local path"
    raise ConfigError(where, f"unsupported URI scheme {scheme!r} in {uri!r} (expected {allowed})")


def check_tracking_uri(uri: str, where: str = "tracking.uri") -> str:
    """An MLflow tracking URI: ``http(s)://host[:port]``, ``sqlite:///path``, ``postgresql://...``, ``file:///path``."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+]*)(\+[A-Za-z0-9]+)?://(.*)$", uri or "")
    if not m:
        raise ConfigError(where, f"{uri!r} is not a URI (expected one of {', '.join(s + '://' for s in _TRACKING_SCHEMES)})")
    scheme, rest = m.group(1).lower(), m.group(3)
    if scheme not in _TRACKING_SCHEMES:
        raise ConfigError(where, f"unsupported scheme {scheme!r} in {uri!r} (expected one of {', '.join(_TRACKING_SCHEMES)})")
    if scheme in ("http", "https"):
        if not re.match(r"^[A-Za-z0-9.\-\[\]:]+(:\d+)?(/.*)?$", rest) or rest.startswith(":"):
            raise ConfigError(where, f"{uri!r}: missing or malformed host")
        port = re.match(r"^[^/\[]*:(\d+)", rest)
        if port and not 0 < int(port.group(1)) < 65536:
            raise ConfigError(where, f"{uri!r}: port out of range")
    if scheme == "sqlite":
        if not rest.startswith("/") or rest == "/":
            raise ConfigError(where, f"{uri!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
    if scheme == "file" and not rest.startswith("/"):
        raise ConfigError(where, f"{uri!r}: a file:// URI must be absolute (file:///...)")
    if scheme == "postgresql" and "/" not in rest:
        raise ConfigError(where, f"{uri!r}: expected postgresql://user[:password]@host[:port]/database")
    return uri


def _abs(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def absolute_tracking_uri(uri: str) -> str:
    """Make a ``sqlite:///relative.db`` URI absolute (workers must never resolve relative paths: ray #18387)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


# --------------------------------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset.  ``name`` is the MLflow ``dataset`` tag; ``kind`` picks the reader (engineer C's ``dml_core.data``).

    ``image_size``: side of the protocol transforms' output (MLRC §3: 227 crops of 256 resizes; use 16–32 for smoke
    runs).  ``classes``: keep only the first N sorted classes (quick runs on big datasets; ``null`` = all).
    """

    name: str
    kind: str
    image_size: int
    path: str | None = None  # omniglot: folder with the zips; folder: root; parquet: local path or s3:// URI
    num_classes: int | None = None  # synthetic
    per_class: int | None = None  # synthetic
    seed: int = 0  # synthetic
    classes: int | None = None


@dataclass(frozen=True)
class LossSpec:
    """A loss to study.  ``params`` pins hyperparameters (removed from the searched space); ``space`` is its tune space."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    space: SearchSpace | None = None

    def searched(self) -> dict:
        """The Param objects the optimiser searches (the tune space minus pinned ones)."""
        return {k: p for k, p in self.space.params.items() if k not in self.params}

    def fixed(self) -> dict[str, Any]:
        """Non-searched values: the space's ``fixed`` plus the pinned ``params``."""
        return {**self.space.fixed, **self.params}


@dataclass(frozen=True)
class ModelSpec:
    """``dml_core.models.build_model`` arguments.  ``pooling``/``layer_norm`` ``null`` = the protocol's (or, with ``recipe: paper``, the loss paper's) recipe."""

    trunk: str = "tiny"
    pooling: str | None = None
    layer_norm: bool | None = None
    embedding_dim: int = 128
    pretrained: str | None = None
    freeze_bn: bool = True

    def kwargs(self, recipe: Any | None = None) -> dict[str, Any]:
        """Arguments for ``build_model``: explicit values win over the loss's :class:`ModelRecipe`."""
        pooling = self.pooling or (recipe.pooling if recipe is not None else "avg")
        layer_norm = self.layer_norm if self.layer_norm is not None else bool(recipe.layer_norm if recipe else False)
        return {
            "trunk": self.trunk,
            "pooling": pooling,
            "layer_norm": layer_norm,
            "embedding_dim": self.embedding_dim,
            "pretrained": self.pretrained,
            "freeze_bn": self.freeze_bn,
        }


@dataclass(frozen=True)
class ProtocolSpec:
    """MLRC protocol (spec protocol_reality_check.md §1.3–§2.3).

    ``eval_every`` and ``patience`` are in epochs of ``iters_per_epoch`` iterations (MLRC §1.5: CUB 2 / 9).
    ``train`` holds further :class:`dml_core.train.TrainConfig` fields (``TRAIN_KEYS``); ``classes_per_batch`` and
    ``m`` default to the protocol's shared batch (or the paper's with ``recipe: paper``).
    """

    name: str = "mlrc"
    folds: int = 4
    fold_layout: str = "mlrc"
    trials: int = 50
    startup_trials: int = 5
    sampler: str = "gp"
    reproductions: int = 10
    iters_per_epoch: int = 100
    eval_every: int = 2
    patience: int = 9
    max_epochs: int = 1000
    seed: int = 0
    train: dict[str, Any] = field(default_factory=dict)
    #: "protocol": every loss gets the reality check's batch (8 × 4) and model unless ``train``/``model`` say
    #: otherwise (a fair comparison); "paper": each loss's own BatchSpec/ModelRecipe (``loss_info``).
    recipe: str = "protocol"


@dataclass(frozen=True)
class ResourcesSpec:
    """Ray resources.  ``num_cpus``: logical CPUs of a *local* Ray (``null`` = enough for ``max_concurrent_trials``
    trials × folds × workers; oversubscribing physical cores is fine for tiny models)."""

    workers_per_fold: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0  # with use_gpu; a fraction (e.g. 0.25) lets small folds share a GPU
    #: restarts of a fold whose worker died (OOM kill, lost node): Ray Train FailureConfig(max_failures); the fold
    #: restarts from scratch with the same seed.  A failure after the retries fails the trial (status=failed).
    fold_retries: int = 1
    max_concurrent_trials: int = 1
    num_cpus: int | None = None


@dataclass(frozen=True)
class TrackingSpec:
    """MLflow: ``uri`` ``null`` = ``$MLFLOW_TRACKING_URI`` if set, else a sqlite DB inside the sweep's local directory;
    ``experiment`` ``null`` = the sweep name."""

    uri: str | None = None
    experiment: str | None = None


@dataclass(frozen=True)
class SweepConfig:
    name: str
    datasets: tuple[DatasetSpec, ...]
    losses: tuple[LossSpec, ...]
    model: ModelSpec
    protocol: ProtocolSpec
    resources: ResourcesSpec
    tracking: TrackingSpec
    storage: str = "runs"
    tune_spaces: str | None = None
    source: str | None = None  # the YAML file, for messages

    # ------------------------------------------------------------------ derived locations
    @property
    def storage_is_s3(self) -> bool:
        return self.storage.startswith("s3://")

    def local_dir(self) -> Path:
        """The sweep's local directory: ``<storage>/<name>`` for local storage, ``./runs/<name>`` with S3 storage."""
        base = Path("runs") if self.storage_is_s3 else Path(self.storage)
        return (base / self.name).resolve()

    def ray_storage(self) -> str:
        """Where Ray Tune / Ray Train persist (absolute local path or ``s3://bucket/prefix/<name>``)."""
        if self.storage_is_s3:
            return self.storage.rstrip("/") + "/" + self.name + "/ray"
        return str(self.local_dir() / "ray")

    def tracking_uri(self) -> str:
        """Absolute MLflow tracking URI (workers get exactly this string): ``tracking.uri``, else
        ``$MLFLOW_TRACKING_URI``, else a sqlite DB in the sweep's local directory."""
        uri = self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return absolute_tracking_uri(uri)
        return "sqlite:///" + str(self.local_dir() / "mlflow.db")

    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (what ``--resume`` compares against the stored copy)."""

        def plain(obj):
            if dataclasses.is_dataclass(obj) and not isinstance(obj, SearchSpace):
                return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "space"}
            if isinstance(obj, (list, tuple)):
                return [plain(x) for x in obj]
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            return obj

        d = plain(self)
        d.pop("source", None)
        return d


# --------------------------------------------------------------------------------------------------- parsing


def _parse_dataset(d: Any, where: str, default_seed: int) -> DatasetSpec:
    d = _mapping(d, where)
    kind = _get(d, "kind", where, str)
    if kind not in DATASET_KINDS:
        raise ConfigError(f"{where}.kind", f"unknown dataset kind {kind!r} (known: {', '.join(DATASET_KINDS)})")
    common = {"name", "kind", "image_size", "classes"}
    name = _get(d, "name", where, str, kind)
    if not _NAME_RE.match(name):
        raise ConfigError(f"{where}.name", f"{name!r}: use letters, digits, '_', '-', '.' (max 64)")
    classes = _int(d, "classes", where, None, lo=2)
    if kind == "synthetic":
        _no_unknown(d, common | {"num_classes", "per_class", "seed"}, where)
        num_classes = _int(d, "num_classes", where, lo=2)
        per_class = _int(d, "per_class", where, lo=2)
        image_size = _int(d, "image_size", where, 16, lo=8, hi=512)
        return DatasetSpec(name, kind, image_size, num_classes=num_classes, per_class=per_class,
                           seed=_int(d, "seed", where, default_seed), classes=classes)
    _no_unknown(d, common | {"path"}, where)
    path = check_uri(_get(d, "path", where, str), f"{where}.path", allow_s3=(kind == "parquet"))
    if not path.startswith("s3://"):
        # Absolute, because Ray Train workers run in their own working directory (and may open shards lazily).
        path = str(Path(path).resolve())
    image_size = _int(d, "image_size", where, 227, lo=8, hi=1024)
    return DatasetSpec(name, kind, image_size, path=path, classes=classes)


def _parse_loss(d: Any, where: str, space_dir: Path) -> LossSpec:
    if isinstance(d, str):
        d = {"name": d}
    d = _mapping(d, where)
    _no_unknown(d, {"name", "params"}, where)
    name = _get(d, "name", where, str)
    # The registry decides what exists; imported here so that a config error never needs Ray or MLflow.
    from dml_core.losses import list_losses, list_wrappers, loss_info

    try:
        loss_info(name)
    except ValueError:
        known = list_losses() + [f"{w}:<base>" for w in list_wrappers()]
        raise ConfigError(f"{where}.name", f"unknown loss {name!r} (known: {', '.join(known)})") from None
    try:
        space = load_space(name, space_dir)
    except SpaceError as e:
        raise ConfigError(f"{where}.name", str(e)) from None
    params = dict(_mapping(d.get("params"), f"{where}.params"))
    for k, v in params.items():
        p = space.params.get(k)
        if p is not None and not p.contains(v):
            raise ConfigError(f"{where}.params.{k}", f"{v!r} is outside the search space of {name!r} ({p.describe()})")
        if k == LOSS_LR and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise ConfigError(f"{where}.params.{k}", f"{v!r} must be a positive number")
    return LossSpec(name, params, space)


def _named_list(doc: dict[str, Any], key: str, noun: str, parse) -> tuple:
    """A non-empty list of specs with distinct ``name``s; errors name the entry (``losses[2].name``)."""
    raw = _get(doc, key, "", list)
    if not raw:
        raise ConfigError(key, f"needs at least one {noun}")
    items = tuple(parse(x, f"{key}[{i}]") for i, x in enumerate(raw))
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.name in seen:
            raise ConfigError(f"{key}[{i}].name", f"{item.name!r} already listed as {key}[{seen[item.name]}]")
        seen[item.name] = i
    return items


def parse_config(doc: Any, *, source: str | None = None) -> SweepConfig:
    """Validate a config mapping (already YAML-parsed) and return the typed :class:`SweepConfig`.

    Checks keys, types, ranges and URI shapes, that every loss exists in the registry and has a search space, and
    that pinned parameters lie inside it.  Building every loss and loading every dataset is :mod:`pipelines.preflight`.
    """
    if not isinstance(doc, dict):
        raise ConfigError("", f"{source or 'config'}: expected a mapping at the top level")
    top = {"name", "seed", "datasets", "losses", "model", "protocol", "resources", "tracking", "storage", "tune_spaces"}
    _no_unknown(doc, top, "")
    name = _get(doc, "name", "", str)
    if not _NAME_RE.match(name):
        raise ConfigError("name", f"{name!r}: use letters, digits, '_', '-', '.' (max 64, no '/')")
    seed = _int(doc, "seed", "", 0, lo=0)

    tune_spaces = _get(doc, "tune_spaces", "", str, None)
    space_dir = Path(tune_spaces) if tune_spaces else spaces_dir()
    if tune_spaces is not None and not space_dir.is_dir():
        raise ConfigError("tune_spaces", f"directory {tune_spaces!r} does not exist")

    datasets = _named_list(doc, "datasets", "dataset", lambda x, where: _parse_dataset(x, where, seed))
    losses = _named_list(doc, "losses", "loss", lambda x, where: _parse_loss(x, where, space_dir))

    m = _mapping(doc.get("model"), "model")
    _no_unknown(m, {"trunk", "pooling", "layer_norm", "embedding_dim", "pretrained", "freeze_bn"}, "model")
    pooling = _get(m, "pooling", "model", str, None)
    if pooling is not None:
        from dml_core.models import parse_pooling

        try:
            parse_pooling(pooling)
        except ValueError as e:
            raise ConfigError("model.pooling", str(e)) from None
    trunk = _get(m, "trunk", "model", str, "tiny")
    if trunk not in ("tiny", "resnet18", "resnet50", "googlenet"):
        raise ConfigError("model.trunk", f"unknown trunk {trunk!r} (known: tiny, resnet18, resnet50, googlenet)")
    model = ModelSpec(
        trunk=trunk,
        pooling=pooling,
        layer_norm=_get(m, "layer_norm", "model", bool, None),
        embedding_dim=_int(m, "embedding_dim", "model", 128, lo=2, hi=4096),
        pretrained=_abs(_get(m, "pretrained", "model", str, None)),
        freeze_bn=_get(m, "freeze_bn", "model", bool, True),
    )

    p = _mapping(doc.get("protocol"), "protocol")
    pkeys = {f.name for f in dataclasses.fields(ProtocolSpec)}
    _no_unknown(p, pkeys, "protocol")
    folds = _int(p, "folds", "protocol", 4, lo=2, hi=10)
    layout = _get(p, "fold_layout", "protocol", str, "mlrc")
    if layout not in ("mlrc", "kfold"):
        raise ConfigError("protocol.fold_layout", f"{layout!r} is not 'mlrc' or 'kfold'")
    if layout == "mlrc" and folds != 4:
        raise ConfigError("protocol.folds", f"the mlrc layout has exactly 4 folds (got {folds}); use fold_layout: kfold")
    trials = _int(p, "trials", "protocol", 50, lo=1)
    startup = _int(p, "startup_trials", "protocol", 5, lo=0)
    sampler = _get(p, "sampler", "protocol", str, "gp")
    if sampler not in ("gp", "tpe"):
        raise ConfigError("protocol.sampler", f"{sampler!r} is not 'gp' (Optuna GPSampler) or 'tpe' (TPESampler)")
    train = dict(_mapping(p.get("train"), "protocol.train"))
    _no_unknown(train, TRAIN_KEYS, "protocol.train")
    for k in ("classes_per_batch", "m", "eval_batch_size"):
        if k in train:
            _int(train, k, "protocol.train", lo=1 if k != "classes_per_batch" else 2)
    if "num_workers" in train:
        _int(train, "num_workers", "protocol.train", lo=0)
    for k in ("trunk_lr", "embedder_lr"):
        if k in train:
            _float(train, k, "protocol.train", lo=0.0, open_lo=True)
    for k in ("weight_decay", "momentum"):
        if k in train:
            train[k] = _float(train, k, "protocol.train", lo=0.0)
    recipe = _get(p, "recipe", "protocol", str, "protocol")
    if recipe not in ("protocol", "paper"):
        raise ConfigError("protocol.recipe", f"{recipe!r} is not 'protocol' (one batch and model for every loss) or 'paper'")
    eval_every = _int(p, "eval_every", "protocol", 2, lo=1)
    protocol = ProtocolSpec(
        recipe=recipe,
        name=_get(p, "name", "protocol", str, "mlrc"),
        folds=folds,
        fold_layout=layout,
        trials=trials,
        startup_trials=startup,
        sampler=sampler,
        reproductions=_int(p, "reproductions", "protocol", 10, lo=2),
        iters_per_epoch=_int(p, "iters_per_epoch", "protocol", 100, lo=1),
        eval_every=eval_every,
        patience=_int(p, "patience", "protocol", 9, lo=0),
        max_epochs=_int(p, "max_epochs", "protocol", 1000, lo=eval_every),
        seed=_int(p, "seed", "protocol", seed, lo=0),
        train=train,
    )

    r = _mapping(doc.get("resources"), "resources")
    _no_unknown(r, {f.name for f in dataclasses.fields(ResourcesSpec)}, "resources")
    resources = ResourcesSpec(
        workers_per_fold=_int(r, "workers_per_fold", "resources", 2, lo=1, hi=1024),
        use_gpu=_get(r, "use_gpu", "resources", bool, False),
        cpus_per_worker=_float(r, "cpus_per_worker", "resources", 1.0, lo=0.0, open_lo=True),
        gpus_per_worker=_float(r, "gpus_per_worker", "resources", 1.0, lo=0.0, open_lo=True),
        fold_retries=_int(r, "fold_retries", "resources", 1, lo=0),
        max_concurrent_trials=_int(r, "max_concurrent_trials", "resources", 1, lo=1),
        num_cpus=_int(r, "num_cpus", "resources", None, lo=1),
    )

    t = _mapping(doc.get("tracking"), "tracking")
    _no_unknown(t, {"uri", "experiment"}, "tracking")
    uri = _get(t, "uri", "tracking", str, None)
    if uri is not None:
        check_tracking_uri(uri)
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        check_tracking_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI (environment, used as tracking.uri)")
    experiment = _get(t, "experiment", "tracking", str, None)
    if experiment is not None and not experiment.strip():
        raise ConfigError("tracking.experiment", "must not be empty")
    tracking = TrackingSpec(uri=uri, experiment=experiment)

    storage = check_uri(_get(doc, "storage", "", str, "runs"), "storage")

    return SweepConfig(name, datasets, losses, model, protocol, resources, tracking, storage,
                       str(space_dir), source)


def load_config(path: str | os.PathLike, *, name: str | None = None) -> SweepConfig:
    """Read and validate ``CONFIG.yaml``; a missing or unparsable file is a :class:`ConfigError` naming it.

    ``name`` overrides the sweep name (e.g. a dated name for scheduled re-runs of the same config).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "config file not found")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML: {e}") from None
    if name is not None and isinstance(doc, dict):
        doc = {**doc, "name": name}
    return parse_config(doc, source=str(path))
