"""What every DataLoader worker process of this library runs first: :func:`init_loader_worker`, the loaders'
``worker_init_fn``.

A worker sends each batch's tensors to the process that iterates the loader through shared memory: torch's default
``file_descriptor`` sharing passes the memory's file descriptor over a connection that the worker's
``multiprocessing.resource_sharer`` thread serves.  When the consumer stops in the middle of taking one (a fold that
Ray cancels, e.g. a pruned trial's, stops wherever its ``KeyboardInterrupt`` lands), that thread's connection is
reset, and the thread hands the error to ``sys.excepthook``: a 19-line ``ConnectionResetError`` traceback in the
worker's stderr, which Ray forwards into the sweep's output, where it reads as a crash.  Nothing is lost there: the
consumer has stopped, and a consumer still running would get an error of its own from the same failed transfer.
:func:`quiet_consumer_gone` leaves exactly that case out and passes every other exception on.
"""

from __future__ import annotations

import sys
from types import TracebackType

__all__ = ["init_loader_worker", "quiet_consumer_gone", "is_consumer_gone"]

#: The thread function of ``multiprocessing.resource_sharer`` that serves file descriptors to other processes.
_SERVE = "_serve"
_SHARER_MODULE = "resource_sharer.py"


def is_consumer_gone(exc_type: type[BaseException], tb: TracebackType | None) -> bool:
    """Whether an exception is a lost connection (reset, broken, or closed early) in the resource sharer's thread."""
    if not issubclass(exc_type, (ConnectionError, EOFError)) or tb is None:
        return False
    code = tb.tb_frame.f_code  # the outermost frame: where the exception was caught and handed to the hook
    return code.co_name == _SERVE and code.co_filename.endswith(_SHARER_MODULE)


def quiet_consumer_gone() -> None:
    """Wrap ``sys.excepthook`` so that a lost connection in the resource sharer's thread prints nothing (module
    docstring).  Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "_dml_core_consumer_gone", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not is_consumer_gone(exc_type, tb):
            previous(exc_type, exc, tb)

    hook._dml_core_consumer_gone = True  # type: ignore[attr-defined]  # marks the hook as installed (idempotence)
    sys.excepthook = hook


def init_loader_worker(worker_id: int) -> None:
    """The ``worker_init_fn`` of the library's DataLoaders (training and embedding)."""
    quiet_consumer_gone()
