"""Run a function in W gloo processes and collect each rank's return value (for DDP tests).

    from ddp_util import run_ddp
    results = run_ddp(my_fn, 2, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on each rank

``my_fn`` must be importable by name (a module-level function of a test module), because the
workers are started with the ``spawn`` method.  Each worker runs with one torch thread inside an
initialised gloo process group on a free loopback port; its return value travels back through
``torch.save`` (tensors, dicts, dataclasses are fine).  A worker exception is re-raised here with
the worker's traceback; a hang is cut off after ``timeout`` seconds and the workers killed.

A worker that has saved its result waits for its peers (a barrier), destroys the process group and leaves with
``os._exit(0)``: a spawned process otherwise runs the interpreter's teardown and the C++ static destructors, the
usual place of a "terminate called without an active exception" (a C++ thread object destroyed while its thread
runs), which once killed a rank of a finished DDP test with SIGABRT.  A native abort prints every thread's Python
stack (``faulthandler``), so a next one says where it happened.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import PortInUse, bind_failure, free_port, start_on_free_ports

__all__ = ["free_port", "run_ddp"]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only; never a real NIC
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while a peer is still inside a collective
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is saved: skip the interpreter's and the C++ runtime's teardown


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ddp_util_") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a worker failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"DDP workers of {fn.__name__} still running after {timeout:.0f}s")
        finally:
            for p in ctx.processes:  # only our own workers, by handle
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_ddp(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(0, W, *args), …, fn(W-1, W, *args)]``, each computed in its own gloo process.

    The rendezvous port (``tests/ports.py``) can be taken by another process between choosing and binding it (tests
    of several sessions run side by side); that one error is retried with a new port.
    """

    def start() -> list[Any]:
        try:
            return _run_once(fn, world_size, args, timeout)
        except mp.ProcessRaisedException as e:
            failure = bind_failure(str(e))
            if failure:
                raise PortInUse(f"gloo rendezvous of {fn.__name__}: {failure}") from e
            raise

    return start_on_free_ports(start, f"the DDP workers of {fn.__name__}")
