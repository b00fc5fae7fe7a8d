"""The resources a sweep asks for against what there is: GPUs on this machine before an embedded Ray starts, and
CPUs/GPUs of the Ray cluster right after it starts (a fold that can never be placed would make Ray Train retry its
worker-group start-up forever)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from pipelines.config import ConfigError, SweepConfig

__all__ = ["check_local_gpus", "check_local_workers", "check_cluster_resources", "memory_gib", "WORKER_GIB"]

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


def check_local_workers(cfg: SweepConfig, address: str | None = None, memory: float | None = None) -> None:
    """On the embedded local Ray (no ``--address``, no ``RAY_ADDRESS``) one fold's DDP workers all run on this machine
    at once: a fold whose ``workers_per_fold`` processes cannot fit in its memory would leave its placement group
    pending (or the machine swapping) forever.  On a cluster, waiting can be right (an autoscaler adds nodes)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return
    memory = memory if memory is not None else memory_gib()
    cores = os.cpu_count() or 1
    w = cfg.resources.workers_per_fold
    if w * WORKER_GIB > 0.8 * memory:
        raise ConfigError(
            "resources.workers_per_fold",
            f"{w} DDP workers per fold cannot run on this machine's local Ray ({memory:.0f} GiB of "
            f"memory, {cores} cores; each worker process needs about {WORKER_GIB:g} GiB): lower it, or "
            "run on a cluster with --address",
        )


def check_cluster_resources(cfg: SweepConfig, resources: Mapping[str, float]) -> None:
    """Right after Ray starts (also a cluster's, with ``--address``), before any trial: the config's resources against
    ``resources`` (``ray.cluster_resources()``): a fold that cannot be placed would make Ray Train retry its
    worker-group start-up forever.  Names ``resources.use_gpu`` / ``resources.cpus_per_worker``
    and what the cluster has.  (An autoscaling cluster may grow later; this checks what it has now.)"""
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
