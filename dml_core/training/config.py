"""One fold's training settings, :class:`TrainConfig`: a plain dataclass that imports no torch, so that a trial's
driver can build and check it and hand it to the fold's process (``pipelines.execution.folds.config.FoldConfig``),
and so that the sweep's config schema can read its defaults.  :func:`dml_core.training.loop.train_fold` takes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TrainConfig", "OPTIMIZERS", "LR_SCHEDULES", "AMP_DTYPE_NAMES", "NUMERICS_AUTO"]

#: The optimisers of the trunk, embedder and loss.
OPTIMIZERS = ("rmsprop", "sgd", "adam")
#: Learning-rate schedules after the warm-up (``dml_core.training.step.lr_scheduler``).
LR_SCHEDULES = ("constant", "cosine")
#: ``amp_dtype`` values: the CUDA autocast dtypes by name (``dml_core.training.step.AMP_DTYPES`` maps them to torch's).
AMP_DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16")
#: ``cpu_amp`` / ``channels_last`` value that leaves the choice to the machine (``dml_core.training.numerics.resolve``).
NUMERICS_AUTO = "auto"


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
    * ``lr_warmup_iters=0``, ``lr_schedule="constant"``: MLRC's learning rates are constant (§Optimisers); a
      schedule is a general option (stepped per iteration, checkpointed and resumed with the optimiser).
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
    #: linear warm-up: every parameter group's lr rises from 0 to its own lr over this many iterations (iteration
    #: ``i`` trains at ``i / lr_warmup_iters`` of it); 0 = none (MLRC).
    lr_warmup_iters: int = 0
    #: after the warm-up, "constant" (MLRC) or "cosine": decay to 0 at iteration ``max_epochs × iters_per_epoch``.
    lr_schedule: str = "constant"
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
    #: "auto": on where the CPU has native bf16, off elsewhere (:mod:`dml_core.training.numerics`).
    cpu_amp: bool | str = False
    #: the model and its training batches in channels-last (NHWC) memory format, which oneDNN's convolutions prefer
    #: on CPU; the arithmetic is the same, the summation order may differ in the last bits.  Off by default.
    #: "auto": on for CPU training, and on CUDA with ``amp`` (:mod:`dml_core.training.numerics`).
    channels_last: bool | str = False
    #: validation metric for best-epoch selection and early stopping.
    primary_metric: str = "map_at_r"

    def __post_init__(self) -> None:
        for name in ("classes_per_batch", "m", "iters_per_epoch", "max_epochs", "eval_every", "eval_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("num_workers", "seed", "lr_warmup_iters"):
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
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.lr_schedule == "cosine" and self.lr_warmup_iters >= self.max_epochs * self.iters_per_epoch:
            raise ValueError(
                f"TrainConfig.lr_warmup_iters ({self.lr_warmup_iters}) leaves no iteration for the cosine decay: "
                f"max_epochs × iters_per_epoch is {self.max_epochs * self.iters_per_epoch}"
            )
        if self.amp_dtype not in AMP_DTYPE_NAMES:
            raise ValueError(f"TrainConfig.amp_dtype must be one of {sorted(AMP_DTYPE_NAMES)}, got {self.amp_dtype!r}")
        if not isinstance(self.amp, bool):
            raise ValueError(f"TrainConfig.amp must be true or false, got {self.amp!r}")
        for name in ("cpu_amp", "channels_last"):
            if not isinstance(getattr(self, name), bool) and getattr(self, name) != NUMERICS_AUTO:
                raise ValueError(
                    f"TrainConfig.{name} must be true, false or {NUMERICS_AUTO!r}, got {getattr(self, name)!r}"
                )
