"""Sweep configuration: the YAML schema of ``dmlrc sweep CONFIG.yaml``, one set of pydantic models.

A config names the datasets, the losses, the model, the protocol (the reality check's 4 class-disjoint folds in the
``mlrc`` layout, 50 Bayesian-optimisation trials of which 5 random start-up trials, 10 reproductions, 100-iteration
"epochs", evaluation interval and patience), the resources, MLflow tracking, storage and the Ray ``runtime_env`` that
carries a user's own code to the workers.  ``configs/*.yaml`` are documented examples, shipped with the ``demo``
preset as package data (:mod:`pipelines.config.presets`; ``dmlrc init`` copies one).

:class:`SweepConfig` is the validated document itself (``extra="forbid"``, strict types, bounds, frozen); its
``model_dump(mode="json")`` is what is written to disk and MLflow, with passwords in URIs redacted.
:func:`sweep_json_schema` publishes it as JSON Schema (``docs/sweep-config.schema.json``, which editors use to complete
and check YAML).  Protocol training defaults are :class:`dml_core.train.TrainConfig`'s field defaults — that dataclass
is the one place deciding them.

:func:`load_config` reads the file through the hardened loader; :func:`parse_config` checks shape (keys, types,
ranges, URIs), that every loss resolves (built-in, entry point or import path) with a search space, and that pinned
parameters lie inside it; :func:`pipelines.execution.preflight.preflight` then checks paths, loads the datasets and
builds every loss.  Errors are :class:`ConfigError` whose field is pydantic's own error location, e.g.
``losses[1].name: unknown loss 'mpaa' (known: ...)``, every problem of the document at once (``ConfigError.more``).
Nothing (no Ray, no MLflow run, no folder) starts before they pass.  This module imports neither Ray nor MLflow.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dml_core.models import parse_pooling
from dml_core.train import _AMP_DTYPES, _OPTIMIZERS, TrainConfig
from dml_core.trunks import check_trunk
from pipelines.config.errors import ConfigError, FieldError, did_you_mean, plain_problem
from pipelines.config.loader import read_yaml_file
from pipelines.config.spaces import (
    LOSS_LR,
    SearchSpace,
    SpaceError,
    builtin_spaces,
    is_flat,
    load_space,
    parse_space,
    read_space_file,
    spaces_dir,
)
from pipelines.config.strict import StrictModel
from pipelines.config.uris import absolute_tracking_uri, check_tracking_uri, check_uri, local_path, redact_uri, shown

__all__ = [
    "SweepConfig",
    "DatasetSpec",
    "LossSpec",
    "ModelSpec",
    "ProtocolSpec",
    "ResourcesSpec",
    "TrackingSpec",
    "TrainSpec",
    "RuntimeEnvSpec",
    "parse_config",
    "load_config",
    "sweep_json_schema",
    "DATASET_KINDS",
    "TRAIN_KEYS",
    "SEED_MAX",
]

#: Dataset kinds: generated data, the Omniglot zips, prepared parquet shards, an image folder, a CSV listing.
DATASET_KINDS = ("synthetic", "omniglot", "parquet", "folder", "csv")
#: numpy/Optuna seeds are 32-bit; every seed a sweep derives (folds, reproductions) must stay below this.
SEED_MAX = 2**32 - 1
#: Synthetic data is generated in memory (``num_classes × per_class`` H×W×3 uint8 images).
MAX_SYNTHETIC_BYTES = 4 << 30
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: TrainConfig's field defaults: the single source of protocol training defaults.
_TC = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
#: The largest GeM power a config may set (``model.pooling: gem:P``).
GEM_P_MAX = 16.0
#: Environment variables that hold credentials: never in a runtime_env (Ray logs runtime_envs in plain text).
_SECRET_ENV = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY)", re.I)


def _check_name(v: str) -> str:
    if not _NAME_RE.fullmatch(v):  # fullmatch: "$" would let a trailing newline through
        raise ValueError(f"{shown(v)}: use letters, digits, '_', '-', '.' (max 64, no '/')")
    return v


def _local_or_s3(v: str) -> str:
    try:
        return check_uri(v, "")
    except ConfigError as e:
        raise ValueError(e.problem) from None


def _absolute(v: str) -> str:
    """A local path made absolute (``~`` expanded; a symbolic-link loop is an error); ``s3://`` kept."""
    if v.startswith("s3://"):
        return v
    try:
        return str(local_path(v, ""))
    except ConfigError as e:
        raise ValueError(e.problem) from None


def _tracking(v: str) -> str:
    try:
        return check_tracking_uri(v, "")
    except ConfigError as e:
        raise ValueError(e.problem) from None


Name = Annotated[str, AfterValidator(_check_name)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
#: A location that may carry credentials (``scheme://user:password@host``): written to disk and MLflow redacted.
Uri = Annotated[str, Field(min_length=1, max_length=4096), PlainSerializer(redact_uri, when_used="json")]


# --------------------------------------------------------------------------------------------------- datasets


class _DatasetBase(StrictModel):
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
        nbytes = self.num_classes * self.per_class * self.image_size**2 * 3
        if nbytes > MAX_SYNTHETIC_BYTES:
            raise FieldError(
                "num_classes",
                f"{self.num_classes} classes × {self.per_class} images of "
                f"{self.image_size}² pixels need {nbytes / 2**30:.0f} GiB in memory "
                f"(limit {MAX_SYNTHETIC_BYTES >> 30} GiB)",
            )
        return self


class _PathDataset(_DatasetBase):
    path: Uri
    image_size: int = Field(227, ge=8, le=1024)
    """Side of the protocol transforms' output (the reality check: 227 crops of 256 resizes; 16–32 for smoke runs)."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        # Absolute, because Ray workers run in their own working directory (and may open shards lazily).
        return _absolute(_local_or_s3(v))


class OmniglotDataset(_PathDataset):
    """The Omniglot zips (``path``: the folder holding them)."""

    kind: Literal["omniglot"]

    @field_validator("path")
    @classmethod
    def _local(cls, v: str) -> str:
        if v.startswith("s3://"):
            raise ValueError("the Omniglot zips are read from a local folder (prepare shards for s3://)")
        return v


class FolderDataset(_PathDataset):
    """An image folder (``path``: root with one sub-folder per class)."""

    kind: Literal["folder"]


class ParquetDataset(_PathDataset):
    """Shards prepared by ``dmlrc data prepare`` (``path``: local folder, manifest.json or s3:// URI)."""

    kind: Literal["parquet"]


class CsvDataset(_PathDataset):
    """A CSV listing ``path,label`` (+ optional ``split``, ``query``, ``gallery``, ``class_name``), local or
    ``s3://`` (docs/datasets.md)."""

    kind: Literal["csv"]
    root: Uri | None = None
    """Folder the CSV's paths are relative to (default: the CSV's own folder)."""

    @field_validator("root")
    @classmethod
    def _root(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return _absolute(_local_or_s3(v))


DatasetSpec = Annotated[
    Union[SyntheticDataset, OmniglotDataset, FolderDataset, ParquetDataset, CsvDataset], Field(discriminator="kind")
]


# --------------------------------------------------------------------------------------------------- losses


class LossSpec(StrictModel):
    """A loss to study; a bare string is its name.  Its search space is, first found: ``space`` here, the user's
    ``tune_spaces`` folder, the space its plugin ships, the built-in one."""

    name: str = Field(min_length=1, max_length=256)
    """A built-in name (``contrastive``, ``mpa``, ``sec:triplet``), an installed plugin's entry point
    (group ``dml_reality_check.losses``) or an import path ``package.module:attribute``; wrappers apply to any of
    them (``sec:mylab.losses:CircleLoss``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Pinned hyperparameters (removed from the searched space)."""
    space: dict[str, Any] | Path_ | None = None
    """This loss's search space: the searched parameters directly (``{margin: {low: 0.1, high: 1.0}}``, with
    ``fixed`` and ``paper_defaults`` beside ``space``), a mapping with the keys of ``tune_spaces/*.yaml`` (``space``,
    ``fixed``, ``paper_defaults``) or the path of such a YAML file.  Overrides every other space of this loss."""
    fixed: dict[str, Any] | None = None
    """With a ``space`` that holds the parameters directly: the values that are not searched."""
    paper_defaults: dict[str, Any] | None = None
    """With a ``space`` that holds the parameters directly: the paper's values (inside the space)."""

    _space: SearchSpace | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("space", mode="before")
    @classmethod
    def _space_shape(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError(
                f"expected a search space (a mapping with space / fixed / paper_defaults) or the path of "
                f"such a YAML file, got {shown(v)}"
            )
        return v

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo):
        ctx = info.context or {}
        if not ctx.get("resolve", True):
            return self
        _resolve_loss(self.name)
        beside = [k for k in ("fixed", "paper_defaults") if getattr(self, k) is not None]
        if beside and not is_flat(self.space):
            raise FieldError(
                beside[0],
                "goes beside a space that holds the parameters directly (space: {margin: {low: .., high: ..}}, "
                f"{beside[0]}: {{..}}); "
                + (
                    f"this space has its own keys ({', '.join(sorted(self.space))}): put {beside[0]} inside it"
                    if isinstance(self.space, dict) and self.space
                    else f"put {beside[0]} in the space's file"
                    if isinstance(self.space, str)
                    else "give the space too"
                ),
            )
        if isinstance(self.space, dict):
            doc = self.space
            if is_flat(doc):
                doc = {"space": doc, "fixed": self.fixed or {}, "paper_defaults": self.paper_defaults or {}}
            try:
                space = parse_space(doc, f"the inline space of {self.name!r}", self.name)
            except SpaceError as e:
                detail = _detail(e, f"the inline space of {self.name!r}")
                key, sep, problem = detail.partition(": ")
                if doc is not self.space and sep and key.startswith(("paper_defaults.", "fixed.")):
                    raise FieldError(key, problem) from None  # a value given beside the flat space: named there
                raise FieldError("space", detail) from None
        elif isinstance(self.space, str):
            try:
                space = read_space_file(Path(self.space).expanduser(), self.name)
            except SpaceError as e:
                raise FieldError("space", " ".join(str(e).split())) from None
        else:
            try:
                space = load_space(self.name, ctx.get("spaces_dir"))
            except SpaceError as e:
                text = " ".join(str(e).split())
                # A broken file in the user's own folder is that folder's fault; a missing space is the loss's.
                if ctx.get("spaces_dir") is not None and not text.startswith("no search space"):
                    raise FieldError("@tune_spaces", text) from None
                raise FieldError("name", text) from None
        if space.loss != self.name:
            raise FieldError("space", f"the space is for loss {space.loss!r}, not {self.name!r}")
        for k, v in self.params.items():
            p = space.params.get(k)
            if k == LOSS_LR and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
                raise FieldError(f"params.{k}", f"{shown(v)} must be a positive number")
            if p is not None and not p.contains(v):
                raise FieldError(
                    f"params.{k}", f"{shown(v)} is outside the search space of {self.name!r} ({p.describe()})"
                )
        self._space = space
        return self

    @property
    def search_space(self) -> SearchSpace:
        """The resolved search space (set by validation)."""
        if self._space is None:
            raise RuntimeError(f"loss {self.name!r} was validated without resolving its search space")
        return self._space

    def searched(self) -> dict:
        """The Param objects the optimiser searches (the search space minus pinned ones)."""
        return {k: p for k, p in self.search_space.params.items() if k not in self.params}

    def fixed_values(self) -> dict[str, Any]:
        """Non-searched values: the space's ``fixed`` plus the pinned ``params``."""
        return {**self.search_space.fixed, **self.params}


def _detail(e: Exception, source: str) -> str:
    text = " ".join(str(e).split())
    return text[len(source) + 2 :] if text.startswith(source + ": ") else text


def _exited(e: SystemExit, what: str) -> str:
    """The problem of a plugin that called ``sys.exit()`` (raised ``SystemExit``) while it was imported or built."""
    from dml_core.plugins import raised_at  # dml_core.plugins: the plugin's own file:line, as for its other errors

    return f"{what}: its code called sys.exit({e.code!r}){raised_at(e)}; a plugin must raise an exception, not exit"


def _resolve_loss(name: str) -> None:
    """The registry decides what exists.  Imported here, not at module level: the loss zoo (pytorch-metric-learning)
    takes seconds to import, and a config error must print at once."""
    # not at module level: the loss zoo takes seconds to import (see the docstring)
    from dml_core.losses import LossPluginError, list_losses, list_wrappers, loss_info

    try:
        loss_info(name)
    except LossPluginError as e:
        raise FieldError("name", " ".join(str(e).split())) from None
    except SystemExit as e:  # a plugin's module that calls sys.exit() when imported: not the sweep's exit
        raise FieldError("name", _exited(e, f"loss {name!r}")) from None
    except ValueError:
        known = list_losses() + [f"{w}:<base>" for w in list_wrappers()]
        raise FieldError(
            "name",
            f"unknown loss {shown(name)} (known: {', '.join(known)}; or an installed plugin's name, or an import path "
            f"'package.module:attribute'){did_you_mean(name, list_losses())}",
        ) from None


class AllLosses(StrictModel):
    """``losses: {all: true, exclude: [...]}``: every built-in loss that has a search space, minus ``exclude``."""

    all: Literal[True]
    exclude: list[str] = Field(default_factory=list, max_length=200)


def _expand_all(value: Any, spaces: dict[str, SearchSpace]) -> Any:
    """``losses: all`` / ``{all: true, exclude: [...]}`` → the list of built-in loss names with a search space."""
    if value == "all":
        value = {"all": True}
    if not isinstance(value, dict) or "all" not in value:
        return value
    try:
        spec = AllLosses.model_validate(value)
    except ValidationError as e:
        raise _to_config_error(e, prefix=("losses",), root=AllLosses) from None
    unknown = [x for x in spec.exclude if x not in spaces]
    if unknown:
        i = spec.exclude.index(unknown[0])
        raise ConfigError(
            f"losses.exclude[{i}]",
            f"{shown(unknown[0])} is not one of the built-in losses{did_you_mean(unknown[0], spaces)} "
            f"({', '.join(sorted(spaces))})",
        )
    return [n for n in sorted(spaces) if n not in spec.exclude]


# --------------------------------------------------------------------------------------------------- model


def _set_keys(train: TrainSpec) -> dict[str, Any]:
    # Only what the config sets: unset keys fall back to TrainConfig, the recipe's batch or the loss's metadata.
    return train.model_dump(exclude_unset=True)


class TrainSpec(StrictModel):
    """``protocol.train``: further :class:`dml_core.train.TrainConfig` fields (defaults are TrainConfig's)."""

    classes_per_batch: int | None = Field(None, ge=2, le=100_000)
    """Classes per batch (null = the protocol's shared batch, 8, or the loss paper's with recipe: paper)."""
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
    optimizer: Literal[_OPTIMIZERS] = _TC["optimizer"]  # type: ignore[valid-type]  # a Literal over the tuple's values
    amp: bool = _TC["amp"]
    amp_dtype: Literal[tuple(_AMP_DTYPES)] = _TC["amp_dtype"]  # type: ignore[valid-type]  # a Literal over the values
    cpu_amp: bool = _TC["cpu_amp"]
    """bfloat16 autocast of the training forward on CPU (not exact; faster only with native bf16: AVX512-BF16/AMX)."""
    channels_last: bool = _TC["channels_last"]
    """Channels-last (NHWC) model and batches (oneDNN's preferred layout on CPU)."""


#: ``protocol.train`` keys forwarded to :class:`dml_core.train.TrainConfig`.
TRAIN_KEYS = tuple(TrainSpec.model_fields)


class ModelSpec(StrictModel):
    """``dml_core.models.build_model`` arguments.  ``pooling``/``layer_norm`` null = the protocol's (or, with
    ``recipe: paper``, the loss paper's) recipe."""

    trunk: str = Field("tiny", min_length=1, max_length=256)
    """tiny | resnet18 | resnet50 | googlenet | bninception | timm:<name> | an installed plugin's trunk (entry-point
    group dml_reality_check.trunks) | an import path package.module:attribute (docs/trunks.md)."""
    pooling: str | None = Field(None, max_length=64)
    """avg | max | avg+max | gem | gem:P | kmax:K (null = the recipe's)."""
    layer_norm: bool | None = None
    embedding_dim: int = Field(128, ge=2, le=4096)
    pretrained: Uri | None = None
    """The trunk's weights: a local file or s3:// URI, read where each model is built (weights_only=True).
    Registered models never need it: their own weights are logged with them."""
    freeze_bn: bool = True

    @field_validator("trunk")
    @classmethod
    def _trunk(cls, v: str) -> str:
        try:
            check_trunk(v)  # its ValueError names the trunk and what is known
        except SystemExit as e:  # a plugin's module that calls sys.exit() when imported
            raise ValueError(_exited(e, f"trunk {v!r}")) from None
        return v

    @field_validator("pooling")
    @classmethod
    def _pooling(cls, v: str | None) -> str | None:
        if v is not None:
            kind, arg = parse_pooling(v)  # its ValueError says what is accepted
            if kind == "gem" and arg > GEM_P_MAX:
                raise ValueError(
                    f"{shown(v)}: GeM's p must be <= {GEM_P_MAX:g} (x^p underflows or overflows float32 beyond: the "
                    "embeddings stop depending on the image); GeM with a large p is max pooling: use 'max'"
                )
        return v

    @field_validator("pretrained")
    @classmethod
    def _pretrained(cls, v: str | None) -> str | None:
        if v is None:
            return v
        # A local file is named absolutely so that every process on this machine (or a shared mount) finds it.
        return _absolute(_local_or_s3(v))

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


# --------------------------------------------------------------------------------------------------- protocol


class ProtocolSpec(StrictModel):
    """The reality check's protocol (docs/protocol.md).

    ``eval_every`` and ``patience`` are in epochs of ``iters_per_epoch`` iterations (the reality check on CUB: 2 / 9).
    ``train`` holds further :class:`dml_core.train.TrainConfig` fields (``TRAIN_KEYS``), as a dict of the keys
    the config sets.
    """

    name: str = Field("mlrc", min_length=1, max_length=64)
    folds: int = Field(4, ge=2, le=10)
    """Class-disjoint cross-validation folds (the mlrc layout has exactly 4)."""
    fold_layout: Literal["mlrc", "kfold"] = "mlrc"
    trials: int = Field(50, ge=1, le=100_000)
    """Bayesian-optimisation trials per study (the reality check: 50)."""
    startup_trials: int = Field(5, ge=0, le=100_000)
    """Random trials before the GP takes over (the reality check: 5 Sobol trials)."""
    sampler: Literal["gp", "tpe"] = "gp"
    """Optuna GPSampler (gp) or TPESampler (tpe)."""
    reproductions: int = Field(10, ge=2, le=1000)
    """Retrainings of the best config; the CI is across these (the reality check: 10)."""
    iters_per_epoch: int = Field(_TC["iters_per_epoch"], ge=1, le=10**7)
    eval_every: int = Field(_TC["eval_every"], ge=1, le=10**6)
    patience: int = Field(_TC["patience"], ge=0, le=10**6)
    max_epochs: int = Field(_TC["max_epochs"], ge=1, le=10**6)
    seed: Seed | None = None
    """Seed of the BO sampler and of fold training (default: the sweep's ``seed``)."""
    train: Annotated[TrainSpec, AfterValidator(_set_keys), PlainSerializer(dict)] = Field(default_factory=dict)
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


# --------------------------------------------------------------------------------------------------- resources


class ResourcesSpec(StrictModel):
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
            raise FieldError(
                "fold_executor",
                f"'warm' runs single-worker folds; workers_per_fold is {self.workers_per_fold} (use 'train' or 'auto')",
            )
        need = self.workers_per_fold * self.cpus_per_worker
        if self.num_cpus is not None and self.num_cpus < need:
            raise FieldError(
                "num_cpus",
                f"{self.num_cpus} CPUs cannot hold one fold's {self.workers_per_fold} "
                f"workers × {self.cpus_per_worker} CPUs = {need:g} (its placement group "
                "would wait forever)",
            )
        return self


def _virtualenv_installed() -> bool:
    """Whether Ray can build a ``runtime_env.pip`` environment here (it needs the virtualenv package)."""
    import importlib.util  # stdlib; only when a config has pip entries

    return importlib.util.find_spec("virtualenv") is not None


class RuntimeEnvSpec(StrictModel):
    """Ray's ``runtime_env`` for every process of the sweep (trial drivers, warm fold workers, Ray Train workers), on
    the embedded local Ray and on a cluster: how a user's own loss, trunk or dataset code reaches them.  The driver
    imports the same code (``py_modules`` and ``working_dir`` are put on its ``sys.path``).  Credentials never travel
    here (Ray logs runtime_envs in plain text): use the cluster's own credential chain."""

    py_modules: list[Path_] = Field(default_factory=list, max_length=100)
    """Local package folders (or .whl / .zip files) shipped to every worker and importable there."""
    working_dir: Path_ | None = None
    """A local folder uploaded to every worker and made its working directory (importable, too)."""
    pip: list[str] = Field(default_factory=list, max_length=200)
    """Installable distributions (pip requirement strings) installed in every worker's environment."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """Further environment variables for every worker (no credentials)."""
    excludes: list[str] = Field(default_factory=list, max_length=200)
    """Files of working_dir / py_modules not to upload (gitignore-style patterns)."""

    @field_validator("py_modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        out = []
        for i, p in enumerate(v):
            path = Path(p).expanduser()
            if not path.exists():
                raise FieldError(f"[{i}]", f"{shown(p)} does not exist (a local package folder or .whl/.zip file)")
            out.append(str(path.resolve()))
        return out

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(v).expanduser()
        if not path.is_dir():
            raise ValueError(f"{shown(v)} is not a folder")
        return str(path.resolve())

    @field_validator("pip")
    @classmethod
    def _pip(cls, v: list[str]) -> list[str]:
        if v and not _virtualenv_installed():
            raise ValueError(
                "Ray installs runtime_env pip packages into a virtualenv, and the virtualenv package is not "
                "installed: pip install virtualenv (on every node), or install the packages on every node yourself "
                "and leave runtime_env.pip out"
            )
        return v

    @field_validator("env_vars")
    @classmethod
    def _no_credentials(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise FieldError(f".{k}", "is not an environment variable name")
            if _SECRET_ENV.search(k):
                raise FieldError(
                    f".{k}",
                    "looks like a credential; credentials never travel in a runtime_env (Ray "
                    "logs it in plain text): give the workers their own credentials",
                )
            if redact_uri(v[k]) != v[k]:  # a password in a URI, a ?token= / ?api_key= query parameter
                raise FieldError(
                    f".{k}",
                    "its value holds a credential (a password in a URI or a secret query parameter); credentials "
                    "never travel in a runtime_env (Ray logs it, the sweep writes its config to disk and MLflow): "
                    "give the workers their own (their environment, instance role or AWS shared credentials file)",
                )
        return v

    def ray_runtime_env(self) -> dict[str, Any]:
        """The ``runtime_env`` mapping for Ray (empty keys left out)."""
        out: dict[str, Any] = {}
        if self.py_modules:
            out["py_modules"] = list(self.py_modules)
        if self.working_dir:
            out["working_dir"] = self.working_dir
        if self.pip:
            out["pip"] = list(self.pip)
        if self.env_vars:
            out["env_vars"] = dict(self.env_vars)
        if self.excludes:
            out["excludes"] = list(self.excludes)
        return out

    def driver_paths(self) -> list[str]:
        """What the driver puts on ``sys.path`` so that it imports the code the workers get: each py_module's parent
        folder (a package folder is imported by its name), each .whl/.zip itself, and working_dir."""
        paths = []
        for p in self.py_modules:
            path = Path(p)
            paths.append(str(path if path.is_file() else path.parent))
        if self.working_dir:
            paths.append(self.working_dir)
        return paths

    def activate_on_driver(self) -> None:
        """Make the user's code importable in this process (idempotent)."""
        for p in reversed(self.driver_paths()):
            if p not in sys.path:
                sys.path.insert(0, p)


# --------------------------------------------------------------------------------------------------- tracking


class TrackingSpec(StrictModel):
    """MLflow: ``uri`` null = ``$MLFLOW_TRACKING_URI`` if set, else a sqlite DB inside the sweep's local directory;
    ``experiment`` null = the sweep name."""

    uri: Annotated[Uri, AfterValidator(_tracking)] | None = None
    """http(s)://host[:port], sqlite:///path.db or postgresql[+psycopg2]://user@host[:port]/database."""
    experiment: str | None = Field(None, max_length=256)
    outage_timeout_s: float = Field(300.0, ge=10.0, le=900.0)
    """How long the tracking server (or PostgreSQL store) may stay unreachable mid-sweep before the sweep stops with
    one message and its state kept for `--resume` (a shorter outage is ridden out: MLflow's HTTP retries are set to
    outlast it).  At most 900 s: MLflow allows 10 retries of at most 120 s back-off each."""

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        if v is not None and re.search(r"[\x00-\x1f\x7f]", v):
            raise ValueError(
                f"{shown(v)} contains a control character (a newline or tab breaks the printed "
                "commands and the MLflow UI)"
            )
        return v


# --------------------------------------------------------------------------------------------------- the sweep


class SweepConfig(StrictModel):
    """A sweep config file (``dmlrc sweep CONFIG.yaml``); `dmlrc init` lists commented presets and copies one."""

    model_config = ConfigDict(title="dmlrc sweep config")

    name: Name
    """Sweep name: MLflow experiment (unless tracking.experiment) and folder <storage>/<name>/."""
    seed: Seed = 0
    """Base seed (BO sampler, fold training; reproduction i uses seed + 1000·(i+1))."""
    tune_spaces: Path_ | None = None
    """A folder of your own <loss>.yaml search spaces: they add to and override the built-in ones, loss by loss
    (default: $DMLRC_TUNE_SPACES, else none)."""
    datasets: list[DatasetSpec] = Field(min_length=1, max_length=100)
    losses: list[LossSpec] = Field(min_length=1, max_length=200)
    """Losses to study, one study per dataset × loss: names or {name, params, space} entries; or `all` (every
    built-in loss with a search space), or {all: true, exclude: [names]}."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    runtime_env: RuntimeEnvSpec = Field(default_factory=RuntimeEnvSpec)
    storage: Uri = "runs"
    """Local folder (<storage>/<name>/) or s3://bucket/prefix for Ray Tune/Train state."""

    _source: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _expand(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("losses") == "all" or isinstance(data.get("losses"), dict)):
            data = {**data, "losses": _expand_all(data["losses"], builtin_spaces())}
        return data

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        v = _local_or_s3(v)
        if not v.startswith("s3://"):
            _absolute(v)  # a symbolic-link loop is an error now, not when the sweep creates its folder
            if v.startswith("~"):
                v = str(Path(v).expanduser())  # "~/runs" is the home folder's runs/, not a folder named "~"
        return v

    @field_validator("tune_spaces")
    @classmethod
    def _spaces(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"directory {shown(v)} does not exist")
        return v if v is None else str(Path(v).expanduser().resolve())

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
            raise FieldError(
                "protocol.seed" if p.seed is not None else "seed",
                f"{base} is too large: reproduction and fold seeds reach {top} > 2**32-1 = {SEED_MAX}",
            )
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def source(self) -> str | None:
        """The YAML file this config came from (for messages)."""
        return self._source

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


def sweep_json_schema() -> dict[str, Any]:
    """The JSON Schema of a sweep config (published as ``docs/sweep-config.schema.json``)."""
    schema = SweepConfig.model_json_schema()
    items = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/LossSpec"}]}
    # A loss may be a bare name, and the list may be `all` / {all, exclude} (before-validators pydantic cannot see).
    schema["properties"]["losses"] = {
        "description": schema["properties"]["losses"].get("description", ""),
        "anyOf": [{"type": "array", "items": items, "minItems": 1}, {"const": "all"}, {"$ref": "#/$defs/AllLosses"}],
    }
    schema.setdefault("$defs", {})["AllLosses"] = AllLosses.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


# --------------------------------------------------------------------------------------------------- errors


_UNION_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _where(loc: tuple) -> str:
    """Pydantic's error location → ``losses[1].params.margin`` (discriminated-union tags dropped; keys inside
    ``params``/``env_vars`` kept as they are)."""
    out = ""
    for i, part in enumerate(loc):
        inside = i >= 1 and loc[i - 1] in ("params", "env_vars")  # a user's own key, kept as it is
        if isinstance(part, int) and not inside:
            out += f"[{part}]"
        elif (
            isinstance(part, str)
            and not inside
            and (not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) or part in _UNION_LABELS)
        ):
            continue  # a union member's label (``str``, ``dict[str,any]``, ``function-after[...]``)
        elif part in DATASET_KINDS and i >= 2 and loc[i - 2] == "datasets" and isinstance(loc[i - 1], int):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (``list[LossSpec]`` → LossSpec; a union → each member)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The config model validating the object at ``loc`` of a ``root`` document (for the "allowed here" list of an
    unknown key)."""
    candidates: list[type[BaseModel]] = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        if len(candidates) > 1:  # a discriminated union: pydantic's next part is the member's tag
            tagged = [m for m in candidates if get_args(m.model_fields["kind"].annotation) == (part,)]
            if tagged:
                candidates = tagged
                continue
            return None
        fields = candidates[0].model_fields
        if part not in fields:
            return None
        candidates = _models_in(fields[part].annotation)
        if not candidates:
            return None
    return candidates[0] if len(candidates) == 1 else None


def _one_error(err: dict, prefix: tuple, root: type[BaseModel]) -> ConfigError:
    """One pydantic error as ``<field>: <problem>``: the field is pydantic's location, extended by a
    :class:`FieldError`'s own sub-path; the problem is in the plain words of :func:`plain_problem`, with the offending
    value for type and range errors."""
    raised = (err.get("ctx") or {}).get("error")
    if isinstance(raised, ConfigError) and raised.field:  # raised with its own field (losses: all)
        return raised
    loc, kind, ctx = prefix + tuple(err["loc"]), err["type"], err.get("ctx") or {}
    where = _where(loc)
    if kind == "value_error" and isinstance(ctx.get("error"), FieldError):
        rel = ctx["error"].path
        if rel.startswith("@"):  # relative to the document, not to the validated object
            where = rel[1:]
        else:
            where = f"{where}.{rel}" if where and not rel.startswith(("[", ".")) else f"{where}{rel}"
        problem = str(ctx["error"])
    elif kind in ("value_error", "assertion_error"):
        problem = str(ctx.get("error") or err["msg"])
    elif kind == "extra_forbidden":
        model = _model_at(tuple(err["loc"])[:-1], root)
        allowed = list(model.model_fields) if model is not None else []
        problem = "unknown key" + did_you_mean(loc[-1], allowed)
        if allowed:
            problem += f" (allowed here: {', '.join(sorted(allowed))})"
    elif kind == "union_tag_not_found":
        where, problem = f"{where}.kind", f"is required (one of {', '.join(DATASET_KINDS)})"
    elif kind == "union_tag_invalid":
        where = f"{where}.kind"
        tag = ctx.get("tag")
        problem = (
            f"unknown dataset kind {shown(tag)}{did_you_mean(tag, DATASET_KINDS)} (known: {', '.join(DATASET_KINDS)})"
        )
    elif kind == "too_short" and loc in (("datasets",), ("losses",)):
        problem = f"needs at least one {'dataset' if loc[0] == 'datasets' else 'loss'}"
    else:
        problem = plain_problem(err, shown) or err["msg"]
    return ConfigError(where or "config", redact_uri(problem))


def _to_config_error(e: ValidationError, prefix: tuple = (), root: type[BaseModel] | None = None) -> ConfigError:
    """Every pydantic error of a document, one :class:`ConfigError` each (the first one's ``more`` holds the
    others); one per field (a union's members each report the same field: the first says it)."""
    found: dict[str, ConfigError] = {}
    for err in e.errors(include_url=False):
        one = _one_error(err, prefix, root or SweepConfig)
        found.setdefault(one.field, one)
    first, *more = found.values()
    return ConfigError(first.field, first.problem, more=more)


# --------------------------------------------------------------------------------------------------- parsing


def parse_config(doc: Any, *, source: str | None = None) -> SweepConfig:
    """Validate a config mapping (already YAML-parsed) and return the :class:`SweepConfig`.

    Checks keys, types, ranges and URI shapes, that every loss exists (built-in, plugin or import path, with the
    config's ``runtime_env`` code importable here) and has a search space, and that pinned parameters lie inside it.
    Building every loss and loading every dataset is :mod:`pipelines.execution.preflight`.
    """
    if not isinstance(doc, dict):
        raise ConfigError(source or "config", f"expected a mapping at the top level, got {type(doc).__name__}")
    try:
        # The runtime_env's code first: the losses and trunk may come from it.
        env = RuntimeEnvSpec.model_validate(doc.get("runtime_env") or {})
    except ValidationError as e:
        raise _to_config_error(e, prefix=("runtime_env",), root=RuntimeEnvSpec) from None
    env.activate_on_driver()
    spaces = doc.get("tune_spaces")
    space_dir = Path(spaces).expanduser() if isinstance(spaces, str) and spaces else spaces_dir()
    context = {"spaces_dir": space_dir if space_dir is None or space_dir.is_dir() else None}
    try:
        cfg = SweepConfig.model_validate(doc, context=context)
    except ValidationError as e:
        raise _to_config_error(e) from None
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(source or "config", "nested too deeply") from None
    datasets = [d if d.name else d.model_copy(update={"name": d.kind}) for d in cfg.datasets]
    datasets = [
        d.model_copy(update={"seed": cfg.seed}) if d.kind == "synthetic" and d.seed is None else d for d in datasets
    ]
    update: dict[str, Any] = {"datasets": datasets}
    if cfg.protocol.seed is None:
        update["protocol"] = cfg.protocol.model_copy(update={"seed": cfg.seed})
    cfg = cfg.model_copy(update=update)  # the losses (and their resolved spaces) are the same objects
    cfg._source = source
    if cfg.tracking.uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        check_tracking_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI (environment, used as tracking.uri)")
    return cfg


def load_config(path: str | os.PathLike, *, name: str | None = None) -> SweepConfig:
    """Read and validate ``CONFIG.yaml`` (:func:`read_yaml_file`: a missing, unreadable, non-UTF-8 or unparsable
    file is a :class:`ConfigError` naming it).  ``name`` overrides the sweep name (e.g. a dated name for scheduled
    re-runs of the same config)."""
    doc = read_yaml_file(path)
    if name is not None and isinstance(doc, dict):
        doc = {**doc, "name": name}
    return parse_config(doc, source=str(path))
