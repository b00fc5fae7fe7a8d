"""The ``protocol`` of a sweep config: folds, trials, reproductions, epochs, evaluation interval and patience
(:class:`ProtocolSpec`), and the further training settings of ``protocol.train`` (:class:`TrainSpec`, defaults
:class:`dml_core.training.loop.TrainConfig`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, model_validator

from dml_core.training.config import AMP_DTYPE_NAMES, LR_SCHEDULES, NUMERICS_AUTO, OPTIMIZERS
from pipelines.config.errors import FieldError, did_you_mean
from pipelines.config.fields import TRAIN_DEFAULTS as _TC  # short: the defaults of every field below
from pipelines.config.fields import Seed
from pipelines.config.strict import StrictModel
from pipelines.config.uris import shown

__all__ = ["ProtocolSpec", "TrainSpec", "TRAIN_KEYS"]


def _set_keys(train: TrainSpec) -> dict[str, Any]:
    # Only what the config sets: unset keys fall back to TrainConfig, the recipe's batch or the loss's metadata.
    return train.model_dump(exclude_unset=True)


def _bool_or_auto(v: Any) -> Any:
    # one message naming every allowed value (a union would report its first member's "expected true or false")
    if isinstance(v, bool) or v == NUMERICS_AUTO:
        return v
    raise ValueError(f"expected true, false or {NUMERICS_AUTO!r}, got {shown(v)}{did_you_mean(v, [NUMERICS_AUTO])}")


#: ``cpu_amp`` / ``channels_last``: on, off, or "auto" (the machine decides: dml_core.training.numerics).
BoolOrAuto = Annotated[bool | Literal[NUMERICS_AUTO], BeforeValidator(_bool_or_auto)]  # type: ignore[valid-type]


class TrainSpec(StrictModel):
    """``protocol.train``: further :class:`dml_core.training.loop.TrainConfig` fields (defaults are TrainConfig's)."""

    classes_per_batch: int | None = Field(None, ge=2, le=100_000)
    """Classes per batch (null = the protocol's shared batch, 8, or the loss paper's with recipe: paper)."""
    m: int | None = Field(None, ge=1, le=10_000)
    """Images per class in a batch (null = as classes_per_batch)."""
    trunk_lr: float = Field(_TC["trunk_lr"], gt=0, le=100)
    embedder_lr: float = Field(_TC["embedder_lr"], gt=0, le=100)
    weight_decay: float = Field(_TC["weight_decay"], ge=0, le=100)
    momentum: float = Field(_TC["momentum"], ge=0, le=1)
    eval_batch_size: int = Field(_TC["eval_batch_size"], ge=1, le=65_536)
    num_workers: int = Field(_TC["num_workers"], ge=0, le=256)
    loss_weight_decay: float | None = Field(None, ge=0, le=100)
    """Weight decay of the loss's own parameters (null = the loss's metadata, else TrainConfig's)."""
    optimizer: Literal[OPTIMIZERS] = _TC["optimizer"]  # type: ignore[valid-type]  # a Literal over the tuple's values
    lr_warmup_iters: int = Field(_TC["lr_warmup_iters"], ge=0, le=10**9)
    """Iterations of linear learning-rate warm-up from 0 (0 = none, the reality check's)."""
    lr_schedule: Literal[LR_SCHEDULES] = _TC["lr_schedule"]  # type: ignore[valid-type]  # a Literal over the values
    """After the warm-up: constant (the reality check's) or cosine (decay to 0 at max_epochs × iters_per_epoch)."""
    amp: bool = _TC["amp"]
    amp_dtype: Literal[AMP_DTYPE_NAMES] = _TC["amp_dtype"]  # type: ignore[valid-type]  # a Literal over the values
    cpu_amp: BoolOrAuto = _TC["cpu_amp"]
    """bfloat16 autocast of the training forward on CPU (not exact; faster only with native bf16: AVX512-BF16/AMX);
    auto = on where the CPU has native bf16 (avx512_bf16 / amx_bf16), off elsewhere."""
    channels_last: BoolOrAuto = _TC["channels_last"]
    """Channels-last (NHWC) model and batches (oneDNN's preferred layout on CPU); auto = on for CPU training, on
    CUDA with amp."""


#: ``protocol.train`` keys forwarded to :class:`dml_core.training.loop.TrainConfig`.
TRAIN_KEYS = tuple(TrainSpec.model_fields)


class ProtocolSpec(StrictModel):
    """The reality check's protocol (docs/protocol.md).

    ``eval_every`` and ``patience`` are in epochs of ``iters_per_epoch`` iterations (the reality check on CUB: 2 / 9).
    ``train`` holds further :class:`dml_core.training.loop.TrainConfig` fields (``TRAIN_KEYS``), as a dict of the keys
    the config sets.
    """

    name: str = Field("mlrc", min_length=1, max_length=64)
    folds: int = Field(4, ge=2, le=10)
    """Class-disjoint cross-validation folds (the mlrc layout has exactly 4)."""
    fold_layout: Literal["mlrc", "kfold"] = "mlrc"
    trials: int = Field(50, ge=1, le=100_000)
    """Bayesian-optimisation trials per study (the reality check: 50)."""
    startup_trials: int = Field(5, ge=0, le=100_000)
    """Random trials before the GP takes over (the reality check: 5 Sobol trials)."""
    sampler: Literal["gp", "tpe"] = "gp"
    """Optuna GPSampler (gp) or TPESampler (tpe)."""
    reproductions: int = Field(10, ge=2, le=1000)
    """Retrainings of the best config; the CI is across these (the reality check: 10)."""
    iters_per_epoch: int = Field(_TC["iters_per_epoch"], ge=1, le=10**7)
    eval_every: int = Field(_TC["eval_every"], ge=1, le=10**6)
    patience: int = Field(_TC["patience"], ge=0, le=10**6)
    max_epochs: int = Field(_TC["max_epochs"], ge=1, le=10**6)
    seed: Seed | None = None
    """Seed of the BO sampler and of fold training (default: the sweep's ``seed``)."""
    if TYPE_CHECKING:  # what validation leaves: the dict of the keys the config sets (_set_keys)
        train: dict[str, Any] = Field(default_factory=dict)
    else:
        train: Annotated[TrainSpec, AfterValidator(_set_keys), PlainSerializer(dict)] = Field(default_factory=dict)
    #: "protocol": every loss gets the reality check's batch (8 × 4) and model unless ``train``/``model`` say
    #: otherwise (a fair comparison); "paper": each loss's own BatchSpec/ModelRecipe (``loss_info``).
    recipe: Literal["protocol", "paper"] = "protocol"
    pruning: Literal["asha"] | None = None
    """Multi-fidelity search (docs/protocol.md §Pruning): asha = Ray Tune's ASHAScheduler stops clearly worse search
    trials early on the fold-mean val MAP@R at each evaluation; null = every trial trains to the full budget (the
    reality check).  Reproductions always do."""
    pruning_grace_period: int = Field(1, ge=1, le=10**6)
    """Evaluations (after the untrained one) every trial makes before it can be stopped."""
    pruning_reduction_factor: float = Field(3.0, ge=1.5, le=100)
    """ASHA's reduction factor: about 1 in this many trials goes on at each rung."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.fold_layout == "mlrc" and self.folds != 4:
            raise FieldError("folds", f"the mlrc layout has exactly 4 folds (got {self.folds}); use fold_layout: kfold")
        if self.max_epochs < self.eval_every:
            raise FieldError("max_epochs", f"{self.max_epochs} must be >= eval_every ({self.eval_every})")
        evaluations = self.max_epochs // self.eval_every  # pipelines.execution.search.pruning.evaluations_per_fold
        if self.pruning is not None and self.pruning_grace_period >= evaluations:
            raise FieldError(
                "pruning_grace_period",
                f"{self.pruning_grace_period} must be < the evaluations per fold, max_epochs // eval_every = "
                f"{evaluations} (else no trial can be stopped)",
            )
        warmup, budget = self.train.get("lr_warmup_iters", 0), self.max_epochs * self.iters_per_epoch
        if warmup >= budget:  # the linear ramp never ends: every iteration trains at a fraction of the rate
            raise FieldError(
                "train.lr_warmup_iters",
                f"{warmup} iterations of warm-up >= a fold's whole budget, max_epochs × iters_per_epoch = "
                f"{self.max_epochs} × {self.iters_per_epoch} = {budget}: training would never reach the learning "
                f"rate (at most {budget / warmup:.2g} of it); use fewer than {budget} (0 = no warm-up)",
            )
        return self
