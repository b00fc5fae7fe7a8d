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

* each rank loads its slice of the global batch (:class:`~dml_core.samplers.MPerClassBatchSampler`
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
has just been reset, so the state right after an evaluation is small and complete: weights, optimiser (and fp16
loss-scaler) state, every RNG stream (:func:`dml_core.checkpoint.rng_state`, per rank), best-so-far weights, metrics
and epoch, the history and the iteration reached.  A fold resumed from it continues exactly as the uninterrupted
fold would have — bit for bit on a deterministic device (``tests/test_train_resume.py``).  The state is built only
at evaluations and only when ``on_checkpoint`` is given; the per-iteration loop is unchanged.
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from dml_core.checkpoint import STATE_FORMAT, rng_state, set_rng_state
from dml_core.data import decode_image, eval_transform
from dml_core.distributed import (
    all_gather_no_grad,
    all_gather_uneven,
    all_gather_with_grad,
    all_ranks_true,
    all_reduce_mean_,
    broadcast_buffers_,
    broadcast_module_,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
    shard_bounds,
)

# MLRC's loss-parameter optimiser: RMSprop with weight decay 1e-4 (``metric_loss_optimizer``); the registry's default
# ``loss_weight_decay`` is the same constant.  Importable from here as before.
from dml_core.protocol import MLRC_LOSS_WEIGHT_DECAY
from dml_core.samplers import MPerClassBatchSampler

__all__ = ["TrainConfig", "FoldResult", "train_fold", "embed", "embed_images"]

_OPTIMIZERS = ("rmsprop", "sgd", "adam")
_AMP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class TrainConfig:
    """One fold's training settings.  These field defaults are *the* defaults: the sweep's config schema
    (``pipelines/config/schema.py``) reads them from here, so a direct caller and a sweep train alike.

    Where each default comes from (MLRC = the reality check's released code; sections of docs/protocol.md):

    * ``classes_per_batch=8``, ``m=4``: MLRC's batch, ``MPerClassSampler(m=4)``, batch 32 (§Batch).
    * ``iters_per_epoch=100``: MLRC's "epoch" is 100 iterations, not a pass over the data (§Schedule).
    * ``eval_every=2``, ``patience=9``, ``max_epochs=1000``: MLRC's ``config_general/default.yaml``
      (§Schedule): validate every 2 epochs, stop after 5 evaluations without improvement, at most 100k
      iterations.  The paper used these for CUB and overrode them for the larger datasets
      (Cars196: 5 / 14, SOP: 20 / 39, §Schedule); they are the protocol's general default, so they are ours.
    * ``trunk_lr=embedder_lr=1e-6``, ``weight_decay=1e-4``, ``momentum=0.9``, ``optimizer="rmsprop"``:
      MLRC's trunk and embedder optimisers (§Optimisers).
    * ``loss_weight_decay=None``: the loss's own (``loss_info(name).loss_weight_decay``, e.g. 0 for
      ProxyNCA++ and Margin's β), found on losses built by ``build_loss``; 1e-4 (MLRC's
      ``metric_loss_optimizer``, §Optimisers) for any other module.
    * ``loss_lr=1e-4``: the loss optimiser's lr is *searched* in MLRC (log-uniform [1e-6, 1], §Optimisers), so
      the protocol has no default; direct callers should pass the loss's ``paper_defaults["loss_lr"]``
      from ``tune_spaces/<loss>.yaml`` (every learnable loss has one).
    * ``eval_batch_size=128``, ``num_workers=0``, ``seed=0``, ``device="cpu"``, no AMP: ours.
    """

    classes_per_batch: int = 8
    m: int = 4
    iters_per_epoch: int = 100
    max_epochs: int = 1000
    eval_every: int = 2
    #: stop when ``epoch − best_epoch > patience``; ``None`` = never stop early.
    patience: int | None = 9
    trunk_lr: float = 1e-6
    embedder_lr: float = 1e-6
    #: lr of the loss's own parameters (proxies, class weights); searched by the sweep.
    loss_lr: float = 1e-4
    weight_decay: float = 1e-4  # trunk and embedder
    #: ``None`` = the loss's own (registry), else MLRC's 1e-4; see the class docstring.
    loss_weight_decay: float | None = None
    momentum: float = 0.9
    #: "rmsprop" (MLRC), "sgd" or "adam" (adam ignores ``momentum``).
    optimizer: str = "rmsprop"
    eval_batch_size: int = 128
    num_workers: int = 0
    seed: int = 0
    #: "cpu", "cuda", "cuda:<i>" or "auto" (cuda if available).  Under DDP "cuda" means the
    #: current CUDA device (Ray Train sets it per worker).
    device: str = "cpu"
    #: autocast the model forward on CUDA (the loss runs in fp32); ignored on CPU.
    amp: bool = False
    amp_dtype: str = "bfloat16"
    #: autocast the model's training forward to bfloat16 on CPU (the loss and evaluation stay fp32).  Off by default:
    #: not exact, and only faster on CPUs with native bf16 arithmetic (AVX512-BF16, AMX): bench/cpu_speed_bench.py.
    cpu_amp: bool = False
    #: the model and its training batches in channels-last (NHWC) memory format, which oneDNN's convolutions prefer
    #: on CPU; the arithmetic is the same, the summation order may differ in the last bits.  Off by default.
    channels_last: bool = False
    #: validation metric for best-epoch selection and early stopping.
    primary_metric: str = "map_at_r"

    def __post_init__(self) -> None:
        for name in ("classes_per_batch", "m", "iters_per_epoch", "max_epochs", "eval_every", "eval_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("num_workers", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative integer, got {v!r}")
        if self.patience is not None and (
            isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0
        ):
            raise ValueError(f"TrainConfig.patience must be a non-negative integer or None, got {self.patience!r}")
        for name in ("trunk_lr", "embedder_lr", "loss_lr", "weight_decay", "loss_weight_decay", "momentum"):
            v = getattr(self, name)
            if v is None and name == "loss_weight_decay":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a finite non-negative number, got {v!r}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}")
        if self.amp_dtype not in _AMP_DTYPES:
            raise ValueError(f"TrainConfig.amp_dtype must be one of {sorted(_AMP_DTYPES)}, got {self.amp_dtype!r}")
        for name in ("amp", "cpu_amp", "channels_last"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig.{name} must be true or false, got {getattr(self, name)!r}")


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


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _resolve_device(spec: str | torch.device) -> torch.device:
    spec = str(spec)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"TrainConfig.device: cannot parse {spec!r} ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"TrainConfig.device is {spec!r} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_dataset(dataset, name: str, what: str) -> None:
    """Fail up front, naming what to pass, for tables (rows of encoded images) and other non-datasets."""
    if hasattr(dataset, "images") and hasattr(dataset, "labels") and not hasattr(type(dataset), "__getitem__"):
        raise ValueError(
            f"{name} is an image table ({type(dataset).__name__}: rows of encoded images), not a dataset of "
            "tensors: pass "
            f"dml_core.data.ImageDataset(table, {what}(image_size)) (the protocol's {what}, "
            "docs/protocol.md §Preprocessing)"
        )
    if not hasattr(type(dataset), "__getitem__") or not hasattr(type(dataset), "__len__"):
        raise ValueError(
            f"{name} must be a map-style dataset (__getitem__/__len__) yielding (image_tensor, label), "
            f"got {type(dataset).__name__}"
        )


def _labels_of(dataset, name: str) -> np.ndarray:
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ValueError(f"{name} must expose .labels (np.ndarray of class ids), {type(dataset).__name__} has none")
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != len(dataset) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{name}.labels must be a 1-D integer array with one entry per row ({len(dataset)}), "
            f"got shape {labels.shape} dtype {labels.dtype}"
        )
    return labels


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
_RESUME_FREE_FIELDS = {"device", "num_workers", "eval_batch_size", "max_epochs", "patience"}


def _check_resume_state(state: dict[str, Any], config: TrainConfig, world: int) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"resume_state is not a train_fold state of format {STATE_FORMAT}")
    if state["world_size"] != world:
        raise ValueError(f"resume_state was written by {state['world_size']} ranks, this run has {world}")
    mine = dataclasses.asdict(config)
    diff = sorted(k for k, v in state["config"].items() if k not in _RESUME_FREE_FIELDS and mine.get(k) != v)
    if diff:
        raise ValueError(
            "resume_state was written with another TrainConfig: "
            + ", ".join(f"{k}={state['config'][k]!r} (now {mine.get(k)!r})" for k in diff)
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


# --------------------------------------------------------------------------------------------
# embedding and evaluation
# --------------------------------------------------------------------------------------------
def _images_of(batch):
    """A loader batch -> its image tensor: ``(images, labels)`` pairs or bare image tensors."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _embed_device(where: str, model: nn.Module, device) -> torch.device:
    """The device to embed on: the model's own (its first parameter or buffer; CPU if it has none) unless
    ``device`` is given, which must then be where the model is -- a model trained on a GPU and embedded with
    CPU batches (or the reverse) is a mistake to name, not to fix by moving weights behind the caller's back."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    first: torch.Tensor | None = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    here = first.device if first is not None else torch.device("cpu")
    if device is None:
        return here
    dev = _resolve_device(device)
    same = dev.type == here.type and (dev.type != "cuda" or dev.index == here.index)
    if not same:
        raise ValueError(
            f"{where}: device is {str(dev)!r} but the model is on {str(here)!r}; pass device=None to "
            "embed on the model's device, or move the model first (model.to(device))"
        )
    return dev


@torch.no_grad()
def _embed_gathered(model: nn.Module, dataset, batch_size: int, device: torch.device, num_workers: int) -> torch.Tensor:
    """Every row's embedding, on ``device``; under DDP each rank embeds a contiguous shard, then gather."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    world, rank = get_world_size(), get_rank()
    if len(dataset) < world:
        raise ValueError(f"dataset has {len(dataset)} rows, fewer than the {world} distributed ranks embedding it")
    start, stop = shard_bounds(len(dataset), world, rank)
    loader = DataLoader(
        Subset(dataset, range(start, stop)),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    was_training = model.training
    model.eval()
    try:
        parts = [model(_images_of(batch).to(device, non_blocking=True)).float() for batch in loader]
    finally:
        model.train(was_training)
    if not parts:  # an empty shard: the embedding width from one forward pass is not worth it; 0 rows
        raise ValueError("nothing to embed: the dataset is empty")
    return all_gather_uneven(torch.cat(parts, dim=0))


def _check_batch_size(where: str, batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{where}: batch_size must be a positive integer, got {batch_size!r}")


def embed(
    model: nn.Module,
    dataset,
    *,
    batch_size: int = 128,
    device: str | torch.device | None = None,
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings of every row of a *labelled* ``dataset`` (in row order) and its labels, both on CPU.

    Raw (un-normalised) float32 model outputs, model in eval mode (its train/eval mode is
    restored afterwards).  Computed on the model's device (``device=None``); a ``device`` other than the
    model's is refused with a ``ValueError``.  Under ``torch.distributed`` each rank embeds a contiguous shard and
    every rank returns the gathered whole.  Unlabelled images: :func:`embed_images`.
    """
    _check_dataset(dataset, "dataset", "eval_transform")
    labels = torch.as_tensor(_labels_of(dataset, "dataset"), dtype=torch.long)
    _check_batch_size("embed", batch_size)
    emb = _embed_gathered(model, dataset, batch_size, _embed_device("embed", model, device), num_workers)
    return emb.cpu(), labels


class _Rows(torch.utils.data.Dataset):
    """Unlabelled rows (decodable images or image tensors) -> transformed image tensors."""

    def __init__(self, rows, transform):
        self.rows, self.transform = rows, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        if isinstance(row, torch.Tensor):
            return self.transform(row) if self.transform is not None else row
        if self.transform is None:
            raise ValueError(
                f"embed_images: row {i} is a {type(row).__name__}, not a tensor; pass image_size or transform"
            )

        is_pil = hasattr(row, "convert") and hasattr(row, "mode")
        return self.transform(row.convert("RGB") if is_pil else decode_image(row))


def embed_images(
    model: nn.Module,
    images,
    *,
    image_size: int | None = None,
    transform: Callable | None = None,
    batch_size: int = 128,
    device: str | torch.device | None = None,
    num_workers: int = 0,
) -> torch.Tensor:
    """Embeddings of unlabelled images, in input order, as a ``(N, D)`` float32 CPU tensor (no labels needed).

    ``images`` is one of: an ``(N, C, H, W)`` tensor or a list of ``(C, H, W)`` tensors (already preprocessed;
    used as they are unless ``transform`` is given); a list of encoded images (bytes, paths, uint8 arrays, PIL
    images), decoded to RGB and passed through ``transform`` — by default the protocol's
    ``eval_transform(image_size)`` (Resize + CenterCrop + ImageNet normalisation,
    docs/protocol.md §Preprocessing), so ``image_size`` is
    required then; an ``ImageTable``/``ShardedTable`` (its labels are ignored), treated as its list of images; a
    map-style dataset yielding image tensors or ``(image, anything)`` pairs.  Raw model outputs, as
    :func:`embed`; eval mode, restored afterwards; on the model's device, as :func:`embed`.
    """
    _check_batch_size("embed_images", batch_size)
    dev = _embed_device("embed_images", model, device)
    if isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise ValueError(f"embed_images: an image tensor must be (N, C, H, W), got shape {tuple(images.shape)}")
        rows = list(images.unbind(0)) if transform is not None else None
        dataset = _Rows(rows, transform) if rows is not None else torch.utils.data.TensorDataset(images)
        return _embed_gathered(model, dataset, batch_size, dev, num_workers).cpu()
    if hasattr(images, "images") and not hasattr(type(images), "__getitem__"):  # ImageTable / ShardedTable
        images = _TableImages(images)
    elif hasattr(type(images), "__getitem__") and not isinstance(images, (list, tuple)):
        return _embed_gathered(model, images, batch_size, dev, num_workers).cpu()  # a dataset
    if not hasattr(images, "__len__") or not hasattr(images, "__getitem__"):
        raise ValueError(
            f"embed_images: images must be a tensor, a list of images or tensors, an ImageTable or a dataset; "
            f"got {type(images).__name__}"
        )
    if len(images) == 0:
        raise ValueError("embed_images: no images")
    if not isinstance(images[0], torch.Tensor) and transform is None:  # the first row decides (tables are lazy)
        if image_size is None:
            raise ValueError(
                "embed_images: encoded images need image_size (for the protocol's eval_transform) or a transform"
            )
        transform = eval_transform(image_size)
    return _embed_gathered(model, _Rows(images, transform), batch_size, dev, num_workers).cpu()


class _TableImages:
    """A table's image column as a sequence (``ShardedTable.images`` reads rows on demand)."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        return self.table.images[i]


class NonFiniteEmbeddings(ValueError):
    """The model's validation embeddings hold NaN or inf: the fold ends ``diverged`` (its metrics would be chance)."""


def _evaluate(model: nn.Module, val_set, config: TrainConfig, device: torch.device) -> dict[str, float]:
    """Val metrics (val compared to itself), computed on rank 0 and broadcast to every rank."""
    broadcast_buffers_(model)  # BN running stats may differ per rank if BN is not frozen
    # Embeddings stay on the device: retrieval_metrics searches CUDA tensors there (dml_core.knn.self_knn).
    emb = _embed_gathered(model, val_set, config.eval_batch_size, device, config.num_workers)
    labels = _labels_of(val_set, "val_set")
    outcome: tuple[str, Any] = ("ok", None)
    if get_rank() == 0:
        bad = int((~torch.isfinite(emb)).any(dim=1).sum())
        if bad:
            # NaN/inf features (an overflowing pooling, a broken trunk) rank at random: every metric at chance level
            outcome = ("nonfinite", f"non-finite validation embeddings ({bad} of {len(emb)} rows)")
        else:
            try:
                from dml_core.metrics import retrieval_metrics  # faiss loads with the first evaluation only

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
# the fold
# --------------------------------------------------------------------------------------------
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
    ``seconds``, ``model``, ``loss``, ``optimizer``, ``scaler`` (or ``None``), ``rng`` (one
    :func:`~dml_core.checkpoint.rng_state` per rank), ``best`` (``metrics``, ``epoch``, ``iteration``, ``state``),
    ``history``.  Store it with :func:`dml_core.checkpoint.save_state` (``weights_only`` loadable).  Under DDP pass
    it (or ``None``) alike on every rank: the ranks' RNG states are gathered for rank 0's call.
    ``resume_state``: such a state (every rank passes the same one): training continues after its evaluation —
    weights, optimiser, RNG streams, best-so-far, patience and history restored — instead of starting at epoch 0.
    The config must match the one it was written with (except device, workers, eval batch, max_epochs,
    patience); ``history``'s ``seconds`` continue from the state's.
    ``on_epoch(epoch, iteration)``: called on rank 0 at the end of every epoch that has no evaluation (those have
    ``on_eval``/``on_checkpoint``) — a cheap progress mark, e.g. to count the iterations a killed fold trained past
    its last checkpoint.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    t0 = time.perf_counter()
    device = _resolve_device(config.device)
    world, rank = get_world_size(), get_rank()
    _check_dataset(train_set, "train_set", "train_transform")
    train_labels = _labels_of(train_set, "train_set")
    fixed_budget = val_set is None
    if not fixed_budget:
        _check_dataset(val_set, "val_set", "eval_transform")
        _labels_of(val_set, "val_set")

    classes = np.unique(train_labels)
    n_loss_classes = getattr(loss, "num_classes", None)
    if isinstance(n_loss_classes, int) and n_loss_classes < len(classes):
        raise ValueError(
            f"loss was built with num_classes={n_loss_classes} but train_set has {len(classes)} classes "
            "(train labels are remapped to 0..C-1)"
        )
    class_table = torch.as_tensor(classes, dtype=torch.long, device=device)

    # Per-rank torch RNG (augmentations, dropout); the batch composition comes from the sampler.
    rank_seed = int(np.random.SeedSequence([config.seed, rank]).generate_state(1)[0])
    torch.manual_seed(rank_seed)

    model.to(device)
    loss.to(device)
    resumed_at = -1 if resume_state is None else int(resume_state["iteration"])
    if broadcast_object(resumed_at) != resumed_at:  # a no-op in one process
        raise ValueError(f"rank {rank}: resume_state is not the same iteration as rank 0's ({resumed_at})")
    if resume_state is not None:
        _check_resume_state(resume_state, config, world)
        model.load_state_dict(resume_state["model"])
        loss.load_state_dict(resume_state["loss"])
    broadcast_module_(loss)  # proxies may be initialised differently per rank
    optimizer = _optimizer(model, loss, config)
    if resume_state is not None:
        optimizer.load_state_dict(resume_state["optimizer"])
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    if config.channels_last:  # before DDP wraps it; the parameters stay the same objects (the optimizer's)
        model.to(memory_format=torch.channels_last)
    distributed = is_distributed()
    net: nn.Module = model
    if distributed:
        # DDP broadcasts rank 0's weights at construction and averages gradients in backward.
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = MPerClassBatchSampler(
        train_labels,
        config.m,
        config.classes_per_batch,
        iters_per_epoch=config.iters_per_epoch,
        seed=config.seed,
        num_replicas=world,
        rank=rank,
    )
    loader_rng = torch.Generator().manual_seed(rank_seed)  # draws each epoch's worker base seed
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
        generator=loader_rng,
    )
    use_amp = (config.amp and device.type == "cuda") or (config.cpu_amp and device.type == "cpu")
    amp_dtype = _AMP_DTYPES[config.amp_dtype] if device.type == "cuda" else torch.bfloat16
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    # Loss scaling only for fp16; one scaler step over all parameter groups (an overflow skips the whole step).
    scaler = torch.amp.GradScaler("cuda") if use_amp and amp_dtype == torch.float16 else None

    history: list[dict[str, Any]] = []
    best: dict[str, Any] = {"metrics": {}, "epoch": 0, "iteration": 0, "state": {}}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    loss_count = 0
    iteration = 0
    start_epoch = 0
    if resume_state is not None:
        if scaler is not None and resume_state.get("scaler"):
            scaler.load_state_dict(resume_state["scaler"])
        history = [dict(r) for r in resume_state["history"]]
        b = resume_state["best"]
        best = {
            "metrics": dict(b["metrics"]),
            "epoch": int(b["epoch"]),
            "iteration": int(b["iteration"]),
            "state": b["state"],
        }
        iteration, start_epoch = int(resume_state["iteration"]), int(resume_state["epoch"])
        t0 -= float(resume_state["seconds"])  # history's seconds continue from the checkpoint's

    def train_loss() -> float | None:
        return float(loss_sum.item() / loss_count) if loss_count else None

    def report(record: dict[str, Any]) -> None:
        nonlocal loss_count
        history.append(record)
        loss_sum.zero_()
        loss_count = 0
        if on_eval is not None and rank == 0:
            on_eval(record)
        if on_checkpoint is not None:
            checkpoint(record["epoch"])

    def checkpoint(epoch: int) -> None:
        # Under DDP every rank's RNG streams go into rank 0's state (one collective, at evaluations only).
        mine = rng_state(device, loader_rng)
        rngs: list[Any] = [mine]
        if distributed:
            rngs = [None] * world
            torch.distributed.all_gather_object(rngs, mine)
        if rank != 0 or on_checkpoint is None:  # called only with on_checkpoint given
            return
        on_checkpoint(
            {
                "format": STATE_FORMAT,
                "epoch": epoch,
                "iteration": iteration,
                "world_size": world,
                "config": dataclasses.asdict(config),
                "seconds": time.perf_counter() - t0,
                "model": _cpu_state(model),
                "loss": _cpu_state(loss),
                "optimizer": _cpu_copy(optimizer.state_dict()),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": rngs,
                "best": {
                    "metrics": dict(best["metrics"]),
                    "epoch": best["epoch"],
                    "iteration": best["iteration"],
                    "state": best["state"],
                },  # CPU copies already, never modified in place
                "history": copy.deepcopy(history),
            }
        )

    def evaluate(epoch: int) -> None:
        te = time.perf_counter()
        metrics = _evaluate(model, val_set, config, device)
        is_best = not history or metrics[config.primary_metric] > best["metrics"][config.primary_metric]
        if is_best:
            best.update(
                metrics=metrics,
                epoch=epoch,
                iteration=iteration,
                state={"model": _cpu_state(model), "loss": _cpu_state(loss)},
            )
        report(
            {
                "epoch": epoch,
                "iteration": iteration,
                "metrics": metrics,
                "train_loss": train_loss(),
                "seconds": time.perf_counter() - t0,
                "eval_seconds": time.perf_counter() - te,
                "is_best": is_best,
                "best_epoch": best["epoch"],
            }
        )
        model.train()

    def log_train_loss(epoch: int) -> None:  # fixed-budget mode: the loss curve only
        report(
            {
                "epoch": epoch,
                "iteration": iteration,
                "metrics": {},
                "train_loss": train_loss(),
                "seconds": time.perf_counter() - t0,
                "eval_seconds": 0.0,
                "is_best": False,
                "best_epoch": 0,
            }
        )

    def result(status: str, reason: str, epochs: int, stopped_early: bool = False) -> FoldResult:
        return FoldResult(
            status=status,
            reason=reason,
            best_metrics=best["metrics"],
            best_epoch=best["epoch"],
            history=history,
            best_state=best["state"],
            train_seconds=time.perf_counter() - t0,
            iterations=iteration,
            epochs=epochs,
            stopped_early=stopped_early,
        )

    model.train()
    loss.train()
    if resume_state is not None:
        # The RNG streams last: nothing above may draw from them, as the uninterrupted run drew nothing here.
        set_rng_state(resume_state["rng"][rank], device, loader_rng)
        if (
            not fixed_budget
            and config.patience is not None
            and start_epoch - best["epoch"] > config.patience
            and start_epoch > 0
        ):
            # killed after the evaluation that stopped the fold, before it returned
            return result("ok", f"early stop at epoch {start_epoch}: best epoch {best['epoch']}", start_epoch, True)
    elif not fixed_budget:
        try:
            evaluate(0)  # untrained model (the reality check's check_untrained_accuracy)
        except NonFiniteEmbeddings as e:
            return result("diverged", f"{e} at epoch 0 (the untrained model)", 0)
    for epoch in range(start_epoch + 1, config.max_epochs + 1):
        sampler.set_epoch(epoch)
        # The per-iteration work is what a bare loop does plus the divergence check; everything that does not
        # change per iteration (DDP, AMP, loss scaling) is decided above, so the single-process path pays nothing.
        for images, labels in loader:
            iteration += 1
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = torch.searchsorted(class_table, labels.to(device, non_blocking=True))
            if use_amp:
                with torch.autocast(device.type, dtype=amp_dtype):
                    emb = net(images)
            else:
                emb = net(images)
            # Finite loss AND finite embeddings: a loss may turn NaN features into a finite value (a masked or
            # clamped term), which would hide a broken model from this check.
            if distributed:
                value = loss(all_gather_with_grad(emb.float()), all_gather_no_grad(labels))
                # Every rank computes the same global loss; the AND over ranks only guards against a rank-local
                # difference ending training on some ranks alone.
                finite = all_ranks_true(torch.isfinite(value) & torch.isfinite(emb).all())
            else:
                value = loss(emb.float(), labels)
                finite = bool(torch.isfinite(value) & torch.isfinite(emb).all())  # the one per-iteration host sync
            if not finite:
                what = f"loss {value.item()}" if not torch.isfinite(value) else "embeddings (NaN/inf features)"
                return result("diverged", f"non-finite {what} at iteration {iteration} (epoch {epoch})", epoch)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                value.backward()
            else:
                scaler.scale(value).backward()
            if distributed:
                all_reduce_mean_([p.grad for p in loss_params if p.grad is not None])
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            loss_sum += value.detach()
            loss_count += 1
        if on_epoch is not None and rank == 0 and epoch % config.eval_every:
            on_epoch(epoch, iteration)
        if epoch % config.eval_every == 0:
            if fixed_budget:
                log_train_loss(epoch)
                continue
            try:
                evaluate(epoch)
            except NonFiniteEmbeddings as e:
                return result("diverged", f"{e} at epoch {epoch}", epoch)
            if config.patience is not None and epoch - best["epoch"] > config.patience:
                return result("ok", f"early stop at epoch {epoch}: best epoch {best['epoch']}", epoch, True)
    if fixed_budget:
        best.update(
            epoch=config.max_epochs, iteration=iteration, state={"model": _cpu_state(model), "loss": _cpu_state(loss)}
        )
    return result("ok", "", config.max_epochs)
