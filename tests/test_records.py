"""A study's records (pipelines.records): a search continued from them proposes what the uninterrupted search
proposes, broken or foreign records are one line naming the file and field, nothing recorded is overwritten, and a
sweep stopped by SIGTERM continues from its records alone, in a fresh folder, to the uninterrupted run's table."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from pipelines.execution.search.searcher import SamplerFactory, TrialSeededSampler
from pipelines.records.model import SCHEMA, TrialRecord
from pipelines.records.rows import row_of_trial, trial_record
from pipelines.records.store import RecordsError, StudyRecords, header_of
from pipelines.results.fingerprint import Fingerprint
from tests.tiny_sweep import ray_tmpdir, sweep_env, tiny_sweep

SPACE = {
    "margin": optuna.distributions.FloatDistribution(0.01, 1.0, log=True),
    "k": optuna.distributions.IntDistribution(1, 8),
    "mode": optuna.distributions.CategoricalDistribution(["a", "b", "c"]),
}


def _value(params) -> float:
    return -((math.log(params["margin"]) + 2.0) ** 2) - 0.1 * params["k"] + (params["mode"] == "b")


def _search(kind: str, n: int, done: list[tuple[dict, float]] = ()) -> list[dict]:
    """``n`` trials of a study that starts with ``done`` (values and results) added: the proposals it makes."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=TrialSeededSampler(SamplerFactory(kind, 2), seed=7))
    for params, value in done:
        study.add_trial(optuna.trial.create_trial(params=params, distributions=SPACE, value=value))
    out = []
    for _ in range(n):
        t = study.ask(SPACE)
        study.tell(t, _value(t.params))
        out.append(t.params)
    return out


@pytest.mark.parametrize("kind", ["gp", "tpe"])
def test_a_continued_search_proposes_what_the_uninterrupted_one_proposes(kind):
    whole = _search(kind, 6)
    continued = _search(kind, 3, [(p, _value(p)) for p in whole[:3]])
    assert continued == whole[3:]
    assert len({json.dumps(p, sort_keys=True) for p in whole}) == 6  # the proposals do differ from trial to trial


def _header(fields=None, **over):
    fp = Fingerprint(fields or {"protocol.max_epochs": 2, "data.digest": "abc"})
    doc = {
        "study": "synthetic/contrastive",
        "dataset": "synthetic",
        "loss": "contrastive",
        "fingerprint": fp.to_json(),
        "trials": 3,
        "reproductions": 2,
        "searched": {"margin": {"name": "margin", "low": 0.01, "high": 1.0, "log": True, "type": "float"}},
    }
    doc.update(over)
    return header_of(doc)


def _row(i: int) -> dict:
    fold = {
        "fold": 0,
        "curve": [[0, 0.1], [4, 0.3 + i / 100]],
        "stopped": "patience",
        "iterations": 8,
        "best_iteration": 4,
        "best_val": {"map_at_r": 0.3},
        "cpu_seconds": 1.5,
        "numerics": "fp32+channels_last",
        "cpu_model": "test CPU",
    }
    return {
        "trial_id": f"t_{i:05d}",
        "config": {"margin": 0.1 * (i + 1), "__pruning__": 3},
        "val_map_at_r_mean": 0.3 + i / 100,
        "val_map_at_r_sem": 0.01,
        "status": "ok",
        "seed": 3,
        "cost_cpu_seconds": 2.0,
        "fold_records": [fold],
    }


def _write(folder: Path, header, n: int) -> StudyRecords:
    records = StudyRecords.open(folder, header)
    for i in range(n):
        records.add_trial(trial_record(_row(i), header.study, header.fingerprint["hash"], i))
    return records


def test_records_round_trip_into_the_rows_the_study_reads(tmp_path):
    header = _header()
    _write(tmp_path / "s", header, 2)
    again = StudyRecords.open(tmp_path / "s", header)
    assert [t.index for t in again.trials] == [0, 1]
    row = row_of_trial(again.trials[1])
    assert row["config"] == {"margin": 0.2}  # the search's own constants are not the trial's values
    assert row["val_map_at_r_mean"] == pytest.approx(0.31) and row["cost_cpu_seconds"] == 2.0
    assert row["fold_records"][0]["curve"] == [[0, 0.1], [4, 0.31]]
    assert json.loads((tmp_path / "s" / "study.json").read_text())["schema"] == SCHEMA
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "s").iterdir()} == {0o644}  # readable by colleagues


def test_a_record_is_never_overwritten(tmp_path):
    header = _header()
    records = _write(tmp_path / "s", header, 1)
    path = tmp_path / "s" / "trial-000.json"
    before = path.read_bytes()
    other = StudyRecords(tmp_path / "s", header)  # a writer that did not see the record
    with pytest.raises(RecordsError, match="exists already; it is kept"):
        other.add_trial(trial_record(_row(5), header.study, header.fingerprint["hash"], 0))
    assert path.read_bytes() == before
    records.add_trial(trial_record(_row(0), header.study, header.fingerprint["hash"], 0))  # the same trial: kept
    assert path.read_bytes() == before and not list((tmp_path / "s").glob(".tmp-*"))


def test_records_of_another_protocol_are_refused_naming_the_field(tmp_path):
    _write(tmp_path / "s", _header(), 1)
    other = _header({"protocol.max_epochs": 4, "data.digest": "abc"})
    with pytest.raises(RecordsError) as e:
        StudyRecords.open(tmp_path / "s", other)
    assert "protocol.max_epochs is 2 in the records and 4 in this sweep" in str(e.value)
    assert str(tmp_path / "s" / "study.json") in str(e.value)
    space = _header(searched={})
    with pytest.raises(RecordsError, match="recorded with searched"):
        StudyRecords.open(tmp_path / "s", space)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda t: t[: len(t) // 2], "not a complete JSON record"),
        (lambda t: t.replace('"objective":0.3', '"objective":NaN'), "objective"),
        (lambda t: t.replace('"status":"ok"', '"status":"great"'), "status"),
        (lambda t: t.replace('"trial_id"', '"extra":1,"trial_id"'), "extra"),
        (lambda t: t.replace('"fingerprint":"', '"fingerprint":"00'), "fingerprint 00"),
        (lambda t: t.replace(SCHEMA, "dmlrc.records/9"), "schema 'dmlrc.records/9'"),
    ],
)
def test_a_truncated_or_hand_edited_record_is_one_error_naming_the_file(tmp_path, damage, words):
    header = _header()
    _write(tmp_path / "s", header, 1)
    path = tmp_path / "s" / "trial-000.json"
    path.write_text(damage(path.read_text()))
    kept = path.read_bytes()
    with pytest.raises(RecordsError) as e:
        StudyRecords.open(tmp_path / "s", header)
    assert str(e.value).startswith(f"records: {path}: ") and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and path.read_bytes() == kept


def test_a_gap_in_the_trials_is_refused(tmp_path):
    header = _header()
    _write(tmp_path / "s", header, 3)
    (tmp_path / "s" / "trial-001.json").unlink()
    with pytest.raises(RecordsError, match="trial 1's record is missing"):
        StudyRecords.open(tmp_path / "s", header)


def test_a_continued_searchs_progress_counts_and_bests_its_recorded_trials(capsys):
    """The 8th trial of 20, the first of a sitting that continued from 7 records, says 8/20, and its "best" is the
    study's (a recorded trial's), not only this sitting's."""
    from types import SimpleNamespace

    from pipelines.execution.studies.progress import TrialProgress

    done = [row_of_trial(trial_record(_row(i), "synthetic/contrastive", "h", i)) for i in range(7)]
    progress = TrialProgress("synthetic/contrastive", 20, done=done)
    progress.on_trial_complete(
        0, [], SimpleNamespace(trial_id="t8", last_result={"val_map_at_r_mean": 0.31, "status": "ok"})
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("[synthetic/contrastive] trial 8/20 t8: val MAP@R 0.3100 [ok], best 0.3600"), line


def test_a_non_finite_parameter_is_refused():
    rec = trial_record(_row(0), "synthetic/contrastive", "h", 0).model_dump(mode="json", by_alias=True)
    rec["params"]["margin"] = float("inf")
    with pytest.raises(ValueError, match="params"):
        TrialRecord.model_validate(rec)


# ------------------------------------------------------------------------------------------------ a real sweep


def _table(stdout: str) -> list[list[str]]:
    """The end-of-sweep table's rows of the study and the untrained reference, without the cost columns (CPU-h and
    GPU-h: measured time, which a loaded machine stretches)."""
    rows = [line.split("  ") for line in stdout.splitlines() if line.startswith("synthetic  ")]
    return [[c.strip() for c in row if c.strip()][:8] for row in rows]


def _cfg(tmp: Path, name: str) -> Path:
    return tiny_sweep(
        tmp,
        name,
        ["contrastive"],
        protocol={"trials": 3, "startup_trials": 1, "reproductions": 2, "max_epochs": 2},
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1},
        tracking={"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "records"},
    )


def _sweep(cfg: Path, records: Path, cwd: Path, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--records", str(records)],
        cwd=cwd,
        env=sweep_env(ray_tmpdir()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _params(records: Path) -> list[dict]:
    files = sorted((records / "synthetic" / "contrastive").glob("trial-*.json"))
    return [json.loads(f.read_text())["params"] for f in files]


@pytest.mark.slow
def test_a_sweep_stopped_after_its_second_trial_continues_from_its_records_alone(tmp_path):
    # the uninterrupted run
    whole = tmp_path / "whole"
    whole.mkdir()
    done = _sweep(_cfg(whole, "rec"), whole / "records", whole)
    out, err = done.communicate(timeout=900)
    assert done.returncode == 0, out[-3000:] + err[-3000:]
    # the same sweep, stopped by SIGTERM once its second trial is recorded
    first = tmp_path / "first"
    first.mkdir()
    records = tmp_path / "records"  # outside the run folder: what a repository keeps
    proc = _sweep(_cfg(first, "rec"), records, first)
    deadline = time.time() + 600
    while not (records / "synthetic" / "contrastive" / "trial-001.json").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no second trial in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    assert proc.returncode == 143
    recorded = len(_params(records))
    assert recorded in (2, 3)
    # a fresh folder (no runs/, no MLflow store): only the records go on
    shutil.rmtree(first)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    go_on = _sweep(_cfg(fresh, "rec"), records, fresh)
    out2, err2 = go_on.communicate(timeout=900)
    assert go_on.returncode == 0, out2[-3000:] + err2[-3000:]
    assert f"{recorded} of 3 trials from the records" in out2
    assert _params(records) == _params(whole / "records")  # trial 3 proposed as the uninterrupted run did
    assert _table(out2) and _table(out2) == _table(out), out + "\n---\n" + out2
    reps = sorted((records / "synthetic" / "contrastive").glob("reproduction-*.json"))
    assert [json.loads(r.read_text())["index"] for r in reps] == [0, 1]
