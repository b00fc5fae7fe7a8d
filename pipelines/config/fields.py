"""What the parts of the sweep config share: the field types (``Name``, ``Seed``, ``Path_``, ``Uri``), the checks
behind them (local path or ``s3://``, made absolute), the training defaults
(:class:`dml_core.training.loop.TrainConfig`'s), a plugin's ``sys.exit()`` as a problem, and how the sweep config's
errors are worded (:func:`sweep_words`, for :func:`pipelines.config.errors.to_config_error`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, PlainSerializer

from dml_core.datasets.registry import builtin_dataset_kinds
from dml_core.plugins import raised_at
from dml_core.training.config import TrainConfig
from pipelines.config.errors import ConfigError, DocumentWords
from pipelines.config.uris import check_uri, local_path, redact_uri, shown, special_file

__all__ = [
    "DATASET_KINDS",
    "SEED_MAX",
    "TRAIN_DEFAULTS",
    "Name",
    "Seed",
    "Path_",
    "Uri",
    "check_name",
    "check_loss_name",
    "local_or_s3",
    "absolute",
    "plugin_exited",
    "sweep_words",
]

#: The built-in dataset kinds, as their registry names them (generated data, the Omniglot zips, prepared parquet
#: shards, an image folder, a CSV listing): the tags the config's errors are worded by.
DATASET_KINDS = builtin_dataset_kinds()
#: numpy/Optuna seeds are 32-bit; every seed a sweep derives (folds, reproductions) must stay below this.
SEED_MAX = 2**32 - 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: TrainConfig's field defaults: the single source of protocol training defaults.
TRAIN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


#: A loss as a study names it: a built-in or entry-point name, an import path ``package.module:attribute``, wrappers
#: before it (``sec:mylab.losses:Circle``); :data:`_NAME_RE`'s characters and ``:``, as long as ``losses[i].name``.
_LOSS_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,255}$")


def check_name(v: str) -> str:
    if not _NAME_RE.fullmatch(v):  # fullmatch: "$" would let a trailing newline through
        raise ValueError(f"{shown(v)}: use letters, digits, '_', '-', '.' (max 64, no '/')")
    return v


def check_loss_name(v: str) -> str:
    """A study's loss name (:data:`_LOSS_NAME_RE`): no space, control character or table separator can reach a
    terminal or a report through it."""
    if not isinstance(v, str) or not _LOSS_NAME_RE.fullmatch(v):
        raise ValueError(f"{shown(v)}: not a loss name (letters, digits, '_', '-', '.', ':'; max 256)")
    return v


def local_or_s3(v: str) -> str:
    """A local path or ``s3://`` URI (:func:`check_uri`); a local path that is a device, FIFO or socket is refused:
    reading ``/dev/zero`` never ends and opening a FIFO blocks, and no dataset, bundle, weights file or storage is
    one."""
    try:
        v = check_uri(v, "")
    except ConfigError as e:
        raise ValueError(e.problem) from None
    what = None if v.startswith("s3://") else special_file(Path(v).expanduser())
    if what:
        raise ValueError(f"{shown(v)} is {what}, not a regular file or folder")
    return v


def absolute(v: str) -> str:
    """A local path made absolute (``~`` expanded; a symbolic-link loop is an error); ``s3://`` kept."""
    if v.startswith("s3://"):
        return v
    try:
        return str(local_path(v, ""))
    except ConfigError as e:
        raise ValueError(e.problem) from None


Name = Annotated[str, AfterValidator(check_name)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
#: A location that may carry credentials (``scheme://user:password@host``): written to disk and MLflow redacted.
Uri = Annotated[str, Field(min_length=1, max_length=4096), PlainSerializer(redact_uri, when_used="json")]


def plugin_exited(e: SystemExit, what: str) -> str:
    """The problem of a plugin that called ``sys.exit()`` (raised ``SystemExit``) while it was imported or built."""
    return f"{what}: its code called sys.exit({e.code!r}){raised_at(e)}; a plugin must raise an exception, not exit"


def _own_words(err: Mapping[str, Any], loc: tuple) -> str | None:
    """The sweep config's own wording: an empty ``datasets`` / ``losses`` list."""
    if err["type"] == "too_short" and loc in (("datasets",), ("losses",)):
        return f"needs at least one {'dataset' if loc[0] == 'datasets' else 'loss'}"
    return None


def sweep_words(root: type[BaseModel]) -> DocumentWords:
    """How the sweep config's errors are worded (:func:`~pipelines.config.errors.to_config_error`); ``root``: the
    model of the document (``SweepConfig``) or of the part validated on its own (``runtime_env``,
    ``losses: {all: ...}``)."""
    return DocumentWords(
        root=root,
        user_keys=frozenset({"params", "env_vars"}),
        tags=DATASET_KINDS,
        tag_noun="dataset",
        words=_own_words,
    )
