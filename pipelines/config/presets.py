"""Built-in sweep presets: what ``dmlrc demo`` runs with no arguments from a fresh clone, and the commented example
configs ``dmlrc init PRESET`` copies to start from.

The example configs are the repository's ``configs/*.yaml``, shipped as package data of ``pipelines.config`` (its
``sweep_presets`` folder is a link to ``configs/``: one copy, read through ``importlib.resources`` in a checkout and in
an installed wheel alike).

The demo preset is defined once, in ``pipelines/config/demo.yaml`` (package data, commented line by line), so the demo
needs no file of the user's and no network.  It is a *smoke* run of the whole protocol, not a benchmark: synthetic
data, a tiny CNN, three losses (the reality-check baseline ``contrastive`` and two seed-paper methods,
``proxynca_pp`` (ProxyNCA++) and ``mpa`` (Multi-Proxy-Anchor)), a few BO trials, 4 warm single-worker folds per
trial and 3 reproductions, so that the intervals mean something.

The demo prints :func:`pipelines.execution.studies.untrained_reference.untrained_test_metrics` next to its results: the
same network, freshly initialised, on the same unseen test classes — trained models must be clearly above it.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipelines.config.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # annotations only: importlib.resources.abc is Python 3.11+, importlib.abc's copy 3.10's
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["DEMO", "DEMO_FILE", "demo_config", "presets", "copy_preset"]

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


#: The folder of ``pipelines.config`` that holds the example configs (the repository's ``configs/``).
PRESETS_FOLDER = "sweep_presets"


def presets() -> dict[str, Traversable]:
    """Every built-in preset by name: ``demo`` and the example configs (``omniglot``, ``mlrc-cub200``, ...)."""
    root = resources.files("pipelines.config")
    out = {"demo": root.joinpath(DEMO_FILE)}
    folder = root.joinpath(PRESETS_FOLDER)
    if folder.is_dir():
        out.update({f.name[: -len(".yaml")]: f for f in folder.iterdir() if f.name.endswith(".yaml")})
    return dict(sorted(out.items()))


def preset_summary(name: str) -> str:
    """The first line of a preset's header comment (what it is for)."""
    for line in presets()[name].read_text(encoding="utf-8").splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text:
            return text[len(name) :].lstrip(" —-:") if text.startswith(name) else text
    return ""


def copy_preset(name: str, dest: str | os.PathLike | None = None) -> Path:
    """Copy preset ``name`` to ``dest`` (a file, or a folder to put ``<name>.yaml`` in; default ``./<name>.yaml``)
    to edit and run; an existing file is never overwritten."""
    known = presets()
    if name not in known:
        raise ConfigError("PRESET", f"no preset {name!r} (known: {', '.join(known)}){did_you_mean(name, known)}")
    target = Path(dest) if dest is not None else Path(f"{name}.yaml")
    if target.is_dir():
        target = target / f"{name}.yaml"
    where = "DEST" if dest is not None else "PRESET"
    if target.exists():
        raise ConfigError(where, f"{str(target)!r} already exists (not overwritten)")
    if not target.parent.is_dir():
        raise ConfigError(where, f"folder {str(target.parent)!r} does not exist")
    try:
        with open(target, "x", encoding="utf-8") as f:  # "x": never over a file created meanwhile
            f.write(known[name].read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(where, f"cannot write {str(target)!r}: {e.strerror or e}") from None
    return target
