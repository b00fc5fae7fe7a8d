"""Sweep configuration: the YAML schema of ``dmlrc sweep CONFIG.yaml`` and its validation.

A config names the datasets, the losses, the model, the protocol (MLRC §1–§2: 4 class-disjoint folds in the
``mlrc`` layout, 50 Bayesian-optimisation trials of which 5 random start-up trials, 10 reproductions, 100-iteration
"epochs", evaluation interval and patience), the resources, MLflow tracking and storage.  The documented examples
are ``configs/{demo,omniglot,mlrc-cub200}.yaml``; the ``demo`` preset is also built in (:mod:`pipelines.config.presets`).

The schema is a set of pydantic models (``extra="forbid"``, strict types, bounds); :func:`sweep_json_schema`
publishes it as JSON Schema (``docs/sweep-config.schema.json``, which editors use to complete and check YAML).
Protocol training defaults are :class:`dml_core.train.TrainConfig`'s field defaults — that dataclass is the one
place deciding them.  :func:`load_config` reads the file (UTF-8, bounded size, duplicate keys and alias bombs
rejected); :func:`parse_config` checks *shape* (keys, types, ranges, URIs) and that every loss exists with a
search space, and never touches the disk or the network; :func:`pipelines.execution.preflight.preflight` then checks
paths, loads the datasets and builds every loss once.  All raise :class:`ConfigError` whose message names the
field, e.g. ``losses[1].name: unknown loss 'mpaa' (known: ...)``.  Nothing (no Ray, no MLflow run, no folder)
starts before they pass.

This module imports neither Ray nor MLflow.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dml_core.train import _AMP_DTYPES, _OPTIMIZERS, TrainConfig
from pipelines.config.errors import ConfigError, FieldError
from pipelines.config.loader import load_yaml, read_yaml_file
from pipelines.config.spaces import LOSS_LR, SearchSpace, SpaceError, load_space, spaces_dir
from pipelines.config.uris import TRACKING_SCHEMES, absolute_tracking_uri, check_tracking_uri, check_uri, redact_uri, shown

__all__ = [
    "ConfigError",
    "DatasetSpec",
    "LossSpec",
    "ModelSpec",
    "ProtocolSpec",
    "ResourcesSpec",
    "TrackingSpec",
    "TrainSpec",
    "SweepConfig",
    "SweepDocument",
    "parse_config",
    "load_config",
    "load_yaml",
    "sweep_json_schema",
    "check_uri",
    "check_tracking_uri",
    "redact_uri",
    "DATASET_KINDS",
    "TRAIN_KEYS",
    "SEED_MAX",
]

#: Dataset kinds: generated data, the Omniglot zips, a prepared parquet manifest (engineer C's format), an image folder.
DATASET_KINDS = ("synthetic", "omniglot", "parquet", "folder")
#: numpy/Optuna seeds are 32-bit; every seed a sweep derives (folds, reproductions) must stay below this.
SEED_MAX = 2**32 - 1
#: Synthetic data is generated in memory (``num_classes × per_class`` H×W×3 uint8 images).
MAX_SYNTHETIC_BYTES = 4 << 30
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: TrainConfig's field defaults: the single source of protocol training defaults (MLRC §1.5, §3).
_TC = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


# --------------------------------------------------------------------------------------------------- URIs

# --------------------------------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    """Base of every config section: unknown keys rejected, no type coercion (``"5"`` is not 5, ``true`` is not
    1), no NaN/inf, immutable; a YAML ``null`` means "the default"."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False,
                              hide_input_in_errors=True, use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _check_name(v: str) -> str:
    if not _NAME_RE.match(v):
        raise ValueError(f"{shown(v)}: use letters, digits, '_', '-', '.' (max 64, no '/')")
    return v


Name = Annotated[str, AfterValidator(_check_name)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]


class _DatasetBase(_Strict):
    name: Name | None = None
    """The MLflow ``dataset`` tag (default: the kind)."""
    classes: int | None = Field(None, ge=2, le=10**7)
    """Keep only the first N sorted classes (quick runs on big datasets; null = all)."""


class SyntheticDataset(_DatasetBase):
    """Generated compositional toy classes (``dml_core.data.synthetic``)."""

    kind: Literal["synthetic"]
    num_classes: int = Field(ge=2, le=100_000)
    per_class: int = Field(ge=2, le=100_000)
    image_size: int = Field(16, ge=8, le=512)
    """Side of the generated images in pixels."""
    seed: Seed | None = None
    """Generator seed (default: the sweep's ``seed``)."""

    @model_validator(mode="after")
    def _fits_in_memory(self):
        nbytes = self.num_classes * self.per_class * self.image_size ** 2 * 3
        if nbytes > MAX_SYNTHETIC_BYTES:
            raise FieldError("num_classes", f"{self.num_classes} classes × {self.per_class} images of {self.image_size}² "
                                     f"pixels need {nbytes / 2**30:.0f} GiB in memory (limit "
                                     f"{MAX_SYNTHETIC_BYTES >> 30} GiB)")
        return self


class _PathDataset(_DatasetBase):
    path: Path_
    image_size: int = Field(227, ge=8, le=1024)
    """Side of the protocol transforms' output (MLRC §3: 227 crops of 256 resizes; 16–32 for smoke runs)."""


class OmniglotDataset(_PathDataset):
    """The Omniglot zips (``path``: the folder holding them)."""

    kind: Literal["omniglot"]


class FolderDataset(_PathDataset):
    """An image folder (``path``: root with one sub-folder per class)."""

    kind: Literal["folder"]


class ParquetDataset(_PathDataset):
    """Shards prepared by ``dmlrc data prepare`` (``path``: local folder, manifest.json or s3:// URI)."""

    kind: Literal["parquet"]


DatasetEntry = Annotated[Union[SyntheticDataset, OmniglotDataset, FolderDataset, ParquetDataset],
                         Field(discriminator="kind")]


class LossEntry(_Strict):
    """A loss to study; a bare string is its name."""

    name: str = Field(min_length=1, max_length=128)
    """Registry name (``dml_core.losses``), e.g. ``contrastive``, ``mpa``, ``xbm:contrastive``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Pinned hyperparameters (removed from the searched space)."""

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


def _set_keys(train: TrainSpec) -> dict[str, Any]:
    # Only what the config sets: unset keys fall back to TrainConfig, the recipe's batch or the loss's metadata.
    return train.model_dump(exclude_unset=True)


class TrainSpec(_Strict):
    """``protocol.train``: further :class:`dml_core.train.TrainConfig` fields (defaults are TrainConfig's)."""

    classes_per_batch: int | None = Field(None, ge=2, le=100_000)
    """Classes per batch (null = the protocol's shared batch, MLRC 8, or the loss paper's with recipe: paper)."""
    m: int | None = Field(None, ge=1, le=10_000)
    """Images per class in a batch (null = as classes_per_batch)."""
    trunk_lr: float = Field(_TC["trunk_lr"], gt=0, le=100)
    embedder_lr: float = Field(_TC["embedder_lr"], gt=0, le=100)
    weight_decay: float = Field(_TC["weight_decay"], ge=0, le=100)
    momentum: float = Field(_TC["momentum"], ge=0, le=1)
    eval_batch_size: int = Field(_TC["eval_batch_size"], ge=1, le=65_536)
    num_workers: int = Field(_TC["num_workers"], ge=0, le=256)
    loss_weight_decay: float | None = Field(None, ge=0, le=100)
    """Weight decay of the loss's own parameters (null = the loss's metadata, else TrainConfig's)."""
    optimizer: Literal[_OPTIMIZERS] = _TC["optimizer"]  # type: ignore[valid-type]
    amp: bool = _TC["amp"]
    amp_dtype: Literal[tuple(_AMP_DTYPES)] = _TC["amp_dtype"]  # type: ignore[valid-type]


#: ``protocol.train`` keys forwarded to :class:`dml_core.train.TrainConfig` (MLRC §3 defaults where they exist).
TRAIN_KEYS = tuple(TrainSpec.model_fields)


class ModelSpec(_Strict):
    """``dml_core.models.build_model`` arguments.  ``pooling``/``layer_norm`` null = the protocol's (or, with
    ``recipe: paper``, the loss paper's) recipe."""

    trunk: Literal["tiny", "resnet18", "resnet50", "googlenet"] = "tiny"
    pooling: str | None = Field(None, max_length=64)
    """avg | max | avg+max | gem | gem:P | kmax:K (null = the recipe's)."""
    layer_norm: bool | None = None
    embedding_dim: int = Field(128, ge=2, le=4096)
    pretrained: Path_ | None = None
    """A local torchvision state_dict file for the trunk (loaded with weights_only=True)."""
    freeze_bn: bool = True

    @field_validator("pooling")
    @classmethod
    def _pooling(cls, v: str | None) -> str | None:
        if v is not None:
            from dml_core.models import parse_pooling

            parse_pooling(v)  # its ValueError says what is accepted
        return v

    @field_validator("pretrained")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if "\x00" in v:
            raise ValueError("contains a NUL character")
        return str(Path(v).expanduser().resolve())

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


class ProtocolSpec(_Strict):
    """MLRC protocol (spec protocol_reality_check.md §1.3–§2.3).

    ``eval_every`` and ``patience`` are in epochs of ``iters_per_epoch`` iterations (MLRC §1.5: CUB 2 / 9).
    ``train`` holds further :class:`dml_core.train.TrainConfig` fields (``TRAIN_KEYS``), as a dict of the keys
    the config sets.
    """

    name: str = Field("mlrc", min_length=1, max_length=64)
    folds: int = Field(4, ge=2, le=10)
    """Class-disjoint cross-validation folds (MLRC §1.3; the mlrc layout has exactly 4)."""
    fold_layout: Literal["mlrc", "kfold"] = "mlrc"
    trials: int = Field(50, ge=1, le=100_000)
    """Bayesian-optimisation trials per study (MLRC: 50)."""
    startup_trials: int = Field(5, ge=0, le=100_000)
    """Random trials before the GP takes over (MLRC: 5 Sobol trials)."""
    sampler: Literal["gp", "tpe"] = "gp"
    """Optuna GPSampler (gp) or TPESampler (tpe)."""
    reproductions: int = Field(10, ge=2, le=1000)
    """Retrainings of the best config; the CI is across these (MLRC: 10)."""
    iters_per_epoch: int = Field(_TC["iters_per_epoch"], ge=1, le=10**7)
    eval_every: int = Field(_TC["eval_every"], ge=1, le=10**6)
    patience: int = Field(_TC["patience"], ge=0, le=10**6)
    max_epochs: int = Field(_TC["max_epochs"], ge=1, le=10**6)
    seed: Seed | None = None
    """Seed of the BO sampler and of fold training (default: the sweep's ``seed``)."""
    train: Annotated[TrainSpec, AfterValidator(_set_keys)] = Field(default_factory=dict)
    #: "protocol": every loss gets the reality check's batch (8 × 4) and model unless ``train``/``model`` say
    #: otherwise (a fair comparison); "paper": each loss's own BatchSpec/ModelRecipe (``loss_info``).
    recipe: Literal["protocol", "paper"] = "protocol"

    @model_validator(mode="after")
    def _consistent(self):
        if self.fold_layout == "mlrc" and self.folds != 4:
            raise FieldError("folds", f"the mlrc layout has exactly 4 folds (got {self.folds}); use fold_layout: kfold")
        if self.max_epochs < self.eval_every:
            raise FieldError("max_epochs", f"{self.max_epochs} must be >= eval_every ({self.eval_every})")
        return self


class ResourcesSpec(_Strict):
    """Ray resources.  ``num_cpus``: logical CPUs of a *local* Ray (null = enough for ``max_concurrent_trials``
    trials × folds × workers; oversubscribing physical cores is fine for tiny models)."""

    workers_per_fold: int = Field(2, ge=1, le=1024)
    """DDP workers per fold (gloo on CPU, NCCL with GPUs)."""
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    gpus_per_worker: float = Field(1.0, gt=0, le=64)
    """With use_gpu; a fraction (e.g. 0.25) lets small folds share a GPU."""
    #: restarts of a fold whose worker died (OOM kill, lost node): the warm task's max_retries or Ray Train's
    #: FailureConfig(max_failures); the fold continues from its last checkpoint (mid_fold_resume), else from scratch
    #: with the same seed.  A failure after the retries fails the trial (status=failed).
    fold_retries: int = Field(1, ge=0, le=100)
    mid_fold_resume: bool = True
    """A restarted fold (fold_retries, or a `--resume`d sweep) continues from its last evaluation's checkpoint
    (stored under the study's folds/<run>/ckpt/) instead of from scratch; false = from scratch (for comparison)."""
    max_concurrent_trials: int = Field(1, ge=1, le=1024)
    num_cpus: int | None = Field(None, ge=1, le=1_000_000)
    fold_executor: Literal["auto", "warm", "train"] = "auto"
    """How a fold runs: "warm" = single-worker folds on reused Ray worker processes (workers_per_fold 1 only),
    "train" = always a Ray Train TorchTrainer, "auto" = warm when workers_per_fold is 1, else train."""
    max_concurrent_studies: int | None = Field(None, ge=1, le=1024)
    """Studies (dataset × loss) in flight at once, each with its own searcher and max_concurrent_trials trials.
    null = on a cluster (--address) no limit (Ray's queue holds the folds that do not fit yet); on the embedded
    local Ray as many studies as its CPUs (and GPUs) hold at full demand — floor(CPUs / (max_concurrent_trials ×
    folds × workers_per_fold × cpus_per_worker)), at least 1 — so a laptop is not oversubscribed."""
    trial_retries: int = Field(0, ge=0, le=100)
    """Reruns of a trial whose Tune actor died (e.g. with its node): Tune FailureConfig(max_failures).  The rerun
    finds its finished folds by their result directories and does not retrain them.  0 = a lost trial errors."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.fold_executor == "warm" and self.workers_per_fold != 1:
            raise FieldError("fold_executor", f"'warm' runs single-worker folds; workers_per_fold is "
                                       f"{self.workers_per_fold} (use 'train' or 'auto')")
        need = self.workers_per_fold * self.cpus_per_worker
        if self.num_cpus is not None and self.num_cpus < need:
            raise FieldError("num_cpus", f"{self.num_cpus} CPUs cannot hold one fold's {self.workers_per_fold} workers × "
                                  f"{self.cpus_per_worker} CPUs = {need:g} (its placement group would wait forever)")
        return self


class TrackingSpec(_Strict):
    """MLflow: ``uri`` null = ``$MLFLOW_TRACKING_URI`` if set, else a sqlite DB inside the sweep's local directory;
    ``experiment`` null = the sweep name."""

    uri: str | None = Field(None, max_length=4096)
    """http(s)://host[:port], sqlite:///path.db or postgresql[+psycopg2]://user@host[:port]/database."""
    experiment: str | None = Field(None, max_length=256)
    outage_timeout_s: float = Field(300.0, ge=10.0, le=900.0)
    """How long the tracking server (or PostgreSQL store) may stay unreachable mid-sweep before the sweep stops with
    one message and its state kept for `--resume` (a shorter outage is ridden out: MLflow's HTTP retries are set to
    outlast it).  At most 900 s: MLflow allows 10 retries of at most 120 s back-off each."""

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_tracking_uri(v, "")
            except ConfigError as e:
                raise ValueError(e.problem) from None
        return v

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v


class SweepDocument(_Strict):
    """A sweep config file (``dmlrc sweep CONFIG.yaml``); see configs/demo.yaml for a commented example."""

    model_config = ConfigDict(title="dmlrc sweep config")

    name: Name
    """Sweep name: MLflow experiment (unless tracking.experiment) and folder <storage>/<name>/."""
    seed: Seed = 0
    """Base seed (BO sampler, fold training; reproduction i uses seed + 1000·(i+1))."""
    tune_spaces: Path_ | None = None
    """Folder of <loss>.yaml search spaces (default: the repository's tune_spaces/)."""
    datasets: list[DatasetEntry] = Field(min_length=1, max_length=100)
    losses: list[LossEntry] = Field(min_length=1, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    storage: Path_ = "runs"
    """Local folder (<storage>/<name>/) or s3://bucket/prefix for Ray Tune/Train state."""

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        try:
            return check_uri(v, "")
        except ConfigError as e:
            raise ValueError(e.problem) from None

    @model_validator(mode="after")
    def _consistent(self):
        for key, items in (("datasets", self.datasets), ("losses", self.losses)):
            seen: dict[str, int] = {}
            for i, item in enumerate(items):
                n = item.name or getattr(item, "kind", None)
                if n in seen:
                    raise FieldError(f"{key}[{i}].name", f"{n!r} already listed as {key}[{seen[n]}]")
                seen[n] = i
        p = self.protocol
        base = p.seed if p.seed is not None else self.seed
        top = base + 1000 * p.reproductions + p.folds - 1  # pipelines.execution.trial.reproduction_seed + fold index
        if top > SEED_MAX:
            raise FieldError("protocol.seed" if p.seed is not None else "seed",
                      f"{base} is too large: reproduction and fold seeds reach {top} > 2**32-1 = {SEED_MAX}")
        return self


def sweep_json_schema() -> dict[str, Any]:
    """The JSON Schema of a sweep config (published as ``docs/sweep-config.schema.json``)."""
    schema = SweepDocument.model_json_schema()
    # A loss may be a bare name (LossEntry's before-validator), which pydantic's schema cannot see.
    schema["properties"]["losses"]["items"] = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/LossEntry"}]}
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


# --------------------------------------------------------------------------------------------------- results


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
        ``$MLFLOW_TRACKING_URI``, else a sqlite DB in the sweep's local directory.  It may hold a password:
        print :func:`redact_uri` of it."""
        uri = self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return absolute_tracking_uri(uri)
        return "sqlite:///" + str(self.local_dir() / "mlflow.db")

    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (what ``--resume`` compares against the stored copy, ``sweep_config.json``, MLflow):
        passwords in URIs are redacted."""

        def plain(obj):
            if isinstance(obj, BaseModel):
                return {k: plain(getattr(obj, k)) for k in type(obj).model_fields}
            if dataclasses.is_dataclass(obj) and not isinstance(obj, SearchSpace):
                return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "space"}
            if isinstance(obj, (list, tuple)):
                return [plain(x) for x in obj]
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            if isinstance(obj, str):
                return redact_uri(obj)
            return obj

        d = plain(self)
        d.pop("source", None)
        return d


# --------------------------------------------------------------------------------------------------- errors

_KIND_NAMES = {"int": "an integer", "float": "a number", "string": "a string", "bool": "true/false",
               "dict": "a mapping", "model": "a mapping", "list": "a list"}


def _path(loc: tuple) -> str:
    """Pydantic error location → ``losses[1].params.margin`` (discriminated-union tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int) and not (i >= 1 and loc[i - 1] == "params"):
            out += f"[{part}]"
            continue
        if part in DATASET_KINDS and i >= 2 and loc[i - 2] == "datasets" and isinstance(loc[i - 1], int):
            continue
        out += f".{part}" if out else str(part)
    return out


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model class validating the object at ``loc`` (for "allowed here" lists)."""
    model: Any = SweepDocument
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if model is SweepDocument and part == "datasets":
            if len(parts) >= 2 and isinstance(parts[0], int):
                model = {"synthetic": SyntheticDataset, "omniglot": OmniglotDataset, "folder": FolderDataset,
                         "parquet": ParquetDataset}.get(parts[1])
                parts = parts[2:]
                continue
            return None
        if model is SweepDocument and part == "losses":
            model = LossEntry
            parts = parts[1:]
            continue
        sub = {"model": ModelSpec, "protocol": ProtocolSpec, "resources": ResourcesSpec, "tracking": TrackingSpec,
               "train": TrainSpec}.get(part) if isinstance(part, str) else None
        if sub is None or part not in getattr(model, "model_fields", {}):
            return None
        model = sub
    return model


def _to_config_error(e: ValidationError) -> ConfigError:
    """The first pydantic error as one ``<field>: <problem>`` (plus how many more there are)."""
    errors = e.errors(include_url=False)
    err = errors[0]
    loc, kind, ctx, value = tuple(err["loc"]), err["type"], err.get("ctx") or {}, err.get("input")
    where = _path(loc)
    if kind == "value_error" and isinstance(ctx.get("error"), FieldError):
        rel = ctx["error"].path
        where = f"{where}.{rel}" if where and not rel.startswith("[") else f"{where}{rel}"
        problem = str(ctx["error"])
    elif kind in ("value_error", "assertion_error"):
        problem = redact_uri(str(ctx.get("error") or err["msg"]))
    elif kind == "missing":
        problem = "is required"
    elif kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = f" (allowed here: {', '.join(sorted(model.model_fields))})" if model else ""
        problem = f"unknown key{allowed}"
    elif kind.endswith("_type") and kind[: -len("_type")] in _KIND_NAMES:
        problem = f"expected {_KIND_NAMES[kind[: -len('_type')]]}, got {shown(value)}"
    elif kind == "finite_number":
        problem = f"{shown(value)} must be a finite number"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op, bound = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                     "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}[kind]
        problem = f"{shown(value)} must be {op} {ctx[bound]}"
    elif kind == "literal_error":
        problem = f"{shown(value)} is not one of {ctx.get('expected')}"
    elif kind == "too_short" and loc in (("datasets",), ("losses",)):
        problem = f"needs at least one {loc[0][:-1] if loc[0] == 'datasets' else 'loss'}"
    elif kind == "too_long":
        problem = f"has more than {ctx.get('max_length')} entries"
    elif kind == "string_too_long":
        problem = f"longer than {ctx.get('max_length')} characters"
    elif kind == "string_too_short":
        problem = "must not be empty"
    elif kind == "union_tag_not_found":
        where, problem = f"{where}.kind", f"is required (one of {', '.join(DATASET_KINDS)})"
    elif kind == "union_tag_invalid":
        where = f"{where}.kind"
        problem = f"unknown dataset kind {shown(ctx.get('tag'))} (known: {', '.join(DATASET_KINDS)})"
    else:
        problem = redact_uri(err["msg"])
    if len(errors) > 1:
        problem += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ConfigError(where or "config", problem)


# --------------------------------------------------------------------------------------------------- parsing


def _loss_spec(entry: LossEntry, where: str, space_dir: Path | None, custom_spaces: bool) -> LossSpec:
    """The registry decides what exists; imported here so that a config error never needs Ray or MLflow."""
    from dml_core.losses import list_losses, list_wrappers, loss_info

    name = entry.name
    try:
        loss_info(name)
    except ValueError:
        known = list_losses() + [f"{w}:<base>" for w in list_wrappers()]
        raise ConfigError(f"{where}.name", f"unknown loss {shown(name)} (known: {', '.join(known)})") from None
    try:
        space = load_space(name, space_dir)
    except SpaceError as e:
        # A broken file in the user's own tune_spaces folder is that folder's fault; a missing space is the loss's.
        blame = "tune_spaces" if custom_spaces and not str(e).startswith("no search space") else f"{where}.name"
        raise ConfigError(blame, " ".join(str(e).split())) from None
    for k, v in entry.params.items():
        p = space.params.get(k)
        if k == LOSS_LR and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise ConfigError(f"{where}.params.{k}", f"{shown(v)} must be a positive number")
        if p is not None and not p.contains(v):
            raise ConfigError(f"{where}.params.{k}",
                              f"{shown(v)} is outside the search space of {name!r} ({p.describe()})")
    return LossSpec(name, dict(entry.params), space)


def _dataset_spec(d: Any, where: str, default_seed: int) -> DatasetSpec:
    name = d.name or d.kind
    if d.kind == "synthetic":
        return DatasetSpec(name, d.kind, d.image_size, num_classes=d.num_classes, per_class=d.per_class,
                           seed=d.seed if d.seed is not None else default_seed, classes=d.classes)
    path = check_uri(d.path, f"{where}.path", allow_s3=(d.kind == "parquet"))
    if not path.startswith("s3://"):
        # Absolute, because Ray Train workers run in their own working directory (and may open shards lazily).
        path = str(Path(path).expanduser().resolve())
    return DatasetSpec(name, d.kind, d.image_size, path=path, classes=d.classes)


def parse_config(doc: Any, *, source: str | None = None) -> SweepConfig:
    """Validate a config mapping (already YAML-parsed) and return the typed :class:`SweepConfig`.

    Checks keys, types, ranges and URI shapes (the pydantic :class:`SweepDocument`), that every loss exists in the
    registry and has a search space, and that pinned parameters lie inside it.  Building every loss and loading
    every dataset is :mod:`pipelines.execution.preflight`.
    """
    if not isinstance(doc, dict):
        raise ConfigError(source or "config", f"expected a mapping at the top level, got {type(doc).__name__}")
    try:
        d = SweepDocument.model_validate(doc)
    except ValidationError as e:
        raise _to_config_error(e) from None
    except RecursionError:
        raise ConfigError(source or "config", "nested too deeply") from None

    space_dir = Path(d.tune_spaces) if d.tune_spaces else spaces_dir()
    if space_dir is not None and not space_dir.is_dir():
        raise ConfigError("tune_spaces", f"directory {shown(d.tune_spaces)} does not exist")
    datasets = tuple(_dataset_spec(x, f"datasets[{i}]", d.seed) for i, x in enumerate(d.datasets))
    losses = tuple(_loss_spec(x, f"losses[{i}]", space_dir, d.tune_spaces is not None)
                   for i, x in enumerate(d.losses))

    protocol = d.protocol
    if protocol.seed is None:
        protocol = protocol.model_copy(update={"seed": d.seed})
    if d.tracking.uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        check_tracking_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI (environment, used as tracking.uri)")
    return SweepConfig(d.name, datasets, losses, d.model, protocol, d.resources, d.tracking, d.storage,
                       str(space_dir) if space_dir is not None else None, source)


def load_config(path: str | os.PathLike, *, name: str | None = None) -> SweepConfig:
    """Read and validate ``CONFIG.yaml`` (:func:`read_yaml_file`: a missing, unreadable, non-UTF-8 or unparsable
    file is a :class:`ConfigError` naming it).  ``name`` overrides the sweep name (e.g. a dated name for scheduled
    re-runs of the same config)."""
    src = str(path)
    doc = read_yaml_file(path)
    if name is not None and isinstance(doc, dict):
        doc = {**doc, "name": name}
    return parse_config(doc, source=src)
