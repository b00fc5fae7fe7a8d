"""Stopping a sweep: Ctrl-C (SIGINT) and SIGTERM — what Kubernetes sends a RayJob/CronJob pod before it kills it.

At any moment the driver ends in seconds with one line (no traceback, no native stack dump), exit status 130 /
143; once Ray runs it closes its MLflow runs (``KILLED``, reason ``interrupted``; none left RUNNING), prints the
``--resume`` command and leaves no process behind; ``--resume`` then finishes the sweep with nothing lost.
Points tried: while the CLI imports (before any output), right after the sweep's banner (Ray just started), and
mid-fold (then ``--resume``).

The SIGTERM sweep tracks to PostgreSQL as a *direct* MLflow store (``postgresql://`` with a password, no MLflow
server; a fresh database of the PostgreSQL at 127.0.0.1:5432, ``$DMLRC_TEST_PG`` overrides the admin URI; sqlite, and
the PostgreSQL part skipped at the end, when none answers): the store's path through the product is the sweep's,
and a stopped and resumed sweep is where a password could leak (three banners, closed runs).  SQLAlchemy 2.1's
default driver for ``postgresql://`` is psycopg 3; without it the config pins the installed psycopg2.  The password
(the test server trusts local connections, so any password is accepted) must not appear in what the sweep prints, in
any MLflow param, tag or artifact, in the sweep folder or in Ray's session dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paced_trunk import PACE_FILE_ENV, PACED_TRUNK, pace_file
from tests.test_resume import sweep_started
from tests.tiny_sweep import files_containing, ray_tmpdir, smallest_sweep, sweep_env

#: Seconds from the signal to exit, Ray shutdown and closing the runs included: a hang guard, not a speed target.
#: Alone on 2 cores a sweep stops in seconds; beside the other pytest worker's 3-node cluster it has taken over 45 s.
STOP_WITHIN_S = 120


def _processes_under(ray_tmp: str) -> list[str]:
    """Command lines of live processes that belong to the Ray started with this temp dir (raylet, GCS, workers)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if ray_tmp in cmd or ray_tmp.encode() in environ:
            out.append(f"{proc.name}: {cmd[:150]}")
    return out


def _stopped(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)
        pytest.fail(f"still running {STOP_WITHIN_S} s after {signal.Signals(sig).name}")


def _no_process_left(ray_tmp: str) -> None:
    deadline = time.time() + 20  # Ray's processes notice their raylet is gone within seconds
    while (left := _processes_under(ray_tmp)) and time.time() < deadline:
        time.sleep(1)
    assert left == [], left


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (Linux: the SigCgt mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc: fall back to signalling at once
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_cli_starts_is_one_line_and_its_exit_status(tmp_path, sig, status):
    """Before the banner (torch, the schema and Ray are still importing): one line, 128 + the signal, nothing
    written."""
    cfg = smallest_sweep(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", name="early")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=sweep_env(ray_tmpdir()),
        text=True,
    )
    # Inside the imports (they take several seconds): once the CLI catches SIGTERM its start-up handlers are in
    # place for both signals.  Before that, the interpreter itself is still starting (a loaded machine can take over
    # a second), which is not what this test is about.
    deadline = time.time() + 60
    while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, (out, err)
    assert err.strip() == "interrupted" and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_stop_message_is_printed_once_where_output_and_errors_go_to_one_place(tmp_path, monkeypatch):
    """Ctrl-C in a terminal (stdout and stderr the same terminal) or ``> log 2>&1``: one message, not two; a sweep
    output written elsewhere (a log file) gets it too."""
    from pipelines.execution.runtime.interrupts import SweepInterrupted, stop_on_sigint

    def stop(out_path, err_path):
        with open(err_path, "a") as err, open(out_path, "a") as out:
            monkeypatch.setattr(sys, "stderr", err)
            with pytest.raises(SweepInterrupted), stop_on_sigint("stopping", out):
                signal.raise_signal(signal.SIGINT)

    one = tmp_path / "both.log"
    stop(one, one)  # two descriptors of one file, as 2>&1 gives
    assert one.read_text().count("stopping") == 1
    stop(tmp_path / "out.log", tmp_path / "err.log")
    assert (tmp_path / "out.log").read_text() == (tmp_path / "err.log").read_text() == "stopping\n"


@pytest.mark.parametrize("sigint_before", ["default_int_handler", "SIG_IGN"])
def test_both_signals_get_the_same_handler_during_a_sweep(sigint_before):
    """Within the sweep both signals stop it; afterwards the handlers from before are back -- also ``SIG_IGN``, which
    a process started in the background of a non-interactive shell (``nohup``, ``cmd &`` in a script) inherits for
    SIGINT and must keep."""
    from pipelines.execution.runtime.interrupts import SweepInterrupted, exit_status, stop_on_sigint

    original = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, getattr(signal, sigint_before))
    try:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        with stop_on_sigint("stopping"):
            assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM)
            with pytest.raises(SweepInterrupted) as e:
                signal.raise_signal(signal.SIGTERM)
            assert exit_status(e.value) == 143
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        signal.signal(signal.SIGINT, original)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_the_sweep_closes_its_runs_leaves_no_process_and_resume_finishes_it(tmp_path):
    import shutil

    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all
    from tests.mlflow_server import PostgresUnavailable, postgres_database
    from tests.test_postgres_tracking import PASSWORD, check_accepted, with_password

    check_accepted("postgresql")
    pg = postgres_database()
    try:
        admin_uri = pg.__enter__()  # postgresql+psycopg2://user@host:port/db
    except PostgresUnavailable as e:
        pg, admin_uri, no_pg = None, None, str(e)
    if admin_uri:
        uri, hostpart = with_password(admin_uri, "postgresql")  # the user's URI: plain scheme, a password
    else:
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    read_uri = admin_uri or uri  # the test reads the store back without the password (trust auth)
    ray_tmp = ray_tmpdir()
    # Long enough folds that the signal lands mid-trial (each fold then takes several seconds, waiting: the paced
    # trunk).
    cfg = smallest_sweep(tmp_path, uri, name="stopme", max_epochs=4, iters_per_epoch=40, trunk=PACED_TRUNK)
    pace = pace_file(tmp_path)  # steps wait until the SIGTERM mid-fold
    env = sweep_env(ray_tmp, **{PACE_FILE_ENV: str(pace)})
    proc = None
    try:
        # 1. Right after the banner: Ray has just started, no fold yet.
        out_path, err_path = tmp_path / "banner.out", tmp_path / "banner.err"
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
                cwd=tmp_path,
                stdout=out_f,
                stderr=err_f,
                env=env,
            )
        deadline = time.time() + 240
        while not sweep_started(out_path):
            assert proc.poll() is None, err_path.read_text(errors="replace")[-3000:]
            assert time.time() < deadline, "no banner in time"
            time.sleep(0.2)
        rc = _stopped(proc, signal.SIGTERM)
        stderr = err_path.read_text(errors="replace")
        assert rc == 143 and "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-4000:]
        assert "resume with: dmlrc sweep" in stderr, stderr[-4000:]
        _no_process_left(ray_tmp)

        # 2. Mid-fold, continuing the same sweep: a fold of the first trial is training.
        out_path, err_path = tmp_path / "first.out", tmp_path / "first.err"
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--resume"],
                cwd=tmp_path,
                stdout=out_f,
                stderr=err_f,
                env=env,
            )
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, f"the sweep ended before it could be stopped: {proc.returncode}"
            assert time.time() < deadline, "no fold started in time"
            time.sleep(1)
            if not sweep_started(out_path):  # opening a new store earlier races the sweep's schema migration
                continue
            try:
                c = MlflowClient(read_uri)
                exp = c.get_experiment_by_name("stopme-experiment")
                runs = search_all(c, exp.experiment_id, "tags.stage = 'fold'") if exp else []
            except Exception:  # noqa: BLE001 - the DB may be mid-creation
                continue
            if any(r.info.status == "RUNNING" for r in runs):
                break
        time.sleep(3)
        assert proc.poll() is None, "the sweep finished before it could be stopped"
        t0 = time.time()
        rc = _stopped(proc, signal.SIGTERM)
        took = time.time() - t0
        pace.unlink()  # --resume at full speed
        stderr = err_path.read_text(errors="replace")
        assert rc == 143, stderr[-4000:]
        assert "interrupted: stopping trials, state is kept; resume with: dmlrc sweep" in stderr, stderr[-4000:]
        assert "--resume" in stderr and "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-4000:]
        _no_process_left(ray_tmp)

        c = MlflowClient(read_uri)
        exp = c.get_experiment_by_name("stopme-experiment")
        runs = search_all(c, exp.experiment_id, "")
        assert [r for r in runs if r.info.status == "RUNNING"] == []
        killed = [r for r in runs if r.info.status == "KILLED"]
        assert killed and all(r.data.tags.get("reason") == "interrupted" for r in killed), [
            (r.data.tags, r.info.status) for r in runs
        ]
        study = [r for r in runs if r.data.tags.get("stage") == "study"]
        assert len(study) == 1 and study[0].data.tags.get("done") != "true"  # not recorded as a finished study
        print(f"stopped {took:.1f} s after SIGTERM")

        # 3. --resume continues from there and finishes the sweep; every run is FINISHED, the study done.
        done = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--resume"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        runs = search_all(c, exp.experiment_id, "")
        assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]
        study = [r for r in runs if r.data.tags.get("stage") == "study"]
        assert len(study) == 1 and study[0].data.tags["done"] == "true" and study[0].data.tags["status"] == "ok"
        assert len([r for r in runs if r.data.tags.get("stage") == "trial"]) == 1
        assert len([r for r in runs if r.data.tags.get("stage") == "reproduction"]) == 2
        assert len([r for r in runs if r.data.tags.get("stage") == "fold"]) == 2 * 3
        _no_process_left(ray_tmp)

        if admin_uri:
            # the banner names the store with its password redacted (postgresql:// may be pinned to the installed
            # psycopg2: pipelines.config.schema); the password is nowhere the sweep wrote
            assert f":***@{hostpart} experiment" in done.stdout and "MLflow postgresql" in done.stdout, done.stdout[
                -3000:
            ]
            printed = [f.read_text(errors="replace") for f in tmp_path.glob("*.out")] + [
                f.read_text(errors="replace") for f in tmp_path.glob("*.err")
            ]
            assert not [t for t in [*printed, done.stdout, done.stderr] if PASSWORD in t]
            for r in runs:
                assert PASSWORD not in repr(r.data.params) + repr(r.data.tags), r.info.run_id
            art = tmp_path / "artifacts"
            art.mkdir()
            c.download_artifacts(study[0].info.run_id, "", str(art))
            assert files_containing(art, [PASSWORD.encode()]) == []
            assert files_containing(tmp_path / "runs", [PASSWORD.encode()]) == []  # (the config file itself has it)
            assert files_containing(Path(ray_tmp), [PASSWORD.encode()]) == []
    finally:
        if (
            proc is not None and proc.poll() is None
        ):  # a failed assertion above: stop our driver (its Ray fate-shares with it)
            proc.kill()
            proc.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if pg is not None and admin_uri:
            pg.__exit__(None, None, None)
    if not admin_uri:
        pytest.skip(f"the direct PostgreSQL store part (the rest passed on sqlite): {no_pg}")
