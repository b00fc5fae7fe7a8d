"""``dmlrc report --records DIR``: the report of the studies in a records folder, from the records alone (no MLflow).

:func:`read_records` reads every study folder under ``DIR`` (``<dataset>/<loss>/``) with the checks a sweep applies;
:func:`studies_from_records` turns each study whose search and reproductions are all recorded into the report's
:class:`~pipelines.results.report_studies.Study` (intervals from the reproductions' test metrics, the best trial by
the sweep's own rule); :func:`records_section` writes what only records know — how the folds stopped, the expected
validation performance of each search (Dodge et al. 2019, Tang et al. 2020's unbiased estimator), CPU-hours, the CPUs
and numerics the records came from, and which studies are still in progress.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dml_core.evaluation.expected_validation import expected_max
from dml_core.evaluation.stats import confidence_interval
from pipelines.execution.search.searcher import best_result
from pipelines.names import HEADLINE_METRICS, MODES
from pipelines.records.model import StudyHeader
from pipelines.records.rows import row_of_trial
from pipelines.records.store import HEADER, RecordsError, StudyRecords, read_record
from pipelines.results.fingerprint import Fingerprint
from pipelines.results.plotting import plt
from pipelines.results.report_studies import Study

__all__ = ["RecordedStudy", "read_records", "studies_from_records", "records_section", "evp_figure"]


@dataclass
class RecordedStudy:
    records: StudyRecords

    @property
    def header(self) -> StudyHeader:
        return self.records.header

    @property
    def complete(self) -> bool:
        h = self.header
        return len(self.records.trials) >= h.trials and len(self.records.reproductions) >= h.reproductions

    def folds(self, kind: str) -> list:
        runs = self.records.trials if kind == "trial" else list(self.records.reproductions.values())
        return [f for r in runs for f in r.folds]

    @functools.cached_property
    def evp(self) -> list[float]:
        """Expected best validation MAP@R after n = 1..N of the recorded trials (Tang et al.'s estimator)."""
        values = [t.objective for t in self.records.trials]
        return expected_max(values) if values else []

    def cpu_seconds(self) -> float:
        runs = [*self.records.trials, *self.records.reproductions.values()]
        return sum(r.cpu_seconds for r in runs)


def read_records(root: str | Path) -> list[RecordedStudy]:
    """Every study under ``root`` (a folder holding ``<dataset>/<loss>/study.json``), each checked as a sweep checks
    it; a records folder without any study is a :class:`RecordsError`."""
    root = Path(root)
    if not root.is_dir():
        raise RecordsError(f"{root}: no such folder")
    out = []
    for header_path in sorted(root.glob(f"*/*/{HEADER}")):
        header = read_record(header_path, StudyHeader)
        out.append(RecordedStudy(StudyRecords.open(header_path.parent, header)))
    if not out:
        raise RecordsError(f"{root}: no study records (<dataset>/<loss>/{HEADER})")
    return out


def _stopped_share(folds: list, why: str) -> float:
    return sum(f.stopped == why for f in folds) / len(folds) if folds else math.nan


def studies_from_records(studies: list[RecordedStudy]) -> list[Study]:
    """The complete studies as the report's Study objects (in progress: left out, listed by records_section)."""
    out = []
    for rs in studies:
        if not rs.complete:
            continue
        h, rec = rs.header, rs.records
        rows = [row_of_trial(t) for t in rec.trials]
        best = best_result(rows)
        reps = {i: r for i, r in sorted(rec.reproductions.items())}
        metrics: dict[str, float] = {"test.n_reproductions": float(len(reps))}
        for mode in MODES:
            for k in HEADLINE_METRICS:
                vals = [r.test.get(mode, {}).get(k) for r in reps.values()]
                if all(isinstance(v, float) for v in vals):
                    m, lo, hi = confidence_interval(vals)
                    metrics.update(
                        {f"test.{mode}.{k}.mean": m, f"test.{mode}.{k}.ci_low": lo, f"test.{mode}.{k}.ci_high": hi}
                    )
        if best is not None:
            metrics["best.val.map_at_r.mean"] = best["val_map_at_r_mean"]
            metrics["best.val.map_at_r.sem"] = best["val_map_at_r_sem"]
        for key in ("cpu_seconds", "gpu_seconds", "wall_seconds"):
            metrics[f"cost.{key}"] = sum(r.cost.get(key, 0.0) for r in [*rec.trials, *reps.values()])
        folds = rs.folds("trial") + rs.folds("reproduction")
        per_epoch = int(h.fingerprint["fields"].get("protocol.iters_per_epoch") or 1)
        study = Study(
            run_id="",
            dataset=h.dataset,
            loss=h.loss,
            metrics=metrics,
            reproductions={
                i: {f"test.{m}.{k}": v for m, d in r.test.items() for k, v in d.items()} for i, r in reps.items()
            },
            seeds={i: str(r.seed) for i, r in reps.items()},
            best_params={k: str(v) for k, v in (best["config"] if best else {}).items()},
            training={
                "folds": len(folds),
                "improving": sum(1 for f in folds if f.stopped == "cap" and f.best_iteration == f.iterations),
                "epochs": float(sum(f.iterations for f in folds) / max(1, len(folds)) / per_epoch),
            },
            untrained=dict(h.untrained),
            fingerprint=Fingerprint.from_json(h.fingerprint),
            best_trial=best["trial_id"] if best else "",
            source=f"records {rec.folder}",
            source_date=max((r.written for r in [*rec.trials, *reps.values()]), default=""),
        )
        out.append(study)
    return sorted(out, key=lambda s: (s.dataset, s.loss))


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.0f} %"


def records_section(studies: list[RecordedStudy]) -> tuple[str, dict[str, Any]]:
    """The records' own part of the report, as markdown and as JSON (no NaN: null instead)."""
    lines = ["## From the records", ""]
    done = [s for s in studies if s.complete]
    todo = [s for s in studies if not s.complete]
    lines.append(
        f"{len(done)} of {len(studies)} studies complete"
        + (" — **partial**: the table holds only the complete studies." if todo else ".")
    )
    lines += [
        "",
        "| study | trials | reproductions | search folds ended by patience | reproduction folds ended by "
        "patience | CPU-hours | CPUs | numerics |",
        "|---|---|---|---|---|---|---|---|",
    ]
    doc_studies = []
    for s in studies:
        h = s.header
        search, reps = s.folds("trial"), s.folds("reproduction")
        cpus = sorted({f.cpu_model for f in search + reps})
        numerics = sorted({f.numerics for f in search + reps})
        lines.append(
            f"| {h.study} | {len(s.records.trials)}/{h.trials} | {len(s.records.reproductions)}/{h.reproductions} | "
            f"{_pct(_stopped_share(search, 'patience'))} | {_pct(_stopped_share(reps, 'patience'))} | "
            f"{s.cpu_seconds() / 3600:.2f} | {'; '.join(cpus) or '–'} | {', '.join(numerics) or '–'} |"
        )
        share = {k: _stopped_share(v, "patience") for k, v in (("search", search), ("reproductions", reps))}
        doc_studies.append(
            {
                "study": h.study,
                "complete": s.complete,
                "trials": len(s.records.trials),
                "reproductions": len(s.records.reproductions),
                "patience_share": {k: (None if math.isnan(v) else v) for k, v in share.items()},
                "cpu_hours": s.cpu_seconds() / 3600,
                "cpus": cpus,
                "numerics": numerics,
                "fingerprint": h.fingerprint["hash"],
                "expected_best_val_map_at_r": s.evp,
            }
        )
    total = sum(s.cpu_seconds() for s in studies) / 3600
    lines += [
        "",
        f"CPU-hours in all: {total:.2f}. Fingerprints: "
        + ", ".join(sorted({s.header.fingerprint["hash"] for s in studies}))
        + ".",
        "",
    ]
    lines += [
        "### Expected validation performance",
        "",
        'The expected best validation MAP@R after n trials of each search (Dodge et al. 2019, "Show your work"), by '
        "the unbiased estimator of Tang et al. 2020 (draws without replacement from the recorded trials): a loss "
        "whose curve rises late won through its search's luck, not its level.",
        "",
    ]
    width = max((len(s.evp) for s in studies), default=0)
    marks = sorted({n for n in (1, 2, 5, 10, 20, 50) if n <= width} | ({width} if width else set()))
    if marks:
        lines += ["| study | " + " | ".join(f"n={n}" for n in marks) + " |", "|---" * (len(marks) + 1) + "|"]
        for s in studies:
            e = s.evp
            lines.append(
                f"| {s.header.study} | " + " | ".join(f"{e[n - 1]:.4f}" if n <= len(e) else "–" for n in marks) + " |"
            )
    doc = {"studies": doc_studies, "cpu_hours": total, "complete": len(done), "total": len(studies)}
    return "\n".join(lines) + "\n", doc


def evp_figure(studies: list[RecordedStudy], path: Path) -> None:
    """One figure: every study's expected best validation MAP@R against the number of trials."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in studies:
        e = s.evp
        if e:
            ax.plot(range(1, len(e) + 1), e, marker=".", label=s.header.loss)
    ax.set_xlabel("trials")
    ax.set_ylabel("expected best validation MAP@R")
    ax.set_title("Expected validation performance (Tang et al. 2020 estimator)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
