"""How a sweep stops early: Ctrl-C, a failed study, a crash — say why, close the MLflow runs, keep ``--resume`` working.

* **Ctrl-C or SIGTERM** (:func:`stop_on_sigint`; before the sweep runs :func:`install_startup_handlers`): the first
  SIGINT or SIGTERM prints what happens and how to resume, then raises
  :class:`SweepInterrupted` (a ``KeyboardInterrupt``) in the driver, which leaves the running ``Tuner.fit()`` at
  once.  Ray Tune's own handler is switched off (``TUNE_DISABLE_SIGINT_HANDLER=1`` in
  :data:`pipelines.execution.runtime.environment.RAY_ENV`): it would only end the current Tuner, quietly, and the sweep
  would go on with the next one.  Nothing is lost: Tune snapshots its experiment state every
  ``TUNE_GLOBAL_CHECKPOINT_S`` seconds and finished folds keep their results (a warm fold's ``result/`` directory or a
  Ray Train checkpoint), so ``--resume`` continues as after a killed driver (unfinished trials rerun under their trial
  ids).  A second Ctrl-C interrupts the clean-up too.
* **Study threads** (:func:`stop_threads`): only the main thread receives a signal; a sweep running studies in
  threads raises the same :class:`SweepInterrupted` into each of them (CPython's ``PyThreadState_SetAsyncExc``).
  Such an exception lands at the thread's next Python instruction, and if that instruction belongs to a finalizer (a
  weakref callback, a ``__del__``) CPython swallows it ("Exception ignored in ...") and the thread goes on; a thread
  whose stop was swallowed gets it again.
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
import ctypes
import os
import shlex
import signal
import sys
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "SweepInterrupted",
    "INTERRUPTED",
    "STOP_SIGNALS",
    "stop_on_sigint",
    "stop_threads",
    "raise_in_thread",
    "install_startup_handlers",
    "exit_status",
    "resume_command",
    "close_open_runs",
    "reopen_interrupted",
    "failure_reason",
    "error_text",
]

INTERRUPTED = "interrupted"


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM during a sweep (a ``KeyboardInterrupt``): the CLI exits with 128 + the signal's
    number — 130 for Ctrl-C, 143 for SIGTERM (what Kubernetes sends a pod before it kills it)."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = int(signum)
        self.announced = False  # True once the sweep printed what happens and how to resume


#: The signals that stop a sweep cleanly.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(e: BaseException) -> int:
    """128 + the signal that interrupted (130 for a plain KeyboardInterrupt)."""
    return 128 + int(getattr(e, "signum", signal.SIGINT))


def install_startup_handlers() -> None:
    """From the first line of ``dmlrc``: SIGTERM, like Ctrl-C, becomes a :class:`SweepInterrupted` in the main thread,
    so a scheduler's stop during start-up (imports, preflight, Ray starting) ends in one line and exit 143, not a
    traceback or a native stack dump.  :func:`stop_on_sigint` replaces both once the sweep runs."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise SweepInterrupted("interrupted", signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def resume_command(cfg) -> str:
    """The command that continues this sweep (``cfg.source`` is the config file, unless it is a built-in preset)."""
    source = getattr(cfg, "source", None)
    if source and Path(source).is_file():
        return f"dmlrc sweep {shlex.quote(str(source))} --name {shlex.quote(cfg.name)} --resume"
    return f"dmlrc demo --name {shlex.quote(cfg.name)} --storage {shlex.quote(str(cfg.storage))} --resume"


def _same_destination(a: Any, b: Any) -> bool:
    """Whether two streams write to the same file or terminal (``2>&1``, or both on one terminal)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a StringIO): the same object or not
        return a is b
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


@contextlib.contextmanager
def stop_on_sigint(message: str, out=None) -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM prints ``message`` and raises :class:`SweepInterrupted`; the
    handlers installed before come back at once, so a second signal interrupts whatever clean-up follows (closing
    runs, stopping Ray).  Installed after Ray starts: Ray's driver sets a native SIGTERM handler of its own."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def restore() -> None:
        # SIG_IGN and SIG_DFL come back as they were (a background job keeps ignoring SIGINT); None is a handler
        # installed outside Python (Ray's native one), which cannot be reinstalled: Python's default instead
        for sig, h in previous.items():
            if h is None:
                h = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, h)

    def handler(signum, frame):
        restore()
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        # stderr, and the sweep's output too where that is somewhere else (a log file): once on a terminal
        streams = [sys.stderr] + ([out] if out is not None and not _same_destination(out, sys.stderr) else [])
        for stream in streams:
            print(f"{message} ({name})" if signum == signal.SIGTERM else message, file=stream, flush=True)
        stop = SweepInterrupted(message, signum)
        stop.announced = True
        raise stop

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is handler:
            restore()


def raise_in_thread(ident: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in the thread ``ident`` at its next Python instruction."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))


def stop_threads(
    running: Callable[[], list[int]],
    futures: list[Future],
    timeout_s: float,
) -> set[Future]:
    """Raise :class:`SweepInterrupted` in each thread ``running()`` names and wait up to ``timeout_s`` for
    ``futures``; returns those not done by then.  A thread whose exception a finalizer swallowed (seen through
    ``sys.unraisablehook``, which is called in that thread) gets it again, so one unlucky instruction does not leave
    it running; the swallowed exception is not printed (it is this stop, not an error)."""
    swallowed: set[int] = set()
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, SweepInterrupted):
            swallowed.add(threading.get_ident())
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        for ident in running():
            raise_in_thread(ident, SweepInterrupted)
        deadline = time.monotonic() + timeout_s
        left = {f for f in futures if not f.cancelled()}
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _, left = wait(left, timeout=min(0.2, remaining))
            again = swallowed & set(running())
            swallowed.difference_update(again)
            for ident in again:
                raise_in_thread(ident, SweepInterrupted)
        return left
    finally:
        sys.unraisablehook = previous


def close_open_runs(tracker, sweep: str, *, reason: str, status: str = "FAILED", study: str | None = None) -> int:
    """Close every run of ``sweep`` (of ``study`` only, if given) that is still RUNNING: MLflow status ``status``
    (``KILLED`` for an interruption), tags ``status`` (``interrupted`` | ``failed``) and ``reason``.  Call it once
    no Ray worker can write to them any more.  Returns how many runs it closed."""
    # MLflow: pipelines.cli imports this module first, and it must load nothing but the standard library
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
    # MLflow: see close_open_runs
    from pipelines.tracking.runs import search_all

    flt = (
        f"tags.sweep = '{_q(sweep)}' and tags.stage = 'study' and attributes.status = 'KILLED' "
        f"and tags.status = '{INTERRUPTED}'"
    )
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
    seen, cause = 0, getattr(e, "cause", None)
    while isinstance(cause, BaseException) and seen < 10:
        e, seen = cause, seen + 1
        cause = getattr(e, "cause", None)
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _q(v: str) -> str:
    return str(v).replace("'", "\\'")
