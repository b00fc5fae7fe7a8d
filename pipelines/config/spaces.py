"""Search spaces: the built-in ``tune_spaces/<file>.yaml``, a user's folder, a config's inline space or a plugin's
shipped one → :class:`SearchSpace`.

One YAML per loss (format in ``docs/architecture.md``)::

    loss: mpa
    space:
      alpha: {low: 1.0, high: 64.0, log: true}
      num_proxies: {low: 1, high: 10, type: int}
      loss_lr: {low: 1.0e-6, high: 1.0, log: true}
    fixed: {}
    paper_defaults:
      alpha: 32

This module only parses and checks; turning a space into an Optuna/Tune space is the sweep's
job.  It imports neither Ray nor MLflow, so configs can be validated before anything starts.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from pipelines.config.errors import ConfigError, did_you_mean
from pipelines.config.loader import load_yaml

__all__ = [
    "Param",
    "SearchSpace",
    "SpaceError",
    "spaces_dir",
    "builtin_spaces",
    "folder_spaces",
    "all_spaces",
    "load_space",
    "parse_space",
    "read_space_file",
    "is_flat",
    "LOSS_LR",
]

#: The learning rate of the loss's own parameters: a TrainConfig field, never a build_loss argument.
LOSS_LR = "loss_lr"

_PARAM_KEYS = {"low", "high", "log", "type", "choices"}
_TOP_KEYS = {"loss", "space", "fixed", "paper_defaults"}


class SpaceError(ValueError):
    """A malformed search-space file or an out-of-space value; the message names file and field."""


@dataclass(frozen=True)
class Param:
    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    type: str = "float"  # "float" | "int" | "categorical"
    choices: tuple[Any, ...] | None = None

    @property
    def bounds(self) -> tuple[float, float]:
        """``(low, high)`` of an int or float parameter (ints stay ints)."""
        if self.low is None or self.high is None:
            raise ValueError(f"parameter {self.name!r}: a {self.type} range needs low and high")
        return self.low, self.high

    @property
    def options(self) -> tuple[Any, ...]:
        """The choices of a categorical parameter."""
        if self.choices is None:
            raise ValueError(f"parameter {self.name!r}: a categorical parameter needs choices")
        return self.choices

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in self.options
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.type == "int" and int(value) != value:
            return False
        low, high = self.bounds
        return low <= value <= high

    def describe(self) -> str:
        if self.type == "categorical":
            return f"one of {list(self.options)}"
        scale = "log" if self.log else "linear"
        return f"{self.type} in [{self.low}, {self.high}] ({scale})"

    def midpoint(self) -> Any:
        if self.type == "categorical":
            return self.options[0]
        low, high = self.bounds
        mid = math.sqrt(low * high) if self.log else (low + high) / 2
        return int(round(mid)) if self.type == "int" else mid


@dataclass(frozen=True)
class SearchSpace:
    loss: str
    params: dict[str, Param]
    fixed: dict[str, Any] = field(default_factory=dict)
    paper_defaults: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def defaults(self) -> dict[str, Any]:
        """A full assignment: paper defaults, else the space's midpoint, plus the fixed values."""
        out = {name: self.paper_defaults.get(name, p.midpoint()) for name, p in self.params.items()}
        out.update({k: v for k, v in self.paper_defaults.items() if k not in out})
        out.update(self.fixed)
        return out

    def corners(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The defaults, then each searched parameter at each of its bounds (others at defaults)."""
        base = self.defaults()
        yield "defaults", dict(base)
        for name, p in self.params.items():
            ends = p.options if p.type == "categorical" else p.bounds
            for v in ends:
                yield f"{name}={v}", {**base, name: v}

    def check(self, values: dict[str, Any], where: str = "params") -> None:
        """Raise :class:`SpaceError` for a value outside its searched range (names the field)."""
        for name, v in values.items():
            p = self.params.get(name)
            if p is not None and not p.contains(v):
                raise SpaceError(f"{where}.{name}: {v!r} is outside the search space of {self.loss!r} ({p.describe()})")

    @staticmethod
    def split(values: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
        """``(build_loss kwargs, loss_lr)`` from one full assignment."""
        params = {k: v for k, v in values.items() if k != LOSS_LR}
        return params, values.get(LOSS_LR)


def spaces_dir() -> Path | None:
    """A folder of the user's own spaces named by ``$DMLRC_TUNE_SPACES`` (``None`` if unset).  Its files add to and
    override the built-in spaces, loss by loss."""
    env = os.environ.get("DMLRC_TUNE_SPACES")
    return Path(env) if env else None


def builtin_spaces() -> dict[str, SearchSpace]:
    """The built-in losses' spaces: the ``tune_spaces`` package's ``*.yaml`` (package data, read through
    ``importlib.resources``: the same in a source checkout and an installed wheel)."""
    return dict(_builtin_spaces())


@functools.lru_cache(maxsize=1)
def _builtin_spaces() -> dict[str, SearchSpace]:
    out: dict[str, SearchSpace] = {}
    file_of: dict[str, str] = {}  # loss -> the file that defined it
    files = sorted(
        (f for f in resources.files("tune_spaces").iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name
    )
    for f in files:
        space = _parse_doc(_read(f, f.name), f.name, f if isinstance(f, Path) else Path(f.name))
        if space.loss in out:
            raise SpaceError(f"{f.name}: loss {space.loss!r} already defined in {file_of[space.loss]}")
        out[space.loss], file_of[space.loss] = space, f.name
    return out


def _read(f, name: str) -> Any:
    try:
        return load_yaml(f.read_bytes().decode("utf-8"), name)  # no duplicate keys, no alias bombs
    except ConfigError as e:
        raise SpaceError(str(e)) from None
    except UnicodeDecodeError as e:
        raise SpaceError(f"{name}: not UTF-8 text (offset {e.start})") from None
    except OSError as e:
        raise SpaceError(f"{name}: cannot read: {e.strerror or e}") from None


def _parse_param(path: Path, name: str, spec: Any) -> Param:
    where = f"{path.name}: space.{name}"
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: expected a mapping like {{low: .., high: ..}}, got {spec!r}")
    unknown = set(spec) - _PARAM_KEYS
    if unknown:
        raise SpaceError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_PARAM_KEYS)}"
            + did_you_mean(min(unknown, key=str), _PARAM_KEYS)
        )
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{where}.choices: expected a non-empty list")
        return Param(name, type="categorical", choices=tuple(choices))
    if "low" not in spec or "high" not in spec:
        raise SpaceError(f"{where}: needs 'low' and 'high' (or 'choices')")
    kind = spec.get("type", "float")
    if kind not in ("float", "int"):
        raise SpaceError(f"{where}.type: {kind!r} is not 'float' or 'int'")
    low, high, log = spec["low"], spec["high"], spec.get("log", False)
    if not isinstance(log, bool):  # strict: the string "false" is not false (nor is 0)
        raise SpaceError(f"{where}.log: expected true or false, got {log!r}")
    for key, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SpaceError(f"{where}.{key}: {v!r} is not a number")
        if not math.isfinite(v):
            raise SpaceError(f"{where}.{key}: {v!r} is not a finite number")
        if kind == "int" and not float(v).is_integer():  # int(0.8) would silently move the bound to 0
            raise SpaceError(f"{where}.{key}: {v!r} is not an integer (an int range has integer bounds)")
    if not low < high:
        raise SpaceError(f"{where}: low ({low}) must be < high ({high})")
    if log and low <= 0:
        raise SpaceError(f"{where}: a log-scale range needs low > 0 (got {low})")
    if kind == "int":
        low, high = int(low), int(high)
    else:
        low, high = float(low), float(high)
    return Param(name, low=low, high=high, log=log, type=kind)


def _load_file(path: Path) -> SearchSpace:
    return _parse_doc(_read(path, path.name), path.name, path)


def read_space_file(path: Path, loss: str | None = None) -> SearchSpace:
    """One space file named by a config (``losses[].space: path.yaml``); ``loss`` fills in a missing ``loss:`` key."""
    if not path.is_file():
        raise SpaceError(f"{path}: no such file")
    doc = _read(path, str(path))
    if isinstance(doc, dict) and loss is not None and "loss" not in doc:
        doc = {"loss": loss, **doc}
    return _parse_doc(doc, str(path), path.resolve())


def is_flat(doc: Any) -> bool:
    """Whether an inline ``space:`` mapping holds the parameters directly (``{margin: {low: .., high: ..}}``) rather
    than the keys of a space file (``space`` / ``fixed`` / ``paper_defaults`` / ``loss``)."""
    return (
        isinstance(doc, dict)
        and bool(doc)
        and not set(doc) & _TOP_KEYS
        and all(isinstance(v, dict) and set(v) & {"low", "high", "choices"} for v in doc.values())
    )


def parse_space(doc: Any, source: str, loss: str | None = None) -> SearchSpace:
    """A space given as a mapping (a config's inline ``space:``, a plugin's shipped space); ``source`` names it in
    errors; ``loss`` fills in a missing ``loss:`` key."""
    if isinstance(doc, dict) and loss is not None and "loss" not in doc:
        doc = {"loss": loss, **doc}
    return _parse_doc(doc, source, None)


def _parse_doc(doc: Any, name: str, path: Path | None) -> SearchSpace:
    if not isinstance(doc, dict):
        raise SpaceError(f"{name}: expected a mapping at top level")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise SpaceError(
            f"{name}: unknown top-level key(s) {sorted(unknown, key=str)}; allowed: {sorted(_TOP_KEYS)}"
            + did_you_mean(min(unknown, key=str), _TOP_KEYS)
            + (
                " (or, inline, the searched parameters directly: {name: {low: .., high: ..} or {choices: [..]}})"
                if path is None
                else ""
            )
        )
    if not all(isinstance(k, str) for k in doc):
        raise SpaceError(f"{name}: keys must be strings")
    if not isinstance(doc.get("loss"), str):
        raise SpaceError(f"{name}: 'loss' (the registry name) is missing")
    for key in ("space", "fixed", "paper_defaults"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise SpaceError(f"{name}: '{key}' must be a mapping")
    where = Path(name)
    params = {str(n): _parse_param(where, str(n), s) for n, s in (doc.get("space") or {}).items()}
    fixed = dict(doc.get("fixed") or {})
    both = sorted(set(fixed) & set(params))
    if both:
        raise SpaceError(f"{name}: {both} both searched (space) and fixed")
    space = SearchSpace(doc["loss"], params, fixed, dict(doc.get("paper_defaults") or {}), path or where)
    space.check(space.paper_defaults, where=f"{name}: paper_defaults")
    return space


def folder_spaces(directory: str | Path) -> dict[str, SearchSpace]:
    """Every space in a user's folder keyed by loss name; two files for one loss is an error."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SpaceError(f"search-space directory {directory} does not exist")
    out: dict[str, SearchSpace] = {}
    file_of: dict[str, str] = {}  # loss -> the file that defined it
    for path in sorted(directory.glob("*.yaml")):
        space = _load_file(path)
        if space.loss in out:
            raise SpaceError(f"{path.name}: loss {space.loss!r} already defined in {file_of[space.loss]}")
        out[space.loss], file_of[space.loss] = space, path.name
    return out


def all_spaces(directory: str | Path | None = None) -> dict[str, SearchSpace]:
    """The built-in spaces, overridden and extended loss by loss by a user's folder (``directory``, else
    ``$DMLRC_TUNE_SPACES``)."""
    out = builtin_spaces()
    directory = directory if directory is not None else spaces_dir()
    if directory is not None:
        out.update(folder_spaces(directory))
    return out


def load_space(loss: str, directory: str | Path | None = None) -> SearchSpace:
    """The search space of one loss (``"sec:triplet"`` lives in ``sec_triplet.yaml``): a user's folder (``directory``,
    else ``$DMLRC_TUNE_SPACES``) first, then a space shipped by the plugin that provides the loss, then the built-in
    one.  (A config's inline ``losses[].space`` comes before all of them: :mod:`pipelines.config.schema`.)"""
    directory = directory if directory is not None else spaces_dir()
    if directory is not None:
        user = folder_spaces(directory)
        if loss in user:
            return user[loss]
    shipped = _plugin_space(loss)
    if shipped is not None:
        return shipped
    builtin = builtin_spaces()
    if loss not in builtin:
        raise SpaceError(
            f"no search space for loss {loss!r}: give one inline (losses[].space), in a tune_spaces "
            f"folder, or ship one with its plugin (built-in spaces: {', '.join(sorted(builtin))})"
        )
    return builtin[loss]


def _plugin_space(loss: str) -> SearchSpace | None:
    """The space a plugin loss ships (``dml_core.losses.loss_metadata(space=...)``), if any."""
    # the loss zoo takes seconds to import: not at module level, so a config error prints before it loads
    from dml_core.losses import plugin_space, resolve_loss

    try:
        resolve_loss(loss)
    except ValueError:  # not a loss at all: the config's loss check names it
        return None
    try:
        doc = plugin_space(loss)
    except ValueError as e:
        raise SpaceError(" ".join(str(e).split())) from None
    if doc is None:
        return None
    if isinstance(doc, dict):  # the space belongs to the object, whichever name (entry point, import path) it has here
        doc = {**doc, "loss": loss}
    return parse_space(doc, f"the space shipped with {loss!r}", loss)
