"""Everything a sweep is told: the YAML schema and its validation (``schema``), the hardened YAML reader
(``loader``), paths and URIs (``uris``), search spaces (``spaces``), the built-in demo preset (``presets``).
Nothing here imports Ray or MLflow: a config is checked before anything starts."""

from pipelines.config.errors import ConfigError, FieldError
from pipelines.config.loader import load_yaml, read_yaml_file
from pipelines.config.schema import (
    DATASET_KINDS,
    SEED_MAX,
    TRAIN_KEYS,
    DatasetSpec,
    LossSpec,
    SweepConfig,
    load_config,
    parse_config,
    sweep_json_schema,
)
from pipelines.config.uris import absolute_tracking_uri, check_tracking_uri, check_uri, redact_uri

__all__ = [
    "ConfigError",
    "FieldError",
    "load_yaml",
    "read_yaml_file",
    "DATASET_KINDS",
    "SEED_MAX",
    "TRAIN_KEYS",
    "DatasetSpec",
    "LossSpec",
    "SweepConfig",
    "load_config",
    "parse_config",
    "sweep_json_schema",
    "absolute_tracking_uri",
    "check_tracking_uri",
    "check_uri",
    "redact_uri",
]
