"""``dmlrc``: the command line.

    dmlrc sweep CONFIG.yaml [--resume] [--address ADDR]   run / continue a reality-check sweep
    dmlrc demo [--storage DIR] [--name NAME]               smoke sweep with the built-in demo preset
    dmlrc data prepare|verify ...                          datasets as parquet shards (pipelines.data_cli)
    dmlrc report --experiment NAME ...                     one table over every study (pipelines.report)
    dmlrc reeval CONFIG.yaml                               re-evaluate registered models (pipelines.reeval)

Bad input exits with status 2 and one line ``config error: <field>: <problem>`` — before Ray or MLflow start.
"""

from __future__ import annotations

import argparse
import sys

from pipelines.config import ConfigError

__all__ = ["main", "build_parser"]


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="run a reality-check sweep (Bayesian optimisation × 4 folds per loss and dataset)")
    p.add_argument("config", help="sweep config YAML (see configs/)")
    p.add_argument("--resume", action="store_true",
                   help="continue the sweep of this config's name: finished trials are kept, unfinished ones rerun")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (e.g. ray://head:10001 or auto); default: start a local Ray")
    p.add_argument("--name", default=None,
                   help="override the config's sweep name (e.g. a dated name for a scheduled re-run)")
    p.set_defaults(func=_run_sweep)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="smoke sweep on synthetic data with the built-in demo preset (a few minutes)")
    p.add_argument("--storage", default=None, help="parent folder of the sweep (default: ./runs)")
    p.add_argument("--name", default=None, help="sweep name (default: demo-<timestamp>)")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local Ray")
    p.set_defaults(func=_run_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmlrc", description="Metric Learning Reality Check sweeps on Ray + MLflow")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep(sub)
    _add_demo(sub)
    from pipelines.data_cli import add_data_parser
    from pipelines.reeval import add_reeval_parser
    from pipelines.report import add_report_parser

    add_data_parser(sub)
    add_report_parser(sub)
    add_reeval_parser(sub)
    return parser


def _finish(outcome) -> int:
    from pipelines.sweep import ci_table

    print()
    print(f"sweep {outcome.name!r} finished in {outcome.seconds / 60:.1f} min — test metrics ×100, "
          "mean ± half-width of the 95 % t-interval across reproductions:")
    print(ci_table(outcome.studies))
    print()
    print("Browse the runs (study → trial → fold, reproductions) with:")
    print(f"  {outcome.mlflow_ui_command()}")
    return 0 if all(s.status == "ok" for s in outcome.studies) else 1


def _run_sweep(args) -> int:
    from pipelines.config import load_config
    from pipelines.sweep import run_sweep

    cfg = load_config(args.config, name=args.name)
    return _finish(run_sweep(cfg, resume=args.resume, address=args.address))


def _run_demo(args) -> int:
    from pipelines.config import parse_config
    from pipelines.presets import demo_config
    from pipelines.sweep import run_sweep

    cfg = parse_config(demo_config(args.name, args.storage), source="built-in demo preset")
    return _finish(run_sweep(cfg, address=args.address))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
