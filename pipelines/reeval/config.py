"""Re-evaluation configuration: the YAML schema of ``dmlrc reeval CONFIG.yaml``, one set of pydantic models.

Config (YAML; unknown keys are errors; ``null`` means the default)::

    schedule: nightly                      # a name for this job (tag ``schedule`` on every reeval run; default: the
                                           # config file's name without .yaml)
    tracking_uri: http://mlflow:5000       # default $MLFLOW_TRACKING_URI
    models:                                # each: a registered model (alias ``reality-check`` unless alias/version)
      - name: dmlrc.mlrc.cub200.contrastive
        alias: reality-check
      - name: dmlrc.mlrc.cub200.sec:triplet  # the loss as the sweep config names it (registered as sec-triplet)
      - experiment: mlrc                   # or: the ``reality-check`` version of every model of that experiment
    datasets:                              # version tag ``dataset`` -> parquet shards (`dmlrc data prepare`)
      cub200: s3://bucket/cub200/          # local path or s3:// (endpoint/credentials from the AWS_* environment)
    metrics: [map_at_r, r_precision, precision_at_1]   # compared (every retrieval metric is computed and logged)
    tolerance: 0.01                        # allowed absolute drop (metrics are in 0..1)
    ray_address: null                      # null: start a local Ray, like `dmlrc sweep`
    use_gpu: false                         # one embedding actor per GPU
    batch_size: 256
    out: reeval                            # folder for reeval.md / .html / .png

:class:`ReevalSpec` is the validated document (``extra="forbid"``, strict types, bounds, frozen), the same rules as
the sweep config (:mod:`pipelines.config.schema`); :func:`reeval_json_schema` publishes it as JSON Schema
(``docs/reeval-config.schema.json``, which editors use to complete and check the YAML).  :func:`load_reeval_config`
reads the file through the hardened loader (:func:`pipelines.config.loader.read_yaml_file`: size bound, UTF-8, no
duplicate keys, bounded aliases) and returns the :class:`ReevalConfig` the job runs on.  Errors are one
:class:`~pipelines.config.errors.ConfigError` whose field is pydantic's error location (``models[0].alias``,
``metrics[1]``, ``tolerance``), passwords in URIs never shown.  This checks the shape only, before MLflow or Ray
start; :func:`pipelines.reeval.run.resolve_versions` then checks the models and datasets against MLflow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipelines.config.errors import ConfigError, DocumentWords, FieldError, to_config_error
from pipelines.config.loader import read_yaml_file
from pipelines.config.strict import StrictModel
from pipelines.config.uris import (
    absolute_tracking_uri,
    check_ray_address,
    check_tracking_uri,
    check_uri,
    local_path,
    shown,
)
from pipelines.names import ALIAS, HEADLINE_METRICS

__all__ = [
    "Target",
    "ReevalConfig",
    "ReevalSpec",
    "ModelRef",
    "load_reeval_config",
    "parse_reeval_config",
    "reeval_json_schema",
    "KNOWN_METRICS",
]

#: The metrics a re-evaluation can compare (keys of ``dml_core.evaluation.metrics.retrieval_metrics``).
KNOWN_METRICS = (
    "map_at_r",
    "r_precision",
    "precision_at_1",
    "recall_at_1",
    "recall_at_2",
    "recall_at_4",
    "recall_at_8",
    "ndcg_at_2",
    "ndcg_at_4",
    "ndcg_at_8",
    "nmi",
)


@dataclass
class ReevalConfig:
    """What a re-evaluation job runs on (built by :func:`load_reeval_config`; tests and benchmarks build it
    directly).  ``models`` are the config's entries as mappings holding only the keys given."""

    schedule: str
    tracking_uri: str
    models: list[dict[str, Any]]
    datasets: dict[str, str]
    metrics: tuple[str, ...] = HEADLINE_METRICS
    tolerance: float = 0.01
    ray_address: str | None = None
    use_gpu: bool = False
    batch_size: int = 256
    out: str = "reeval"


def _printable(v: str) -> str:
    if re.search(r"[\x00-\x1f\x7f]", v):
        raise ValueError(f"{shown(v)} contains a control character")
    return v


def _parquet_uri(v: str) -> str:
    """A local path (made absolute: Ray Data's readers run in their own working directory) or ``s3://``."""
    try:
        v = check_uri(v, "")
        return v if v.startswith("s3://") else str(local_path(v, ""))
    except ConfigError as e:
        raise ValueError(e.problem) from None


def _tracking(v: str) -> str:
    try:
        return absolute_tracking_uri(check_tracking_uri(v, ""))
    except ConfigError as e:
        raise ValueError(e.problem) from None


def _ray_address(v: str) -> str:
    """``auto``, ``host:port`` or ``ray://host:port``.  The shape only: ``ray://`` needs Ray Client (``ray[client]``)
    where the job runs, which need not be where the config is written or checked."""
    try:
        check_ray_address(v.removeprefix("ray://"), "")
    except ConfigError as e:
        if "@" in v:  # the problem names only what follows the '@': never the credentials
            raise ValueError(e.problem) from None
        raise ValueError(f"{shown(v)} is not a Ray address (expected auto, host:port or ray://host:port)") from None
    return v


def _out_folder(v: str) -> str:
    try:
        v = check_uri(v, "", allow_s3=False)
    except ConfigError as e:
        raise ValueError(e.problem) from None
    return str(Path(v).expanduser()) if v.startswith("~") else v


Name = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_printable)]
ParquetUri = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_parquet_uri)]
TrackingUri = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_tracking)]
Version = Annotated[int, Field(ge=1)] | Annotated[str, Field(pattern=r"^[1-9][0-9]{0,17}$")]
Metric = Literal[KNOWN_METRICS]  # type: ignore[valid-type]  # a Literal over the tuple's values


class ModelRef(StrictModel):
    """A registered model version (``name``, at alias ``reality-check`` unless ``alias`` or ``version``), or every
    registered model of a sweep experiment (``experiment``, each at alias ``reality-check``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [{"required": ["name"]}, {"required": ["experiment"]}],
            "not": {"required": ["alias", "version"]},
            "dependentRequired": {"alias": ["name"], "version": ["name"]},
        }
    )

    name: Name | None = None
    """Registered model name (``dmlrc.<experiment>.<dataset>.<loss>``)."""
    alias: Name | None = None
    """Model alias (default ``reality-check``, the latest sweep's version); not with ``version``."""
    version: Version | None = None
    """Model version number; not with ``alias``."""
    experiment: Name | None = None
    """A sweep experiment: the ``reality-check`` version of every registered model tagged with it."""

    @model_validator(mode="before")
    @classmethod
    def _one_of(cls, data: Any) -> Any:
        given = {k for k, v in data.items() if v is not None} if isinstance(data, dict) else set()
        if not isinstance(data, dict) or not (("name" in given) ^ ("experiment" in given)):
            raise ValueError("needs exactly one of `name` or `experiment`")
        return data

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        # One message for both spellings (1 or "1") instead of one per member of the union.
        if isinstance(v, bool) or not (
            isinstance(v, int) and v >= 1 or isinstance(v, str) and re.fullmatch(r"[1-9][0-9]{0,17}", v)
        ):
            raise ValueError(f"must be a model version number (1, 2, ...), got {shown(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.alias is not None and self.version is not None:
            raise ValueError("give `alias` or `version`, not both")
        if self.experiment is not None:
            for key in ("alias", "version"):
                if getattr(self, key) is not None:
                    raise FieldError(key, f"only with `name` (an experiment's models are compared at alias {ALIAS!r})")
            if "'" in self.experiment:  # it is quoted inside MLflow's search filter
                raise FieldError("experiment", f"{shown(self.experiment)} contains a quote")
        return self


class ReevalSpec(StrictModel):
    """A re-evaluation config file (``dmlrc reeval CONFIG.yaml``); see infra/reeval/reeval.yaml."""

    model_config = ConfigDict(title="dmlrc reeval config")

    schedule: Name | None = None
    """A name for this job: tag ``schedule`` on every reeval run (default: the config file's name without .yaml)."""
    tracking_uri: TrackingUri | None = Field(None, validate_default=True)  # never None once validated (below)
    """The MLflow server or store the models are registered in: http(s)://host[:port], sqlite:///path.db or
    postgresql[+psycopg2]://user@host[:port]/database (default: $MLFLOW_TRACKING_URI)."""
    models: list[ModelRef] = Field(min_length=1, max_length=1000)
    """The model versions to re-evaluate: {name[, alias|version]} or {experiment} entries."""
    datasets: dict[Name, ParquetUri] = Field(min_length=1, max_length=1000)
    """Dataset name (a version's tag ``dataset``) -> its current parquet shards (``dmlrc data prepare``): a local
    path or s3://bucket/prefix (endpoint and credentials from the AWS_* environment)."""
    metrics: list[Metric] = Field(list(HEADLINE_METRICS), min_length=1, max_length=len(KNOWN_METRICS))
    """The metrics compared with the registered values (every retrieval metric is computed and logged)."""
    tolerance: float = Field(0.01, ge=0, lt=1)
    """Allowed absolute drop of a metric (metrics are in 0..1); a larger drop is a regression only if the paired
    95 % interval of the change also lies below zero."""
    ray_address: Annotated[str, AfterValidator(_ray_address)] | None = None
    """auto, host:port or ray://host:port (Ray Client); null: start a local Ray, like `dmlrc sweep`."""
    use_gpu: bool = False
    """One embedding actor per GPU."""
    batch_size: int = Field(256, ge=1)
    """Images per embedding batch."""
    out: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_out_folder)] = "reeval"
    """Local folder for reeval.md / .html / .png."""

    @field_validator("tracking_uri", mode="before")
    @classmethod
    def _from_environment(cls, v: Any) -> Any:
        if v is not None:
            return v
        # validate_default: a missing or null tracking_uri comes here too, and leaves with a URI or an error
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if not env:
            raise ConfigError("tracking_uri", "missing (set it or $MLFLOW_TRACKING_URI)")
        return absolute_tracking_uri(check_tracking_uri(env, "MLFLOW_TRACKING_URI (environment, used as tracking_uri)"))

    @field_validator("metrics")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        for j, m in enumerate(v):
            if m in v[:j]:
                raise FieldError(f"[{j}]", f"{m!r} already listed as metrics[{v.index(m)}]")
        return v


def reeval_json_schema() -> dict[str, Any]:
    """The JSON Schema of a reeval config (published as ``docs/reeval-config.schema.json``)."""
    schema = ReevalSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


# --------------------------------------------------------------------------------------------------- errors


#: The problem of a whole field of the wrong type or range, as the CLI has always phrased it.
_FIELD_PROBLEMS = {
    "models": "must be a non-empty list of {name[, alias|version]} or {experiment}",
    "datasets": "must map dataset names (the version tag `dataset`) to parquet URIs",
    "metrics": "must be a non-empty list",
    "tolerance": "must be a number in [0, 1), got {value}",
    "batch_size": "must be a positive integer, got {value}",
    "use_gpu": "must be true or false, got {value}",
}


def _reeval_words(err: Mapping[str, Any], loc: tuple) -> str | None:
    """A whole field of the wrong type or range in the re-evaluation's own words (:data:`_FIELD_PROBLEMS`)."""
    if len(loc) == 1 and loc[0] in _FIELD_PROBLEMS and err["type"] != "missing":
        return _FIELD_PROBLEMS[loc[0]].replace("{value}", shown(err.get("input")))
    return None


#: How the re-evaluation config's errors are worded (:func:`~pipelines.config.errors.to_config_error`, the sweep
#: config's translator): the ``datasets`` keys are the user's dataset names.
_WORDS = DocumentWords(root=ReevalSpec, user_keys=frozenset({"datasets"}), words=_reeval_words)


# --------------------------------------------------------------------------------------------------- parsing


def parse_reeval_config(doc: Any, *, source: str = "config", schedule: str = "reeval") -> ReevalConfig:
    """Validate a config mapping (already YAML-parsed) and return the :class:`ReevalConfig`; ``schedule`` is the
    default job name, ``source`` names the document in a top-level error."""
    if not isinstance(doc, dict):
        raise ConfigError(source, f"expected a mapping at the top level, got {type(doc).__name__}")
    try:
        spec = ReevalSpec.model_validate(doc)
    except ValidationError as e:
        raise to_config_error(e, _WORDS) from None
    except RecursionError:
        raise ConfigError(source, "nested too deeply") from None
    assert spec.tracking_uri is not None  # _from_environment (validate_default) sets it or refuses the config
    return ReevalConfig(
        schedule=spec.schedule or schedule,
        tracking_uri=spec.tracking_uri,
        models=[m.model_dump(exclude_none=True) for m in spec.models],
        datasets=dict(spec.datasets),
        metrics=tuple(spec.metrics),
        tolerance=spec.tolerance,
        ray_address=spec.ray_address,
        use_gpu=spec.use_gpu,
        batch_size=spec.batch_size,
        out=spec.out,
    )


def load_reeval_config(path: str | os.PathLike) -> ReevalConfig:
    """Read and check ``CONFIG.yaml`` (shape only; :func:`pipelines.reeval.run.resolve_versions` checks it against
    MLflow).  A missing, unreadable, oversized, non-UTF-8 or unparsable file, a duplicate key or an alias bomb is a
    :class:`ConfigError` naming the file; the schedule defaults to the file's name without its suffix."""
    return parse_reeval_config(read_yaml_file(path), source=str(path), schedule=Path(path).stem)


@dataclass
class Target:
    """One model version to re-evaluate, with what it is compared against."""

    name: str
    version: str
    tags: dict[str, str]
    dataset_uri: str
    manifest: dict
    test_classes: list[int]
    reproductions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version}"
