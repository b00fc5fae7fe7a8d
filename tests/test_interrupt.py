"""Ctrl-C: the first SIGINT stops a sweep within seconds, says so and how to resume, closes its MLflow runs
(``KILLED``, reason ``interrupted``; none left RUNNING) and exits 130; ``--resume`` then finishes the sweep."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.test_resume import sweep_started
from tests.test_security import ray_tmpdir, sweep_env, tiny_sweep_config

#: Seconds from SIGINT to exit: Ray shutdown and closing the runs included, on a busy 2-core machine.
STOP_WITHIN_S = 45


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_first_sigint_stops_the_sweep_closes_its_runs_and_resume_finishes_it(tmp_path):
    import shutil

    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    ray_tmp = ray_tmpdir()
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    # Long enough folds that the SIGINT lands mid-trial (each fold then takes several seconds).
    cfg = tiny_sweep_config(tmp_path, uri, name="ctrlc", max_epochs=4, iters_per_epoch=40)
    env = sweep_env(ray_tmp)
    proc = None
    try:
        out_path, err_path = tmp_path / "first.out", tmp_path / "first.err"
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)], cwd=tmp_path,
                                    stdout=out_f, stderr=err_f, env=env)

        # Wait until a fold of the first trial is training (its fold runs exist and are RUNNING).
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, f"the sweep ended before it could be interrupted: {proc.returncode}"
            assert time.time() < deadline, "no fold started in time"
            time.sleep(1)
            if not sweep_started(out_path):  # opening the sqlite store earlier races the sweep's migration
                continue
            try:
                c = MlflowClient(uri)
                exp = c.get_experiment_by_name("ctrlc-experiment")
                runs = search_all(c, exp.experiment_id, "tags.stage = 'fold'") if exp else []
            except Exception:  # noqa: BLE001 - the DB may be mid-creation
                continue
            if any(r.info.status == "RUNNING" for r in runs):
                break
        time.sleep(3)
        assert proc.poll() is None, "the sweep finished before it could be interrupted"

        t0 = time.time()
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the driver (Ray's own processes block SIGINT)
        try:
            rc = proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
            pytest.fail(f"still running {STOP_WITHIN_S} s after the first SIGINT")
        took = time.time() - t0
        stderr = err_path.read_text(errors="replace")
        assert rc == 130, stderr[-4000:]
        assert "interrupted: stopping trials, state is kept; resume with: dmlrc sweep" in stderr, stderr[-4000:]
        assert "--resume" in stderr and "Traceback" not in stderr, stderr[-4000:]

        c = MlflowClient(uri)
        exp = c.get_experiment_by_name("ctrlc-experiment")
        runs = search_all(c, exp.experiment_id, "")
        assert [r for r in runs if r.info.status == "RUNNING"] == []
        killed = [r for r in runs if r.info.status == "KILLED"]
        assert killed and all(r.data.tags.get("reason") == "interrupted" for r in killed), \
            [(r.data.tags, r.info.status) for r in runs]
        study = [r for r in runs if r.data.tags.get("stage") == "study"]
        assert len(study) == 1 and study[0].data.tags.get("done") != "true"  # not recorded as a finished study
        print(f"stopped {took:.1f} s after SIGINT")

        # --resume continues from there and finishes the sweep; every run is FINISHED, the study done.
        done = subprocess.run([sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--resume"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        runs = search_all(c, exp.experiment_id, "")
        assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]
        study = [r for r in runs if r.data.tags.get("stage") == "study"]
        assert len(study) == 1 and study[0].data.tags["done"] == "true" and study[0].data.tags["status"] == "ok"
        assert len([r for r in runs if r.data.tags.get("stage") == "trial"]) == 1
        assert len([r for r in runs if r.data.tags.get("stage") == "reproduction"]) == 2
        assert len([r for r in runs if r.data.tags.get("stage") == "fold"]) == 2 * 3
    finally:
        if proc is not None and proc.poll() is None:  # a failed assertion above: stop our driver (its Ray fate-shares with it)
            proc.kill()
            proc.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
