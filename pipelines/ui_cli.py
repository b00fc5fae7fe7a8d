"""``dmlrc ui [CONFIG] [--tracking-uri URI] [--experiment NAME] [--port N] [--no-browser]``: its parser, which every
``dmlrc`` command builds; what the command runs (MLflow, the tracking checks) is :mod:`pipelines.ui_serve`, loaded
when it runs."""

from __future__ import annotations

__all__ = ["add_ui_parser"]


def add_ui_parser(sub) -> None:
    p = sub.add_parser(
        "ui",
        help="open a sweep's MLflow UI on its studies view: serves a sqlite/PostgreSQL store with mlflow server on "
        "127.0.0.1 until Ctrl-C (a server URI: prints its link)",
    )
    p.add_argument(
        "config", nargs="?", default=None, help="the sweep's config YAML (its tracking store and experiment)"
    )
    p.add_argument("--name", default=None, help="the sweep name the config ran under, if dmlrc sweep was given --name")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="the MLflow store instead of a config: sqlite:///runs/NAME/mlflow.db, postgresql://… or http(s)://host"
        " (default: $MLFLOW_TRACKING_URI)",
    )
    p.add_argument(
        "--experiment", default=None, help="the experiment to open (default: the config's; else the store's only one)"
    )
    p.add_argument("--port", type=int, default=None, help="loopback port to serve on (default: a free one)")
    p.add_argument("--no-browser", action="store_true", help="print the link only; do not open a browser")
    p.set_defaults(func=_run_ui)


def _run_ui(args) -> int:
    # MLflow and the tracking store's checks for `dmlrc ui` only: every dmlrc command imports this module's parser
    from pipelines.ui_serve import run_ui

    return run_ui(args)
