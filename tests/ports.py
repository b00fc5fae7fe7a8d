"""Loopback ports for every server the tests start (SeaweedFS, ``mlflow server``, Ray nodes, gloo rendezvous).

    from tests.ports import free_port, free_port_pairs, start_on_free_ports, PortInUse

A port chosen here lies in :data:`PORT_RANGE`: above Ray's worker ports (``ray start`` gives workers 10002–19999 by
default; its fixed ports 6379, 8265, 10001 and 52365 are outside too) and below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768–60999 by default), from which every outgoing connection takes its
local port — a port chosen there can be taken by any connection between our check and the server's bind.  The choice
is random per process (several pytest-xdist workers choose at once) and a port handed out in this process is not
handed out again for a while (a caller may choose several before starting anything).

A port free at the check can still be taken before the server binds it.  A start that loses that race raises
:class:`PortInUse` (:func:`bind_failure` reads the server's log); :func:`start_on_free_ports` starts again on
fresh ports, a bounded number of times, and then fails naming what could not start.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

__all__ = [
    "PORT_RANGE",
    "RAY_WORKER_PORTS",
    "RAY_FIXED_PORTS",
    "ephemeral_range",
    "port_is_free",
    "free_port",
    "free_ports",
    "free_port_pairs",
    "PortInUse",
    "bind_failure",
    "start_on_free_ports",
]

T = TypeVar("T")

#: ``ray start``'s default ``--min-worker-port`` / ``--max-worker-port`` (Ray 2.60), inclusive.
RAY_WORKER_PORTS = (10002, 19999)
#: Ray's fixed defaults: GCS, dashboard, Ray Client server, dashboard agent.
RAY_FIXED_PORTS = (6379, 8265, 10001, 52365)
_LOW = RAY_WORKER_PORTS[1] + 1
_EPHEMERAL_DEFAULT = (32768, 60999)
#: Ports handed out in this process are not handed out again for this long (the caller starts its server meanwhile).
_REUSE_AFTER_S = 600.0


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive); Linux's default where it cannot be read."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def _port_range() -> tuple[int, int]:
    low_ephemeral = ephemeral_range()[0]
    # A machine whose ephemeral range starts lower than this leaves no room below it: keep the usual bound (the
    # retries of start_on_free_ports still cover a lost race).
    high = low_ephemeral if _LOW + 12000 < low_ephemeral <= _EPHEMERAL_DEFAULT[0] else _EPHEMERAL_DEFAULT[0]
    return _LOW, high


#: ``[low, high)`` of the ports chosen here.
PORT_RANGE = _port_range()

_rng = random.SystemRandom()  # per process, never a seed shared by forked or spawned workers
_lock = threading.Lock()
_handed_out: dict[int, float] = {}


def port_is_free(port: int) -> bool:
    """Nothing is bound to ``port`` on any local address (a bind on all of them succeeds; nothing listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _recent(port: int, now: float) -> bool:
    t = _handed_out.get(port)
    return t is not None and now - t < _REUSE_AFTER_S


def free_port_pairs(n: int, offset: int = 0) -> list[int]:
    """``n`` distinct ports ``p``, each with ``p + offset`` (when ``offset``) also in :data:`PORT_RANGE` and free now,
    none within 1 of another, none handed out by this process lately."""
    low, high = PORT_RANGE
    if high - offset <= low:
        raise RuntimeError(f"no port p with p and p + {offset} in {low}..{high - 1}")
    with _lock:
        now = time.monotonic()
        chosen: list[int] = []
        taken: set[int] = set()
        for _ in range(5000):
            p = _rng.randrange(low, high - offset)
            group = {p, p + offset}
            if any(abs(q - c) < 2 for q in group for c in taken) or any(_recent(q, now) for q in group):
                continue
            if all(port_is_free(q) for q in group):
                chosen.append(p)
                taken |= group
                if len(chosen) == n:
                    for q in taken:
                        _handed_out[q] = now
                    return chosen
    what = f"port pairs (p, p + {offset})" if offset else "ports"
    raise RuntimeError(f"could not find {n} free loopback {what} in {low}..{high - 1}")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports in :data:`PORT_RANGE` that are free now."""
    return free_port_pairs(n)


def free_port() -> int:
    """One port in :data:`PORT_RANGE` that is free now."""
    return free_port_pairs(1)[0]


class StartAgain(RuntimeError):
    """A server's start failed for a reason of the moment: starting it again on fresh ports may well succeed."""


class PortInUse(StartAgain):
    """A server could not bind a port chosen for it: another process took it after the check."""


class SlowStart(StartAgain):
    """A server gave up within a time limit of its own that a busy machine overran (Ray's raylet registering)."""


_BIND_FAILURE = re.compile(
    r"address already in use|eaddrinuse|errno 98\b|already occupied|failed to bind|bind: address",
    re.IGNORECASE,
)


def bind_failure(log_text: str) -> str:
    """The line of a server's log that says one of its ports was taken (the wordings of Go, Python, uvicorn, gRPC,
    Ray), or ``""``."""
    for line in log_text.splitlines():
        if _BIND_FAILURE.search(line):
            return line.strip()
    return ""


def start_on_free_ports(start: Callable[[], T], what: str, tries: int = 4) -> T:
    """``start()`` (which chooses fresh ports each call), again after each :class:`StartAgain` (a lost port, a slow
    start), at most ``tries`` times."""
    for attempt in range(1, tries + 1):
        try:
            return start()
        except StartAgain as e:
            if attempt == tries:
                cause = "its ports were taken by other processes" if isinstance(e, PortInUse) else "it failed"
                raise RuntimeError(
                    f"{what} could not start: {cause} {tries} times in a row "
                    f"(ports from {PORT_RANGE[0]}..{PORT_RANGE[1] - 1}); last: {e}"
                ) from e
    raise AssertionError("unreachable")
