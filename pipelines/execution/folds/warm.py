"""Warm fold execution: single-worker folds as Ray tasks on worker processes that outlive a fold.

Why tasks (measured in ``bench/overhead_bench.py``, reasoning in ``docs/architecture.md``): a Ray Train job starts a
controller, helper actors and fresh worker processes for every fold, each importing torch, Ray Train and MLflow —
tens of seconds per fold on a small machine.  A Ray *task* runs on a pooled worker process of the job, which Ray
keeps and reuses for the next task (``max_calls=0``), so imports, the CUDA context and the dataset table
(:func:`pipelines.execution.folds.fold._table`) are paid once per process.  Everything else is Ray's own:

* queueing and resources: each fold task asks for ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs); folds of
  every trial share Ray's queue, and a trial never holds a process while it waits;
* retries: ``max_retries = resources.fold_retries`` — Ray resubmits a fold whose worker process or node died (system
  failures only: an exception in our code is not retried, it fails the trial with its message);
* GPUs: Ray normally gives every GPU task a fresh process (``max_calls=1``) because ``CUDA_VISIBLE_DEVICES`` cannot
  change inside a process that has initialised CUDA.  Warm GPU folds instead set Ray's documented
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` for their workers and select the device Ray assigned
  (``cuda:<ray.get_gpu_ids()[0]>``), so a reused process can serve whichever GPU its next fold is given.

Result directory: rank 0 of :func:`pipelines.execution.folds.fold.run_fold` writes it locally, then it is copied to
``<fold_storage>/<run name>/result/`` (local path or ``s3://``), ``outcome.json`` last — so a directory with
``outcome.json`` is complete, and a fold that finished before the sweep was killed is found there by
``--resume`` and not trained again (the same story as Ray Train's restored checkpoint on the other path).
A fold that had not finished continues from its last evaluation: its mid-fold states live in
``<fold_storage>/<run name>/ckpt/`` (:func:`pipelines.execution.folds.fold.run_fold`), deleted once the result is
stored.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import ray

from dml_core.storage import open_storage
from pipelines.execution.folds.config import FoldConfig
from pipelines.names import OUTCOME_FILE

__all__ = ["warm_fold_ref", "result_uri", "NOSET_CUDA"]

NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def result_uri(fold_storage: str, name: str) -> str:
    """Where a warm fold's result directory lives (a local path or ``s3://``)."""
    return fold_storage.rstrip("/") + "/" + name + "/result"


def _fold_dir(uri: str) -> str:
    """``<fold_storage>/<run name>`` of a result directory URI."""
    return uri.rstrip("/").rsplit("/", 1)[0]


def _stored(uri: str) -> bool:
    return open_storage(uri).exists(OUTCOME_FILE)


def _upload(local: Path, uri: str) -> None:
    store = open_storage(uri)
    files = sorted(p for p in local.iterdir() if p.is_file())
    for p in sorted(files, key=lambda p: p.name == OUTCOME_FILE):  # outcome.json last: it marks a complete result
        store.put_file(p, p.name)


def _warm_fold(cfg: FoldConfig, uri: str) -> str:
    """Body of the fold task: skip if already stored, else train and store; returns the result directory URI."""
    # torch and the fold code load in the fold's worker process, not in the trial's driver that submits the task
    import torch

    # (the fold code imports torch: as above)
    from pipelines.execution.folds.fold import checkpoint_uri_of, clear_checkpoints, quiet_worker_logs, run_fold

    if _stored(uri):
        return uri
    cfg = cfg.with_checkpoint_uri(checkpoint_uri_of(_fold_dir(uri)))
    quiet_worker_logs()
    device = "cpu"
    if cfg.use_gpu:
        gpu = int(ray.get_gpu_ids()[0])
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    with tempfile.TemporaryDirectory() as tmp:
        run_fold(
            cfg, rank=0, world_size=1, device=device, out_dir=Path(tmp), node_id=ray.get_runtime_context().get_node_id()
        )
        _upload(Path(tmp), uri)  # raises on failure: a fold's result must be stored
    clear_checkpoints(cfg.checkpoint_uri)  # the result is stored: the mid-fold states are not needed any more
    if cfg.use_gpu:
        torch.cuda.empty_cache()  # the next fold in this process may be given another GPU
    return uri


_REMOTE = None


def warm_fold_ref(cfg: FoldConfig, uri: str, *, cpus: float, gpus: float, retries: int):
    """Submit one warm fold; returns the ObjectRef of its result directory URI."""
    global _REMOTE

    if _REMOTE is None:
        # max_calls=0: the worker process is kept for the next fold (Ray's default for GPU tasks is a fresh one).
        _REMOTE = ray.remote(max_calls=0)(_warm_fold)
    # "DEFAULT": a fold is not a child of the trial's tiny placement group (Tune's trial bundle is the driver resource).
    options: dict[str, Any] = {
        "num_cpus": cpus,
        "max_retries": retries,
        "retry_exceptions": False,
        "scheduling_strategy": "DEFAULT",
        "name": f"fold:{cfg.label}:{cfg.fold.index}",
    }
    if gpus:
        options["num_gpus"] = gpus
        options["runtime_env"] = {"env_vars": {NOSET_CUDA: "1"}}
    return _REMOTE.options(**options).remote(cfg, uri)
