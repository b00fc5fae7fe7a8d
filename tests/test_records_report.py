"""dmlrc report --records: the report from a records folder alone (no MLflow store)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines.records.rows import reproduction_record, trial_record
from pipelines.records.store import StudyRecords, header_of
from pipelines.results.fingerprint import Fingerprint
from tests.tiny_sweep import ROOT

FP = Fingerprint({"protocol.max_epochs": 4, "protocol.eval_every": 1, "data.digest": "abc"})


def _fold(k: int, stopped: str, v: float) -> dict:
    return {
        "fold": k,
        "curve": [[0, 0.1], [10, v - 0.05], [20, v]],
        "stopped": stopped,
        "iterations": 20,
        "best_iteration": 20,
        "best_val": {"map_at_r": v},
        "cpu_seconds": 900.0,
        "numerics": "bf16+channels_last",
        "cpu_model": "Test CPU",
    }


def _study(root, loss: str, trials: int, reps: int, level: float) -> None:
    header = header_of(
        {
            "study": f"synthetic/{loss}",
            "dataset": "synthetic",
            "loss": loss,
            "fingerprint": FP.to_json(),
            "trials": 3,
            "reproductions": 3,
            "searched": {},
            "untrained": {"map_at_r": 0.05, "r_precision": 0.1, "precision_at_1": 0.2},
        }
    )
    rec = StudyRecords.open(root / "synthetic" / loss, header)
    for i in range(trials):
        v = level + 0.01 * i
        row = {
            "trial_id": f"t{i}",
            "config": {"lr": 0.1 * (i + 1)},
            "val_map_at_r_mean": v,
            "val_map_at_r_sem": 0.01,
            "status": "ok",
            "seed": 0,
            "cost_cpu_seconds": 1800.0,
            "fold_records": [_fold(0, "patience", v), _fold(1, "cap" if i == 0 else "patience", v)],
        }
        rec.add_trial(trial_record(row, header.study, FP.hash, i))
    for r in range(reps):
        row = {
            "__reproduction__": r,
            "status": "ok",
            "seed": 1000 * (r + 1),
            "cost_cpu_seconds": 1800.0,
            "fold_records": [_fold(0, "patience", level), _fold(1, "patience", level)],
            **{
                f"test_{m}_{k}": level + 0.01 * r
                for m in ("concat", "separated")
                for k in ("map_at_r", "r_precision", "precision_at_1")
            },
        }
        rec.add_reproduction(reproduction_record(row, header.study, FP.hash, {"lr": 0.3}))


def _no_nan(name):
    raise ValueError(f"{name} in a JSON the report wrote")


def test_the_report_from_records_alone(tmp_path):
    records = tmp_path / "records"
    _study(records, "contrastive", 3, 3, 0.30)
    _study(records, "arcface", 3, 3, 0.40)
    _study(records, "triplet", 2, 0, 0.35)  # in progress
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "report", "--records", str(records), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = (out / "report.md").read_text()
    assert "arcface" in md and "contrastive" in md
    assert "2 of 3 studies complete — **partial**" in md
    # search folds: 6, of which one ended by the cap; reproduction folds all by patience; 3 trials × 0.5 h + 3 × 0.5 h
    assert "| synthetic/contrastive | 3/3 | 3/3 | 83 % | 100 % | 3.00 | Test CPU | bf16+channels_last |" in md
    assert "| synthetic/triplet | 2/3 | 0/3 |" in md
    assert "Expected validation performance" in md
    doc = json.loads((out / "records.json").read_text(), parse_constant=_no_nan)
    by = {s["study"]: s for s in doc["studies"]}
    assert by["synthetic/contrastive"]["expected_best_val_map_at_r"] == pytest.approx([0.31, 0.3167, 0.32], abs=1e-4)
    assert by["synthetic/triplet"]["patience_share"]["reproductions"] is None
    assert doc["complete"] == 2 and (out / "expected_validation.png").stat().st_size > 0
    for path in out.glob("*.json"):
        json.loads(path.read_text(), parse_constant=_no_nan)
    rows = [line for line in md.splitlines() if "contrastive" in line and "±" in line]
    assert rows, md[:3000]


def test_a_broken_records_folder_is_one_line(tmp_path):
    records = tmp_path / "records"
    _study(records, "contrastive", 1, 0, 0.3)
    path = records / "synthetic" / "contrastive" / "trial-000.json"
    path.write_text(path.read_text()[:40])
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "report", "--records", str(records), "--out", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"config error: records: {path}: not a complete JSON record")
