"""Fault tolerance of a local sweep, both executors, in one sweep each: a fold's process SIGKILLed mid-training (what
an OOM kill does), then the sweep driver SIGKILLed mid-study, then ``dmlrc sweep CONFIG --resume`` finishes it.
:func:`kill_and_resume` runs such a sweep and :func:`check_killed_and_resumed` checks it: here with warm folds;
the Ray Train executor's sweep (DDP folds of 2 gloo workers) runs against a real ``mlflow server`` with fake AWS
credentials in its environment, so that tests/test_security.py's questions are asked of a real sweep here too: no
credential anywhere Ray or MLflow wrote, across both driver sessions and a restarted worker group, and Ray's sockets
on loopback (one sweep for both: a Ray Train sweep costs minutes).

**The killed fold.**  ``resources.fold_retries`` is Ray's own retry: the warm executor's fold task is resubmitted by
Ray (``max_retries``) onto another worker process; Ray Train's ``FailureConfig(max_failures)`` starts the fold's
worker group again.  Either way the fold continues from its last checkpoint (mid-fold resume,
``pipelines/execution/folds/fold.py``): a fold killed after it had stored a checkpoint past epoch 0 resumed from it in
the
*same* MLflow run (tags ``resumes``/``resumed_from``, no ``restarted`` replacement, nothing soft-deleted); the
iterations trained twice (``redone_iterations`` in MLflow and ``outcome.json``) are at most one evaluation interval
per restart.  At that moment the search trial's driver process (a Tune actor) is alive; with warm folds it has not
loaded torch (``tests/test_lean_imports.py`` checks its imports; this checks the process a real sweep started).

**The killed driver.**  The driver and everything it started die mid-study -- warm: once the first of two trials has
finished and the second is training (mid-search); train: once the search's one trial has finished and a
reproduction's folds are training (mid-reproductions: ``--resume`` restores the reproductions' Tuner too and fits
that reproduction's Ray Train folds again under their stable names; they resume from their checkpoints in their
own runs).  ``--resume`` completes the study: every trial ran exactly once to completion (the trial that had
finished before the kill was not rerun: its MLflow metrics and its folds' start times were logged once), the
Bayesian optimiser's history was kept (the restored Optuna study holds every trial), no MLflow run is duplicated.

Checked at the end, over the whole study: every fold run holds each evaluation step exactly once, none missing;
every trial and reproduction keeps exactly one run per fold, all FINISHED; each parent's objective is the mean of its
folds' best val MAP@R as logged; the finished folds' checkpoints were deleted; the study completed with its CIs.
Two k-fold folds per trial (the protocol's four folds are checked end to end in tests/test_sweep.py): what is tested
here is restarts, and half the folds halve the test's time.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.names import tuner_name
from tests.paced_trunk import PACE_FILE_ENV, PACED_TRUNK, pace_file
from tests.tiny_sweep import files_containing, ray_tmpdir, sweep_env

ROOT = Path(__file__).resolve().parents[1]
#: Folds per trial: k-fold, two (see the module docstring).
FOLDS = 2
#: The process title Ray gives a process while it runs a fold, per executor.
_FOLD_TITLE = {"warm": "ray::fold:", "train": "RayTrainWorker"}


def _children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> list[int]:
    """Every process started (directly or not) by ``pid`` — read from /proc, so Linux only."""
    kids, out, todo = _children_of(), [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def sweep_started(log: Path) -> bool:
    """The sweep printed its banner, so its MLflow store exists and is migrated.  Opening a sqlite store earlier
    races the sweep's own schema migration (MLflow migrates a new DB from whichever process opens it first)."""
    try:
        return " studies (" in log.read_text(errors="replace")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _checkpointed_past(root: Path, iteration: int) -> bool:
    """Some fold's ``ckpt/latest.json`` points at a state of at least ``iteration``."""
    for f in root.glob("**/ckpt/latest.json"):
        try:
            if json.loads(f.read_text())["iteration"] >= iteration:
                return True
        except (OSError, ValueError, KeyError):
            continue  # replaced while we read it
    return False


def _maps_torch(pid: int) -> bool:
    """Process ``pid`` has torch's C++ library mapped (it imported torch)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _fold_processes(root: int, executor: str) -> list[int]:
    """Processes below ``root`` running a fold right now (found by the title Ray sets)."""
    return [p for p in _descendants(root) if _FOLD_TITLE[executor] in _cmdline(p) and _alive(p)]


def _runs_now(uri: str, experiment: str, log: Path, query: str = "") -> list:
    """The experiment's runs, or [] while the sweep has not yet created its store (see :func:`sweep_started`)."""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    if not sweep_started(log):
        return []
    try:
        c = MlflowClient(uri)
        exp = c.get_experiment_by_name(experiment)
        return search_all(c, exp.experiment_id, query) if exp else []
    except Exception:  # noqa: BLE001 - the DB may be mid-creation
        return []


def _evaluated_twice(uri: str, runs: list) -> list:
    """Those of ``runs`` that have logged two evaluations.  No store is opened for no runs: before the sweep has
    created and migrated its sqlite DB, opening it would race that migration (see :func:`sweep_started`)."""
    if not runs:
        return []
    from mlflow.tracking import MlflowClient

    try:
        c = MlflowClient(uri)
        return [r for r in runs if len(c.get_metric_history(r.info.run_id, "val.map_at_r")) >= 2]
    except Exception:  # noqa: BLE001 - a run may be mid-update
        return []


def _tune_trial_statuses(experiment: Path) -> dict[str, str]:
    """Trial id -> status in the latest experiment state Tune stored in ``experiment`` (``experiment_state-<start
    time>.json``, one per driver session); {} before the first."""
    states = sorted(experiment.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        trial_data = json.loads(states[-1].read_text())["trial_data"]
    except (OSError, ValueError, KeyError):
        return {}  # being replaced while we read it
    trials = [json.loads(state) if isinstance(state, str) else state for state, _runtime in trial_data]
    return {t.get("trial_id"): t.get("status") for t in trials}


def _saved_searcher_state(search: Path) -> dict | None:
    """The searcher's state Tune saved last in ``search`` (``searcher-state-<start time>.pkl``, one per driver
    session, saved and synced with the experiment state); None before the first or while it is replaced."""
    files = sorted(search.glob("searcher-state-*.pkl"))
    try:
        with open(files[-1], "rb") as f:
            return pickle.load(f)
    except (IndexError, OSError, EOFError, pickle.UnpicklingError):
        return None


def _tune_stored_as_finished(search: Path, trial_id: str) -> bool:
    """Tune's stored state of the search holds trial ``trial_id`` as TERMINATED, and the searcher's saved Optuna
    study holds a finished trial."""
    if _tune_trial_statuses(search).get(trial_id) != "TERMINATED":
        return False
    state = _saved_searcher_state(search)
    return state is not None and any(t.state.name == "COMPLETE" for t in state["_ot_study"].trials)


@dataclass
class KilledAndResumed:
    """What :func:`kill_and_resume` did and saw, for :func:`check_killed_and_resumed` and the caller's own checks."""

    doc: dict
    uri: str
    experiment: str
    search: Path  # Tune's experiment dir of the study's search
    storage: Path
    first_output: str  # the killed driver's output
    resume_rc: int
    resume_output: str
    killed: list[int]  # fold processes SIGKILLed
    drivers: list[int]  # the search trial's driver processes alive while its folds trained
    drivers_with_torch: list[int]
    first_trial: set[str]  # the parent run of the folds killed
    done: Any  # the trial run finished before the driver's kill
    done_folds: set[str]
    kill_stage: str

    @property
    def interval(self) -> int:
        return self.doc["protocol"]["iters_per_epoch"] * self.doc["protocol"]["eval_every"]

    @property
    def trials(self) -> int:
        return self.doc["protocol"]["trials"]


def kill_and_resume(
    tmp_path: Path,
    *,
    executor: str,
    workers: int = 1,
    name: str = "resume",
    tracking_uri: str | None = None,
    env: dict[str, str] | None = None,
    watch: Callable[[int], None] | None = None,
) -> KilledAndResumed:
    """Run a paced sweep of ``executor`` folds (``workers`` per fold), SIGKILL its fold processes mid-fold, then
    its driver mid-study, then finish it with ``--resume`` (module docstring).  ``tracking_uri``: an MLflow server
    (default: the sweep's own sqlite store); ``env``: the sweeps' environment (default: this one's);
    ``watch(pid)``: called about once a second with the running driver's pid, in both sessions."""
    # warm: the driver dies mid-search (trial 1 finished, trial 2 training); train: mid-reproductions (the search's
    # one trial finished, a reproduction's folds training), so that --resume restores the reproductions' Tuner and
    # fits Ray Train folds again under their stable names
    trials, kill_stage = {"warm": (2, "trial"), "train": (1, "reproduction")}[executor]
    doc = {
        "name": name,
        "seed": 5,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 8, "image_size": 16}],
        "losses": ["contrastive"],
        # the paced trunk (tests/paced_trunk.py): folds long enough (also warm ones, whose trials take seconds) that
        # a fold is still training a while after its second evaluation and trial 2 still runs when the driver dies,
        # their steps waiting rather than computing; no early stop
        "model": {"trunk": PACED_TRUNK, "embedding_dim": 16, "freeze_bn": False},
        "protocol": {
            "folds": FOLDS,
            "fold_layout": "kfold",
            "trials": trials,
            "startup_trials": 1,
            "reproductions": 2,
            "iters_per_epoch": 100,
            "eval_every": 1,
            "patience": 50,
            "max_epochs": 3,
            "train": {"classes_per_batch": 4, "m": 2, "trunk_lr": 1e-3, "embedder_lr": 1e-3},
        },
        "resources": {
            "workers_per_fold": workers,
            # every fold of a trial at once, DDP's too (the default is the usable cores): paced folds mostly wait
            "num_cpus": FOLDS * workers + 1,
            "max_concurrent_trials": 1,
            "fold_retries": 1,
            "fold_executor": executor,
        },
        "storage": str(tmp_path / "runs"),
    }
    if tracking_uri:
        doc["tracking"] = {"uri": tracking_uri, "experiment": name}
    interval = doc["protocol"]["iters_per_epoch"] * doc["protocol"]["eval_every"]
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    uri = tracking_uri or f"sqlite:///{tmp_path / 'runs' / name / 'mlflow.db'}"
    study = tmp_path / "runs" / name / "ray" / "synthetic__contrastive"
    search = study / tuner_name(name, str(study), "search")  # Tune's experiment dir
    watch = watch or (lambda pid: None)

    log_path = tmp_path / "first.log"
    log = open(log_path, "wb")
    env = dict(env if env is not None else {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # the paced trunk
    env[PACE_FILE_ENV] = str(pace := pace_file(tmp_path))  # steps wait until the driver's kill
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )

    def pause(seconds: float) -> None:
        watch(proc.pid)
        time.sleep(seconds)

    killed: list[int] = []
    family: list[int] = []
    try:
        # 1. Some fold of the search trial has logged two evaluations, stored a checkpoint past epoch 0 and is still
        # running: kill every fold process alive at that moment (each one's fold restarts and resumes).
        deadline = time.time() + 900
        while not killed:
            assert proc.poll() is None, "sweep ended before a fold could be killed:\n" + log_path.read_text()[-4000:]
            assert time.time() < deadline, "no fold logged evaluations in time:\n" + log_path.read_text()[-4000:]
            pause(1)
            runs = _runs_now(uri, name, log_path, "tags.stage = 'fold'")
            busy = _evaluated_twice(uri, [r for r in runs if r.info.status == "RUNNING"])
            if busy and _checkpointed_past(tmp_path / "runs", interval):
                # the search trial's driver (a Tune actor) while its folds train: warm folds leave it without torch
                drivers = [p for p in _descendants(proc.pid) if "ImplicitFunc" in _cmdline(p) and _alive(p)]
                drivers_with_torch = [p for p in drivers if _maps_torch(p)]
                for pid in _fold_processes(proc.pid, executor):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        first_trial = {r.data.tags.get("mlflow.parentRunId") for r in busy}

        # 2. Trial 1 finished and a run of `kill_stage` training (trial 2 / a reproduction; one of its folds has
        # evaluated twice, so stored a checkpoint): kill the driver.
        finished: list = []
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.time() < deadline, "no trial finished in time: " + log_path.read_text()[-4000:]
            pause(2)
            runs = _runs_now(uri, name, log_path)
            finished = [r for r in runs if r.data.tags.get("stage") == "trial" and r.info.status == "FINISHED"]
            running = {
                r.info.run_id for r in runs if r.data.tags.get("stage") == kill_stage and r.info.status == "RUNNING"
            }
            in_stage = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in running]
            training = _evaluated_twice(uri, [r for r in in_stage if r.info.status == "RUNNING"])
            if finished and training:
                break
        # the kill must come after Tune has stored trial 1 as finished (it writes its experiment state, with the
        # searcher's, every few seconds), else --resume would rightly run it again
        while not _tune_stored_as_finished(search, finished[0].data.tags["trial_id"]):
            assert time.time() < deadline, (
                "Tune did not store the finished trial in time: " + log_path.read_text()[-4000:]
            )
            pause(0.5)
        # and, mid-reproductions, after Tune has stored the reproductions' experiment (what --resume restores)
        while (
            kill_stage == "reproduction"
            and "RUNNING" not in _tune_trial_statuses(study / tuner_name(name, str(study), "reproductions")).values()
        ):
            assert time.time() < deadline, (
                "Tune did not store the reproductions in time: " + log_path.read_text()[-4000:]
            )
            pause(0.5)
        assert proc.poll() is None, "the sweep finished before it could be killed"
        family = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        pace.unlink(missing_ok=True)  # --resume at full speed
        if proc.poll() is None:  # a failed assertion above: the driver still runs
            family = _descendants(proc.pid)
            proc.kill()
        log.close()
        # The local Ray the driver started notices its death and exits; stop whatever is left, by pid.
        t_end = time.time() + 60
        while any(_alive(p) for p in family) and time.time() < t_end:
            time.sleep(1)
        for p in family:
            if _alive(p):
                os.kill(p, signal.SIGKILL)

    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(name)
    done = finished[0]
    done_folds = {
        r.info.run_id for r in search_all(c, exp.experiment_id, f"tags.`mlflow.parentRunId` = '{done.info.run_id}'")
    }

    # 3. --resume finishes the study (the same environment; the pace file is gone: full speed).
    resume_log = tmp_path / "resume.log"
    with open(resume_log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--resume"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.time() + 1200  # a hang guard, not a speed target
            while proc.poll() is None and time.time() < deadline:
                pause(1)
        finally:
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait(timeout=60)
    return KilledAndResumed(
        doc=doc,
        uri=uri,
        experiment=name,
        search=search,
        storage=tmp_path / "runs",
        first_output=log_path.read_text(errors="replace"),
        resume_rc=rc,
        resume_output=resume_log.read_text(errors="replace"),
        killed=killed,
        drivers=drivers,
        drivers_with_torch=drivers_with_torch,
        first_trial=first_trial,
        done=done,
        done_folds=done_folds,
        kill_stage=kill_stage,
    )


def check_killed_and_resumed(r: KilledAndResumed) -> None:
    """The checks of the module docstring on a study :func:`kill_and_resume` ran."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    assert r.drivers, "no trial driver process found while its folds trained"
    assert r.resume_rc == 0, r.resume_output[-5000:]
    assert "resuming search" in r.resume_output
    if r.kill_stage == "reproduction":
        assert "resuming reproductions" in r.resume_output, r.resume_output[-3000:]
    text = r.first_output + r.resume_output
    interval, trials = r.interval, r.trials

    c = MlflowClient(r.uri)
    exp = c.get_experiment_by_name(r.experiment)
    done_id, done_trial = r.done.info.run_id, r.done.data.tags["trial_id"]
    assert r.first_trial == {done_id}, "the fold killed was not the first trial's"
    assert len(r.done_folds) == FOLDS

    runs = search_all(c, exp.experiment_id, "")
    stage = lambda s: [x for x in runs if x.data.tags.get("stage") == s]  # noqa: E731
    assert len(stage("study")) == 1 and stage("study")[0].data.tags["done"] == "true"
    assert "test.concat.map_at_r.mean" in stage("study")[0].data.metrics
    assert all(x.info.status == "FINISHED" for x in runs), [(x.data.tags, x.info.status) for x in runs]
    trial_runs = stage("trial")
    assert len(trial_runs) == trials, [x.data.tags for x in trial_runs]  # no duplicated trial runs
    assert len({x.data.tags["trial_id"] for x in trial_runs}) == trials
    parents = trial_runs + stage("reproduction")
    assert len(stage("reproduction")) == 2 and len(stage("fold")) == FOLDS * (trials + 2)

    # the killed fold resumed in its own run: no replacement, nothing of the first trial soft-deleted
    folds = stage("fold")
    assert not [x for x in folds if x.data.tags.get("restarted")], "a restarted fold got a replacement run"
    deleted = c.search_runs([exp.experiment_id], "tags.stage = 'fold'", run_view_type=ViewType.DELETED_ONLY)
    assert not [x for x in deleted if x.data.tags.get("mlflow.parentRunId") == done_id], [x.data.tags for x in deleted]
    resumed = [x for x in folds if x.data.tags["mlflow.parentRunId"] == done_id and int(x.data.tags.get("resumes", 0))]
    assert resumed, f"no fold run of the first trial resumed after killing {len(r.killed)} process(es):\n{text[-4000:]}"
    assert max(int(x.data.tags["resumed_from"]) for x in resumed) >= interval, [x.data.tags for x in resumed]
    evals = r.doc["protocol"]["max_epochs"] // r.doc["protocol"]["eval_every"] + 1  # epochs 0..max_epochs
    for x in folds:
        # every evaluation step exactly once, none missing, also in the resumed runs
        for key in ("val.map_at_r", "epoch"):
            steps = [m.step for m in c.get_metric_history(x.info.run_id, key)]
            assert sorted(steps) == [i * interval for i in range(evals)], (key, x.data.tags, steps)
        assert "best_epoch" in x.data.metrics and x.data.tags["status"] == "ok"
        restarts = int(x.data.tags.get("resumes", 0))
        outcome = json.loads((Path(x.data.tags["checkpoint"]) / "outcome.json").read_text())
        assert outcome["restarts"] == restarts and len(outcome["resumed_from"]) == restarts
        assert 0 <= outcome["redone_iterations"] <= restarts * interval, outcome
        if restarts:
            assert x.data.metrics["redone_iterations"] == outcome["redone_iterations"]
            assert outcome["resumed_from"][-1] == int(x.data.tags["resumed_from"])
    # the finished folds' mid-fold states were deleted once their results were stored
    assert not list(r.storage.glob("**/ckpt/state-*.pt"))
    for parent in parents:
        kids = [x for x in folds if x.data.tags["mlflow.parentRunId"] == parent.info.run_id]
        assert sorted(int(x.data.tags["fold"]) for x in kids) == list(range(FOLDS))
        best = [x.data.metrics["best.val.map_at_r"] for x in kids]
        assert parent.data.metrics["val.map_at_r.mean"] == pytest.approx(sum(best) / FOLDS, abs=1e-9)
    if r.kill_stage == "reproduction":
        # the reproduction killed with the driver: its folds fitted again (new Ray Train runs under the same names)
        # resumed in their own runs from their checkpoints
        rep_ids = {x.info.run_id for x in stage("reproduction")}
        resumed = [
            x for x in folds if x.data.tags["mlflow.parentRunId"] in rep_ids and int(x.data.tags.get("resumes", 0))
        ]
        assert resumed and max(int(x.data.tags["resumed_from"]) for x in resumed) >= interval, [
            x.data.tags for x in folds if x.data.tags["mlflow.parentRunId"] in rep_ids
        ]

    # the trial finished before the driver's kill was not rerun: same run, each metric logged once, folds not retrained
    again = c.get_run(done_id)
    assert again.data.tags["trial_id"] == done_trial
    assert len(c.get_metric_history(done_id, "val.map_at_r.mean")) == 1
    kids = search_all(c, exp.experiment_id, f"tags.`mlflow.parentRunId` = '{done_id}'")
    assert {x.info.run_id for x in kids} == r.done_folds
    for f in kids:
        assert len(c.get_metric_history(f.info.run_id, "time.start")) == 1

    # the Bayesian optimiser's history survived: the restored Optuna study holds every trial, with its objective
    state = _saved_searcher_state(r.search)
    assert state is not None, list(r.search.iterdir())
    study = state["_ot_study"]
    values = sorted(t.value for t in study.trials if t.state.name == "COMPLETE")
    assert len(values) == trials
    mlflow_values = sorted(x.data.metrics["val.map_at_r.mean"] for x in trial_runs)
    assert values == pytest.approx(mlflow_values, abs=1e-12)
    # a GP sampler per trial, seeded by the trial's number (pipelines.execution.search.searcher)
    sampler = state["_sampler"]
    assert type(sampler).__name__ == "TrialSeededSampler" and sampler._make.kind == "gp"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_killed_fold_resumes_in_its_run_and_a_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path):
    """Warm folds (the Ray Train executor's sweep: ``test_ddp_sweep_killed_and_resumed_end_to_end_...`` below)."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the sweep's fold processes and the killed driver's children")
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    r = kill_and_resume(tmp_path, executor="warm")
    assert not r.drivers_with_torch, f"a search trial's driver with warm folds loaded torch: {r.drivers_with_torch}"
    check_killed_and_resumed(r)
    # Warm processes outlive a fold: some process ran several folds.
    c = MlflowClient(r.uri)
    folds = search_all(c, c.get_experiment_by_name(r.experiment).experiment_id, "tags.stage = 'fold'")
    pids = [x.data.tags["pid"] for x in folds]
    assert max(pids.count(p) for p in set(pids)) >= 2, pids


# ------------------------------------------------------------------------------------------------ Ray Train folds


def _process_tree(pid: int) -> set[int]:
    from tests.cluster import vendored_psutil

    psutil = vendored_psutil()

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)} | {pid}
    except psutil.NoSuchProcess:
        return set()


def _listening(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process title, address, port) of every TCP socket in LISTEN state owned by one of ``pids``."""
    from tests.cluster import vendored_psutil

    psutil = vendored_psutil()

    out = []
    for c in psutil.net_connections("inet"):
        if c.pid in pids and c.status == psutil.CONN_LISTEN:
            try:
                proc = psutil.Process(c.pid)
                title = f"{proc.name()} {' '.join(proc.cmdline())[:100]}"
            except psutil.NoSuchProcess:
                title = "?"
            out.append((c.pid, title, c.laddr.ip, c.laddr.port))
    return out


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


@pytest.fixture(scope="module")
def train_sweep_with_credentials(tmp_path_factory):
    """The Ray Train executor's kill-and-resume sweep (module docstring) with fake AWS credentials in its
    environment, against an ``mlflow server`` whose files live in the sweep's tmp dir; the sockets of both driver
    sessions' process trees sampled while they run."""
    from tests.mlflow_server import mlflow_server

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the sweep's fold processes and the killed driver's children")
    tmp = tmp_path_factory.mktemp("secure")
    ray_tmp = ray_tmpdir()
    secret = {
        "AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
        "AWS_SECRET_ACCESS_KEY": "fake-secret-" + secrets.token_hex(16),
        "AWS_SESSION_TOKEN": "fake-token-" + secrets.token_hex(16),
    }
    sockets: set[tuple[int, str, str, int]] = set()
    with mlflow_server(tmp / "server") as uri:
        # 2 workers per fold (Ray Train): the gloo connections between them are checked too
        run = kill_and_resume(
            tmp,
            executor="train",
            workers=2,
            name="secure",
            tracking_uri=uri,
            env=sweep_env(ray_tmp, **secret),
            watch=lambda pid: sockets.update(_listening(_process_tree(pid))),
        )
        yield {
            "run": run,
            "rc": run.resume_rc,
            "out": (run.first_output + run.resume_output).encode(),
            "tmp": tmp,
            "ray_tmp": Path(ray_tmp),
            "secret": secret,
            "sockets": sockets,
            "uri": uri,
        }
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(1800)
def test_ddp_sweep_killed_and_resumed_end_to_end_against_an_mlflow_server(train_sweep_with_credentials):
    """One trial + 2 reproductions of one loss as DDP folds (Ray Train, 2 gloo workers each), against a real
    ``mlflow server``, a fold's worker group and then the driver SIGKILLed, ``--resume`` finishing the study:
    tests/test_resume.py's checks (the killed folds resumed in their runs, nothing finished rerun, the optimiser's
    history kept), then the whole MLflow tree with Tune's results = MLflow's metrics (tests/test_sweep.py's check).
    Two k-fold folds per trial and one trial: the Ray Train path's properties depend neither on the number of folds
    nor on the search, and every Ray Train job costs a worker group's start-up; the reality check's 4 folds in the
    ``mlrc`` layout and a Bayesian search run end to end in test_sweep.py's PostgreSQL sweep (warm folds)."""
    from tests.test_sweep import _check_run_tree

    s = train_sweep_with_credentials
    out = s["out"].decode(errors="replace")
    assert s["rc"] == 0, out[-5000:]
    assert "mlflow ui" not in out and s["uri"] in out  # the server to browse
    assert "[synthetic/contrastive] done in" in out
    check_killed_and_resumed(s["run"])
    _check_run_tree(
        s["uri"],
        "secure",
        losses=["contrastive"],
        trials=1,
        workers=2,
        storage=s["tmp"] / "runs",
        name="secure",
        n_folds=2,
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_aws_credentials_never_reach_ray_logs_mlflow_or_the_sweep_folder(train_sweep_with_credentials):
    s = train_sweep_with_credentials
    assert s["rc"] == 0, s["out"].decode(errors="replace")[-5000:]
    sessions = list((s["ray_tmp"] / "ray").glob("session_2*"))
    assert sessions, "the sweep's Ray did not use the test's RAY_TMPDIR"
    assert any(sessions[0].rglob("runtime_env_agent.log")), "no runtime-env agent log: nothing was checked"
    needles = [v.encode() for v in s["secret"].values()]
    for root in (s["ray_tmp"], s["tmp"]):  # Ray's whole session dir; MLflow DB, artifacts, Ray storage, config
        assert files_containing(root, needles) == []
    assert not any(n in s["out"] for n in needles)
    # the private credentials files the sweep used while Ray ran are gone: the resumed session's (deleted when it
    # stopped) and the killed one's (deleted when the resumed session started)
    leftovers = [
        p for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d) for p in Path(d).glob("dmlrc-aws-*")
    ]
    assert files_containing_any(leftovers, needles) == []


def files_containing_any(paths: list[Path], needles: list[bytes]) -> list[str]:
    hits = []
    for p in paths:
        hits += files_containing(p, needles) if p.is_dir() else []
    return hits


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_sweeps_own_ray_listens_on_loopback_only(train_sweep_with_credentials):
    s = train_sweep_with_credentials
    assert s["rc"] == 0, s["out"].decode(errors="replace")[-5000:]
    titles = " | ".join(sorted({t for _, t, _, _ in s["sockets"]}))
    # GCS, raylet, the runtime-env agent and Train workers must have been seen, or the sampling checked nothing
    for process in ("gcs_server", "raylet", "RuntimeEnvAgent", "RayTrainWo"):
        assert process in titles, titles
    # A process's title changes with the task it runs (a Train worker shows "ray::RayTrainWorker", then e.g.
    # "ray::execute._setup_torch_process_group"): classify processes by every title seen for their pid.
    titles_of: dict[int, set[str]] = {}
    for pid, title, _, _ in s["sockets"]:
        titles_of.setdefault(pid, set()).add(title)
    public = sorted({(pid, ip, port) for pid, _, ip, port in s["sockets"] if not _is_loopback(ip)})
    # The one known exception: each fold's torch.distributed rendezvous store (a TCPStore that rank 0 of the Train
    # worker group opens; torch has no bind-address option for it) — at most one such socket per Train worker,
    # and never anywhere else.
    per_pid: dict[int, int] = {}
    for pid, ip, port in public:
        assert any("RayTrainWo" in t for t in titles_of[pid]), [(p, i, o, titles_of[p]) for p, i, o in public]
        per_pid[pid] = per_pid.get(pid, 0) + 1
    assert all(n == 1 for n in per_pid.values()), public


def test_outcome_json_keeps_its_format_and_files_of_earlier_versions_still_read():
    """``outcome.json`` through :class:`FoldOutcome`: a fold's outcome is written with the same keys in the same order
    as the dict it replaced (``test_metrics`` only when the test classes were evaluated), and a file written before
    the restart and timing fields existed still reads (``--resume`` reads the stored results of finished folds)."""
    from pipelines.execution.folds.config import FoldOutcome

    best = {"map_at_r": 0.25, "r_precision": 0.3, "precision_at_1": 0.5}
    written = {
        "fold": 1,
        "status": "ok",
        "reason": "",
        "best_epoch": 2,
        "best_metrics": best,
        "iterations": 40,
        "epochs": 2,
        "stopped_early": False,
        "train_seconds": 3.5,
        "time_start": 10.0,
        "time_train_start": 11.0,
        "time_end": 15.0,
        "world_size": 2,
        "pid": 123,
        "node_id": "n",
        "device": "cpu",
        "rss_peak_mb": 512.0,
        "restarts": 1,
        "resumed_from": [20],
        "redone_iterations": 4,
        "history": [{"epoch": 1, "iteration": 20, "train_loss": 0.5, "metrics": best}],
    }
    # what a fold measured of itself (the study's records), after the test metrics
    measured = {"cpu_seconds": 4.5, "numerics": "bf16+channels_last", "cpu_model": "a CPU"}
    assert FoldOutcome.from_json(json.dumps({**written, **measured})).to_json() == json.dumps({**written, **measured})
    with_test = {**written, "test_metrics": best, **measured}
    assert FoldOutcome.from_json(json.dumps(with_test)).to_json() == json.dumps(with_test)
    old = {k: written[k] for k in ("fold", "status", "reason", "best_metrics", "time_start", "time_end", "history")}
    read = FoldOutcome.from_json(json.dumps(old))
    assert (read.time_train_start, read.restarts, read.resumed_from, read.world_size) == (10.0, 0, [], 1)
    assert (read.cpu_seconds, read.numerics, read.cpu_model) == (None, "", "")  # a file written before them
