"""A sweep stops its study threads by raising ``SweepInterrupted`` into them; a stop that a finalizer swallowed
must not leave a study running (the sweep would wait, shut Ray down under it, and exit with the wrong status)."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import pytest

from pipelines.execution.runtime.interrupts import SweepInterrupted, stop_threads


class _Thing:
    pass


class _Study:
    """A thread that is inside a finalizer when the stop comes (so the first stop is swallowed, as CPython does with
    any exception a weakref callback raises), then runs ordinary code until it is stopped or told to quit."""

    def __init__(self, on_stop: Callable[[], None] = lambda: None):
        self.in_finalizer = threading.Event()
        self.quit = threading.Event()
        self.ident = 0
        self.caught: list[BaseException] = []
        self.on_stop = on_stop

    def _finalizer(self) -> None:
        self.in_finalizer.set()
        while not self.quit.is_set():  # Python code: the stop lands here, and the finalizer ends with it
            pass

    def body(self) -> None:
        self.ident = threading.get_ident()
        try:
            thing = _Thing()
            weakref.finalize(thing, self._finalizer)
            del thing  # the finalizer runs here, in this thread, until the stop interrupts it
            while not self.quit.is_set():
                pass
        except SweepInterrupted as e:
            self.caught.append(e)
            self.on_stop()


def _stop(study: _Study, future: Future) -> set[Future]:
    try:
        assert study.in_finalizer.wait(10)
        return stop_threads(lambda: [] if future.done() else [study.ident], [future], timeout_s=5.0)
    finally:
        study.quit.set()


def test_a_stop_swallowed_by_a_finalizer_is_raised_again_until_the_thread_takes_it():
    study = _Study()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(study.body)
        left = _stop(study, future)
    assert not left, "the thread ran on: its stop was swallowed by a finalizer and not raised again"
    assert len(study.caught) == 1 and isinstance(study.caught[0], SweepInterrupted)


def test_the_swallowed_stop_is_not_printed_and_other_finalizer_errors_reach_the_previous_hook(monkeypatch):
    seen: list[type] = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_type))

    def failing_finalizer() -> None:
        raise ValueError("a real error in a finalizer")

    def clean_up_with_a_failing_finalizer() -> None:
        thing = _Thing()
        weakref.finalize(thing, failing_finalizer)
        del thing

    study = _Study(on_stop=clean_up_with_a_failing_finalizer)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(study.body)
        assert not _stop(study, future)
    assert seen == [ValueError]


def test_threads_that_are_gone_are_not_raised_into():
    with ThreadPoolExecutor(max_workers=1) as pool:
        done = pool.submit(lambda: 1)
        assert done.result() == 1
        assert stop_threads(lambda: [], [done], timeout_s=1.0) == set()


@pytest.fixture(autouse=True)
def _no_stray_hook():
    import sys

    before = sys.unraisablehook
    yield
    assert sys.unraisablehook is before, "stop_threads left its hook installed"
