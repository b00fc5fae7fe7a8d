"""A Ray process's native abort report, forwarded to the command's terminal, is one ``warning:`` line
(``pipelines/execution/runtime/output.py``): which process aborted, the reason its report gives, and the log file that
keeps the whole report.  Every other forwarded line is printed as before.

The unit cases use the lines of a real report, as a Ray 2.60 worker wrote them (Abseil's ``Mutex corrupt``, the
failure-signal handler of Ray's core, faulthandler); the end-to-end case makes a real Ray worker abort the same way
under :func:`init_ray` and reads the driver's output.
"""

from __future__ import annotations

import re
import textwrap
from glob import glob
from pathlib import Path

import pytest

from pipelines.execution.runtime.output import AbortCondenser
from tests.ray_driver import run_driver

REPORT = [
    "[mutex.cc : 1446] RAW: Mutex corrupt: both reader and writer lock held: 0x55d0c0ffee00",
    "*** SIGABRT received at time=1795883949 on cpu 0 ***",
    "PC: @     0x7fc1a24a8eec  (unknown)  (unknown)",
    "    @     0x7fc1a245a050   68376336  (unknown)",
    "    @     0x7fc1a2c2b4f0  (unknown)  (unknown)",
    "[2026-11-28 16:39:09,271 E 6438 6438] logging.cc:474: *** SIGABRT received at time=1795883949 on cpu 0 ***",
    "[2026-11-28 16:39:09,271 E 6438 6438] logging.cc:474: PC: @     0x7fc1a24a8eec  (unknown)  (unknown)",
    "[2026-11-28 16:39:09,271 E 6438 6438] logging.cc:474:     @     0x7fc1a245a050   68376336  (unknown)",
    "[2026-11-28 16:39:09,272 E 6438 6438] logging.cc:474:     @     0x7fc1a2c2b4f0  (unknown)  (unknown)",
    "Fatal Python error: Aborted",
    "",
    "Stack (most recent call first):",
    '  File "/opt/fold.py", line 8 in train',
    '  File "/opt/ray/_private/worker.py", line 1069 in main_loop',
    "",
    "Extension modules: msgpack._cmsgpack, google._upb._message, psutil._psutil_linux (total: 3)",
]


class _Terminal:
    """What the condenser hands on: Ray's printer (batches) and the warning lines."""

    def __init__(self) -> None:
        self.printed: list[tuple[object, str]] = []
        self.said: list[str] = []
        self.now = 0.0

    def condenser(self, logs_dir: str | None = "/tmp/ray/session_x/logs") -> AbortCondenser:
        return AbortCondenser(
            lambda data: self.printed.extend((data["pid"], line) for line in data["lines"]),
            self.said.append,
            logs_dir,
            clock=lambda: self.now,
        )

    def lines(self, pid: object = 6438) -> list[str]:
        return [line for p, line in self.printed if p == pid]


def _batch(lines: list[str], pid: object = 6438, **more: object) -> dict:
    return {"ip": "10.0.0.5", "localhost": "10.0.0.5", "pid": pid, "is_err": True, "lines": lines, **more}


def test_a_report_is_one_line_naming_process_reason_and_file():
    term = _Terminal()
    term.condenser()(_batch(["epoch 3 done", *REPORT, "a later line"], actor_name="FoldWorker"))
    assert term.lines() == ["epoch 3 done", "a later line"]
    assert term.said == [
        "warning: Ray worker process 6438 (FoldWorker) aborted in native code (Mutex corrupt: both reader and writer "
        "lock held: 0x55d0c0ffee00); its full report is in /tmp/ray/session_x/logs/worker-*-6438.err. A fold whose "
        'process died restarts from its last checkpoint and says so; see "Lines from Ray\'s own processes" in '
        "docs/reliability.md"
    ]


def test_a_report_split_over_batches_stays_out_and_other_processes_print_meanwhile():
    term = _Terminal()
    condense = term.condenser()
    condense(_batch(REPORT[:3]))
    condense(_batch(["fold 1: epoch 4"], pid=7001))
    condense(_batch(REPORT[3:12]))
    condense(_batch([*REPORT[12:], "after the report"]))
    assert term.lines() == ["after the report"]
    assert term.lines(7001) == ["fold 1: epoch 4"]
    assert len(term.said) == 1


def test_an_abort_without_abseil_message_is_named_sigabrt_and_a_daemon_by_its_file():
    term = _Terminal()
    term.condenser()(_batch(REPORT[1:], pid="raylet"))
    assert term.lines("raylet") == []
    assert term.said[0].startswith(
        "warning: Ray's raylet aborted in native code (SIGABRT); its full report is in "
        "/tmp/ray/session_x/logs/raylet.err."
    )


def test_faulthandler_alone_starts_a_report_and_a_remote_node_is_named():
    term = _Terminal()
    term.condenser()(_batch(["Fatal Python error: Aborted", "", *REPORT[11:]], ip="10.0.0.7"))
    assert term.lines() == []
    assert "its full report is in worker-*-6438.err in the Ray session logs of node 10.0.0.7." in term.said[0]


def test_a_report_without_its_last_line_holds_the_process_for_30_s_only():
    term = _Terminal()
    condense = term.condenser()
    condense(_batch(REPORT[:10]))  # faulthandler did not get to write its part
    term.now = 29.0
    condense(_batch(["still the report"]))
    term.now = 61.0
    condense(_batch(["a new process with the same pid"]))
    assert term.lines() == ["a new process with the same pid"]


def test_lines_that_are_not_an_abort_print_unchanged():
    term = _Terminal()
    lines = [
        "[mutex.cc : 1384] RAW: Potential Mutex deadlock: ",  # Abseil's debug check, not fatal: no report follows
        "Fatal Python error: Segmentation fault",
        "Traceback (most recent call last):",
        "*** SIGABRT is a word in a user's own line",
    ]
    term.condenser()(_batch(lines, is_err=False))
    assert term.lines() == lines
    assert term.said == []


_ABORTING_WORKER = textwrap.dedent(
    """
    import os
    import sys
    import time

    import ray
    from pipelines.execution.runtime.session import init_ray, stop_ray

    class Tee:
        def __init__(self, stream):
            self.stream, self.text = stream, []
        def write(self, s):
            self.text.append(s)
            return self.stream.write(s)
        def flush(self):
            self.stream.flush()
        def fileno(self):
            return self.stream.fileno()
        def seen(self, word):
            return word in "".join(self.text)

    sys.stdout, sys.stderr = Tee(sys.stdout), Tee(sys.stderr)
    started = init_ray(None, num_cpus=1)
    try:
        @ray.remote(num_cpus=0, max_restarts=0)
        class Aborter:
            def pid(self):
                return os.getpid()

            def abort(self):
                # what Abseil writes before it aborts on a corrupt absl::Mutex, then the abort itself
                sys.stderr.write(
                    "[mutex.cc : 1446] RAW: Mutex corrupt: both reader and writer lock held: 0x55d0c0ffee00\\n"
                )
                sys.stderr.flush()
                os.abort()

        @ray.remote(num_cpus=0)
        def talk():
            print("a line from another worker", flush=True)

        aborter = Aborter.remote()
        print("PID", ray.get(aborter.pid.remote()), flush=True)
        try:
            ray.get(aborter.abort.remote(), timeout=120)
        except ray.exceptions.RayActorError:
            pass
        ray.get(talk.remote())
        deadline = time.monotonic() + 90  # until both reached this terminal (or the raw report did)
        while time.monotonic() < deadline and not (
            sys.stdout.seen("a line from another worker")
            and (sys.stderr.seen("aborted in native code") or sys.stderr.seen("Extension modules:"))
        ):
            time.sleep(0.2)
        time.sleep(1)
    finally:
        stop_ray(started)
    """
)


@pytest.mark.slow
def test_a_real_worker_abort_reaches_the_terminal_as_one_line(tmp_path: Path):
    proc = run_driver(_ABORTING_WORKER, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    pid = re.search(r"^PID (\d+)$", proc.stdout, re.M)[1]
    for raw in ("[mutex.cc", "SIGABRT received", "Fatal Python error", "Stack (most recent call first)", "Extension"):
        assert raw not in out, out
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, out
    found = re.fullmatch(
        rf"warning: Ray worker process {pid} \(Aborter\) aborted in native code \(Mutex corrupt: both reader and "
        r"writer lock held: 0x55d0c0ffee00\); its full report is in (\S+)\. A fold .*",
        warnings[0],
    )
    assert found, warnings[0]
    kept = glob(found[1])  # the named file keeps the whole report
    assert len(kept) == 1 and "Fatal Python error: Aborted" in Path(kept[0]).read_text(), found[1]
    assert "a line from another worker" in proc.stdout, out
