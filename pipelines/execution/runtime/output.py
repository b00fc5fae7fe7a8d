"""What Ray forwards to the command's terminal from its processes: a native abort of one of them as one line.

Ray's log monitor sends what every worker, raylet and GCS server writes to stderr to the driver, which prints it
(``log_to_driver``).  A Ray process that aborts in native code writes a report of tens of lines there: Abseil's
fatal message (``[mutex.cc : N] RAW: Mutex corrupt: …``), the ``*** SIGABRT received`` block of the failure-signal
handler of Ray's core (raw, then again through Ray's logger), and ``Fatal Python error: Aborted`` with the Python
stacks and the extension-module list from :mod:`faulthandler`, which Ray enables in every process it connects.  In
a sweep's terminal that reads as the sweep crashing.  The driver prints one ``warning:`` line for it instead: which
process aborted, the reason its report gives, and the file that keeps the whole report (the lines are only
forwarded from that node's Ray session logs, which keep them).  Whether the sweep lost anything is in the sweep's
own lines: a fold whose process died restarts from its last checkpoint and says so.

Ray has no setting for this short of dropping every forwarded line (``log_to_driver=False``, which would also drop
the folds' progress lines), so :func:`condense_aborts` wraps the printing handler Ray registers on its driver-side
dispatcher of forwarded lines; everything else is passed to Ray's handler unchanged.  This module imports Ray: it is
imported by :mod:`pipelines.execution.runtime.session`, after Ray's settings are in the environment.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Any

# Ray's driver-side dispatcher of forwarded lines, and the node that holds this driver's session logs, have no
# public interface.
from ray._private import worker as ray_worker
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

# Abseil's raw log line, e.g. "[mutex.cc : 1446] RAW: Mutex corrupt: both reader and writer lock held: 0x…"
_RAW_LOG = re.compile(r"^\[[\w.\-]+ : \d+\] RAW: (?P<message>.*)$")
# The first line of the abort report: Ray core's failure-signal handler (raw, or through Ray's logger as
# "[<time> E <pid> <tid>] logging.cc:N: *** SIGABRT …"), or faulthandler where Ray's handler did not run.
_ABORT_START = re.compile(r"\*\*\* SIGABRT received at time=|^Fatal Python error: Aborted")
# faulthandler's last line of the report (Python 3.10 and later).
_REPORT_END = "Extension modules:"
# A process whose report did not end with faulthandler's line: its later lines are dropped for this long (an aborted
# process writes nothing after its report; a new process may reuse the pid later).
_REPORT_S = 30.0
_REASON_CHARS = 160
_RAY_DAEMONS = {"raylet": "Ray's raylet", "gcs_server": "Ray's GCS server"}

PRINT_HANDLER = "ray_print_logs"  # the name Ray's driver registers its printing handler under


class AbortCondenser:
    """A handler of Ray's forwarded-line dispatcher: lines pass to ``forward`` (Ray's printer) unchanged, except a
    process's abort report, which becomes one line given to ``say``.  ``logs_dir``: this node's Ray session logs
    (named in the line for a process on this node); ``clock``: seconds, monotonic."""

    def __init__(
        self,
        forward: Callable[[dict[str, Any]], None],
        say: Callable[[str], None],
        logs_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.forward = forward
        self.say = say
        self.logs_dir = logs_dir
        self.clock = clock
        self._reporting: dict[tuple[Any, Any], float] = {}  # (ip, pid) → when its report began

    def __call__(self, data: dict[str, Any]) -> None:
        key = (data.get("ip"), data.get("pid"))
        lines = list(data.get("lines") or [])
        began = self._reporting.get(key)
        if began is not None and self.clock() - began > _REPORT_S:
            del self._reporting[key]
            began = None
        if began is not None:  # the rest of a report that began in an earlier batch
            self._pass(data, self._after_report(key, lines, 0))
            return
        start = next((i for i, line in enumerate(lines) if _ABORT_START.search(line)), None)
        if start is None:
            self._pass(data, lines)
            return
        first = start
        while first > 0 and _RAW_LOG.match(lines[first - 1]):  # Abseil's fatal message comes just before
            first -= 1
        self._pass(data, lines[:first])
        self._reporting[key] = self.clock()
        self.say(self.summary(data, lines[first:]))
        self._pass(data, self._after_report(key, lines, start))

    def _after_report(self, key: tuple[Any, Any], lines: list[str], start: int) -> list[str]:
        """The lines after the report's end, if it ends in ``lines[start:]`` (the report state then ends)."""
        for i in range(start, len(lines)):
            if lines[i].startswith(_REPORT_END):
                del self._reporting[key]
                return lines[i + 1 :]
        return []

    def _pass(self, data: dict[str, Any], lines: list[str]) -> None:
        if lines:
            self.forward({**data, "lines": lines})

    def summary(self, data: dict[str, Any], report: list[str]) -> str:
        """The one line for a process's abort ``report`` (its lines from the first one)."""
        pid = data.get("pid")
        raw = next((m["message"] for line in report if (m := _RAW_LOG.match(line))), None)
        reason = (raw or "SIGABRT").strip()
        if len(reason) > _REASON_CHARS:
            reason = reason[: _REASON_CHARS - 1] + "…"
        if pid in _RAY_DAEMONS:
            who, file = _RAY_DAEMONS[pid], f"{pid}.err"
        else:
            name = data.get("actor_name") or data.get("task_name")
            who, file = f"Ray worker process {pid}" + (f" ({name})" if name else ""), f"worker-*-{pid}.err"
        ip = data.get("ip")
        if self.logs_dir and (ip is None or ip == data.get("localhost")):
            where = f"{self.logs_dir}/{file}"
        else:
            where = f"{file} in the Ray session logs of node {ip}"
        return (
            f"warning: {who} aborted in native code ({reason}); its full report is in {where}. "
            "A fold whose process died restarts from its last checkpoint and says so; see "
            '"Lines from Ray\'s own processes" in docs/reliability.md'
        )


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def condense_aborts() -> None:
    """Wrap the printing handler of this driver's Ray (``ray.init(log_to_driver=True)`` registered it) in an
    :class:`AbortCondenser`; without one (``log_to_driver=False``) nothing is printed, and nothing changes."""
    node = getattr(ray_worker, "_global_node", None)
    logs_dir = node.get_logs_dir_path() if node is not None else None
    with dispatcher._lock:
        dispatcher.handlers = [
            (name, AbortCondenser(handler, _say, logs_dir) if name == PRINT_HANDLER else handler)
            for name, handler in dispatcher.handlers
        ]
