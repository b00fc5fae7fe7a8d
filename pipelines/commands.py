"""The ``dmlrc`` commands: their parsers, their checks of what they are given, and what each runs.

``pipelines.cli`` installs the signal handlers and then calls :func:`run`; everything here is imported after that,
so a Ctrl-C while torch, pydantic and MLflow load still ends in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipelines.config import ConfigError, check_tracking_uri
from pipelines.config.presets import copy_preset, demo_config, preset_summary, presets
from pipelines.config.schema import load_config, parse_config, redact_uri
from pipelines.config.uris import check_ray_address
from pipelines.data_cli import add_data_parser
from pipelines.docs_cli import add_docs_parser
from pipelines.execution.preflight.locations import check_dir_writable
from pipelines.execution.runtime.resources import check_local_gpus, check_local_workers
from pipelines.list_cli import add_list_parser
from pipelines.records.report_cli import add_records_option
from pipelines.reeval.config import load_reeval_config
from pipelines.results.compare import add_compare_option, check_compare_args
from pipelines.results.report import add_report_parser
from pipelines.results.study_results import ci_table, params_table
from pipelines.tracking.outage import TrackingUnavailable
from pipelines.tracking.server import check_mlflow_server
from pipelines.ui_cli import add_ui_parser

__all__ = ["run", "build_parser"]


_PLAN_HELP = (
    "check the config, print the studies, trials, folds and iterations and the estimated CPU/GPU-hours and wall "
    "time (a few seconds of calibration on this machine); start nothing (dmlrc docs plan)"
)


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="run a reality-check sweep (Bayesian optimisation × 4 folds per loss and dataset)")
    p.add_argument("config", help="sweep config YAML (start from a built-in preset: dmlrc init)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep of this config's name: finished trials are kept, unfinished ones rerun",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster address: head:6379 (the head's GCS), ray://head:10001 (Ray Client) or auto; with token "
        "authentication set RAY_AUTH_MODE=token and the token (dmlrc docs readme, Running on a cluster); default: "
        "start a local Ray",
    )
    p.add_argument(
        "--name", default=None, help="override the config's sweep name (e.g. a dated name for a scheduled re-run)"
    )
    p.add_argument("--plan", action="store_true", help=_PLAN_HELP)
    p.add_argument(
        "--rerun",
        action="append",
        default=[],
        metavar="LOSS",
        help="run this loss's study again although it finished (repeatable; the old run is kept, marked superseded); "
        "other finished studies of the experiment are reused (dmlrc docs compare)",
    )
    p.add_argument(
        "--records",
        default=None,
        metavar="DIR",
        help="write a small JSON record per finished trial and reproduction into DIR/<dataset>/<loss>/ and continue "
        "every study from the records already there, on any machine (overrides the config's records:)",
    )
    p.set_defaults(func=_run_sweep)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="smoke sweep on synthetic data with the built-in demo preset (a few minutes)")
    p.add_argument("--storage", default=None, help="parent folder of the sweep (default: ./runs)")
    p.add_argument("--name", default=None, help="sweep name (default: demo-<timestamp>)")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local Ray")
    p.add_argument("--resume", action="store_true", help="continue the demo sweep of this --name (after Ctrl-C)")
    p.add_argument("--plan", action="store_true", help=_PLAN_HELP)
    p.set_defaults(func=_run_demo)


def _add_init(sub) -> None:
    p = sub.add_parser(
        "init", help="list the built-in sweep presets, or copy one to a file to edit and run with dmlrc sweep"
    )
    p.add_argument("preset", nargs="?", default=None, help="preset name (none: list them)")
    p.add_argument("dest", nargs="?", default=None, help="file or folder to copy it to (default: ./PRESET.yaml)")
    p.set_defaults(func=_run_init)


def _run_init(args) -> int:
    if args.preset is None:
        print("built-in sweep presets (dmlrc init PRESET [DEST] copies one to start from):")
        for name in presets():
            print(f"  {name:14s} {preset_summary(name)}")
        return 0
    target = copy_preset(args.preset, args.dest)
    print(f"wrote {target}: edit it (datasets, losses, storage), then run  dmlrc sweep {target}")
    return 0


def _version() -> str:
    """The installed distribution's version (``dml-reality-check``)."""
    try:
        return version("dml-reality-check")
    except PackageNotFoundError:
        return "(not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmlrc", description="Metric Learning Reality Check sweeps on Ray + MLflow")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep(sub)
    _add_demo(sub)
    _add_init(sub)
    add_data_parser(sub)
    add_report_parser(sub)
    _add_reeval(sub)
    add_list_parser(sub)
    add_ui_parser(sub)
    add_docs_parser(sub)
    report = sub.choices["report"]
    add_compare_option(report)  # dmlrc report --compare EXP_A EXP_B
    report.set_defaults(func=_checked_report(report.get_default("func")))
    add_records_option(report)  # dmlrc report --records DIR: from the records alone
    return parser


def _add_reeval(sub) -> None:
    p = sub.add_parser(
        "reeval",
        help="re-evaluate registered models on the current test data "
        "(exit 0 ok, 3 regression, 1 failure, 2 bad config)",
    )
    p.add_argument(
        "config",
        help="reeval config YAML (its keys: dmlrc docs reeval-config.schema.json; models[].name may spell the loss "
        "as the sweep config does, e.g. dmlrc.EXP.DATASET.sec:triplet)",
    )
    p.set_defaults(func=_run_reeval)


def _run_reeval(args) -> int:
    cfg = load_reeval_config(args.config)
    # Ray and Ray Data (seconds of imports) load for this command only, once its config has been read
    from pipelines.reeval.run import run_reeval

    return run_reeval(cfg)


def _check_report_args(args) -> None:
    """What ``dmlrc report`` is given, checked before MLflow is asked (which would retry an unreachable server
    for minutes, or create an empty sqlite DB at a mistyped path)."""
    if args.compare:
        check_compare_args(args)
    elif not str(args.experiment or "").strip():
        raise ConfigError("--experiment", "required and must not be empty (or --compare EXP_A EXP_B)")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    where = "--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI"
    if not uri:  # MLflow's default store would be created empty in this folder before saying nothing is there
        raise ConfigError(
            "--tracking-uri",
            "required (or set MLFLOW_TRACKING_URI): the MLflow store the sweep logged "
            "to, e.g. sqlite:///runs/NAME/mlflow.db or http://host:5000",
        )
    check_tracking_uri(uri, where)
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        if not db.is_file():
            raise ConfigError(where, f"no sqlite DB at {str(db)!r} (the report only reads)")
        if not os.access(db, os.R_OK | os.W_OK):  # the report logs a run: MLflow would retry a read-only DB for minutes
            raise ConfigError(where, f"sqlite DB {str(db)!r} is not writable (the report logs its run there)")
    if uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, where)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a file, not a folder")
    check_dir_writable(out.resolve(), "--out", "report folder")


def _checked_report(report):
    def run_report(args) -> int:
        _check_report_args(args)
        try:
            return report(args)
        except ValueError as e:  # the report's own input errors start with the option they are about
            text = " ".join(str(e).split())
            if not text.startswith("--"):
                raise
            option, _, problem = text.partition(" ")
            raise ConfigError(option.rstrip(":"), problem) from None

    return run_report


def _finish(outcome) -> int:
    print()
    print(
        f"sweep {outcome.name!r} finished in {outcome.seconds / 60:.1f} min — test metrics ×100, "
        "mean ± half-width of the 95 % t-interval across reproductions:"
    )
    # ranked per dataset; its "untrained network" row: each study's network before training; a study this sweep did
    # not train (reused, a bundle's) marked in its source column, the marks explained under the table
    print(ci_table(outcome.studies, sweep=outcome.name))
    print()
    print("Winning hyperparameters (best BO trial of each study):")
    print(params_table(outcome.studies))
    print()
    if outcome.registered:  # study -> the study run's registered_model tag: "<name>/<version>" or "failed: <why>"
        print("Registered models (dmlrc reeval's models[].name; the loss may also be spelt as in the config):")
        width = max(len(study) for study in outcome.registered)
        for study, ref in outcome.registered.items():
            name, _, number = ref.rpartition("/")
            shown = ref if ref.startswith("failed") or not name else f"{name} version {number}"
            print(f"  {study:{width}s}  {shown}")
        print()
    print("Next: browse the runs (study → trial → fold, reproductions) with")
    print(f"  {redact_uri(outcome.ui_command())}")  # a tracking URI may hold a password
    print("and write one report over every study (markdown, CSV, HTML, paired comparisons) with")
    print(f"  dmlrc report --experiment {outcome.experiment} --tracking-uri {redact_uri(outcome.tracking_uri)}")
    return 0 if all(s.status == "ok" for s in outcome.studies) else 1


def _run_sweep(args) -> int:
    cfg = load_config(args.config, name=args.name, records=args.records)
    _check_address(args)
    check_local_gpus(cfg, args.address)
    check_local_workers(cfg, args.address)
    return _plan_or_sweep(cfg, args)


def _plan_or_sweep(cfg, args) -> int:
    """``--plan``: the sweep's checks, counts and cost estimate, nothing started; else the sweep itself."""
    rerun = frozenset(getattr(args, "rerun", None) or ())  # sweep --rerun LOSS; demo has none
    # the sweep's modules (stores, Ray start-up, the loss zoo: 2 s of CPU) load for `sweep` and `demo` only; the plan
    # imports the sweep's modules itself, and adds a few of the training loop's to a sweep (0.06 s)
    from pipelines.execution import plan, sweep

    if args.plan:
        return plan.plan_sweep(cfg, address=args.address, resume=args.resume, rerun=rerun)
    return _finish(sweep.run_sweep(cfg, resume=args.resume, address=args.address, rerun=rerun))


def _check_address(args) -> None:
    """``--address`` or ``$RAY_ADDRESS`` (which ``ray.init`` would read), checked before anything starts."""
    if args.address is not None:
        check_ray_address(args.address, "--address")
    elif os.environ.get("RAY_ADDRESS"):
        # ray.init would join that cluster anyway: treat it as --address from here on (no local-Ray settings)
        args.address = check_ray_address(os.environ["RAY_ADDRESS"], "RAY_ADDRESS (environment)")


def _run_demo(args) -> int:
    if args.resume and not args.name:
        raise ConfigError(
            "--resume", "needs --name NAME: the demo sweep to continue (its name was printed with the resume command)"
        )
    _check_address(args)
    cfg = parse_config(demo_config(args.name, args.storage), source="built-in demo preset")
    return _plan_or_sweep(cfg, args)


def run(argv: list[str] | None) -> int:
    """Parse ``argv`` and run its command: its exit status; a user's mistake is one ``config error:`` line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for noisy in ("mlflow.store", "alembic"):  # a new sqlite store announces its tables and migrations at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        for line in e.lines():  # one line per problem, each "config error: <field>: <problem>"
            print("config error: " + line, file=sys.stderr)
        return 2
    except TrackingUnavailable as e:  # MLflow down longer than tracking.outage_timeout_s: stopped, state kept
        print("tracking error: " + " ".join(str(e).split()), file=sys.stderr)
        return 3
