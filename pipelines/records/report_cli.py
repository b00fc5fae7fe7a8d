"""``dmlrc report --records DIR --out DIR``: the report from a records folder alone (no MLflow store needed)."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.config.errors import ConfigError

__all__ = ["add_records_option", "run_records_report"]


def add_records_option(report_parser) -> None:
    """``--records DIR`` on ``dmlrc report``: with it the report reads the records, not MLflow."""
    report_parser.add_argument(
        "--records",
        default=None,
        metavar="DIR",
        help="build the report from a records folder (dmlrc sweep --records) alone: the complete studies' table and "
        "tests, how folds stopped, expected validation performance, CPU-hours; no MLflow store needed",
    )
    inner = report_parser.get_default("func")

    def run(args) -> int:
        if args.records is None:
            return inner(args)
        for name in ("experiment", "compare", "tracking_uri"):
            if getattr(args, name, None):
                raise ConfigError("--records", f"reads the records alone: leave out --{name.replace('_', '-')}")
        return run_records_report(args.records, args.out)

    report_parser.set_defaults(func=run)


def run_records_report(records: str, out_dir: str) -> int:
    # the report's modules (matplotlib, scipy, the report writers) load for this command only
    from pipelines.records.report import evp_figure, read_records, records_section, studies_from_records
    from pipelines.results.report import write_report_files

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a file, not a folder")
    recorded = read_records(records)
    studies = studies_from_records(recorded)
    out.mkdir(parents=True, exist_ok=True)
    section, doc = records_section(recorded)
    paths: dict[str, Path] = {}
    if studies:
        paths = write_report_files(f"records {records}", studies, out)
        paths["md"].write_text(paths["md"].read_text() + "\n" + section)
    else:
        paths["md"] = out / "report.md"
        paths["md"].write_text(f"# Report from the records in {records}\n\nNo study is complete yet.\n\n" + section)
    paths["records_json"] = out / "records.json"
    paths["records_json"].write_text(json.dumps(doc, indent=2, allow_nan=False))
    paths["evp_png"] = out / "expected_validation.png"
    evp_figure(recorded, paths["evp_png"])
    print(paths["md"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
