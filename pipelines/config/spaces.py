"""Search spaces: ``tune_spaces/<file>.yaml`` → :class:`SearchSpace`.

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

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


__all__ = ["Param", "SearchSpace", "SpaceError", "spaces_dir", "load_space", "all_spaces", "LOSS_LR"]

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

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.type == "int" and int(value) != value:
            return False
        return self.low <= value <= self.high

    def describe(self) -> str:
        if self.type == "categorical":
            return f"one of {list(self.choices)}"
        scale = "log" if self.log else "linear"
        return f"{self.type} in [{self.low}, {self.high}] ({scale})"

    def midpoint(self) -> Any:
        if self.type == "categorical":
            return self.choices[0]
        mid = math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2
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
            ends = p.choices if p.type == "categorical" else (p.low, p.high)
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


def spaces_dir() -> Path:
    """``$DMLRC_TUNE_SPACES`` if set, else the repository's ``tune_spaces/``."""
    env = os.environ.get("DMLRC_TUNE_SPACES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "tune_spaces"


def _parse_param(path: Path, name: str, spec: Any) -> Param:
    where = f"{path.name}: space.{name}"
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: expected a mapping like {{low: .., high: ..}}, got {spec!r}")
    unknown = set(spec) - _PARAM_KEYS
    if unknown:
        raise SpaceError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_PARAM_KEYS)}")
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
    low, high, log = spec["low"], spec["high"], bool(spec.get("log", False))
    for key, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SpaceError(f"{where}.{key}: {v!r} is not a number")
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
    from pipelines.config import ConfigError, load_yaml  # (config imports this module)

    try:
        doc = load_yaml(path.read_bytes().decode("utf-8"), path.name)  # no duplicate keys, no alias bombs
    except ConfigError as e:
        raise SpaceError(str(e)) from None
    except UnicodeDecodeError as e:
        raise SpaceError(f"{path.name}: not UTF-8 text (offset {e.start})") from None
    except OSError as e:
        raise SpaceError(f"{path.name}: cannot read: {e.strerror or e}") from None
    if not isinstance(doc, dict):
        raise SpaceError(f"{path.name}: expected a mapping at top level")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise SpaceError(f"{path.name}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    if not all(isinstance(k, str) for k in doc):
        raise SpaceError(f"{path.name}: keys must be strings")
    if not isinstance(doc.get("loss"), str):
        raise SpaceError(f"{path.name}: 'loss' (the registry name) is missing")
    for key in ("space", "fixed", "paper_defaults"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise SpaceError(f"{path.name}: '{key}' must be a mapping")
    params = {str(n): _parse_param(path, str(n), s) for n, s in (doc.get("space") or {}).items()}
    fixed = dict(doc.get("fixed") or {})
    both = sorted(set(fixed) & set(params))
    if both:
        raise SpaceError(f"{path.name}: {both} both searched (space) and fixed")
    space = SearchSpace(doc["loss"], params, fixed, dict(doc.get("paper_defaults") or {}), path)
    space.check(space.paper_defaults, where=f"{path.name}: paper_defaults")
    return space


def all_spaces(directory: str | Path | None = None) -> dict[str, SearchSpace]:
    """Every space in ``directory`` keyed by loss name; two files for one loss is an error."""
    directory = Path(directory) if directory else spaces_dir()
    if not directory.is_dir():
        raise SpaceError(f"search-space directory {directory} does not exist")
    out: dict[str, SearchSpace] = {}
    for path in sorted(directory.glob("*.yaml")):
        space = _load_file(path)
        if space.loss in out:
            raise SpaceError(f"{path.name}: loss {space.loss!r} already defined in {out[space.loss].path.name}")
        out[space.loss] = space
    return out


def load_space(loss: str, directory: str | Path | None = None) -> SearchSpace:
    """The search space of one loss (``"sec:triplet"`` lives in ``sec_triplet.yaml``)."""
    spaces = all_spaces(directory)
    if loss not in spaces:
        raise SpaceError(
            f"no search space for loss {loss!r} in {Path(directory) if directory else spaces_dir()} "
            f"(have: {', '.join(sorted(spaces))})"
        )
    return spaces[loss]
