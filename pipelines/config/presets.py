"""Built-in sweep presets: what ``dmlrc demo`` runs with no arguments from a fresh clone.

The demo preset is defined once, in ``pipelines/config/demo.yaml`` (package data, commented line by line), so the demo
needs no file of the user's and no network.  It is a *smoke* run of the whole protocol, not a benchmark: synthetic
data, a tiny CNN, three losses (the reality-check baseline ``contrastive`` and two seed-paper methods,
``proxynca_pp`` (ProxyNCA++) and ``mpa`` (Multi-Proxy-Anchor)), a few BO trials, 4 warm single-worker folds per
trial and 3 reproductions, so that the intervals mean something.

The demo prints :func:`pipelines.results.untrained.untrained_test_metrics` next to its results: the same network,
freshly initialised, on the same unseen test classes — trained models must be clearly above it.
"""

from __future__ import annotations

import copy
import time
from importlib import resources
from typing import Any

import yaml

__all__ = ["DEMO", "DEMO_FILE", "demo_config"]

DEMO_FILE = "demo.yaml"
#: The preset as written in ``pipelines/config/demo.yaml`` (sweep name ``demo``).
DEMO: dict[str, Any] = yaml.safe_load(
    resources.files("pipelines.config").joinpath(DEMO_FILE).read_text(encoding="utf-8")
)


def demo_config(name: str | None = None, storage: str | None = None) -> dict[str, Any]:
    """The demo preset with a fresh, timestamped sweep name (so ``make demo`` can be run again and again)."""
    cfg = copy.deepcopy(DEMO)
    cfg["name"] = name or time.strftime("demo-%Y%m%d-%H%M%S")
    if storage:
        cfg["storage"] = storage
    return cfg
