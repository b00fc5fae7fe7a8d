"""Sweep configuration: the YAML schema of ``dmlrc sweep CONFIG.yaml``, one set of pydantic models.

A config names the datasets, the losses, the model, the protocol (the reality check's 4 class-disjoint folds in the
``mlrc`` layout, 50 Bayesian-optimisation trials of which 5 random start-up trials, 10 reproductions, 100-iteration
"epochs", evaluation interval and patience), the resources, MLflow tracking, storage and the Ray ``runtime_env`` that
carries a user's own code to the workers.  ``configs/*.yaml`` are documented examples, shipped with the ``demo``
preset as package data (:mod:`pipelines.config.presets`; ``dmlrc init`` copies one).

:class:`SweepConfig` is the validated document itself (``extra="forbid"``, strict types, bounds, frozen); its
``model_dump(mode="json")`` is what is written to disk and MLflow, with passwords in URIs redacted.
:func:`sweep_json_schema` publishes it as JSON Schema (``docs/sweep-config.schema.json``, which editors use to complete
and check YAML).  Protocol training defaults are :class:`dml_core.training.loop.TrainConfig`'s field defaults — that
dataclass is the one place deciding them.

:func:`load_config` reads the file through the hardened loader; :func:`parse_config` checks shape (keys, types,
ranges, URIs), that every loss resolves (built-in, entry point or import path) with a search space, and that pinned
parameters lie inside it; :func:`pipelines.execution.preflight.study_plans.preflight` then checks paths, loads the
datasets and builds every loss.  Errors are :class:`ConfigError` whose field is pydantic's own error location, e.g.
``losses[1].name: unknown loss 'mpaa' (known: ...)``, every problem of the document at once (``ConfigError.more``).
Nothing (no Ray, no MLflow run, no folder) starts before they pass.  This module imports neither Ray nor MLflow.

The sections have their own modules: :mod:`~pipelines.config.datasets`, :mod:`~pipelines.config.losses`,
:mod:`~pipelines.config.model`, :mod:`~pipelines.config.protocol`, :mod:`~pipelines.config.resources`,
:mod:`~pipelines.config.runtime_env`, :mod:`~pipelines.config.tracking`, sharing :mod:`~pipelines.config.fields`;
this module assembles them and keeps giving every name it always gave.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pipelines.config.datasets import (
    DATASET_KINDS,
    MAX_SYNTHETIC_BYTES,
    CsvDataset,
    DatasetSpec,
    FolderDataset,
    OmniglotDataset,
    ParquetDataset,
    SyntheticDataset,
)
from pipelines.config.errors import ConfigError, FieldError, to_config_error
from pipelines.config.fields import SEED_MAX, Name, Path_, Seed, Uri, absolute, local_or_s3, sweep_words
from pipelines.config.loader import read_yaml_file
from pipelines.config.losses import AllLosses, LossSpec, expand_all
from pipelines.config.model import GEM_P_MAX, ModelSpec
from pipelines.config.protocol import TRAIN_KEYS, ProtocolSpec, TrainSpec
from pipelines.config.resources import ResourcesSpec
from pipelines.config.runtime_env import RuntimeEnvSpec
from pipelines.config.spaces import builtin_spaces, spaces_dir
from pipelines.config.strict import StrictModel
from pipelines.config.tracking import TrackingSpec
from pipelines.config.uris import absolute_tracking_uri, check_tracking_uri, check_uri, redact_uri, shown

__all__ = [
    "SweepConfig",
    "DatasetSpec",
    "SyntheticDataset",
    "OmniglotDataset",
    "FolderDataset",
    "ParquetDataset",
    "CsvDataset",
    "LossSpec",
    "AllLosses",
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
    "MAX_SYNTHETIC_BYTES",
    "GEM_P_MAX",
    "ConfigError",
    "FieldError",
    "check_tracking_uri",
    "check_uri",
    "redact_uri",
    "shown",
]


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
    compare_with: list[Uri] = Field(default_factory=list, max_length=20)
    """Results bundles (the results-bundle.json `dmlrc report` writes; a local file or s3:// URI, or a list): their
    studies join this sweep's table, report and paired tests without running, once their protocol fingerprint equals
    this config's (docs/compare.md)."""
    records: Path_ | None = None
    """A local folder where every finished trial and reproduction leaves a small JSON record (<records>/<dataset>/
    <loss>/): a study continues from its records on any machine, with or without its storage folder (docs/records.md).
    `dmlrc sweep --records DIR` sets it too."""

    _source: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _expand(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("losses") == "all" or isinstance(data.get("losses"), dict)):
            data = {**data, "losses": expand_all(data["losses"], builtin_spaces())}
        return data

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        v = local_or_s3(v)
        if not v.startswith("s3://"):
            absolute(v)  # a symbolic-link loop is an error now, not when the sweep creates its folder
            if v.startswith("~"):
                v = str(Path(v).expanduser())  # "~/runs" is the home folder's runs/, not a folder named "~"
        return v

    @field_validator("records")
    @classmethod
    def _records(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = local_or_s3(v)
        if v.startswith("s3://"):
            raise ValueError(f"{shown(v)}: a local folder (records are files to commit; copy them to S3 if you like)")
        path = Path(absolute(v)).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{shown(v)} is a file, not a folder")
        if any(p.exists() and not p.is_dir() for p in path.parents):
            raise ValueError(f"{shown(v)}: a part of the path is a file")
        return str(path) if v.startswith("~") else v

    @field_validator("compare_with", mode="before")
    @classmethod
    def _one_bundle(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("compare_with")
    @classmethod
    def _bundles(cls, v: list[str]) -> list[str]:
        out = []
        for uri in v:
            uri = local_or_s3(uri)
            if not uri.startswith("s3://"):
                path = Path(uri).expanduser()
                if not path.exists():
                    raise ValueError(f"no results bundle at {shown(uri)} (`dmlrc report` writes results-bundle.json)")
                uri = str(path.resolve())
            out.append(uri)
        return out

    @field_validator("tune_spaces")
    @classmethod
    def _spaces(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"directory {shown(v)} does not exist")
        return v if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _consistent(self) -> SweepConfig:
        for key, items in (("datasets", self.datasets), ("losses", self.losses)):
            seen: dict[str | None, int] = {}  # name (a dataset's kind where unnamed) -> its index
            for i, item in enumerate(items):
                n = item.name or getattr(item, "kind", None)
                if n in seen:
                    raise FieldError(f"{key}[{i}].name", f"{n!r} already listed as {key}[{seen[n]}]")
                seen[n] = i
        p = self.protocol
        base = p.seed if p.seed is not None else self.seed
        top = base + 1000 * p.reproductions + p.folds - 1  # pipelines.names.reproduction_seed + fold index
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

    def protocol_seed(self) -> int:
        """The seed of the BO sampler and of fold training: ``protocol.seed``, else the sweep's ``seed`` (what
        :func:`parse_config` writes into an unset ``protocol.seed``)."""
        return self.protocol.seed if self.protocol.seed is not None else self.seed


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


# --------------------------------------------------------------------------------------------------- parsing


def parse_config(doc: Any, *, source: str | None = None) -> SweepConfig:
    """Validate a config mapping (already YAML-parsed) and return the :class:`SweepConfig`.

    Checks keys, types, ranges and URI shapes, that every loss exists (built-in, plugin or import path, with the
    config's ``runtime_env`` code importable here) and has a search space, and that pinned parameters lie inside it.
    Building every loss and loading every dataset is :mod:`pipelines.execution.preflight.study_plans`.
    """
    if not isinstance(doc, dict):
        raise ConfigError(source or "config", f"expected a mapping at the top level, got {type(doc).__name__}")
    try:
        # The runtime_env's code first: the losses and trunk may come from it.
        env = RuntimeEnvSpec.model_validate(doc.get("runtime_env") or {})
    except ValidationError as e:
        raise to_config_error(e, sweep_words(RuntimeEnvSpec), prefix=("runtime_env",)) from None
    env.activate_on_driver()
    spaces = doc.get("tune_spaces")
    space_dir = Path(spaces).expanduser() if isinstance(spaces, str) and spaces else spaces_dir()
    context = {"spaces_dir": space_dir if space_dir is None or space_dir.is_dir() else None}
    try:
        cfg = SweepConfig.model_validate(doc, context=context)
    except ValidationError as e:
        raise to_config_error(e, sweep_words(SweepConfig)) from None
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(source or "config", "nested too deeply") from None
    datasets = [d if d.name else d.model_copy(update={"name": d.kind}) for d in cfg.datasets]
    datasets = [
        d.model_copy(update={"seed": cfg.seed}) if isinstance(d, SyntheticDataset) and d.seed is None else d
        for d in datasets
    ]
    update: dict[str, Any] = {"datasets": datasets}
    if cfg.protocol.seed is None:
        update["protocol"] = cfg.protocol.model_copy(update={"seed": cfg.seed})
    cfg = cfg.model_copy(update=update)  # the losses (and their resolved spaces) are the same objects
    cfg._source = source
    if cfg.tracking.uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        check_tracking_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI (environment, used as tracking.uri)")
    return cfg


def load_config(path: str | os.PathLike, *, name: str | None = None, records: str | None = None) -> SweepConfig:
    """Read and validate ``CONFIG.yaml`` (:func:`read_yaml_file`: a missing, unreadable, non-UTF-8 or unparsable
    file is a :class:`ConfigError` naming it).  ``name`` overrides the sweep name (e.g. a dated name for scheduled
    re-runs of the same config), ``records`` its records folder (``--records``)."""
    doc = read_yaml_file(path)
    if name is not None and isinstance(doc, dict):
        doc = {**doc, "name": name}
    if records is not None and isinstance(doc, dict):
        doc = {**doc, "records": records}
    return parse_config(doc, source=str(path))
