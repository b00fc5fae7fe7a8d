"""Winning configurations on a bound of their search space.

A best trial whose value sits on the edge of the searched range says the optimum may lie outside it: the range, not
the loss, may have decided the result.  :func:`on_bound` finds such parameters (pure: a search space and one
configuration in, the hits out); the sweep stores them on the study run as the tag :data:`ON_BOUND_TAG`
(:func:`format_tag`), and ``dmlrc report`` reads that tag back (:func:`parse_tag`) or, for runs that predate it,
recomputes the hits from the study run's logged ``space.<name>`` params (:func:`params_from_descriptions`).

"On a bound" means within ``rel_tol`` (default 0.1 %) of the searched range from it, measured on the search's own
scale: in log space for a log-scale parameter, linearly otherwise; an integer parameter must equal the bound.
Categorical parameters have no bounds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipelines.config.spaces import Param, SearchSpace

__all__ = ["ON_BOUND_TAG", "BoundHit", "on_bound", "format_tag", "parse_tag", "params_from_descriptions"]

#: The study run's tag: ``"loss_lr=low(1e-06); scale=low(0.01)"``, or ``"none"`` when no winning value is on a bound.
ON_BOUND_TAG = "dmlrc.on_bound"

#: The share of a parameter's searched range (on its search scale) within which a value counts as on the bound.
REL_TOL = 1e-3

_SIDES = {"low": "lower", "high": "upper"}


@dataclass(frozen=True)
class BoundHit:
    """One winning value on a bound: ``param`` at its ``side`` (``"low"`` or ``"high"``) bound ``bound``."""

    param: str
    side: str
    bound: float

    def tag(self) -> str:
        return f"{self.param}={self.side}({self.bound:g})"

    def describe(self) -> str:
        return f"{self.param} at {_SIDES[self.side]} bound {self.bound:g}"


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    try:
        x = float(v)  # MLflow params come back as strings
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def on_bound(
    space: SearchSpace | Mapping[str, Param], config: Mapping[str, Any], rel_tol: float = REL_TOL
) -> list[BoundHit]:
    """The searched parameters of ``space`` whose value in ``config`` lies on a bound of their range, in the
    space's parameter order.  Parameters that are not searched (fixed values, ``loss_lr`` of a loss without one),
    categorical ones and values that are missing or not numbers are skipped."""
    params = space.params if isinstance(space, SearchSpace) else space
    hits = []
    for name, p in params.items():
        if p.type == "categorical" or name not in config:
            continue
        v = _number(config[name])
        if v is None:
            continue
        low, high = p.bounds
        for side, bound in (("low", low), ("high", high)):
            if p.type == "int":
                hit = v == bound
            elif p.log:
                hit = v > 0 and abs(math.log(v) - math.log(bound)) <= rel_tol * (math.log(high) - math.log(low))
            else:
                hit = abs(v - bound) <= rel_tol * (high - low)
            if hit:
                hits.append(BoundHit(name, side, float(bound)))
                break
    return hits


def format_tag(hits: list[BoundHit]) -> str:
    """The :data:`ON_BOUND_TAG` value of a study run."""
    return "; ".join(h.tag() for h in hits) or "none"


_TAG_ITEM = re.compile(r"^(?P<param>[^=;]+)=(?P<side>low|high)\((?P<bound>[^()]+)\)$")


def parse_tag(text: str) -> list[BoundHit]:
    """:func:`format_tag` read back; an item it cannot read is skipped (a tag written by hand, say)."""
    hits = []
    for item in text.split(";"):
        m = _TAG_ITEM.match(item.strip())
        bound = _number(m["bound"]) if m else None
        if m and bound is not None:
            hits.append(BoundHit(m["param"], m["side"], bound))
    return hits


# Param.describe() of a numeric parameter, as the sweep logs it in the study run's ``space.<name>`` params
_DESCRIBED = re.compile(r"^(?P<type>float|int) in \[(?P<low>[^,\]]+), (?P<high>[^\]]+)\] \((?P<scale>log|linear)\)$")


def params_from_descriptions(described: Mapping[str, str]) -> dict[str, Param]:
    """The numeric parameters of a space from their logged descriptions (``{"loss_lr": "float in [1e-06, 1.0]
    (log)"}``); descriptions of another form (categorical parameters, other writers) are left out."""
    out = {}
    for name, text in described.items():
        m = _DESCRIBED.match(str(text).strip())
        if m is None:
            continue
        low, high = _number(m["low"]), _number(m["high"])
        if low is None or high is None or not low < high:
            continue
        out[name] = Param(name, low=low, high=high, log=m["scale"] == "log", type=m["type"])
    return out
