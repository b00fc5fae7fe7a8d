"""``dmlrc sweep CONFIG --plan`` (and ``dmlrc demo --plan``): what a sweep will run and cost, known before it starts.

:func:`plan_sweep` takes a config the CLI has loaded and checked exactly as for a sweep, runs the sweep's own checks
that come before Ray (:func:`~pipelines.execution.preflight.study_plans.preflight`, the tracking store and the storage
answering: all of them only read) and prints, without starting Ray and without creating the sweep's folder, MLflow
experiment or sqlite DB:

* per study (dataset × loss) and in all: trials (search + reproductions), fold runs, training iterations and
  validation evaluations.  Early stopping makes the real count data-dependent, so the numbers are an upper bound at
  the epoch cap ``protocol.max_epochs`` (and a lower bound: every fold stopping at its earliest early stop);
* the studies a finished study run or a results bundle already covers
  (:func:`pipelines.execution.studies.reuse.find_reuse`): listed, and left out of the totals;
* CPU-hours (GPU-hours with ``resources.use_gpu``), counted as the sweep's cost table counts them (fold wall time ×
  reserved CPUs/GPUs), and the wall time on the resources the sweep would use.

The estimate (docs/plan.md) is built from a short calibration on this machine through the real ``dml_core`` code
path (:func:`calibrate_network`: :func:`dml_core.training.loop.train_fold` on fold 0 of the study's dataset, its model,
transforms and training settings, a few iterations and one validation pass, in the CPU seconds of this process — on a
GPU in wall seconds) and from the orchestration's fixed costs per sweep, study, trial and fold, constants measured on
real sweeps (bench/README_plan.md).  Every distinct network (dataset, model, image size, batch) is calibrated once;
every other loss on it adds only the difference of its own forward/backward step, timed on a random batch of
embeddings (:func:`loss_step_seconds`): the zoo's 28 losses on one model cost one network calibration plus 28 loss
timings of a fraction of a second each.

On a local Ray the folds share this machine's real cores (:func:`~pipelines.execution.runtime.resources.usable_cpus`:
the affinity mask capped by the cgroup quota), not the logical CPUs Ray declares: at most ``min(folds wanted, fold
slots of the declared CPUs)`` folds run at once and the others wait in Ray's queue for a slot (:class:`Slots`
rounds), and a fold's compute is stretched by ``max(1, (fold processes × threads + load) / cores)`` times the
measured :data:`CONTENTION` (the sweep's own driver, Tune, Ray and MLflow work beside the folds), where ``load`` is
the other work the machine has (its load average before the plan), :func:`_slots`.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dml_core.data import ImageDataset, eval_transform, train_transform
from dml_core.losses import build_loss
from dml_core.models import build_model
from dml_core.training.loop import TrainConfig, train_fold
from pipelines.config.schema import SweepConfig
from pipelines.config.spaces import LOSS_LR
from pipelines.execution.preflight.study_plans import StudyPlan, preflight, study_train_config
from pipelines.execution.runtime.environment import (
    check_storage_reachable,
    check_tracking_reachable,
    redact_uri,
)
from pipelines.execution.runtime.resources import default_num_cpus, usable_cpus
from pipelines.execution.studies.continuation import check_continuation, check_restart, check_resume
from pipelines.execution.studies.reuse import find_reuse
from pipelines.execution.sweep import max_concurrent_studies

__all__ = [
    "StudyCount",
    "count_study",
    "NetworkTiming",
    "calibrate",
    "calibrate_network",
    "loss_step_seconds",
    "Estimate",
    "estimate",
    "plan_sweep",
    "PlanResult",
    "plan_estimate",
    "Slots",
    "fold_work",
    "SWEEP_S",
    "STUDY_S",
    "TRIAL_S",
    "FOLD_S",
    "TRAIN_FOLD_S",
    "CONTENTION",
]

# The orchestration's fixed costs, measured on real sweeps of this repository on an idle 2-core machine
# (bench/README_plan.md: how, where, when); with other work on the machine they are stretched like the sweep's own
# processes' share of the cores (:meth:`Slots.overhead_stretch`).
#: Per sweep: Ray's start, the user-code check on a worker, the MLflow experiment, the fold processes' start-up
#: (imports, a first fold's lazy initialisation) and Ray's shutdown: the sweep's wall time beyond preflight and its
#: studies.
SWEEP_S = 20.0
#: Per study: its MLflow run, two Tuners, and its end (intervals, CI report, fold models, visuals, registered model).
STUDY_S = 9.5
#: Per trial (search or reproduction): Tune's scheduling of its driver, the searcher's suggestion, its MLflow trial and
#: fold runs, reading its folds' results: its wall time beyond its slowest fold's.
TRIAL_S = 0.9
#: Per fold on the warm executor: the Ray task's dispatch, the fold's build (table fetch, model, loss), its MLflow run
#: and its result directory: a fold's wall time beyond ``train_fold``'s own seconds.
FOLD_S = 0.18
#: Per fold on the Ray Train executor (``workers_per_fold`` > 1): the worker group's start-up (controller, helper
#: actors, workers, each importing Ray and torch), bench/README_overhead.md (median 59.7 s on a 2-core machine).
TRAIN_FOLD_S = 59.7
#: How much more than ``max(1, (fold processes × threads + load) / cores)`` a local sweep's folds are stretched: the
#: sweep's own driver, Tune, Ray and MLflow logging work beside them on the same cores.  Measured as fold
#: ``train_seconds`` against the calibrated compute with 1, 2 and 4 folds in flight on 2 cores
#: (bench/plan_check_bench.py, bench/README_plan.md): ×1.01 and ×0.99 with 1 and 4 folds on an idle machine (×0.76
#: with 2, where the plan's load term counted the previous sweep's fading load), ×0.38–×1.43 on a loaded one: 1.
CONTENTION = 1.0

#: Calibration: validation images embedded (fold 0's val classes, whole classes up to this count) and the wall time
#: aimed at for the timed training iterations of one network.
_VAL_IMAGES = 512
_TIMED_SECONDS = 1.0
_LOSS_REPEATS = 12


# ------------------------------------------------------------------------------------------------------ counting


@dataclass(frozen=True)
class StudyCount:
    """What one study runs: ``trials`` search trials (1 when nothing is searched) and ``reproductions``, each a trial
    of ``folds`` folds; a fold trains ``iters_per_epoch`` iterations per epoch for between ``min_epochs`` (its
    earliest early stop) and ``max_epochs`` (the cap) epochs, with a validation evaluation at epoch 0 and every
    ``eval_every`` epochs."""

    study: str
    trials: int
    reproductions: int
    folds: int
    iters_per_epoch: int
    eval_every: int
    min_epochs: int
    max_epochs: int

    @property
    def fold_runs(self) -> int:
        return (self.trials + self.reproductions) * self.folds

    def iterations(self, capped: bool = True) -> int:
        return self.fold_runs * self.fold_iterations(capped)

    def fold_iterations(self, capped: bool = True) -> int:
        return (self.max_epochs if capped else self.min_epochs) * self.iters_per_epoch

    def fold_evaluations(self, capped: bool = True) -> int:
        return 1 + (self.max_epochs if capped else self.min_epochs) // self.eval_every

    def evaluations(self, capped: bool = True) -> int:
        return self.fold_runs * self.fold_evaluations(capped)

    @property
    def test_passes(self) -> int:
        """Test-class embedding passes: one per reproduction fold (docs/protocol.md §Test evaluation)."""
        return self.reproductions * self.folds


def count_study(cfg: SweepConfig, plan: StudyPlan) -> StudyCount:
    """:class:`StudyCount` of ``plan`` under ``cfg``'s protocol.  The earliest early stop: the first evaluation epoch
    ``e`` with ``e − best_epoch > patience`` when the best epoch stays 0."""
    p = cfg.protocol
    earliest = (p.patience // p.eval_every + 1) * p.eval_every
    return StudyCount(
        study=plan.key,
        trials=p.trials if plan.searched else 1,  # as the sweep: one trial of the fixed values
        reproductions=p.reproductions,
        folds=p.folds,
        iters_per_epoch=p.iters_per_epoch,
        eval_every=p.eval_every,
        min_epochs=min(p.max_epochs, earliest),
        max_epochs=p.max_epochs,
    )


# ------------------------------------------------------------------------------------------------------ calibration


@dataclass
class NetworkTiming:
    """One network's measured seconds on this machine, with the fold's ``threads`` torch threads: a training
    iteration (with the loss it was calibrated with, ``loss``, which takes ``loss_s`` of it), one validation image
    embedded and scored, and a fold's set-up inside ``train_fold`` (optimiser, loader, the first epoch's extra) in a
    process that has trained a fold before; ``per_loss_s``: every loss's own step on this network's batch."""

    iteration_s: float
    val_image_s: float
    setup_s: float
    loss: str
    loss_s: float
    device: str
    calibration_s: float
    per_loss_s: dict[str, float] = field(default_factory=dict)


def _network_key(plan: StudyPlan) -> tuple:
    """What makes two studies' iterations cost the same apart from their loss: dataset, model, image size, batch."""
    model = tuple(sorted((k, str(v)) for k, v in plan.model_kwargs.items()))
    return (plan.dataset.index, model, plan.dataset.spec.image_size, plan.classes_per_batch, plan.m)


def _loss_values(plan: StudyPlan) -> tuple[dict[str, Any], float | None]:
    """The loss's build kwargs and ``loss_lr`` at its defaults (paper defaults, fixed and pinned values)."""
    values = {**plan.loss.search_space.defaults(), **plan.fixed}
    return {k: v for k, v in values.items() if k != LOSS_LR}, values.get(LOSS_LR)


def _train_config(cfg: SweepConfig, plan: StudyPlan, device: str, iters: int) -> TrainConfig:
    """The study's fold TrainConfig (:func:`~pipelines.execution.preflight.study_plans.study_train_config`) at the
    loss's default learning rate, with a calibration's short schedule."""
    _, loss_lr = _loss_values(plan)
    short: dict[str, Any] = dict(
        lr_schedule="constant",  # a schedule's cost is nil; its length would not fit
        lr_warmup_iters=0,
        iters_per_epoch=iters,
        eval_every=2,
        max_epochs=2,
        patience=None,
        seed=cfg.protocol.seed,
        device=device,
    )
    if loss_lr is not None:
        short["loss_lr"] = float(loss_lr)
    return replace(study_train_config(cfg, plan), **short)


def _fold_parts(plan: StudyPlan, device: str):
    """Fold 0's model, loss, train set and a validation set of whole val classes (about ``_VAL_IMAGES`` images), as
    :func:`pipelines.execution.folds.fold.run_fold` builds them."""
    table, fold = plan.dataset.table, plan.dataset.manifest.folds[0]
    model = build_model(**plan.model_kwargs)
    prep, size = model.preprocessing, plan.dataset.spec.image_size
    val_classes, n = [], 0
    for c in fold.val_classes:
        val_classes.append(c)
        n = len(table.subset(val_classes))
        if n >= _VAL_IMAGES and len(val_classes) >= 2:
            break
    train_set = ImageDataset(table.subset(list(fold.train_classes)), train_transform(size, prep))
    val_set = ImageDataset(table.subset(val_classes), eval_transform(size, prep))
    params, _ = _loss_values(plan)
    loss = build_loss(
        plan.loss.name, num_classes=len(fold.train_classes), embedding_dim=plan.model_kwargs["embedding_dim"], **params
    )
    return model, loss, train_set, val_set


def _clock(device: str):
    """What a calibration times: this process's CPU seconds on a CPU (what a fold's compute costs, whatever else
    shares the cores meanwhile: the sharing is the estimate's business), wall seconds on a GPU."""
    return time.perf_counter if device.startswith("cuda") else time.process_time


def calibrate_network(cfg: SweepConfig, plan: StudyPlan, device: str) -> NetworkTiming:
    """Time ``plan``'s network with :func:`dml_core.training.loop.train_fold` on fold 0: a validated run of 2 epochs of
    2 iterations (set-up, the untrained model's evaluation, a warm-up epoch, a timed epoch, an evaluation), then a
    fixed-budget run of 2 epochs whose second (after a warm-up epoch) lasts about ``_TIMED_SECONDS``."""
    t0, clock = time.perf_counter(), _clock(device)
    model, loss, train_set, val_set = _fold_parts(plan, device)
    marks: dict[str, tuple[float, float]] = {}  # (wall, clock) at each epoch's end
    records: list[dict[str, Any]] = []

    def on_eval(record: dict[str, Any]) -> None:
        records.append(record)
        marks[f"eval{record['epoch']}"] = (time.perf_counter(), clock())

    def on_epoch(epoch: int, iteration: int) -> None:
        marks[f"epoch{epoch}"] = (time.perf_counter(), clock())

    train_fold(model, loss, train_set, val_set, _train_config(cfg, plan, device, 2), on_eval=on_eval, on_epoch=on_epoch)
    wall, spent = (marks["eval2"][i] - marks["epoch1"][i] for i in (0, 1))
    share = records[-1]["eval_seconds"] / max(wall, 1e-9)  # of the timed epoch, the evaluation's part
    rough = max(1e-4, (wall - records[-1]["eval_seconds"]) / 2)
    iters = max(3, min(500, round(_TIMED_SECONDS / rough)))
    # The second run is a fold in a process that has run one (a warm worker's): its set-up and first epoch's extra
    # are what every fold pays; a process's first fold (imports, lazy initialisation) is in SWEEP_S.
    model, loss, train_set, _ = _fold_parts(plan, device)  # fresh weights: the timed run starts as a fold does
    fixed: list[float] = []
    c1 = clock()
    train_fold(
        model,
        loss,
        train_set,
        None,
        _train_config(cfg, plan, device, iters),
        on_eval=lambda r: fixed.append(clock()),
        on_epoch=lambda e, i: fixed.append(clock()),
    )
    iteration_s = (fixed[1] - fixed[0]) / iters
    loss_s = loss_step_seconds(plan, device)
    return NetworkTiming(
        iteration_s=iteration_s,
        val_image_s=spent * share / len(val_set),
        setup_s=max(0.0, fixed[0] - c1 - iters * iteration_s),
        loss=plan.loss.name,
        loss_s=loss_s,
        device=device,
        calibration_s=time.perf_counter() - t0,
        per_loss_s={plan.loss.name: loss_s},
    )


def loss_step_seconds(plan: StudyPlan, device: str) -> float:
    """One forward and backward pass of ``plan``'s loss on a random batch of embeddings of the study's shape
    (``classes_per_batch × m``, ``m`` per class), median of ``_LOSS_REPEATS`` after two untimed ones."""
    params, _ = _loss_values(plan)
    fold = plan.dataset.manifest.folds[0]
    dim = plan.model_kwargs["embedding_dim"]
    loss = build_loss(plan.loss.name, num_classes=len(fold.train_classes), embedding_dim=dim, **params).to(device)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(plan.classes_per_batch * plan.m, dim, generator=g).to(device).requires_grad_()
    labels = torch.arange(plan.classes_per_batch).repeat_interleave(plan.m).to(device)
    times, clock = [], _clock(device)
    for i in range(_LOSS_REPEATS + 2):
        t = clock()
        loss(emb, labels).backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            times.append(clock() - t)
        emb.grad = None
    return statistics.median(times)


def calibrate(cfg: SweepConfig, plans: list[StudyPlan], device: str) -> dict[str, NetworkTiming]:
    """Study key → the timing of its network, each distinct network calibrated once (with the first of its studies'
    losses) and every other loss on it timed on its own (:func:`loss_step_seconds`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))  # a fold's threads (FoldConfig.threads)
    try:
        networks: dict[tuple, NetworkTiming] = {}
        out = {}
        for plan in plans:
            key = _network_key(plan)
            if key not in networks:
                networks[key] = calibrate_network(cfg, plan, device)
            timing = networks[key]
            if plan.loss.name not in timing.per_loss_s:
                t = time.perf_counter()
                timing.per_loss_s[plan.loss.name] = loss_step_seconds(plan, device)
                timing.calibration_s += time.perf_counter() - t
            out[plan.key] = timing
        return out
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------------ the estimate


@dataclass
class Slots:
    """The resources the sweep would use: ``studies`` at once, at most ``fold_slots`` folds in flight (0: no limit, a
    cluster assumed to hold them all), ``processes`` fold worker processes in flight at full demand, sharing
    ``cores`` real cores (GPUs) — 0: nothing shared — with ``load`` runnable processes of other work; ``contention``
    is the stretch of a fold's compute at full demand (1 = each fold worker has what it reserved)."""

    studies: int
    processes: int
    contention: float
    where: str
    load: float = 0.0
    fold_slots: int = 0
    cores: float = 0.0
    workers: int = 1
    threads: int = 1
    per_worker: float = 1.0
    factor: float = 1.0

    def rounds(self, demand: int) -> list[int]:
        """Folds in flight in each round of ``demand`` equal folds wanted at once: full rounds of ``fold_slots`` while
        the rest waits in Ray's queue, then the remainder."""
        if demand <= 0:
            return []
        if not self.fold_slots or demand <= self.fold_slots:
            return [demand]
        full, rest = divmod(demand, self.fold_slots)
        return [self.fold_slots] * full + ([rest] if rest else [])

    def stretch(self, folds: int) -> float:
        """How much longer a fold's compute takes with ``folds`` folds in flight than with its reserved resources
        to itself: ``max(1, (fold processes × threads + load) / cores)`` (GPUs: processes × gpus_per_worker / GPUs)
        times the measured contention :data:`CONTENTION`; 1 where nothing is shared (a cluster)."""
        if not self.cores:
            return 1.0
        demand = folds * self.workers * self.threads + self.load
        return max(1.0, demand / self.cores) * self.factor

    def overhead_stretch(self) -> float:
        """How much longer the orchestration's fixed costs (:data:`SWEEP_S`, :data:`STUDY_S`, :data:`TRIAL_S`, a
        fold's start) take than on an idle machine, where they were measured: the sweep's driver and trial drivers
        are one more process beside ``load`` runnable ones, ``max(1, (1 + load) / cores)``; 1 where nothing is
        shared."""
        if not self.cores:
            return 1.0
        return max(1.0, (1.0 + self.load) / self.cores)

    def fold_seconds(self, work: float, folds: int) -> float:
        """Wall seconds of a fold's compute of ``work`` seconds (CPU seconds on a CPU: spread over its workers and
        their threads; wall seconds on a GPU: over its workers) with ``folds`` folds in flight."""
        return self.stretch(folds) * work / (self.workers * self.threads)


def _slots(cfg: SweepConfig, address: str | None, n_studies: int, load: float = 0.0) -> Slots:
    """As the sweep decides them: a local Ray with ``num_cpus`` logical CPUs (default the sweep's) on this machine's
    real cores (:func:`~pipelines.execution.runtime.resources.usable_cpus`; GPUs), ``max_concurrent_studies`` studies;
    with ``address`` the cluster is assumed to hold the config's concurrency (every fold worker gets its reserved CPUs /
    GPUs).  ``load``: runnable processes this machine has besides the sweep (its load average before the plan),
    which share the cores with a local sweep's folds."""
    r = cfg.resources
    w = r.workers_per_fold
    threads = max(1, int(r.cpus_per_worker))
    per_worker = r.gpus_per_worker if r.use_gpu else r.cpus_per_worker
    if address:
        studies = max_concurrent_studies(cfg, address, {}, n_studies)
        processes = studies * r.max_concurrent_trials * cfg.protocol.folds * w
        where = f"Ray cluster at {address}, assumed to hold all {processes} fold workers"
        return Slots(
            studies, processes, 1.0, where, workers=w, threads=1 if r.use_gpu else threads, per_worker=per_worker
        )
    num_cpus = r.num_cpus or default_num_cpus(cfg)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    studies = max_concurrent_studies(cfg, None, {"CPU": num_cpus, "GPU": gpus}, n_studies)
    demand = studies * r.max_concurrent_trials * cfg.protocol.folds
    fold_slots = max(1, math.floor(num_cpus / (w * r.cpus_per_worker) + 1e-9))  # what Ray's logical CPUs place
    if r.use_gpu:
        fold_slots = max(1, min(fold_slots, math.floor(gpus / (w * r.gpus_per_worker) + 1e-9)))
        slots = Slots(studies, 0, 1.0, "", 0.0, fold_slots, max(gpus, 1) / r.gpus_per_worker, w, 1, per_worker)
        what = f"{gpus} GPUs"
    else:
        cores = usable_cpus()  # real cores: a declared logical CPU beyond them is a time slice, not a core
        slots = Slots(studies, 0, 1.0, "", load, fold_slots, cores, w, threads, per_worker, CONTENTION)
        what = f"{cores} usable cores"
    in_flight = slots.rounds(demand)[0]
    where = f"local Ray: {num_cpus} logical CPUs on this machine's {what}"
    return replace(slots, processes=in_flight * w, contention=slots.stretch(in_flight), where=where)


@dataclass
class Estimate:
    """A sweep's estimated cost: device-hours as the cost table counts them and wall time, at the epoch cap and with
    every fold at its earliest early stop."""

    device_hours: float
    device_hours_min: float
    wall_s: float
    wall_min_s: float
    slots: Slots
    per_study_hours: dict[str, float]


def _val_images(plan: StudyPlan) -> float:
    labels = np.asarray(plan.dataset.table.labels)
    return float(np.mean([np.isin(labels, list(f.val_classes)).sum() for f in plan.dataset.manifest.folds]))


def fold_work(plan: StudyPlan, count: StudyCount, timing: NetworkTiming, capped: bool = True) -> tuple[float, float]:
    """``(search fold, test pass)``: a fold's calibrated compute in ``train_fold`` (set-up, iterations with the
    study's own loss, validation evaluations) and a reproduction fold's extra test-class embedding pass, in the
    calibration's seconds (CPU seconds on a CPU)."""
    iteration = max(0.0, timing.iteration_s + timing.per_loss_s[plan.loss.name] - timing.loss_s)
    work = (
        timing.setup_s
        + count.fold_iterations(capped) * iteration
        + count.fold_evaluations(capped) * _val_images(plan) * timing.val_image_s
    )
    test = len(plan.dataset.table.subset(list(plan.dataset.manifest.test_classes))) * timing.val_image_s
    return work, test


def _waves(trials: int, per_wave: int) -> list[int]:
    """Trials in each wave of ``trials`` run ``per_wave`` at a time."""
    full, rest = divmod(trials, per_wave)
    return [per_wave] * full + ([rest] if rest else [])


def _study_seconds(cfg, plan, count, timing, slots, capped) -> tuple[float, float]:
    """``(wall, device-seconds)`` of one study running with its own trial concurrency on ``slots``: its trial waves
    (search, then reproductions), each wave's folds — with the other studies' at once — in rounds of the fold slots,
    each round as long as a fold with that many folds in flight."""
    r = cfg.resources
    work, test = fold_work(plan, count, timing, capped)
    fixed = slots.overhead_stretch()
    overhead = fixed * (FOLD_S if r.workers_per_fold == 1 and r.fold_executor != "train" else TRAIN_FOLD_S)
    wall = device = 0.0
    for trials, fold_work_s in ((count.trials, work), (count.reproductions, work + test)):
        for k in _waves(trials, r.max_concurrent_trials):
            demand = slots.studies * k * count.folds  # folds wanted at once: this wave's and the other studies'
            rounds = slots.rounds(demand)
            fold_walls = [overhead + slots.fold_seconds(fold_work_s, n) for n in rounds]
            wall += fixed * TRIAL_S + sum(fold_walls)
            # the cost table's fold wall × reserved units, this study's share of the wave's folds
            share = k * count.folds / demand
            device += share * sum(n * slots.workers * slots.per_worker * f for n, f in zip(rounds, fold_walls))
    return fixed * STUDY_S + wall, device


def estimate(cfg, plans, counts, timings, address, fixed_s: float = 0.0, load: float = 0.0) -> Estimate:
    """The sweep's wall time: ``fixed_s`` (what already ran here, e.g. preflight) + :data:`SWEEP_S` (stretched by the
    load, :meth:`Slots.overhead_stretch`) + the
    untrained reference passes (one per dataset and network, on the driver) + the studies, ``slots.studies`` at a
    time (the longest study, or their sum shared out, whichever is longer)."""
    slots = _slots(cfg, address, len(plans), load)
    untrained = {}
    for plan in plans:
        n_test = len(plan.dataset.table.subset(list(plan.dataset.manifest.test_classes)))
        untrained[_network_key(plan)] = n_test * timings[plan.key].val_image_s
    out = {}
    for capped in (True, False):
        studies = [
            _study_seconds(cfg, p, counts[p.key], timings[p.key], slots, capped) for p in plans if p.key in counts
        ]
        walls = [s[0] for s in studies] or [0.0]
        sweep_s = slots.overhead_stretch() * SWEEP_S
        wall = fixed_s + sweep_s + sum(untrained.values()) + max(max(walls), sum(walls) / slots.studies)
        out[capped] = (wall, sum(s[1] for s in studies) / 3600, [s[1] / 3600 for s in studies])
    keys = [p.key for p in plans if p.key in counts]
    return Estimate(
        device_hours=out[True][1],
        device_hours_min=out[False][1],
        wall_s=out[True][0],
        wall_min_s=out[False][0],
        slots=slots,
        per_study_hours=dict(zip(keys, out[True][2])),
    )


# ------------------------------------------------------------------------------------------------------ the report


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _print_counts(counts: dict[str, StudyCount], hours: dict[str, float], unit: str, out) -> None:
    print(
        f"  {'study':34s} {'trials':>6s} {'reps':>5s} {'folds':>6s} {'iterations ≤':>13s} {'evaluations ≤':>14s}"
        f" {unit + '-h':>7s}",
        file=out,
    )
    for key, c in counts.items():
        print(
            f"  {key:34s} {c.trials:6d} {c.reproductions:5d} {c.fold_runs:6d} {c.iterations():13,d} "
            f"{c.evaluations():14,d} {hours[key]:7.2f}",
            file=out,
        )


def _print_totals(counts: dict[str, StudyCount], out) -> None:
    cs = list(counts.values())
    search, reps = sum(c.trials for c in cs), sum(c.reproductions for c in cs)
    print(
        f"total: {len(cs)} studies, {search + reps} trials ({search} search + {reps} reproductions), "
        f"{sum(c.fold_runs for c in cs):,} fold runs, ≤ {sum(c.iterations() for c in cs):,} training iterations and "
        f"≤ {sum(c.evaluations() for c in cs):,} validation evaluations at the epoch cap "
        f"(≥ {sum(c.iterations(False) for c in cs):,} and {sum(c.evaluations(False) for c in cs):,} if every fold "
        f"stops at its earliest early stop), {sum(c.test_passes for c in cs):,} test embedding passes",
        file=out,
    )


def _print_calibration(timings: dict[str, NetworkTiming], out) -> None:
    networks = {id(t): t for t in timings.values()}.values()
    for t in networks:
        others = ", ".join(f"{k} {1000 * (v - t.loss_s):+.1f}" for k, v in t.per_loss_s.items() if k != t.loss)
        print(
            f"  network ({t.device}, calibrated with {t.loss}): {1000 * t.iteration_s:.1f} ms/iteration, "
            f"{1000 * t.val_image_s:.2f} ms/validation image, {t.setup_s:.1f} s fold set-up"
            + (f"; other losses, ms/iteration: {others}" if others else "")
            + f" ({t.calibration_s:.1f} s of calibration)",
            file=out,
        )


def _checked_plans(cfg: SweepConfig, resume: bool, rerun: frozenset[str]) -> tuple[list[StudyPlan], dict[str, str]]:
    """The sweep's checks before Ray, in its order (``run_sweep``): the same sweep started again, preflight, the
    tracking store and the storage answering, the finished and bundled studies against the config's fingerprint,
    the stored config, unfinished studies.  All of them only read.  Returns the plans and the covered studies."""
    check_restart(cfg, resume, rerun)
    plans = preflight(cfg)
    check_tracking_reachable(cfg.tracking_uri())
    check_storage_reachable(cfg)
    reuse = find_reuse(cfg, plans, rerun)
    check_resume(cfg)
    check_continuation(cfg, resume, plans, reuse, redact_uri(cfg.tracking_uri()))
    return plans, reuse.covered()


@dataclass
class PlanResult:
    """What :func:`plan_estimate` found: every study's plan, the covered ones (key → source), the counts, timings and
    the estimate of the studies to run, and the seconds the checks took."""

    plans: list[StudyPlan]
    covered: dict[str, str]
    todo: list[StudyPlan]
    counts: dict[str, StudyCount]
    timings: dict[str, NetworkTiming]
    estimate: Estimate
    fixed_s: float
    device: str


def plan_estimate(
    cfg: SweepConfig, *, address: str | None = None, resume: bool = False, rerun=frozenset(), load: float | None = None
) -> PlanResult:
    """The plan's checks, counts, calibration and estimate (:func:`plan_sweep` without the report).  ``load``: the
    machine's other work (default: its 1-minute load average now, before the plan's own work)."""
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if load is None else load
    plans, covered = _checked_plans(cfg, resume, frozenset(rerun))
    todo = [p for p in plans if p.key not in covered]
    counts = {p.key: count_study(cfg, p) for p in todo}
    fixed_s = time.perf_counter() - t0
    device = "cuda" if cfg.resources.use_gpu and torch.cuda.is_available() else "cpu"
    timings = calibrate(cfg, todo, device)
    est = estimate(cfg, todo, counts, timings, address, fixed_s, load)
    return PlanResult(plans, covered, todo, counts, timings, est, fixed_s, device)


def plan_sweep(
    cfg: SweepConfig, *, address: str | None = None, resume: bool = False, rerun=frozenset(), out=None
) -> int:
    """Check ``cfg`` as the sweep does, count what it would run, calibrate, print the plan; start nothing.  Returns
    the CLI's exit status (0).  Raises :class:`~pipelines.config.ConfigError` as the sweep would."""
    out = out or sys.stdout
    res = plan_estimate(cfg, address=address, resume=resume, rerun=rerun)
    unit = "GPU" if cfg.resources.use_gpu else "CPU"
    print(
        f"plan of sweep {cfg.name!r}: {len(res.plans)} studies, {len(res.covered)} already covered; nothing was "
        "started (no Ray, no MLflow experiment, no sweep folder)",
        file=out,
    )
    for key, source in res.covered.items():
        print(f"  covered, left out of the totals: {key} ({source})", file=out)
    if not res.todo:
        print("nothing to run: every study is covered", file=out)
        return 0
    _print_counts(res.counts, res.estimate.per_study_hours, unit, out)
    _print_totals(res.counts, out)
    print(
        f"calibration on this machine ({_cpu_model()}, {usable_cpus()} usable cores; the checks took "
        f"{res.fixed_s:.1f} s):",
        file=out,
    )
    _print_calibration(res.timings, out)
    _print_estimate(cfg, res.estimate, unit, res.device, address, out)
    return 0


def _print_estimate(cfg: SweepConfig, est: Estimate, unit: str, device: str, address: str | None, out) -> None:
    s, r = est.slots, cfg.resources
    print(
        f"estimate: {unit}-hours ≈ {est.device_hours:.2f} at the epoch cap (≥ {est.device_hours_min:.2f} with the "
        f"earliest early stops), counted as the sweep's cost table counts them: fold wall time × reserved "
        f"{unit}s",
        file=out,
    )
    print(
        f"          wall time ≈ {_duration(est.wall_s)} at the epoch cap (≥ {_duration(est.wall_min_s)} with the "
        f"earliest early stops) on {s.where}: ≤ {s.studies} studies at once, {r.max_concurrent_trials} trial(s) × "
        f"{cfg.protocol.folds} folds each, {s.processes} fold workers in flight"
        + (f", each fold's compute stretched ×{s.contention:.2f} by sharing" if s.contention > 1 else ""),
        file=out,
    )
    wanted = s.studies * r.max_concurrent_trials * cfg.protocol.folds
    if s.fold_slots and wanted > s.fold_slots:
        print(
            f"          {wanted} folds wanted at once, {s.fold_slots} placed by Ray's logical CPUs: the others "
            "wait in its queue",
            file=out,
        )
    if s.load >= 0.05:
        print(
            f"          other work on this machine now (1-min load average {s.load:.2f}) is assumed to go on "
            "sharing its cores with the sweep",
            file=out,
        )
    if address:
        print(
            f"          the calibration is of this machine ({device}); the wall time assumes the cluster's "
            "resources equal the config's concurrency and its nodes compute as fast as this one",
            file=out,
        )
    elif r.use_gpu and device == "cpu":
        print("          no GPU here: calibrated on the CPU, so the GPU figures are not meaningful", file=out)
