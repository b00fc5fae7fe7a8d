"""Between a study's Tune results and its records: the record a finished trial or reproduction leaves, and the
result row a record stands for when a study continues from its records (the same keys the study's steps read).

Torch-free: a trial's driver calls :func:`fold_records` on its folds' outcomes."""

from __future__ import annotations

import datetime
import math
from typing import Any, Literal

from dml_core import __version__
from pipelines.execution.folds.config import FoldOutcome
from pipelines.names import HEADLINE_METRICS, MODES, OBJECTIVE, PARAMS, REPRODUCTION
from pipelines.records.model import SCHEMA, FoldRecord, ReproductionRecord, TrialRecord
from pipelines.results.study_results import COST_KEYS

__all__ = ["FOLDS_KEY", "fold_records", "trial_record", "reproduction_record", "row_of_trial", "row_of_reproduction"]

#: The Tune result key holding a trial's folds as records (pipelines.execution.folds.trial).
FOLDS_KEY = "fold_records"


def _stopped(o: FoldOutcome) -> Literal["patience", "cap", "diverged"]:  # FoldRecord.stopped
    if o.status != "ok":
        return "diverged"
    return "patience" if o.stopped_early else "cap"


def fold_records(outcomes: list[FoldOutcome]) -> list[dict[str, Any]]:
    """Each fold's record (as JSON-ready dicts, for the trial's Tune result)."""
    out = []
    for o in outcomes:
        curve = [
            (int(r["iteration"]), float(r["metrics"]["map_at_r"]))
            for r in o.history
            if isinstance(r.get("metrics", {}).get("map_at_r"), (int, float))
            and math.isfinite(r["metrics"]["map_at_r"])
        ]
        best = [int(r["iteration"]) for r in o.history if r.get("epoch") == o.best_epoch]
        rec = FoldRecord(
            fold=o.fold,
            curve=curve,
            stopped=_stopped(o),
            iterations=int(o.iterations),
            best_iteration=best[0] if best else 0,
            best_val={k: float(v) for k, v in o.best_metrics.items() if k in HEADLINE_METRICS},
            cpu_seconds=float(o.cpu_seconds or 0.0),
            numerics=o.numerics,
            cpu_model=o.cpu_model,
        )
        out.append(rec.model_dump(mode="json"))
    return out


def _common(row: dict[str, Any], study: str, fingerprint: str) -> dict[str, Any]:
    folds = [FoldRecord.model_validate(f) for f in row.get(FOLDS_KEY) or []]
    cost = {k: float(row[f"cost_{k}"]) for k in COST_KEYS if isinstance(row.get(f"cost_{k}"), (int, float))}
    return {
        "schema": SCHEMA,
        "study": study,
        "fingerprint": fingerprint,
        "seed": int(row.get("seed", 0)),
        "status": row.get("status", "ok"),
        "reason": str(row.get("reason") or ""),
        "folds": folds,
        "cost": cost,
        "cpu_seconds": sum(f.cpu_seconds for f in folds),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "package_version": __version__,
    }


def _finite(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else default


def trial_record(row: dict[str, Any], study: str, fingerprint: str, index: int) -> TrialRecord:
    """The record of search trial ``row`` (a Tune result row: ``config``, ``trial_id``, the objective, folds)."""
    params = {k: v for k, v in row["config"].items() if not k.startswith("__")}
    return TrialRecord(
        kind="trial",
        index=index,
        trial_id=str(row["trial_id"]),
        params=params,
        objective=_finite(row.get(OBJECTIVE)),
        objective_sem=_finite(row.get("val_map_at_r_sem")),
        **_common(row, study, fingerprint),
    )


def reproduction_record(
    row: dict[str, Any], study: str, fingerprint: str, params: dict[str, Any]
) -> ReproductionRecord:
    """The record of reproduction ``row`` (its test metrics in both modes)."""
    test = {
        mode: {k[len(f"test_{mode}_") :]: float(v) for k, v in row.items() if k.startswith(f"test_{mode}_")}
        for mode in MODES
    }
    return ReproductionRecord(
        kind="reproduction",
        index=int(row[REPRODUCTION]),
        params=dict(params),
        test=test,
        **_common(row, study, fingerprint),
    )


def _row(rec: TrialRecord | ReproductionRecord) -> dict[str, Any]:
    row: dict[str, Any] = {
        "status": rec.status,
        "reason": rec.reason,
        "seed": rec.seed,
        "error": None,
        "from_records": True,
        FOLDS_KEY: [f.model_dump(mode="json") for f in rec.folds],
    }
    row.update({f"cost_{k}": v for k, v in rec.cost.items()})
    return row


def row_of_trial(rec: TrialRecord) -> dict[str, Any]:
    """The result row trial ``rec`` stands for: what best_result, the study's costs and the summary read."""
    row = _row(rec)
    row.update(
        {
            "trial_id": rec.trial_id,
            "config": dict(rec.params),
            OBJECTIVE: rec.objective,
            "val_map_at_r_sem": rec.objective_sem,
            "record_index": rec.index,
        }
    )
    return row


def row_of_reproduction(rec: ReproductionRecord) -> dict[str, Any]:
    """The result row reproduction ``rec`` stands for: its test metrics under the keys the intervals read."""
    row = _row(rec)
    row.update({REPRODUCTION: rec.index, "trial_id": f"reproduction-{rec.index}", "config": {PARAMS: dict(rec.params)}})
    for mode, metrics in rec.test.items():
        row.update({f"test_{mode}_{k}": v for k, v in metrics.items()})
    return row
