"""What every Ray worker process of a ``dmlrc`` job runs first: :func:`setup_worker`, Ray's
``worker_process_setup_hook`` (set by :func:`pipelines.execution.ray_runtime.init_ray`).

:func:`scope_to_own_cluster` points the worker's ``RAY_ADDRESS`` at the cluster the worker belongs to.  Ray's State
API, which Ray Train's placement-group cleaner (a detached actor of every Train run) polls from a worker, otherwise
looks for "the" cluster on the machine: with a second Ray instance on the same machine (another user's sweep, a
``ray start`` cluster) it raises ``ConnectionError: Found multiple active Ray instances`` in the cleaner's thread,
which prints a 30-line traceback into the sweep's output, or it asks the other cluster about our actors.  With the
address set, the State API asks this cluster only; where it cannot answer (no dashboard), the cleaner's own handling
applies (a warning, below the log level the sweep gives Ray).

:func:`install_sigterm_exit_hook` makes a worker that Ray stops with SIGTERM exit, quietly, even when the signal
lands while a finalizer (``__del__``, a weakref or GC callback) runs.  The raylet sends SIGTERM to a worker's process
group when it disconnects the worker (e.g. a trial actor whose placement group Tune removes as the trial ends) and
SIGKILL moments later.  Ray's worker SIGTERM handler (``sigterm_handler`` in ``Worker.main_loop``,
``ray/_private/worker.py``) raises ``SystemExit(1)``; Python cannot let an exception out of a finalizer, so it prints
``Exception ignored in: <function WeakSet...._remove> ... sigterm_handler ... SystemExit: 1`` into the sweep's output
(which a user reads as a crash) and the worker runs on until the SIGKILL.  The hook recognises exactly that case and
ends the process with Ray's exit code; every other unraisable exception goes to the hook that was there before,
unchanged.

Standard library and Ray only: every worker process runs it, trial drivers that never load torch included.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

__all__ = ["setup_worker", "scope_to_own_cluster", "install_sigterm_exit_hook", "is_sigterm_exit"]

#: The name of the function that Ray's worker installs as its SIGTERM handler (``ray/_private/worker.py``).
_SIGTERM_HANDLER = "sigterm_handler"


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for every ``dmlrc`` job (module docstring)."""
    scope_to_own_cluster()
    install_sigterm_exit_hook()


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


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit`` would give for ``exc`` (None: 0, an int: itself, anything else: 1)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def install_sigterm_exit_hook() -> None:
    """Install a ``sys.unraisablehook`` that ends the process for a SIGTERM handler's ``SystemExit`` swallowed by a
    finalizer (module docstring) and hands every other unraisable exception to the previous hook.  Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "_dmlrc_sigterm_exit", False):
        return

    def hook(unraisable: Any) -> None:
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

    hook._dmlrc_sigterm_exit = True  # type: ignore[attr-defined]  # marks the hook as installed (idempotence)
    sys.unraisablehook = hook
