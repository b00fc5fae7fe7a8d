"""What ``dmlrc list`` shows: what a sweep config can name, from the registries themselves.

Losses (:func:`dml_core.losses.list_losses`, :func:`~dml_core.losses.loss_info`), loss wrappers
(:func:`~dml_core.losses.list_wrappers`), trunks (:func:`dml_core.trunks.list_trunks`), the dataset kinds of a sweep
config (the registry's built-in kinds, described by their models: :func:`pipelines.config.datasets.dataset_models`)
and the datasets ``dmlrc data prepare`` reads (:data:`dml_core.datasets.DATASETS`, :data:`~dml_core.datasets.KINDS`),
the presets (:func:`pipelines.config.presets.presets`) and the installed plug-ins of the three registries — losses,
trunks, dataset kinds (:class:`dml_core.registry.Registry`) — with the distribution behind each.  No table of names
lives here: a loss registered tomorrow is listed tomorrow.

Plug-ins are read from installed metadata only (no plugin module is imported), so a broken plug-in is listed with its
distribution rather than stopping the listing; ``status`` says whether a sweep can use it (a name a built-in takes, or
two distributions exporting one name, are refused when a sweep names them).
"""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

from dml_core.datasets import DATASETS, KINDS
from dml_core.datasets.registry import DATASET_KIND_REGISTRY
from dml_core.losses import list_losses, list_wrappers, loss_info
from dml_core.losses.resolve import LOSS_REGISTRY
from dml_core.trunks import list_trunks
from dml_core.trunks.builtin import FEATURE_DIMS
from dml_core.trunks.registry import TRUNK_REGISTRY
from pipelines.config.datasets import dataset_models
from pipelines.config.presets import preset_summary, presets
from pipelines.config.spaces import builtin_spaces
from pipelines.docs_cli import DOC_MENTION, user_docs

__all__ = ["catalogue", "render_text"]


def _doc_ref(text: str) -> str:
    """``docs/datasets.md`` in a docstring → ``dmlrc docs datasets`` (what an installed user can open)."""
    return DOC_MENTION.sub(lambda m: "dmlrc docs " + m.group(0)[len("docs/") :].removesuffix(".md"), text)


def _plain(doc: str | None) -> str:
    """A docstring as one line of plain text (reST literals unquoted)."""
    return _doc_ref(" ".join((doc or "").replace("``", "").split()))


def _distribution(dist) -> dict[str, Any]:
    if dist is None:
        return {"name": None, "version": None, "origin": None}
    return {"name": dist.name, "version": dist.version, "origin": dist.origin}


def _losses(docs: set[str]) -> list[dict[str, Any]]:

    spaces = builtin_spaces()
    out = []
    for name in list_losses():
        info = loss_info(name)
        family = info.factory.__module__.rsplit(".", 1)[-1]  # one module per paper or family (docs/losses/<family>)
        out.append(
            {
                "name": name,
                "family": family,
                "paper": info.paper,
                "learnable": info.learnable,
                "search_space": name in spaces,
                "docs": f"losses/{family}" if f"losses/{family}" in docs else "losses",
            }
        )
    return out


def _wrappers() -> list[dict[str, Any]]:

    spaces = sorted(builtin_spaces())
    return [
        {"name": w, "usage": f"{w}:<loss>", "search_spaces": [s for s in spaces if s.startswith(f"{w}:")]}
        for w in list_wrappers()
    ]


def _trunks() -> list[dict[str, Any]]:

    return [
        {"name": name, "source": source, "feature_dim": FEATURE_DIMS.get(name)}
        for name, source in list_trunks().items()
        if source == "built-in"  # installed entry points are listed with the plug-ins
    ]


def _dataset_kinds() -> list[dict[str, str]]:
    """The built-in dataset kinds (the registry's, in its order), each described by its sweep-config model."""

    return [{"kind": kind, "description": _plain(model.__doc__)} for kind, model in dataset_models().items()]


def _presets() -> list[dict[str, str]]:

    return [{"name": name, "summary": _doc_ref(preset_summary(name))} for name in presets()]


def _plugins() -> list[dict[str, Any]]:
    """The installed entry points of the three registries (losses, trunks, dataset kinds), each with its
    distribution(s) and whether a sweep can use it (the registry's :meth:`~dml_core.registry.Registry.status`)."""

    return [
        {
            "kind": registry.kind,
            "name": name,
            "distributions": [_distribution(d) for d in dists],
            "status": registry.status(name, dists),
        }
        for registry in (LOSS_REGISTRY, TRUNK_REGISTRY, DATASET_KIND_REGISTRY)
        for name, dists in registry.plugins().items()
    ]


def catalogue() -> dict[str, Any]:
    """Everything ``dmlrc list`` shows, as JSON-ready values."""

    docs = set(user_docs())
    return {
        "losses": _losses(docs),
        "wrappers": _wrappers(),
        "trunks": _trunks(),
        "dataset_kinds": _dataset_kinds(),
        "prepare_datasets": list(DATASETS + KINDS),
        "presets": _presets(),
        "plugins": _plugins(),
    }


# ------------------------------------------------------------------------------------------------------- text


def _table(headers: list[str], rows: list[list[str]], width: int) -> list[str]:
    """Aligned columns, two spaces apart, indented by two; the last column wraps under itself within ``width``."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    indent = 2 + sum(w + 2 for w in widths)
    room = max(30, width - indent)
    lines = []
    for row in [headers, *rows]:
        head = "  " + "".join(f"{str(c):{w}s}  " for c, w in zip(row, widths))
        tail = textwrap.wrap(str(row[-1]), room) or [""]
        lines.append((head + tail[0]).rstrip())
        lines.extend((" " * indent + t).rstrip() for t in tail[1:])
    return lines


def _dists(p: dict[str, Any]) -> str:
    shown = [f"{d['name']} {d['version']}" if d["name"] else "an unknown distribution" for d in p["distributions"]]
    return ", ".join(shown)


def render_text(cat: dict[str, Any], width: int | None = None) -> str:
    """The catalogue as aligned plain text (``width``: the terminal's columns by default)."""
    width = width or max(80, shutil.get_terminal_size((100, 24)).columns)
    yes = {True: "yes", False: "no", None: "–"}
    out = [
        "Losses (a sweep config's losses[].name; space: a built-in search space, so `losses: all` includes it; "
        "equations and settings: dmlrc docs losses/<family>; the full citations: dmlrc list --json):"
    ]
    out += _table(
        ["name", "family", "space", "paper"],
        # the paper itself: the part of the citation before the settings' and readings' sources
        [
            [loss["name"], loss["family"], yes[loss["search_space"]], loss["paper"].split(";")[0]]
            for loss in cat["losses"]
        ],
        width,
    )
    out += ["", "Wrappers (around any loss, e.g. sec:triplet; a built-in search space for the ones listed):"]
    out += _table(
        ["wrapper", "usage", "with a search space"],
        [[w["name"], w["usage"], ", ".join(w["search_spaces"]) or "–"] for w in cat["wrappers"]],
        width,
    )
    out += ["", "Trunks (model.trunk; dmlrc docs trunks):"]
    rows = [[t["name"], str(t["feature_dim"] or "–"), t["source"]] for t in cat["trunks"]]
    rows += [
        ["timm:<model>", "–", "any model of the installed timm"],
        ["package.module:attr", "–", "a callable of your own code (import path)"],
    ]
    out += _table(["name", "features", "source"], rows, width)
    out += ["", "Dataset kinds (a sweep config's datasets[].kind; dmlrc docs datasets):"]
    out += _table(["kind", "what"], [[d["kind"], d["description"]] for d in cat["dataset_kinds"]], width)
    out += ["", f"Datasets dmlrc data prepare NAME reads into parquet shards: {', '.join(cat['prepare_datasets'])}"]
    out += ["", "Presets (dmlrc init PRESET copies one to start from):"]
    out += _table(["preset", "what"], [[p["name"], p["summary"]] for p in cat["presets"]], width)
    out += ["", "Installed plug-ins (entry points; dmlrc docs plugins):"]
    if cat["plugins"]:
        out += _table(
            ["kind", "name", "distribution", "status"],
            [[p["kind"], p["name"], _dists(p), p["status"]] for p in cat["plugins"]],
            width,
        )
    else:
        out.append("  none installed")
    # section headings wrap like the tables (table lines start with two spaces)
    return "\n".join(textwrap.fill(line, width) if line and not line.startswith(" ") else line for line in out)
