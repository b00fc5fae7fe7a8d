"""What every Ray worker process of a ``dmlrc`` job runs first: :func:`setup_worker`, Ray's
``worker_process_setup_hook`` (set by :func:`pipelines.execution.runtime.session.init_ray`).

:func:`scope_to_own_cluster` points the worker's ``RAY_ADDRESS`` at the cluster the worker belongs to.  Ray's State
API, which Ray Train's placement-group cleaner (a detached actor of every Train run) polls from a worker, otherwise
looks for "the" cluster on the machine: with a second Ray instance on the same machine (another user's sweep, a
``ray start`` cluster) it raises ``ConnectionError: Found multiple active Ray instances`` in the cleaner's thread,
which prints a 30-line traceback into the sweep's output, or it asks the other cluster about our actors.  With the
address set, the State API asks this cluster only; where it cannot answer (no dashboard), the cleaner's own handling
applies (a warning, below the log level the sweep gives Ray).

:func:`install_unraisable_hook` handles the two signals Ray sends a worker that Python can swallow: a signal's
handler runs at the next bytecode of the main thread, which may be inside a finalizer (``__del__``, a weakref or GC
callback) or an ``os.register_at_fork`` callback, and an exception raised there cannot propagate: CPython prints it
as ``Exception ignored in: …`` and goes on.

* **SIGTERM.**  The raylet sends SIGTERM to a worker's process group when it disconnects the worker (e.g. a trial
  actor whose placement group Tune removes as the trial ends) and SIGKILL moments later.  Ray's worker SIGTERM
  handler (``sigterm_handler`` in ``Worker.main_loop``, ``ray/_private/worker.py``) raises ``SystemExit(1)``; in a
  finalizer that prints ``Exception ignored in: <function WeakSet...._remove> ... sigterm_handler ... SystemExit: 1``
  into the sweep's output (which a user reads as a crash) and the worker runs on until the SIGKILL.  The hook ends
  the process with Ray's exit code instead.
* **Ray's cancel.**  ``ray.cancel(ref)`` (a pruned trial's folds, :mod:`pipelines.execution.folds.trial`) interrupts the
  task's main thread with a ``KeyboardInterrupt``.  A fold forks its DataLoader's worker processes every epoch
  (``num_workers > 0``), and ``logging`` registers at-fork callbacks: an interrupt landing in one printed
  ``Exception ignored in: <function _releaseLock …> … KeyboardInterrupt`` and was lost, so the pruned trial's fold
  trained on to its end, holding its CPU or GPU and logging to the closed pruned run.  The hook has a helper thread
  raise the ``KeyboardInterrupt`` again in the interrupted thread once the hook has returned (again after each
  callback that swallows it), so the cancel takes effect.  In a worker a ``KeyboardInterrupt`` comes from Ray: a
  worker runs in a process group of its own, out of reach of a terminal's Ctrl-C.

Every other unraisable exception goes to the hook that was there before, unchanged.

Standard library and Ray only: every worker process runs it, trial drivers that never load torch included.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import CodeType
from typing import Any

from pipelines.execution.runtime.interrupts import raise_in_thread

__all__ = ["setup_worker", "scope_to_own_cluster", "install_unraisable_hook", "is_sigterm_exit", "is_interrupt"]

#: The name of the function that Ray's worker installs as its SIGTERM handler (``ray/_private/worker.py``).
_SIGTERM_HANDLER = "sigterm_handler"


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for every ``dmlrc`` job (module docstring)."""
    scope_to_own_cluster()
    install_unraisable_hook()


def scope_to_own_cluster() -> None:
    """Set ``RAY_ADDRESS`` in this worker process to the GCS address of its own cluster."""
    import ray  # a worker process has Ray loaded and connected already

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def is_sigterm_exit(unraisable: Any) -> bool:
    """Whether an unraisable exception (``sys.unraisablehook``'s argument) is the ``SystemExit`` of a SIGTERM
    handler: a ``SystemExit`` whose traceback passes through a function named ``sigterm_handler``."""
    if not isinstance(unraisable.exc_value, SystemExit):
        return False
    return any(frame.f_code.co_name == _SIGTERM_HANDLER for frame, _ in traceback.walk_tb(unraisable.exc_traceback))


def is_interrupt(unraisable: Any) -> bool:
    """Whether an unraisable exception is a ``KeyboardInterrupt`` (in a Ray worker: Ray's cancel of its task)."""
    return isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt)


def _interrupt_once_out_of(ident: int, hook: CodeType) -> None:
    """Raise ``KeyboardInterrupt`` in the thread ``ident`` once no frame of ``hook`` (the unraisable hook that saw
    its interrupt swallowed) is on that thread's stack, so that it is raised where it can propagate: in the code the
    swallowing callback returns to, or in a next callback, which swallows it again and calls the hook again."""
    while True:
        frame = sys._current_frames().get(ident)
        if frame is None:  # the thread has ended
            return
        while frame is not None and frame.f_code is not hook:
            frame = frame.f_back
        if frame is None:
            raise_in_thread(ident, KeyboardInterrupt)
            return
        time.sleep(0.001)


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit`` would give for ``exc`` (None: 0, an int: itself, anything else: 1)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def install_unraisable_hook() -> None:
    """Install a ``sys.unraisablehook`` that ends the process for a SIGTERM handler's ``SystemExit`` swallowed by a
    finalizer, raises a swallowed ``KeyboardInterrupt`` again in its thread (module docstring), and hands every other
    unraisable exception to the previous hook.  Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "_dmlrc_worker_hook", False):
        return

    def hook(unraisable: Any) -> None:
        if is_interrupt(unraisable):
            # Not from here: an exception set for this thread now would be raised inside this hook, and lost.
            threading.Thread(
                target=_interrupt_once_out_of, args=(threading.get_ident(), hook.__code__), daemon=True
            ).start()
            return
        if not is_sigterm_exit(unraisable):
            previous(unraisable)
            return
        # The process must go now, as Ray asked.  Raising SystemExit again cannot work here (an exception out of
        # this hook is itself "ignored" and printed), and re-sending SIGTERM would run Ray's handler again at some
        # later bytecode — possibly inside another finalizer, or inside this hook.  os._exit ends the process at
        # once, from any thread, with the status Ray's handler chose.  It skips atexit handlers and C++ static
        # destructors: the raylet that sent SIGTERM has already disconnected this worker and SIGKILLs it moments
        # later anyway, and tearing down the interpreter while Ray's core-worker threads still run (from inside a
        # finalizer that may hold locks) is what can hang or abort.  Python's own buffers are flushed first, so
        # the worker's last printed lines still reach its log.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream: nothing left to save
                pass
        os._exit(_exit_code(unraisable.exc_value))

    hook._dmlrc_worker_hook = True  # type: ignore[attr-defined]  # marks the hook as installed (idempotence)
    sys.unraisablehook = hook
