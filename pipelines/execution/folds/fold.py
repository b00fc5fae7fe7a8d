"""One cross-validation fold: :func:`run_fold`, shared by both ways a fold runs on Ray.

docs/protocol.md §Training a fold: each fold trains an independent model on the fold's train classes, evaluates on its
val classes (compared to self), and keeps the checkpoint with the best val MAP@R (early stopping §1.5).  That is
:func:`dml_core.training.loop.train_fold`; :func:`run_fold` wires it to the sweep:

* rank 0 logs every evaluation to the fold's MLflow run (``val.<metric>``, step = iteration) through an explicit run
  id and prints one progress line per evaluation;
* at the end rank 0 writes the fold's *result directory*: ``outcome.json`` (status, best val metrics, history, time
  span, process id, node id) and — for reproductions — the test-set embeddings of the best model
  (``test_embeddings.npy``/``test_labels.npy``, for the concatenated evaluation) and the model state (``model.pt``).

The two executors (chosen by :func:`pipelines.execution.folds.trial.fold_executor`) only differ in how the process is
obtained and where the result directory goes:

* **warm** (:mod:`pipelines.execution.folds.warm`, single-worker folds): a Ray task on a reused worker process; the
  directory is copied to the sweep's storage;
* **train** (:func:`fold_worker` here, ``workers_per_fold > 1`` or forced): a Ray Train ``TorchTrainer`` job.
  ``torch.distributed`` is initialised by Ray Train (gloo on CPU, NCCL with GPUs); ``train_fold`` detects it, wraps
  the model in DDP and draws its rank's slice of every m-per-class batch from
  :class:`~dml_core.training.samplers.MPerClassBatchSampler`.  We never call ``ray.train.torch.prepare_data_loader``: it
  would replace the m-per-class sampler by a ``DistributedSampler`` (Ray Train's ``prepare_data_loader`` would).  The
  directory is rank 0's Ray Train checkpoint.

Both keep the same resume story: a fold whose result directory exists (it finished before the sweep was killed) is
not trained again.

Mid-fold resume (``mid_fold_resume``, default on): after every evaluation rank 0 stores the full training state
(:mod:`dml_core.training.checkpoint`) under the fold's checkpoint directory ``<fold_storage>/<run name>/ckpt/``
(``state-<iteration>.pt`` + ``latest.json``, written in that order; the latest and the best state are kept).  A fold
started again — Ray's task retry, Ray Train's worker-group restart, or ``dmlrc sweep --resume`` — loads the latest
state and continues from that evaluation, logging to the *same* MLflow run: the run's logged steps are compared with
the checkpoint's history, and only the missing ones are logged (an evaluation logged just before the kill, after the
last checkpoint, is not logged twice when it is trained again).  ``attempts.json`` in the same directory counts the
starts; ``progress.json`` marks the last epoch reached between evaluations, so the iterations trained twice are
known.  A checkpoint that cannot be stored (S3 trouble after botocore's retries) is a warning: training goes on and
the next evaluation tries again.  With ``mid_fold_resume`` off, a restarted fold starts from scratch in a fresh run
tagged ``restarted=true`` (the partial run soft-deleted).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from dml_core.data import ImageDataset, eval_transform, train_transform
from dml_core.distributed import broadcast_object
from dml_core.models import build_model
from dml_core.training.checkpoint import CheckpointDir
from dml_core.training.loop import TrainConfig, embed, train_fold
from dml_core.training.numerics import cpu_model
from pipelines.execution.folds.config import FoldConfig, FoldOutcome, s3_uri
from pipelines.names import FOLD_STARTED_TAG, HEADLINE_METRICS, MODEL_FILE, OUTCOME_FILE, TEST_EMBEDDINGS, TEST_LABELS
from pipelines.tracking.evaluations import evaluation_metrics, finite_metrics, logged_evaluations

if TYPE_CHECKING:
    from pipelines.tracking.runs import Tracker

__all__ = [
    "run_fold",
    "fold_worker",
    "CHECKPOINT_DIR",
    "checkpoint_uri_of",
    "clear_checkpoints",
]

#: A fold's mid-fold checkpoints: ``<fold_storage>/<run name>/ckpt/`` (next to the warm executor's ``result/``).
CHECKPOINT_DIR = "ckpt"
ATTEMPTS_FILE = "attempts.json"
PROGRESS_FILE = "progress.json"


def checkpoint_uri_of(fold_dir: str) -> str:
    """The checkpoint directory of a fold whose run directory is ``fold_dir`` (local path or ``s3://``)."""
    return fold_dir.rstrip("/") + "/" + CHECKPOINT_DIR


def clear_checkpoints(uri: str | None) -> None:
    """Delete a finished fold's checkpoints (its result is stored); trouble is only reported."""
    if not uri:
        return

    try:
        CheckpointDir(uri).clear()
    except Exception as e:  # stale checkpoints cost space, not correctness
        print(f"fold: could not delete the checkpoints in {uri}: {e}", file=sys.stderr)


#: The dataset table of the last fold this process ran, by object-ref id: a reused (warm) worker fetches and
#: deserialises it once per study, not once per fold.
_TABLE_CACHE: dict[str, Any] = {}


def _table(ref) -> Any:
    key = ref.hex()
    if key not in _TABLE_CACHE:
        _TABLE_CACHE.clear()  # one study's table at a time: bounded memory in a long-lived process
        _TABLE_CACHE[key] = ray.get(ref)
    return _TABLE_CACHE[key]


def _rss_peak_mb() -> float:
    """This process's peak resident memory so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quiet_worker_logs() -> None:
    """Ray sets the root logger to INFO in workers (and Train logs every report under root); faiss's loader logs
    each CPU-feature probe.  Progress lines are our prints."""
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("faiss").setLevel(logging.WARNING)


class _Checkpoints:
    """A fold's checkpoint directory as :func:`run_fold` uses it: the resume state, the start count, the progress
    marks, and storing a state at each evaluation without letting storage trouble end the fold.

    ``attempts.json``: ``{"attempts", "resumed_from", "redone_iterations"}`` across the fold's starts;
    ``progress.json``: ``{"attempt", "iteration"}``, the last epoch end reached without an evaluation.  The
    iterations a restart trains twice are those from the state it continues from to the furthest point the killed
    attempt is known to have reached (its last checkpoint, progress mark or logged evaluation; an epoch it had not
    finished is not counted, so at most one evaluation interval per restart).
    """

    def __init__(self, uri: str | None, *, enabled: bool, label: str, rank: int):
        self.uri = uri
        self.enabled = bool(uri) and enabled
        self.label = label
        self.rank = rank
        self.attempt = 1
        self.restarts = 0
        self.resumed_from: list[int] = []
        self.redone_iterations = 0
        self.store: CheckpointDir | None = CheckpointDir(uri) if uri else None
        self.pointer: dict[str, Any] | None = None  # the latest checkpoint's pointer, read by resume_state()

    @property
    def _dir(self) -> CheckpointDir:
        """The checkpoint directory; only asked for where checkpoints are enabled (which needs a URI)."""
        if self.store is None:
            raise RuntimeError(f"{self.label}: the fold has no checkpoint directory")
        return self.store

    def _warn(self, what: str, e: BaseException) -> None:
        print(f"{self.label}: {what} failed ({type(e).__name__}: {e}); training goes on", file=sys.stderr, flush=True)

    def resume_state(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None

        pointer = None
        if self.rank == 0:
            try:
                pointer = self._dir.latest()
            except Exception as e:  # no readable checkpoint: start from scratch
                self._warn("reading the checkpoint pointer", e)
        pointer = broadcast_object(pointer)  # under DDP every rank loads the state rank 0 found
        self.pointer = pointer  # start() needs it too: read once
        return self._dir.load(pointer) if pointer is not None else None

    def start(self, resume_state: dict[str, Any] | None, last_logged: int) -> None:
        """Rank 0: count this start and, for a restart, what it continues from and what it trains again."""
        if self.store is None:
            return
        try:
            meta = self.store.read_json(ATTEMPTS_FILE) or {}
            progress = self.store.read_json(PROGRESS_FILE) or {}
        except Exception as e:
            self._warn("reading the fold's attempt count", e)
            return
        self.attempt = int(meta.get("attempts", 0)) + 1
        self.restarts = self.attempt - 1
        self.resumed_from = list(meta.get("resumed_from", []))
        self.redone_iterations = int(meta.get("redone_iterations", 0))
        if self.restarts:
            start = int(resume_state["iteration"]) if resume_state is not None else 0
            reached = [start, last_logged]
            if self.pointer is not None:
                reached.append(int(self.pointer["iteration"]))
            if int(progress.get("attempt", 0)) == self.attempt - 1:
                reached.append(int(progress.get("iteration", 0)))
            self.resumed_from.append(start)
            self.redone_iterations += max(reached) - start
        try:
            self.store.write_json(
                ATTEMPTS_FILE,
                {
                    "attempts": self.attempt,
                    "resumed_from": self.resumed_from,
                    "redone_iterations": self.redone_iterations,
                },
            )
        except Exception as e:
            self._warn("storing the fold's attempt count", e)

    def save(self, state: dict[str, Any]) -> None:  # train_fold's on_checkpoint (rank 0)
        try:
            self._dir.save(state)
        except Exception as e:  # the next evaluation tries again
            self._warn(f"storing the checkpoint of iteration {state['iteration']} in {self.uri}", e)

    def progress(self, epoch: int, iteration: int) -> None:  # train_fold's on_epoch (rank 0)
        try:
            self._dir.write_json(PROGRESS_FILE, {"attempt": self.attempt, "iteration": iteration})
        except Exception as e:
            self._warn("storing the progress mark", e)


@dataclass
class _FoldParts:
    """What a fold trains and evaluates, built in its own process from the :class:`FoldConfig`."""

    table: Any  # the study's dataset table
    model: Any  # the embedding network
    prep: Any  # the input convention of the trunk's weights
    train_set: ImageDataset
    val_set: ImageDataset
    loss: Any
    config: TrainConfig
    num_classes: int  # train classes: the size of a proxy/classification loss


def _build(cfg: FoldConfig, device: str) -> _FoldParts:
    """Step 1: the dataset table (cached per process), the model, its datasets, the loss and the train config."""
    # the loss zoo (seconds): trial drivers and `dmlrc reeval` import this module without training
    from dml_core.losses import build_loss

    table = _table(cfg.table_ref[0])
    model = build_model(**cfg.model)
    prep = model.preprocessing  # the input convention of the trunk's weights (BGR / 0-255 for BN-Inception, ...)
    train_set = ImageDataset(table.subset(list(cfg.fold.train_classes)), train_transform(cfg.image_size, prep))
    val_set = ImageDataset(table.subset(list(cfg.fold.val_classes)), eval_transform(cfg.image_size, prep))
    num_classes = len(cfg.fold.train_classes)
    loss = build_loss(cfg.loss, num_classes=num_classes, embedding_dim=cfg.model["embedding_dim"], **cfg.loss_params)
    return _FoldParts(table, model, prep, train_set, val_set, loss, replace(cfg.train, device=device), num_classes)


class _FoldLog:
    """Rank 0's side of the fold's MLflow run: its tags, every evaluation logged once, a progress line each."""

    def __init__(self, cfg: FoldConfig):
        self.cfg = cfg
        self.where = f"[{cfg.label}] fold {cfg.fold.index}"
        self.tracker: Tracker | None = None  # open() sets it
        self.run_id = cfg.fold_run_id
        self.logged: set[int] = set()  # iterations the fold run already holds an evaluation for

    def open(self, ckpt: _Checkpoints, resume_state: dict[str, Any] | None, tags: dict[str, Any]) -> None:
        """Step 2 (rank 0): the fold run found (or, restarted without mid-fold resume, replaced), this start counted
        in the checkpoint directory, the run tagged, and the evaluations checkpointed but never logged logged."""
        # MLflow only on rank 0, the rank that logs
        from pipelines.tracking.runs import Tracker

        cfg = self.cfg
        self.tracker = tracker = Tracker.from_uri(cfg.tracking_uri, cfg.experiment_id)
        run = tracker.run(self.run_id)
        if run.data.metrics:
            self.logged = logged_evaluations(tracker, self.run_id)
        last_logged = max(self.logged, default=0)  # how far a killed attempt is known to have got
        if run.data.metrics and not ckpt.enabled:
            # This fold is being run again after its process died (an OOM kill, a lost node; Ray retried the task
            # or restarted the worker group) and mid-fold resume is off: the fold starts from scratch, so it gets a
            # fresh run and the half-logged one is soft-deleted.
            self.run_id, _ = tracker.get_or_create(
                cfg.fold_run_tags,
                parent=cfg.parent_run_id,
                run_name=f"fold {cfg.fold.index}",
                reuse_unfinished=False,
            )
            tracker.set_tags(self.run_id, {**cfg.fold_run_extra_tags, "restarted": "true"})
            self.logged = set()
        ckpt.start(resume_state, last_logged)
        if ckpt.restarts:
            tags.update(resumes=ckpt.restarts, resumed_from=ckpt.resumed_from[-1])
            print(
                f"{self.where}: restart {ckpt.restarts}, continuing from iteration {ckpt.resumed_from[-1]}", flush=True
            )
        tracker.set_tags(self.run_id, tags)
        if resume_state is not None:
            # Evaluations checkpointed but never logged (MLflow trouble, or a fresh run after `dmlrc sweep --resume`).
            for record in resume_state["history"]:
                if record["iteration"] not in self.logged:
                    self.log_record(record)

    @property
    def _tracker(self) -> Tracker:
        if self.tracker is None:
            raise RuntimeError(f"{self.where}: the fold run is not open")
        return self.tracker

    def log_record(self, record: dict[str, Any]) -> None:
        try:
            self._tracker.log_metrics(self.run_id, evaluation_metrics(record), step=record["iteration"])
            self.logged.add(record["iteration"])
        except Exception as e:  # tracking trouble must not kill a training run
            print(f"{self.where}: MLflow logging failed: {e}", file=sys.stderr)

    def on_eval(self, record: dict[str, Any]) -> None:  # rank 0 only (train_fold's contract)
        # An evaluation logged by the killed attempt after its last checkpoint is trained again: log it once.
        if record["iteration"] not in self.logged:
            self.log_record(record)
        m = record["metrics"]
        print(
            f"{self.where} it {record['iteration']:>6} epoch {record['epoch']:>4} "
            f"val MAP@R {m.get('map_at_r', float('nan')):.4f} P@1 {m.get('precision_at_1', float('nan')):.4f}"
            f"{'  (best)' if record['is_best'] else ''}",
            flush=True,
        )

    def started(self, time_start: float) -> None:
        """The fold function's start, as a tag at once (each start overwrites it: no metric history, so
        ``time.start`` is still logged once, with the result): a fold cancelled before its end (a pruned trial's,
        :mod:`pipelines.execution.studies.pruned_runs`) is costed from it."""
        try:
            self._tracker.set_tags(self.run_id, {FOLD_STARTED_TAG: repr(time_start)})
        except Exception as e:  # tracking trouble must not kill a training run
            print(f"{self.where}: MLflow logging failed: {e}", file=sys.stderr)

    def log_restarts(self, ckpt: _Checkpoints) -> None:
        if not ckpt.restarts:
            return
        try:
            self._tracker.log_metrics(
                self.run_id, {"restarts": ckpt.restarts, "redone_iterations": ckpt.redone_iterations}
            )
        except Exception as e:  # the outcome holds them too
            print(f"{self.where}: MLflow logging failed: {e}", file=sys.stderr)


def _run_tags(device: str, node_id: str, prep) -> dict[str, Any]:
    """The fold run's tags of this attempt: where it ran, on what, with which input convention."""
    tags: dict[str, Any] = {"pid": os.getpid(), "node_id": node_id, "device": device, "preprocessing": prep.describe()}
    if device.startswith("cuda"):
        tags["gpu_name"] = torch.cuda.get_device_name(torch.device(device))
    if dist.is_available() and dist.is_initialized():  # a Ray Train fold: gloo on CPU, NCCL on GPUs
        tags["dist_backend"] = str(dist.get_backend())
    return tags


def _cpu_time() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers) so far, user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _outcome(result, ckpt: _Checkpoints, fold: int, times: tuple[float, float, float], **where: Any) -> FoldOutcome:
    """Step 4: the fold's outcome from ``train_fold``'s result (``where``: world_size, node_id, device, cpu_seconds)."""
    time_start, time_train_start, time_end = times
    return FoldOutcome(
        fold=fold,
        status=result.status,
        reason=result.reason,
        best_epoch=result.best_epoch,
        best_metrics=finite_metrics(result.best_metrics),
        iterations=result.iterations,
        epochs=result.epochs,
        stopped_early=result.stopped_early,
        train_seconds=result.train_seconds,
        time_start=time_start,
        time_train_start=time_train_start,
        time_end=time_end,
        world_size=where["world_size"],
        pid=os.getpid(),
        node_id=where["node_id"],
        device=where["device"],
        rss_peak_mb=_rss_peak_mb(),
        restarts=ckpt.restarts,
        resumed_from=ckpt.resumed_from,
        redone_iterations=ckpt.redone_iterations,
        cpu_seconds=where["cpu_seconds"],
        numerics=getattr(result, "numerics", ""),
        cpu_model=cpu_model(),
        history=[
            {
                "epoch": r["epoch"],
                "iteration": r["iteration"],
                "train_loss": r.get("train_loss"),
                "metrics": finite_metrics({k: v for k, v in r["metrics"].items() if k in HEADLINE_METRICS}),
            }
            for r in result.history
        ],
    )


def _evaluate_test(cfg: FoldConfig, parts: _FoldParts, result, outcome: FoldOutcome, rank: int, device: str):
    """Step 5 (reproductions): the best checkpoint's test-set embeddings, every rank embedding a shard (embed's
    contract); rank 0 gets ``(embeddings, labels)`` and the "separated" metrics in ``outcome``, others ``None``."""
    if not (cfg.evaluate_test and result.status == "ok"):
        return None
    # faiss: loaded by the folds that evaluate the test classes only (reproductions), not by every fold process
    from dml_core.evaluation.metrics import retrieval_metrics

    parts.model.load_state_dict(result.best_state["model"])
    test_set = ImageDataset(parts.table.subset(list(cfg.test_classes)), eval_transform(cfg.image_size, parts.prep))
    c = parts.config
    emb, labels = embed(parts.model, test_set, batch_size=c.eval_batch_size, device=device, num_workers=c.num_workers)
    if rank != 0:
        return None
    test_emb, test_labels = emb.numpy().astype(np.float32), labels.numpy()
    # "separated" (docs/protocol.md §Test evaluation): this fold model alone on all test classes, compared to self.
    outcome.test_metrics = finite_metrics(retrieval_metrics(test_emb, test_labels))
    return test_emb, test_labels


def _write_result(out_dir: Path, cfg: FoldConfig, parts: _FoldParts, result, outcome: FoldOutcome, test) -> None:
    """Step 6 (rank 0): the result directory — ``outcome.json``, the test embeddings, the best model."""
    (out_dir / OUTCOME_FILE).write_text(outcome.to_json())
    if test is not None:
        np.save(out_dir / TEST_EMBEDDINGS, test[0])
        np.save(out_dir / TEST_LABELS, test[1])
    if cfg.save_model and result.status == "ok":
        torch.save(
            {
                "model": result.best_state["model"],
                "loss": result.best_state["loss"],
                "model_kwargs": cfg.model,
                "loss_name": cfg.loss,
                "loss_params": cfg.loss_params,
                "num_classes": parts.num_classes,
                "fold": cfg.fold.as_dict(),
            },
            out_dir / MODEL_FILE,
        )


def run_fold(
    cfg: FoldConfig, *, rank: int, world_size: int, device: str, out_dir: Path, node_id: str = ""
) -> dict[str, Any]:
    """Train and evaluate one fold.  Every rank calls it; rank 0 logs to the fold run and writes the result
    directory ``out_dir``.  Returns the small summary every rank reports (status, fold, best val metrics, time span).
    """
    torch.set_num_threads(max(1, int(cfg.threads)))
    torch.manual_seed(cfg.train.seed)
    time_start, cpu_start = time.time(), _cpu_time()
    parts = _build(cfg, device)
    index = cfg.fold.index
    ckpt = _Checkpoints(cfg.checkpoint_uri, enabled=cfg.mid_fold_resume, label=f"[{cfg.label}] fold {index}", rank=rank)
    resume_state = ckpt.resume_state()  # every rank: the state rank 0's pointer names, or None
    log = _FoldLog(cfg)
    if rank == 0:
        log.open(ckpt, resume_state, _run_tags(device, node_id, parts.prep))
        log.started(time_start)
    time_train_start = time.time()
    result = train_fold(
        parts.model,
        parts.loss,
        parts.train_set,
        parts.val_set,
        parts.config,
        on_eval=log.on_eval,
        on_checkpoint=ckpt.save if ckpt.enabled else None,
        resume_state=resume_state,
        on_epoch=ckpt.progress if ckpt.uri else None,
    )
    time_end = time.time()
    times = (time_start, time_train_start, time_end)
    outcome = _outcome(
        result,
        ckpt,
        index,
        times,
        world_size=world_size,
        node_id=node_id,
        device=device,
        cpu_seconds=_cpu_time() - cpu_start,
    )
    test = _evaluate_test(cfg, parts, result, outcome, rank, device)
    if rank == 0:
        log.log_restarts(ckpt)
        _write_result(out_dir, cfg, parts, result, outcome, test)
    return {
        "status": outcome.status,
        "fold": index,
        "train_seconds": outcome.train_seconds,
        "time_start": time_start,
        "time_end": time_end,
        **{f"val_{k}": v for k, v in outcome.best_metrics.items()},
    }


def fold_worker(cfg: FoldConfig) -> None:
    """Ray Train ``train_loop_per_worker`` for one fold: :func:`run_fold` on every rank, rank 0's result directory
    as the run's checkpoint (Ray Train needs the same number of reports from all ranks).

    Resume: if Ray Train restored a checkpoint for this run name (the fold finished before the sweep was killed),
    the worker returns at once; ``TorchTrainer.fit()`` then returns the stored result without retraining.
    """
    quiet_worker_logs()
    ctx = ray.train.get_context()
    if ray.train.get_checkpoint() is not None:
        return
    device = "cpu"
    if cfg.use_gpu:
        device = str(ray.train.torch.get_device())
    rank = ctx.get_world_rank()
    cfg = cfg.with_checkpoint_uri(checkpoint_uri_of(_train_run_dir(ctx)))
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_fold(
            cfg,
            rank=rank,
            world_size=ctx.get_world_size(),
            device=device,
            out_dir=Path(tmp),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        if rank != 0:
            ray.train.report(summary)
        else:
            ray.train.report(summary, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            clear_checkpoints(cfg.checkpoint_uri)  # the result is Train's checkpoint now


def _train_run_dir(ctx) -> str:
    """This Ray Train run's directory ``<storage_path>/<run name>`` as a local path or ``s3://`` URI."""
    storage = ctx.get_storage()
    return s3_uri(storage.storage_filesystem, storage.storage_fs_path.rstrip("/") + "/" + storage.experiment_dir_name)
