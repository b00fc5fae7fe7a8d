"""Your loss against finished studies: a sweep of 3 losses, then the same config with a plugin loss added — only its
study runs, the report ranks all 4 with paired tests; a changed budget is refused naming the field; ``--rerun``
runs one study again; a sweep of the plugin loss alone with ``compare_with:`` the first sweep's results bundle gives
the same table as the combined sweep.  Real sweeps (synthetic data, tiny trunk, 1 trial, 2 reproductions, 2 folds)
through the CLI, each in its own process, on sqlite MLflow stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.tiny_sweep import tiny_sweep

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BASE = ["contrastive", "triplet", "ntxent"]
PLUGIN = "dmlrc_example.losses:CircleLoss"


def _config(tmp: Path, name: str, losses: list[str], *, max_epochs: int = 2, **extra) -> Path:
    return tiny_sweep(
        tmp,
        name,
        losses,
        filename=f"{name}-{len(losses)}-{max_epochs}.yaml",
        protocol={"max_epochs": max_epochs},
        runtime_env={"py_modules": [str(ROOT / "examples/plugin/src/dmlrc_example")]},
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1, "num_cpus": 4},
        **extra,
    )


def _cli(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples/plugin/src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *argv], cwd=tmp, capture_output=True, text=True, timeout=1200, env=env
    )


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    return out.stdout


def _db(tmp: Path, name: str) -> str:
    return f"sqlite:///{tmp / 'runs' / name / 'mlflow.db'}"


def _report(tmp: Path, name: str, out: str) -> dict:
    _ok(_cli(tmp, "report", "--experiment", name, "--tracking-uri", _db(tmp, name), "--out", str(tmp / out)))
    return json.loads((tmp / out / "report.json").read_text())


def _ran(stdout: str) -> set[str]:
    """The studies whose search started in this sweep's output."""
    return {line.split("]")[0][1:] for line in stdout.splitlines() if "] search: " in line}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """The 3-loss sweep, its report (and bundle), then the same config with the plugin loss added."""
    tmp = tmp_path_factory.mktemp("reuse")
    sweep = _cli(tmp, "sweep", str(_config(tmp, "zoo", BASE)))
    (tmp / "first.err").write_text(sweep.stderr)
    first = _ok(sweep)
    three = _report(tmp, "zoo", "report-3")
    added = _ok(_cli(tmp, "sweep", str(_config(tmp, "zoo", [*BASE, PLUGIN]))))
    four = _report(tmp, "zoo", "report-4")
    return tmp, first, three, added, four


@pytest.mark.timeout(2400)
def test_adding_a_loss_runs_only_its_study_and_the_report_ranks_all(zoo):
    tmp, first, three, added, report = zoo
    assert _ran(first) == {f"synthetic/{loss}" for loss in BASE}
    assert _ran(added) == {f"synthetic/{PLUGIN}"}  # only the new study
    for loss in BASE:
        assert f"[synthetic/{loss}] already finished" in added
    assert sorted(s["loss"] for s in report["studies"]) == sorted([*BASE, PLUGIN])
    pairs = {tuple(sorted((c["loss_a"], c["loss_b"]))) for c in report["paired_tests"]}
    assert len(pairs) == 6 and all(c["n"] == 2 for c in report["paired_tests"])  # paired by the 2 seeds
    # the three finished studies are the same runs, their numbers unchanged
    before = {s["loss"]: (s["run_id"], s["test"]) for s in three["studies"]}
    after = {s["loss"]: (s["run_id"], s["test"]) for s in report["studies"]}
    assert all(after[loss] == before[loss] for loss in BASE)
    # every study run records its protocol fingerprint: one hash for the four
    assert len({s["fingerprint"]["hash"] for s in report["studies"]}) == 1
    assert (tmp / "report-4" / "results-bundle.json").is_file()


@pytest.mark.timeout(600)
def test_a_new_sqlite_store_is_created_without_mlflow_log_lines(zoo):
    err = (zoo[0] / "first.err").read_text()
    assert "Creating initial MLflow database tables" not in err and "INFO mlflow" not in err, err[-3000:]
    assert "INFO alembic" not in err and "Updating database tables" not in err, err[-3000:]


@pytest.mark.timeout(600)
def test_a_changed_budget_is_refused_naming_the_field(zoo):
    tmp = zoo[0]
    out = _cli(tmp, "sweep", str(_config(tmp, "zoo", [*BASE, PLUGIN], max_epochs=3)))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("config error: protocol.max_epochs: differs from the finished studies (2 vs 3); "), line
    assert "ray" not in out.stdout.lower() or "search:" not in out.stdout


@pytest.mark.timeout(2400)
def test_compare_with_a_bundle_gives_the_combined_table(zoo):
    """A new experiment with the plugin loss alone and compare_with the 3-loss bundle: the same table, paired
    tests and top group as the combined sweep (same seeds, same protocol, so the plugin's study is identical)."""
    tmp = zoo[0]
    bundle = tmp / "report-3" / "results-bundle.json"
    cfg = _config(tmp, "mine", [PLUGIN], compare_with=str(bundle))
    plan = _ok(_cli(tmp, "sweep", str(cfg), "--plan"))  # what the bundle covers, before anything starts
    for loss in BASE:
        assert f"covered, left out of the totals: synthetic/{loss} (bundle {bundle})" in plan
    assert not (tmp / "runs" / "mine").exists()
    mine = _ok(_cli(tmp, "sweep", str(cfg)))
    assert _ran(mine) == {f"synthetic/{PLUGIN}"}
    for loss in BASE:  # the bundle's studies are in the final table, marked as the bundle's
        (row,) = [line.split() for line in mine.splitlines() if line.split()[:2] == ["synthetic", loss]]
        assert row[-2:] == ["bundle", "[1]"], row
        assert f"synthetic/{loss}: ok" not in mine  # its winning configuration is listed
    (row,) = [line.split() for line in mine.splitlines() if line.split()[:2] == ["synthetic", PLUGIN]]
    assert row[-1] == "trained", row
    assert f"  [1] results bundle {bundle} (created " in mine  # its URI and date, then its fingerprint
    note = MlflowClient(_db(tmp, "mine")).get_experiment_by_name("mine").tags["mlflow.note.content"]
    assert sum(f"| bundle: results bundle {bundle} (created " in line for line in note.splitlines()) == 3, note
    got = _report(tmp, "mine", "report-mine")  # the report reads the bundle the sweep named
    want = zoo[4]
    assert [s["loss"] for s in got["studies"]] == [s["loss"] for s in want["studies"]]
    assert [s["test"] for s in got["studies"]] == [s["test"] for s in want["studies"]]
    assert got["paired_tests"] == want["paired_tests"] and got["top_group"] == want["top_group"]


@pytest.mark.timeout(2400)
def test_rerun_runs_one_finished_study_again_and_keeps_the_old_run(zoo):
    tmp = zoo[0]
    cfg = _config(tmp, "zoo", [*BASE, PLUGIN])
    refused = _cli(tmp, "sweep", str(cfg))  # nothing new: refused at once
    assert refused.returncode == 2 and "pass --resume" in refused.stderr
    out = _ok(_cli(tmp, "sweep", str(cfg), "--rerun", "triplet"))
    assert _ran(out) == {"synthetic/triplet"} and "--rerun: MLflow run" in out
    client = MlflowClient(_db(tmp, "zoo"))
    exp = client.get_experiment_by_name("zoo")
    old = client.search_runs([exp.experiment_id], "tags.stage = 'study-superseded'")
    assert [r.data.tags["loss"] for r in old] == ["triplet"]
    report = _report(tmp, "zoo", "report-rerun")
    assert sorted(s["loss"] for s in report["studies"]) == sorted([*BASE, PLUGIN])
    assert next(s for s in report["studies"] if s["loss"] == "triplet")["run_id"] != old[0].info.run_id
