"""How a sweep stops early: Ctrl-C, a failed study, a crash — say why, close the MLflow runs, keep ``--resume`` working.

* **Ctrl-C** (:func:`stop_on_sigint`): the first SIGINT prints what happens and how to resume, then raises
  :class:`SweepInterrupted` (a ``KeyboardInterrupt``) in the driver, which leaves the running ``Tuner.fit()`` at
  once.  Ray Tune's own handler is switched off (``TUNE_DISABLE_SIGINT_HANDLER=1`` in
  :data:`pipelines.execution.ray_runtime.RAY_ENV`): it would only end the current Tuner, quietly, and the sweep would go on
  with the next one.  Nothing is lost: Tune snapshots its experiment state every ``TUNE_GLOBAL_CHECKPOINT_S``
  seconds and finished fold runs keep their Ray Train checkpoints, so ``--resume`` continues as after a killed
  driver (unfinished trials rerun under their trial ids).  A second Ctrl-C interrupts the clean-up too.
* **Runs left RUNNING** (:func:`close_open_runs`): after Ray is down, every run of the sweep (or of one study) still
  RUNNING is closed — ``KILLED`` with tags ``status=interrupted`` / ``reason`` for an interruption, ``FAILED`` with the
  real reason otherwise.  ``--resume`` replaces killed fold runs (``Tracker.get_or_create(reuse_unfinished=False)``),
  reuses killed trial/reproduction runs under the same trial id, and :func:`reopen_interrupted` marks interrupted
  study runs RUNNING again.
* **Why a search found nothing** (:func:`failure_reason`): per trial, its own reason, the error Ray reported, or
  that it never reported a result — instead of ``?``.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

__all__ = ["SweepInterrupted", "INTERRUPTED", "stop_on_sigint", "resume_command", "close_open_runs",
           "reopen_interrupted", "failure_reason", "error_text"]

INTERRUPTED = "interrupted"


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep (a ``KeyboardInterrupt``, so the CLI exits with 130)."""


def resume_command(cfg) -> str:
    """The command that continues this sweep (``cfg.source`` is the config file, unless it is a built-in preset)."""
    source = getattr(cfg, "source", None)
    if source and Path(source).is_file():
        return f"dmlrc sweep {shlex.quote(str(source))} --name {shlex.quote(cfg.name)} --resume"
    return f"dmlrc demo --name {shlex.quote(cfg.name)} --storage {shlex.quote(str(cfg.storage))} --resume"


@contextlib.contextmanager
def stop_on_sigint(message: str, out=None) -> Iterator[None]:
    """Within the block, the first SIGINT prints ``message`` and raises :class:`SweepInterrupted`; the handler
    that was installed before comes back at once, so a second SIGINT interrupts whatever clean-up follows."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        signal.signal(signal.SIGINT, previous if callable(previous) else signal.default_int_handler)
        for stream in {id(s): s for s in (out, sys.stderr) if s is not None}.values():
            print(message, file=stream, flush=True)
        raise SweepInterrupted(message)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, previous)


def close_open_runs(tracker, sweep: str, *, reason: str, status: str = "FAILED", study: str | None = None) -> int:
    """Close every run of ``sweep`` (of ``study`` only, if given) that is still RUNNING: MLflow status ``status``
    (``KILLED`` for an interruption), tags ``status`` (``interrupted`` | ``failed``) and ``reason``.  Call it once
    no Ray worker can write to them any more.  Returns how many runs it closed."""
    from pipelines.tracking.runs import search_all

    flt = f"tags.sweep = '{_q(sweep)}' and attributes.status = 'RUNNING'"
    if study is not None:
        flt += f" and tags.study = '{_q(study)}'"
    tag = INTERRUPTED if status == "KILLED" else "failed"
    runs = search_all(tracker.client, tracker.experiment_id, flt)
    for run in runs:
        tracker.set_tags(run.info.run_id, {"status": tag, "reason": reason[:4000]})
        tracker.finish(run.info.run_id, status)
    return len(runs)


def reopen_interrupted(tracker, sweep: str) -> int:
    """On ``--resume``: study runs an interruption closed (``KILLED``, not ``done``) are RUNNING again."""
    from pipelines.tracking.runs import search_all

    flt = (f"tags.sweep = '{_q(sweep)}' and tags.stage = 'study' and attributes.status = 'KILLED' "
           f"and tags.status = '{INTERRUPTED}'")
    runs = [r for r in search_all(tracker.client, tracker.experiment_id, flt) if r.data.tags.get("done") != "true"]
    for run in runs:
        tracker.client.update_run(run.info.run_id, status="RUNNING")
        tracker.set_tags(run.info.run_id, {"status": "running", "reason": ""})
    return len(runs)


def failure_reason(rows: list[dict[str, Any]], limit: int = 200) -> str:
    """Why no trial of a Tuner finished ok, one clause per distinct cause (rows as built from a ``ResultGrid``:
    the trial's reported ``status``/``reason``, Ray's ``error``, ``trial_id``)."""
    if not rows:
        return "no trial ran"
    causes: dict[str, list[str]] = {}
    for r in rows:
        if r.get("reason"):
            cause = f"{r.get('status') or 'failed'}: {r['reason']}"
        elif r.get("error") is not None:
            cause = "error: " + error_text(r["error"])
        elif r.get("status"):
            cause = f"status {r['status']} without a reason"
        else:
            cause = "stopped before reporting a result (interrupted, or its process died)"
        causes.setdefault(cause[:limit], []).append(str(r.get("trial_id") or "?"))
    return "; ".join(f"{cause} [{', '.join(sorted(ids))}]" for cause, ids in causes.items())


def error_text(e: BaseException) -> str:
    """``Type: message`` of what went wrong, on one line.  Ray hands on an error raised in a task or actor wrapped
    in a ``RayTaskError`` whose text is a traceback with terminal colours; the error itself is its ``cause`` (a
    chain of them when a task's error went through a trial's actor)."""
    seen = 0
    while isinstance(getattr(e, "cause", None), BaseException) and seen < 10:
        e, seen = e.cause, seen + 1
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _q(v: str) -> str:
    return str(v).replace("'", "\\'")
