"""The resources a sweep asks for against what there is: GPUs on this machine before an embedded Ray starts, and
CPUs/GPUs of the Ray cluster right after it starts (a fold that can never be placed would make Ray Train retry its
worker-group start-up forever)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from pipelines.config import ConfigError, SweepConfig

__all__ = [
    "check_local_gpus",
    "check_local_workers",
    "check_cluster_resources",
    "default_num_cpus",
    "check_node_resources",
    "memory_gib",
    "usable_cpus",
    "WORKER_GIB",
]

#: Resident memory of one fold worker process (torch, the dataset, the model; measured 1.03 GB for the tiny trunk:
#: bench/README_overhead.md): what an embedded local Ray must be able to hold for each of a fold's DDP workers.
WORKER_GIB = 1.0


def _gpu_error(cfg: SweepConfig, gpus: float, cpus: float | None, where: str) -> None:
    r = cfg.resources
    need = r.workers_per_fold * r.gpus_per_worker
    if r.use_gpu and gpus < need:
        has = f"{gpus:g} GPUs" + (f" and {cpus:g} CPUs" if cpus is not None else "")
        raise ConfigError(
            "resources.use_gpu",
            f"one fold needs {r.workers_per_fold} workers × gpus_per_worker "
            f"{r.gpus_per_worker:g} = {need:g} GPUs; {where} has {has}",
        )


def check_local_gpus(cfg: SweepConfig, address: str | None = None) -> None:
    """``use_gpu: true`` with an embedded Ray (no ``--address``, no ``RAY_ADDRESS``): its GPUs are this machine's,
    which torch.cuda knows before Ray starts.  (On a cluster, :func:`check_cluster_resources` after ``ray.init``.)"""
    if not cfg.resources.use_gpu or address or os.environ.get("RAY_ADDRESS"):
        return

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _gpu_error(cfg, gpus, os.cpu_count(), "this machine (the local Ray's resources)")


def memory_gib() -> float:
    """This machine's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


#: The CPU quota of this process's cgroup: v2's ``cpu.max`` ("max 100000" or "<quota> <period>"), v1's CFS files
#: (the paths a container sees; Ray reads the same ones for its own CPU count).
_CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def _cgroup_quota() -> float | None:
    """CPUs this process's cgroup may use (a container's ``--cpus``), or None without a limit."""
    try:
        if _CGROUP_V2_MAX.exists():
            quota, period = _CGROUP_V2_MAX.read_text().split()[:2]
            return None if quota == "max" else float(quota) / float(period)
        if _CGROUP_V1_QUOTA[0].exists():
            quota_us = float(_CGROUP_V1_QUOTA[0].read_text())
            return None if quota_us <= 0 else quota_us / float(_CGROUP_V1_QUOTA[1].read_text())
    except (OSError, ValueError):
        return None
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a batch scheduler's cpuset), capped by its
    cgroup's quota (rounded up)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def check_local_workers(
    cfg: SweepConfig, address: str | None = None, memory: float | None = None, cpus: int | None = None
) -> None:
    """On the embedded local Ray (no ``--address``, no ``RAY_ADDRESS``) one fold's DDP workers all run on this machine
    at once: a fold whose ``workers_per_fold`` processes cannot fit in its memory would leave its placement group
    pending (or the machine swapping) forever, and one that needs more CPUs than this machine has
    (``workers_per_fold × cpus_per_worker`` > :func:`usable_cpus`) would run its DDP ranks on shared cores — the
    local Ray's logical CPUs do not stop it.  On a cluster, waiting can be right (an autoscaler adds nodes)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return
    memory = memory if memory is not None else memory_gib()
    cores = cpus if cpus is not None else usable_cpus()
    w = cfg.resources.workers_per_fold
    if w * WORKER_GIB > 0.8 * memory:
        raise ConfigError(
            "resources.workers_per_fold",
            f"{w} DDP workers per fold cannot run on this machine's local Ray ({memory:.0f} GiB of "
            f"memory, {cores} cores; each worker process needs about {WORKER_GIB:g} GiB): lower it, or "
            "run on a cluster with --address",
        )
    need = w * cfg.resources.cpus_per_worker
    if need > cores:
        raise ConfigError(
            "resources.workers_per_fold",
            f"one fold's {w} DDP workers × cpus_per_worker {cfg.resources.cpus_per_worker:g} = {need:g} CPUs, but "
            f"this machine has {cores} for the local Ray: lower workers_per_fold (or cpus_per_worker), or run on a "
            "cluster with --address",
        )


def default_num_cpus(cfg: SweepConfig) -> int:
    """Logical CPUs of an embedded local Ray: this machine's usable cores (:func:`usable_cpus`, Ray's own default), so
    the folds in flight never outnumber the cores — two folds sharing a core each train slower than one after the
    other and every extra warm worker process pays its imports again (bench/README_demo.md: on 2 cores, 2 fold
    processes rather than 4 take 13 % less CPU for the same table); no more fold workers than this machine's memory
    holds (about ``WORKER_GIB`` each), beyond which folds would swap instead of waiting in Ray's queue; and never
    fewer than one fold's workers (a fold that needs more cores than there are is refused by
    :func:`check_local_workers` first)."""
    r = cfg.resources
    one_fold = r.workers_per_fold * r.cpus_per_worker
    fits = max(r.workers_per_fold, math.floor(0.8 * memory_gib() / WORKER_GIB)) * r.cpus_per_worker
    return int(max(math.ceil(one_fold), min(usable_cpus(), math.floor(fits))))


def check_cluster_resources(cfg: SweepConfig, resources: Mapping[str, float]) -> None:
    """Right after Ray starts (also a cluster's, with ``--address``), before any trial: the config's resources against
    ``resources`` (``ray.cluster_resources()``): a fold that cannot be placed would make Ray Train retry its
    worker-group start-up forever.  Names ``resources.use_gpu`` / ``resources.cpus_per_worker``
    and what the cluster has.  (An autoscaling cluster may grow later; this checks what it has now.)  A fold's DDP
    workers may spread over nodes (Ray Train's PACK placement), so the fold is held against the whole cluster; one
    worker is held against the biggest node by :func:`check_node_resources`."""
    r = cfg.resources
    gpus, cpus = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    _gpu_error(cfg, gpus, cpus, "the Ray cluster")
    need = r.workers_per_fold * r.cpus_per_worker
    if cpus < need:
        raise ConfigError(
            "resources.cpus_per_worker",
            f"one fold needs {r.workers_per_fold} workers × {r.cpus_per_worker:g} CPUs = {need:g}; "
            f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs",
        )


def check_node_resources(cfg: SweepConfig, nodes: Sequence[Mapping[str, float]]) -> None:
    """After :func:`check_cluster_resources`: one worker runs on one node, so ``cpus_per_worker`` (and with GPUs
    ``gpus_per_worker``) must fit on the biggest of ``nodes`` (each live node's resources, ``ray.nodes()``)."""
    r = cfg.resources
    if not nodes:
        return
    cpus = sum(float(n.get("CPU", 0)) for n in nodes)
    gpus = sum(float(n.get("GPU", 0)) for n in nodes)
    biggest = max(float(n.get("CPU", 0)) for n in nodes)
    if r.cpus_per_worker > biggest:
        raise ConfigError(
            "resources.cpus_per_worker",
            f"{r.cpus_per_worker:g} CPUs per worker, but the biggest node of the Ray cluster has {biggest:g} "
            f"({len(nodes)} nodes, {cpus:g} CPUs in all): one worker runs on one node",
        )
    most_gpus = max(float(n.get("GPU", 0)) for n in nodes)
    if r.use_gpu and r.gpus_per_worker > most_gpus:
        raise ConfigError(
            "resources.gpus_per_worker",
            f"{r.gpus_per_worker:g} GPUs per worker, but the node with the most GPUs has {most_gpus:g} "
            f"({len(nodes)} nodes, {gpus:g} GPUs in all): one worker runs on one node",
        )
