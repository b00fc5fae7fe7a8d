"""``dmlrc list [--json]``: its parser, which every ``dmlrc`` command builds; the listing itself (the registries,
the loss zoo with torch) is :mod:`pipelines.listing`, loaded when the command runs."""

from __future__ import annotations

import json

__all__ = ["add_list_parser"]


def add_list_parser(sub) -> None:
    p = sub.add_parser(
        "list",
        help="what a sweep config can name: losses (family, paper), trunks, dataset kinds, presets and the installed "
        "plug-ins with their distributions",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON instead of aligned text")
    p.set_defaults(func=_run_list)


def _run_list(args) -> int:
    # the registries (the loss zoo loads torch) for `dmlrc list` only: every dmlrc command imports this module
    from pipelines.listing import catalogue, render_text

    cat = catalogue()
    if args.json:
        print(json.dumps(cat, indent=2, allow_nan=False, ensure_ascii=False))
    else:
        print(render_text(cat))
    return 0
