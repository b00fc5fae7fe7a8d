"""Everything a sweep is told: the YAML schema and its validation (``schema``), the hardened YAML reader
(``loader``), paths and URIs (``uris``), search spaces (``spaces``), the built-in demo preset (``presets``).
Nothing here imports Ray or MLflow: a config is checked before anything starts.

The schema's names load on first use (PEP 562 ``__getattr__``): the schema checks models, trunks and training
settings against ``dml_core``, which imports torch, and processes that only read a search space or a URI (a search
trial's driver) must not pay for torch by importing this package."""

from typing import Any

from pipelines.config.errors import ConfigError, FieldError
from pipelines.config.loader import load_yaml, read_yaml_file
from pipelines.config.uris import absolute_tracking_uri, check_tracking_uri, check_uri, redact_uri

#: The names this package gives from ``pipelines.config.schema``, loaded by :func:`__getattr__`.
_FROM_SCHEMA = (
    "DATASET_KINDS",
    "SEED_MAX",
    "TRAIN_KEYS",
    "DatasetSpec",
    "LossSpec",
    "SweepConfig",
    "load_config",
    "parse_config",
    "sweep_json_schema",
)


def __getattr__(name: str) -> Any:
    if name in _FROM_SCHEMA:
        # torch, through dml_core: loaded by the first use of a schema name (see the module docstring)
        from pipelines.config import schema

        return getattr(schema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "FieldError",
    "load_yaml",
    "read_yaml_file",
    *_FROM_SCHEMA,
    "absolute_tracking_uri",
    "check_tracking_uri",
    "check_uri",
    "redact_uri",
]
