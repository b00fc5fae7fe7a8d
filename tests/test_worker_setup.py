"""A Ray worker that Ray stops with SIGTERM while a finalizer runs exits quietly, with Ray's exit code
(``pipelines/execution/runtime/worker_setup.py``): no ``Exception ignored ... sigterm_handler ... SystemExit: 1`` in the
sweep's output, and no worker that runs on after Ray told it to go.  A ``KeyboardInterrupt`` (Ray's cancel of a
task) swallowed by a finalizer or an at-fork callback is raised again in the interrupted code, so a cancelled fold
stops.  Every other unraisable exception is printed as before.

Each case runs in its own Python process: the hook ends the process it runs in, and the test process keeps its own
``sys.unraisablehook``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ray_driver import run_driver

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = textwrap.dedent(
    """
    import importlib
    import signal
    import sys

    from pipelines.execution.runtime import worker_setup
    from pipelines.execution.runtime.environment import WORKER_SETUP_HOOK

    # Ray's worker_process_setup_hook, as a worker resolves it; no cluster here to scope the State API to
    worker_setup.scope_to_own_cluster = lambda: None
    module, _, name = WORKER_SETUP_HOOK.rpartition(".")
    getattr(importlib.import_module(module), name)()
    """
)


def _run(body: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sigterm_exit_handed_to_the_hook_ends_the_process_quietly(tmp_path):
    """A synthetic unraisable: the ``SystemExit`` of a function named like Ray's handler → exit with its code."""
    out = _run(
        """
        # the type of sys.unraisablehook's argument (CPython does not name it): taken from one unraisable
        installed, seen = sys.unraisablehook, []
        sys.unraisablehook = seen.append
        class Probe:
            def __del__(self):
                raise ValueError("probe")
        Probe()
        sys.unraisablehook = installed
        UnraisableHookArgs = type(seen[0])

        def sigterm_handler(signum, frame):
            raise SystemExit(3)

        try:
            sigterm_handler(signal.SIGTERM, None)
        except SystemExit as e:
            exc = e
        sys.unraisablehook(UnraisableHookArgs((SystemExit, exc, exc.__traceback__, None, None)))
        print("still running", flush=True)
        """,
        tmp_path,
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert "still running" not in out.stdout
    assert "Exception ignored" not in out.stderr and "SystemExit" not in out.stderr, out.stderr


_FINALIZERS = {
    "__del__": """
        class Finalized:
            def __del__(self):
                signal.raise_signal(signal.SIGTERM)  # Python runs the handler at once: inside this finalizer

        Finalized()
        """,
    # what the sweeps' trial actors showed: the signal inside a WeakSet's weakref callback
    "weakref callback": """
        import weakref

        class Item:
            pass

        def _remove(ref):
            signal.raise_signal(signal.SIGTERM)

        item = Item()
        ref = weakref.ref(item, _remove)
        del item
        """,
}


@pytest.mark.parametrize("finalizer", sorted(_FINALIZERS))
def test_rays_sigterm_inside_a_finalizer_exits_with_rays_code(tmp_path, finalizer):
    """Ray's own exit (``raise_sys_exit_with_custom_error_message``, as its worker's ``sigterm_handler`` calls it),
    raised by a real SIGTERM while a finalizer runs."""
    out = _run(
        """
        from ray._raylet import raise_sys_exit_with_custom_error_message

        def sigterm_handler(signum, frame):  # what Worker.main_loop installs (ray/_private/worker.py)
            raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)

        signal.signal(signal.SIGTERM, sigterm_handler)
        """
        + _FINALIZERS[finalizer]
        + """
        print("still running", flush=True)
        """,
        tmp_path,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "still running" not in out.stdout
    assert "Exception ignored" not in out.stderr and "SystemExit" not in out.stderr, out.stderr


_SWALLOWERS = {
    "__del__": """
        class Finalized:
            def __del__(self):
                interrupted_here()

        Finalized()
        """,
    "weakref callback": """
        import weakref

        class Item:
            pass

        item = Item()
        ref = weakref.ref(item, lambda ref: interrupted_here())
        del item
        """,
    # what a cancelled fold showed: the interrupt inside logging's at-fork callback as a DataLoader forked a worker
    "at-fork callback": """
        os.register_at_fork(after_in_parent=interrupted_here)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        """,
}


@pytest.mark.parametrize("swallower", sorted(_SWALLOWERS))
def test_an_interrupt_swallowed_by_a_callback_is_raised_again_in_the_interrupted_code(tmp_path, swallower):
    """Ray cancels a running task with a ``KeyboardInterrupt`` in its thread; where a callback swallowed it, the task
    must still stop, and nothing is printed."""
    body = (
        "import os\nimport time\n\n"
        "def interrupted_here():\n    raise KeyboardInterrupt\n\n"
        "try:\n"
        + textwrap.indent(textwrap.dedent(_SWALLOWERS[swallower]).strip(), "    ")
        + "\n    t0 = time.monotonic()\n"
        "    while time.monotonic() - t0 < 20:  # the task's own work goes on\n"
        "        pass\n"
        "    print('ran on', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    out = _run(
        body,
        tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "interrupted", out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr and "KeyboardInterrupt" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "raiser, shown",
    [
        ("def fails():\n    raise ValueError('boom')", "ValueError: boom"),
        ("def fails():\n    raise SystemExit(4)", "SystemExit: 4"),  # not a SIGTERM handler's exit
    ],
)
def test_every_other_unraisable_is_printed_as_before(tmp_path, raiser, shown):
    out = _run(
        raiser
        + textwrap.dedent(
            """

            class Finalized:
                def __del__(self):
                    fails()

            Finalized()
            print("still running", flush=True)
            """
        ),
        tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "still running" in out.stdout
    assert "Exception ignored in" in out.stderr and shown in out.stderr, out.stderr


def test_installing_twice_wraps_once(tmp_path):
    out = _run(
        """
        first = sys.unraisablehook
        worker_setup.install_unraisable_hook()
        print("same hook", sys.unraisablehook is first, flush=True)
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "same hook True" in out.stdout


_RAY_WORKER = textwrap.dedent(
    """
    import signal
    import time

    import ray
    from pipelines.execution.runtime.session import init_ray, stop_ray

    started = init_ray(None, num_cpus=1)
    try:
        @ray.remote(num_cpus=0)
        class Worker:
            def finalize_under_sigterm(self):
                class Finalized:
                    def __del__(self):
                        # SIGTERM while a finalizer runs: Ray's worker handler raises SystemExit(1) in here
                        signal.raise_signal(signal.SIGTERM)

                Finalized()
                return "still running"

        worker = Worker.remote()
        try:
            print("RESULT", ray.get(worker.finalize_under_sigterm.remote(), timeout=120), flush=True)
        except ray.exceptions.RayActorError:
            print("RESULT worker exited", flush=True)
        time.sleep(3)  # the worker's output reaches the driver
    finally:
        stop_ray(started)
    """
)


@pytest.mark.slow
def test_a_ray_worker_sigtermed_in_a_finalizer_exits_without_noise(tmp_path):
    """End to end, in a local Ray as a sweep starts it: Ray's real worker SIGTERM handler, our setup hook."""
    out = run_driver(_RAY_WORKER, tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "RESULT worker exited" in out.stdout, text
    assert "Exception ignored" not in text and "sigterm_handler" not in text, text


_RAY_CANCEL = textwrap.dedent(
    """
    import os
    import sys
    import time

    import ray
    from pipelines.execution.runtime.session import init_ray, stop_ray

    marker = sys.argv[1]
    started = init_ray(None, num_cpus=1)
    try:
        @ray.remote(num_cpus=0, max_retries=0)
        def forks(marker):
            def after_fork_in_parent():  # a slow at-fork callback, so that Ray's cancel lands in it
                open(marker, "w").close()
                time.sleep(3)

            os.register_at_fork(after_in_parent=after_fork_in_parent)
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                time.sleep(0.05)
            return "ran on"

        ref = forks.remote(marker)
        while not os.path.exists(marker):
            time.sleep(0.05)
        ray.cancel(ref)  # what a trial does to its folds when the scheduler prunes it
        try:
            print("RESULT", ray.get(ref, timeout=120), flush=True)
        except ray.exceptions.TaskCancelledError:
            print("RESULT cancelled", flush=True)
        time.sleep(2)  # the worker's output reaches the driver
    finally:
        stop_ray(started)
    """
)


@pytest.mark.slow
def test_rays_cancel_landing_in_an_at_fork_callback_still_stops_the_task(tmp_path):
    """End to end: Ray's real cancel of a running task, delivered while an at-fork callback runs (as when a pruned
    trial's fold forks its DataLoader workers), in a local Ray as a sweep starts it."""
    out = run_driver(_RAY_CANCEL, tmp_path, str(tmp_path / "in-callback"))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "RESULT cancelled" in out.stdout, text
    assert "Exception ignored" not in text, text
