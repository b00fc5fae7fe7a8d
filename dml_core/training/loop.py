"""Training of one cross-validation fold, in one process or under ``torch.distributed``.

What MLRC does per fold (docs/protocol.md §Training a fold, §Schedule, §Optimisers) and how it maps onto
:func:`train_fold`:

* three RMSprop optimisers — trunk and embedder (lr 1e-6, weight_decay 1e-4, momentum 0.9) and,
  if the loss owns parameters (proxies, class weights, β), a loss optimiser whose lr is the
  searched ``loss_lr`` (log-uniform [1e-6, 1]);
* batches of ``classes_per_batch × m`` from the m-per-class sampler; an "epoch" is
  ``iters_per_epoch`` (100) iterations, not a pass over the data;
* validation MAP@R (val compared to itself) at epoch 0 (untrained, ``check_untrained_accuracy``)
  and every ``eval_every`` epochs; the best epoch is the first with the highest MAP@R, epoch 0
  included; training stops when ``epoch − best_epoch > patience`` or at ``max_epochs``;
* the best checkpoint is kept (here: CPU copies of the model's and the loss's state dicts).

Fixed-budget mode (``val_set=None``): no validation at all — no epoch-0 evaluation, no early
stopping; training runs ``max_epochs × iters_per_epoch`` iterations and ``best_state`` is the final
state.  ``history`` then holds one record every ``eval_every`` epochs with the mean train loss and
empty ``metrics`` (a loss curve for ``on_eval``), e.g. to train on all trainval classes for the
epoch count the folds chose (MLRC's "concatenated" models are the fold models themselves; this is for
researchers who want one model).

Labels: the loss sees train labels remapped to ``0 … C−1`` in sorted class order (MLRC's
``set_min_label_to_zero``, made contiguous because a fold's train classes can wrap around the
trainval range), so build the loss with ``num_classes = len(np.unique(train_set.labels))``.

Distributed data parallel (detected with ``dist.is_initialized()``; gloo on CPU, NCCL on GPU):

* each rank loads its slice of the global batch (:class:`~dml_core.training.samplers.MPerClassBatchSampler`
  with ``num_replicas``/``rank``); embeddings are all-gathered *with gradient* and labels gathered,
  so every rank computes the same loss ``L`` on the global batch — the loss never knows about DDP;
* gradient scaling: the gather's backward sums the upstream gradient over ranks, so rank ``r``'s
  embedding gradient is ``W·∂L/∂z_r``; DistributedDataParallel averages parameter gradients over
  the ``W`` ranks, giving ``(1/W)·Σ_r W·(∂z_r/∂θ)ᵀ ∂L/∂z_r = ∂L/∂θ`` — exactly the single-process
  gradient.  Loss parameters are used directly by every rank's identical loss, so each rank already
  holds ``∂L/∂p``; they are all-reduce-*averaged* (keeps the ranks bit-identical);
* validation: each rank embeds a contiguous shard of the val set, shards are gathered (uneven
  sizes padded), rank 0 computes the metrics and broadcasts them, so all ranks take the same
  early-stopping decision.  ``on_eval`` runs on rank 0 only.

The divergence check (non-finite loss → ``status="diverged"``, no exception) reads the loss value
once per iteration (under DDP with an AND over ranks), so all ranks stop together.

Checkpoint and resume (``on_checkpoint`` / ``resume_state``): evaluations fall on epoch boundaries, where the
sampler's position is fully given by the epoch (it reseeds from ``(seed, epoch)``) and the running train-loss mean
has just been reset, so the state right after an evaluation is small and complete: weights, optimiser, fp16
loss-scaler and lr-schedule state, every RNG stream (:func:`dml_core.training.checkpoint.rng_state`, per rank),
best-so-far weights, metrics and epoch, the history and the iteration reached.  A fold resumed from it continues exactly
as the uninterrupted fold would have — bit for bit on a deterministic device (``tests/test_train_resume.py``).  The
state is built only at evaluations and only when ``on_checkpoint`` is given; the per-iteration loop is unchanged.  The
loop itself is ``_FoldLoop``: :func:`train_fold` drives its named steps (setup, one epoch, evaluation, checkpoint,
result).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dml_core.decoded import DecodedBatches, decode_fold
from dml_core.distributed import broadcast_buffers_, broadcast_object, get_rank
from dml_core.evaluation.embedding import check_dataset, embed, embed_gathered, embed_images, labels_of, resolve_device
from dml_core.loader_workers import init_loader_worker

# MLRC's loss-parameter optimiser: RMSprop with weight decay 1e-4 (``metric_loss_optimizer``); the registry's default
# ``loss_weight_decay`` is the same constant.  Importable from here as before.
from dml_core.protocol import MLRC_LOSS_WEIGHT_DECAY
from dml_core.training.checkpoint import STATE_FORMAT, rng_state, set_rng_state
from dml_core.training.config import TrainConfig
from dml_core.training.numerics import resolve as numerics_of
from dml_core.training.samplers import MPerClassBatchSampler
from dml_core.training.step import Precision, Ranks, lr_scheduler

__all__ = ["TrainConfig", "FoldResult", "train_fold", "embed", "embed_images"]


@dataclass
class FoldResult:
    """Outcome of :func:`train_fold`.

    ``history``: one record per evaluation — ``epoch``, ``iteration``, ``metrics`` (val),
    ``train_loss`` (mean loss over the iterations since the previous evaluation; ``None`` at
    epoch 0), ``seconds`` (since the start of the fold), ``eval_seconds``, ``is_best``,
    ``best_epoch``.  ``best_state`` = ``{"model": state_dict, "loss": state_dict}`` on CPU at
    the best evaluation.  On divergence, ``reason`` names the iteration and the best-so-far
    fields describe the evaluations before it.
    """

    status: str
    reason: str
    best_metrics: dict[str, float]
    best_epoch: int
    history: list[dict[str, Any]]
    best_state: dict[str, dict[str, torch.Tensor]]
    train_seconds: float
    iterations: int = 0
    epochs: int = 0
    stopped_early: bool = False
    #: the numerics the fold trained with, ``cpu_amp`` / ``channels_last`` "auto" resolved on its device
    #: (:func:`dml_core.training.numerics.resolve_numerics`): "bf16+channels_last", "fp32+channels_last", "fp32",
    #: "cuda-amp-fp16"
    numerics: str = ""


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU (an optimiser's state_dict references its live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


#: TrainConfig fields that may differ between a checkpoint and its resumption (they do not change the result).
#: (``max_epochs`` only without a cosine schedule, whose length it is).
_RESUME_FREE_FIELDS = {"device", "num_workers", "eval_batch_size", "max_epochs", "patience"}


def _check_resume_state(state: dict[str, Any], config: TrainConfig, world: int) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"resume_state is not a train_fold state of format {STATE_FORMAT}")
    if state["world_size"] != world:
        raise ValueError(f"resume_state was written by {state['world_size']} ranks, this run has {world}")
    mine = dataclasses.asdict(config)
    # A field the state does not name was added since it was written: it trained with that field's default.
    written = {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, **state["config"]}
    free = _RESUME_FREE_FIELDS - ({"max_epochs"} if config.lr_schedule == "cosine" else set())
    diff = sorted(k for k, v in written.items() if k not in free and mine.get(k) != v)
    if diff:
        raise ValueError(
            "resume_state was written with another TrainConfig: "
            + ", ".join(f"{k}={written[k]!r} (now {mine.get(k)!r})" for k in diff)
        )


def loss_weight_decay_for(loss: nn.Module, config: TrainConfig) -> float:
    """The loss optimiser's weight decay: the config's, else the loss's registry value, else MLRC's 1e-4."""
    if config.loss_weight_decay is not None:
        return float(config.loss_weight_decay)
    if isinstance(getattr(loss, "registry_name", None), str):  # built by build_loss: the registry is loaded
        # Not a module-level import: importing the registry imports the whole loss zoo (pytorch-metric-learning;
        # seconds), which a caller training its own loss module never needs.  There is no import cycle
        # (the shared constants live in dml_core.protocol).
        from dml_core.losses import registered_info

        info = registered_info(loss)  # never None for a module with a registry name
        if info is not None:
            return float(info.loss_weight_decay)
    return MLRC_LOSS_WEIGHT_DECAY  # a plain module: no need to import the loss zoo (seconds) to learn that


def _optimizer(model: nn.Module, loss: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """MLRC's three optimisers — trunk, embedder (= every other model parameter), loss
    (docs/protocol.md §Optimisers) — as
    the parameter groups (``group["name"]``) of one optimiser: the same per-parameter update, one call per step."""
    trunk = getattr(model, "trunk", None)
    if not isinstance(trunk, nn.Module):
        raise ValueError(
            f"model ({type(model).__name__}) must have a .trunk submodule: trunk and embedder get separate optimisers"
        )
    trunk_ids = {id(p) for p in trunk.parameters()}
    trunk_params = [p for p in trunk.parameters() if p.requires_grad]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in trunk_ids]
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    groups = [
        {"name": name, "params": params, "lr": lr, "weight_decay": wd}
        for name, params, lr, wd in (
            ("trunk", trunk_params, config.trunk_lr, config.weight_decay),
            ("embedder", rest, config.embedder_lr, config.weight_decay),
            ("loss", loss_params, config.loss_lr, loss_weight_decay_for(loss, config)),
        )
        if params
    ]
    if not groups:
        raise ValueError("nothing to train: neither the model nor the loss has parameters with requires_grad")
    if config.optimizer == "rmsprop":
        return torch.optim.RMSprop(groups, momentum=config.momentum)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=config.momentum)
    return torch.optim.Adam(groups)  # adam ignores momentum


class NonFiniteEmbeddings(ValueError):
    """The model's validation embeddings hold NaN or inf: the fold ends ``diverged`` (its metrics would be chance)."""


def _evaluate(
    model: nn.Module,
    val_set,
    config: TrainConfig,
    device: torch.device,
    memory_format: torch.memory_format = torch.preserve_format,
) -> dict[str, float]:
    """Val metrics (val compared to itself), computed on rank 0 and broadcast to every rank."""
    broadcast_buffers_(model)  # BN running stats may differ per rank if BN is not frozen
    # Embeddings stay on the device: retrieval_metrics searches CUDA tensors there (dml_core.evaluation.knn.self_knn).
    emb = embed_gathered(model, val_set, config.eval_batch_size, device, config.num_workers, memory_format)
    labels = labels_of(val_set, "val_set")
    outcome: tuple[str, Any] = ("ok", None)
    if get_rank() == 0:
        bad = int((~torch.isfinite(emb)).any(dim=1).sum())
        if bad:
            # NaN/inf features (an overflowing pooling, a broken trunk) rank at random: every metric at chance level
            outcome = ("nonfinite", f"non-finite validation embeddings ({bad} of {len(emb)} rows)")
        else:
            try:
                from dml_core.evaluation.metrics import retrieval_metrics  # faiss loads with the first evaluation only

                outcome = ("ok", {k: float(v) for k, v in retrieval_metrics(emb, labels).items()})
            except Exception as e:  # re-raised on every rank below, so no rank waits forever
                outcome = ("error", f"{type(e).__name__}: {e}")
    status, payload = broadcast_object(outcome)
    if status == "nonfinite":
        raise NonFiniteEmbeddings(payload)
    if status == "error":
        raise RuntimeError(f"validation metrics failed: {payload}")
    if config.primary_metric not in payload:
        raise ValueError(f"TrainConfig.primary_metric {config.primary_metric!r} is not a metric; got {sorted(payload)}")
    return payload


# --------------------------------------------------------------------------------------------
# the fold: train_fold drives a _FoldLoop through its named steps
# --------------------------------------------------------------------------------------------
@dataclass
class _Hooks:
    """The caller's callbacks (see :func:`train_fold`); ``on_eval``, ``on_epoch`` and the call of ``on_checkpoint``
    run on rank 0 only."""

    on_eval: Callable[[dict[str, Any]], None] | None
    on_checkpoint: Callable[[dict[str, Any]], None] | None
    on_epoch: Callable[[int, int], None] | None


class _Validation:
    """Model selection on the val set (module docstring): the untrained model is evaluated first, then every
    ``eval_every`` epochs; the best epoch is the first with the highest primary metric; early stop when
    ``epoch − best_epoch > patience``."""

    def __init__(self, val_set) -> None:
        self.val_set = val_set

    def check_inputs(self) -> None:
        check_dataset(self.val_set, "val_set", "eval_transform")
        labels_of(self.val_set, "val_set")

    def begin(self, loop: _FoldLoop) -> FoldResult | None:
        if loop.resumed:  # killed after the evaluation that stopped the fold, before it returned?
            return self._early_stop(loop, loop.start_epoch) if loop.start_epoch > 0 else None
        return self._evaluate(loop, 0, " (the untrained model)")  # the reality check's check_untrained_accuracy

    def at_eval_epoch(self, loop: _FoldLoop, epoch: int) -> FoldResult | None:
        stopped = self._evaluate(loop, epoch)
        return stopped if stopped is not None else self._early_stop(loop, epoch)

    def end(self, loop: _FoldLoop) -> None:
        """The best state is the best evaluation's, kept as it happened."""

    def _evaluate(self, loop: _FoldLoop, epoch: int, what: str = "") -> FoldResult | None:
        te = time.perf_counter()
        try:
            metrics = _evaluate(loop.model, self.val_set, loop.config, loop.device, loop.memory_format)
        except NonFiniteEmbeddings as e:
            return loop.result("diverged", f"{e} at epoch {epoch}{what}", epoch)
        best, primary = loop.best, loop.config.primary_metric
        is_best = not loop.history or metrics[primary] > best["metrics"][primary]
        if is_best:
            best.update(metrics=metrics, epoch=epoch, iteration=loop.iteration, state=loop.weights())
        loop.report(
            {
                "epoch": epoch,
                "iteration": loop.iteration,
                "metrics": metrics,
                "train_loss": loop.train_loss(),
                "seconds": time.perf_counter() - loop.t0,
                "eval_seconds": time.perf_counter() - te,
                "is_best": is_best,
                "best_epoch": best["epoch"],
            }
        )
        loop.model.train()
        return None

    @staticmethod
    def _early_stop(loop: _FoldLoop, epoch: int) -> FoldResult | None:
        best_epoch, patience = loop.best["epoch"], loop.config.patience
        if patience is not None and epoch - best_epoch > patience:
            return loop.result("ok", f"early stop at epoch {epoch}: best epoch {best_epoch}", epoch, True)
        return None


class _FixedBudget:
    """Fixed-budget mode (``val_set=None``, module docstring): no validation and no early stop; a train-loss record
    every ``eval_every`` epochs; the final state is the best."""

    def check_inputs(self) -> None:
        """Nothing to check: there is no val set."""

    def begin(self, loop: _FoldLoop) -> FoldResult | None:
        return None

    def at_eval_epoch(self, loop: _FoldLoop, epoch: int) -> FoldResult | None:
        loop.report(
            {
                "epoch": epoch,
                "iteration": loop.iteration,
                "metrics": {},
                "train_loss": loop.train_loss(),
                "seconds": time.perf_counter() - loop.t0,
                "eval_seconds": 0.0,
                "is_best": False,
                "best_epoch": 0,
            }
        )
        return None

    def end(self, loop: _FoldLoop) -> None:
        loop.best.update(epoch=loop.config.max_epochs, iteration=loop.iteration, state=loop.weights())


class _FoldLoop:
    """One fold's training state and its steps: :meth:`setup`, :meth:`begin`, :meth:`one_epoch`,
    :meth:`end_of_epoch` (evaluation and :meth:`checkpoint`), :meth:`finish` / :meth:`result`.  Resume is
    :meth:`_resume`, DDP is :class:`~dml_core.training.step.Ranks`, AMP is :class:`~dml_core.training.step.Precision`,
    the fixed budget is :class:`_FixedBudget` (against :class:`_Validation`); nothing else branches on them."""

    def __init__(self, model: nn.Module, loss: nn.Module, train_set, val_set, config: TrainConfig, hooks: _Hooks):
        self.t0 = time.perf_counter()
        self.model, self.loss, self.train_set, self.config, self.hooks = model, loss, train_set, config, hooks
        self.selection: _Validation | _FixedBudget = _FixedBudget() if val_set is None else _Validation(val_set)
        self.ranks = Ranks()
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] = {"metrics": {}, "epoch": 0, "iteration": 0, "state": {}}
        self.iteration = self.start_epoch = self.loss_count = 0
        self.resumed = False

    # ---------------------------------------------------------------------------------------- setup
    def setup(self, resume_state: dict[str, Any] | None) -> None:
        """Everything the first iteration needs, in an order that keeps the RNG streams and the collectives of
        every rank in step: inputs, seeds, optimiser, resume, ranks, loader."""
        self._check_inputs()
        self._decode()
        self._seed()
        self._build_optimizer()
        self._resume(resume_state)
        self._distribute()
        self._build_loader()
        self.model.train()
        self.loss.train()

    def _check_inputs(self) -> None:
        self.device = resolve_device(self.config.device)
        check_dataset(self.train_set, "train_set", "train_transform")
        self.train_labels = labels_of(self.train_set, "train_set")
        self.selection.check_inputs()
        classes = np.unique(self.train_labels)
        n_loss_classes = getattr(self.loss, "num_classes", None)
        if isinstance(n_loss_classes, int) and n_loss_classes < len(classes):
            raise ValueError(
                f"loss was built with num_classes={n_loss_classes} but train_set has {len(classes)} classes "
                "(train labels are remapped to 0..C-1)"
            )
        self.class_table = torch.as_tensor(classes, dtype=torch.long, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

    def _decode(self) -> None:
        """The protocol's datasets decoded once when they fit the bound (dml_core.decoded), else streamed; draws
        nothing from any RNG."""
        val_set = self.selection.val_set if isinstance(self.selection, _Validation) else None
        self.decoded_train, val_set = decode_fold(self.train_set, val_set)
        if isinstance(self.selection, _Validation):
            self.selection.val_set = val_set

    def _seed(self) -> None:
        # Per-rank torch RNG (augmentations, dropout); the batch composition comes from the sampler.
        self.rank_seed = int(np.random.SeedSequence([self.config.seed, self.ranks.rank]).generate_state(1)[0])
        torch.manual_seed(self.rank_seed)
        self.loader_rng = torch.Generator().manual_seed(self.rank_seed)  # draws each epoch's worker base seed

    def _build_optimizer(self) -> None:
        self.model.to(self.device)
        self.loss.to(self.device)
        self.optimizer = _optimizer(self.model, self.loss, self.config)
        total = self.config.max_epochs * self.config.iters_per_epoch
        self.scheduler = lr_scheduler(self.optimizer, self.config.lr_warmup_iters, self.config.lr_schedule, total)
        self.loss_params = [p for p in self.loss.parameters() if p.requires_grad]
        self.numerics = numerics_of(self.config, self.device)
        self.precision = Precision(self.numerics, self.config.amp_dtype, self.device)

    def _resume(self, state: dict[str, Any] | None) -> None:
        """Resume, all of it: every rank at rank 0's iteration, the state checked against this run, then weights,
        optimiser, loss scaler, lr schedule, best-so-far, history and position restored; the RNG streams last."""
        self.ranks.agree_on_resume(-1 if state is None else int(state["iteration"]))
        if state is None:
            return
        _check_resume_state(state, self.config, self.ranks.world)
        self.model.load_state_dict(state["model"])
        self.loss.load_state_dict(state["loss"])
        # torch's Optimizer.load_state_dict keeps the given tensors where they already have the parameter's device
        # and dtype (on the CPU, all of them) and then updates them in place: train a copy, not the caller's state.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.precision.load_state_dict(state.get("scaler"))
        if self.scheduler is not None:  # a state without a schedule was refused above (its config differs)
            self.scheduler.load_state_dict(state["scheduler"])
        self.history = [dict(r) for r in state["history"]]
        b = state["best"]
        self.best = {"metrics": dict(b["metrics"]), "epoch": int(b["epoch"]), "iteration": int(b["iteration"])}
        self.best["state"] = b["state"]
        self.iteration, self.start_epoch = int(state["iteration"]), int(state["epoch"])
        self.t0 -= float(state["seconds"])  # history's seconds continue from the checkpoint's
        self.resumed = True
        # Nothing from here to the first iteration draws from these streams, as the uninterrupted run drew nothing.
        set_rng_state(state["rng"][self.ranks.rank], self.device, self.loader_rng)

    def _distribute(self) -> None:
        if self.numerics.channels_last:  # before DDP wraps it; the parameters stay the same objects (the optimizer's)
            self.model.to(memory_format=torch.channels_last)
        self.net = self.ranks.share(self.model, self.loss, self.device)

    def _build_loader(self) -> None:
        config = self.config
        self.sampler = MPerClassBatchSampler(
            self.train_labels,
            config.m,
            config.classes_per_batch,
            iters_per_epoch=config.iters_per_epoch,
            seed=config.seed,
            num_replicas=self.ranks.world,
            rank=self.ranks.rank,
        )
        self.loader: DataLoader | DecodedBatches
        if self.decoded_train is not None:  # augmented in this process: no worker, no decoding
            self.loader = DecodedBatches(self.decoded_train, self.sampler)
        else:
            self.loader = DataLoader(
                self.train_set,
                batch_sampler=self.sampler,
                num_workers=config.num_workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=False,
                generator=self.loader_rng,
                worker_init_fn=init_loader_worker,
            )
        self.memory_format = torch.channels_last if self.numerics.channels_last else torch.contiguous_format

    # ---------------------------------------------------------------------------------------- training
    def begin(self) -> FoldResult | None:
        """Before the first epoch: the untrained model's evaluation, or the resumed fold's stopping check."""
        return self.selection.begin(self)

    def one_epoch(self, epoch: int) -> FoldResult | None:
        """``iters_per_epoch`` training steps; a non-finite loss or embedding ends the fold ``diverged``."""
        self.sampler.set_epoch(epoch)
        for images, labels in self.loader:
            self.iteration += 1
            value, finite = self._forward(images, labels)
            if not finite:
                what = f"loss {value.item()}" if not torch.isfinite(value) else "embeddings (NaN/inf features)"
                return self.result(
                    "diverged", f"non-finite {what} at iteration {self.iteration} (epoch {epoch})", epoch
                )
            self._step(value)
        return None

    def _forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The batch's loss, and whether it and the batch's embeddings are finite (read once: the one host sync)."""
        images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        labels = torch.searchsorted(self.class_table, labels.to(self.device, non_blocking=True))
        emb = self.precision.forward(self.net, images)
        value = self.ranks.loss_value(self.loss, emb, labels)
        # Finite loss AND finite embeddings: a loss may turn NaN features into a finite value (a masked or clamped
        # term), which would hide a broken model from this check.
        return value, self.ranks.all_true(torch.isfinite(value) & torch.isfinite(emb).all())

    def _step(self, value: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.backward(value)
        self.ranks.average_grads_(self.loss_params)
        self.precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss_sum += value.detach()
        self.loss_count += 1

    def end_of_epoch(self, epoch: int) -> FoldResult | None:
        """Every ``eval_every`` epochs an evaluation (or the fixed budget's train-loss record), else ``on_epoch``."""
        if epoch % self.config.eval_every == 0:
            return self.selection.at_eval_epoch(self, epoch)
        if self.hooks.on_epoch is not None and self.ranks.rank == 0:
            self.hooks.on_epoch(epoch, self.iteration)
        return None

    # ---------------------------------------------------------------------------------------- records
    def train_loss(self) -> float | None:
        return float(self.loss_sum.item() / self.loss_count) if self.loss_count else None

    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"model": _cpu_state(self.model), "loss": _cpu_state(self.loss)}

    def report(self, record: dict[str, Any]) -> None:
        """One history record: the train-loss mean restarts, then ``on_eval`` and the checkpoint."""
        self.history.append(record)
        self.loss_sum.zero_()
        self.loss_count = 0
        if self.hooks.on_eval is not None and self.ranks.rank == 0:
            self.hooks.on_eval(record)
        if self.hooks.on_checkpoint is not None:
            self.checkpoint(record["epoch"])

    def checkpoint(self, epoch: int) -> None:
        # Under DDP every rank's RNG streams go into rank 0's state (one collective, at evaluations only).
        rngs = self.ranks.gather(rng_state(self.device, self.loader_rng))
        if self.ranks.rank == 0 and self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(self.checkpoint_state(epoch, rngs))

    def checkpoint_state(self, epoch: int, rngs: list[Any]) -> dict[str, Any]:
        """The full training state right after an evaluation (keys: :func:`train_fold`'s docstring)."""
        best = self.best
        return {
            "format": STATE_FORMAT,
            "epoch": epoch,
            "iteration": self.iteration,
            "world_size": self.ranks.world,
            "config": dataclasses.asdict(self.config),
            "seconds": time.perf_counter() - self.t0,
            "model": _cpu_state(self.model),
            "loss": _cpu_state(self.loss),
            "optimizer": _cpu_copy(self.optimizer.state_dict()),
            "scaler": self.precision.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rngs,
            # the best state's tensors are CPU copies already, never modified in place
            "best": {k: dict(v) if k == "metrics" else v for k, v in best.items()},
            "history": copy.deepcopy(self.history),
        }

    def finish(self) -> FoldResult:
        """The fold ran to ``max_epochs``."""
        self.selection.end(self)
        return self.result("ok", "", self.config.max_epochs)

    def result(self, status: str, reason: str, epochs: int, stopped_early: bool = False) -> FoldResult:
        return FoldResult(
            status=status,
            reason=reason,
            best_metrics=self.best["metrics"],
            best_epoch=self.best["epoch"],
            history=self.history,
            best_state=self.best["state"],
            train_seconds=time.perf_counter() - self.t0,
            iterations=self.iteration,
            epochs=epochs,
            stopped_early=stopped_early,
            numerics=self.numerics.name,
        )


def train_fold(
    model: nn.Module,
    loss: nn.Module,
    train_set,
    val_set,
    config: TrainConfig,
    *,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
    resume_state: dict[str, Any] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
) -> FoldResult:
    """Train ``model`` (and ``loss``'s parameters) on ``train_set``, selecting by val MAP@R.

    ``model`` must have a ``.trunk`` submodule (its other parameters form the embedder group) and
    map an image batch to raw embeddings; ``loss(embeddings, labels)`` returns a scalar.  Both
    datasets yield ``(image_tensor, label)`` and expose ``.labels`` (for a table of images pass
    ``ImageDataset(table, train_transform(size))`` / ``eval_transform``).  Afterwards ``model``/``loss``
    hold the *final* weights; the best ones are in ``FoldResult.best_state``.

    ``val_set=None``: fixed budget (module docstring) — ``max_epochs × iters_per_epoch`` iterations, no
    validation, ``best_state`` = the final state (empty if the loss diverged).

    ``on_checkpoint(state)``: called on rank 0 right after every evaluation (after ``on_eval``; in fixed-budget
    mode after every train-loss record) with the full training state, a dict of tensors (CPU copies) and plain
    values — ``format``, ``epoch``, ``iteration``, ``world_size``, ``config`` (``TrainConfig`` as a dict),
    ``seconds``, ``model``, ``loss``, ``optimizer``, ``scaler`` and ``scheduler`` (or ``None``), ``rng`` (one
    :func:`~dml_core.training.checkpoint.rng_state` per rank), ``best`` (``metrics``, ``epoch``, ``iteration``,
    ``state``), ``history``.  Store it with :func:`dml_core.training.checkpoint.save_state` (``weights_only`` loadable).
    Under DDP pass it (or ``None``) alike on every rank: the ranks' RNG states are gathered for rank 0's call.
    ``resume_state``: such a state (every rank passes the same one): training continues after its evaluation —
    weights, optimiser, RNG streams, best-so-far, patience and history restored — instead of starting at epoch 0.
    The config must match the one it was written with (except device, workers, eval batch, patience and, without a
    cosine schedule, max_epochs); ``history``'s ``seconds`` continue from the state's.
    ``on_epoch(epoch, iteration)``: called on rank 0 at the end of every epoch that has no evaluation (those have
    ``on_eval``/``on_checkpoint``) — a cheap progress mark, e.g. to count the iterations a killed fold trained past
    its last checkpoint.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    loop = _FoldLoop(model, loss, train_set, val_set, config, _Hooks(on_eval, on_checkpoint, on_epoch))
    loop.setup(resume_state)
    stopped = loop.begin()
    epoch = loop.start_epoch
    while stopped is None and epoch < config.max_epochs:
        epoch += 1
        stopped = loop.one_epoch(epoch)
        if stopped is None:
            stopped = loop.end_of_epoch(epoch)
    return stopped if stopped is not None else loop.finish()
