"""``dmlrc``: the command line.

    dmlrc sweep CONFIG.yaml [--resume] [--address ADDR]   run / continue a reality-check sweep
    dmlrc demo [--storage DIR] [--name NAME]               smoke sweep with the built-in demo preset
    dmlrc data prepare|verify ...                          datasets as parquet shards (pipelines.data_cli)
    dmlrc report --experiment NAME ...                     one table over every study (pipelines.results.report)
    dmlrc report --compare EXP_A EXP_B ...                 ranking stability of two runs (pipelines.results.compare)
    dmlrc reeval CONFIG.yaml                               re-evaluate registered models (pipelines.reeval.run)
    dmlrc init [PRESET [DEST]]                             list the built-in presets, or copy one to start from
    dmlrc list [--json]                                    losses, trunks, dataset kinds, presets, installed plug-ins
    dmlrc ui [CONFIG | --tracking-uri URI]                 a sweep's MLflow UI on its studies view (until Ctrl-C)
    dmlrc docs [NAME]                                      the documentation shipped with the package

Bad input exits with status 2 and one line ``config error: <field>: <problem>`` (``data error: <file>: ...`` for
``dmlrc data``) — before Ray or MLflow start and before anything is written.  An MLflow server unreachable
mid-sweep for longer than ``tracking.outage_timeout_s`` stops the sweep with one line ``tracking error: ...`` and
status 3; its state is kept for ``--resume`` (:mod:`pipelines.tracking.outage`).
"""

from __future__ import annotations

import sys

# Only the standard library and the signal handling at import: the console script imports this module first, and a
# Ctrl-C or SIGTERM while torch, Ray and MLflow load must end in one line (main() installs the handlers first).
from pipelines.execution.runtime.interrupts import exit_status, install_startup_handlers

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``dmlrc``: exit 0 ok, 1 a study failed, 2 bad input (one ``config error:`` line), 3 MLflow unreachable
    mid-sweep (state kept), 130 / 143 stopped by Ctrl-C / SIGTERM (state kept; the ``--resume`` command printed)."""
    install_startup_handlers()
    try:
        # the commands (torch, pydantic, MLflow: seconds of imports) load only once the handlers are in place
        from pipelines.commands import run

        return run(argv)
    except KeyboardInterrupt as e:
        if not getattr(e, "announced", False):  # a running sweep has already said how it stopped and how to resume
            print("interrupted", file=sys.stderr)
        return exit_status(e)
    except ModuleNotFoundError as e:
        missing = _missing_training_stack()
        if not missing:
            raise
        # an install for registered models only (the core requirements): one line, not a traceback
        print(
            f"dmlrc: cannot import {e.name!r}: the command line needs the training stack, not installed here "
            f"(missing: {', '.join(missing)}): pip install 'dml-reality-check[train]'",
            file=sys.stderr,
        )
        return 2


def _missing_training_stack() -> list[str]:
    """The distributions of this package's ``train`` extra that are not installed here."""
    # only on the failure path: the CLI's start-up (before its signal handlers) imports as little as it can
    import importlib.metadata

    from packaging.requirements import Requirement  # (as said above)

    try:
        requires = importlib.metadata.requires("dml-reality-check") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for line in requires:
        req = Requirement(line)
        if (
            req.marker is not None
            and req.marker.evaluate({"extra": "train"})
            and not req.marker.evaluate({"extra": ""})
        ):
            try:
                importlib.metadata.distribution(req.name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(req.name)
    return missing


if __name__ == "__main__":
    sys.exit(main())
