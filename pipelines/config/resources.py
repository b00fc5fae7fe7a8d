"""The ``resources`` of a sweep config: Ray workers per fold, CPUs and GPUs, retries, concurrency, the fold
executor (:class:`ResourcesSpec`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.config.errors import FieldError
from pipelines.config.strict import StrictModel

__all__ = ["ResourcesSpec"]


class ResourcesSpec(StrictModel):
    """Ray resources.  ``num_cpus``: logical CPUs of a *local* Ray (null = this machine's usable cores, bounded by
    its memory at about 1 GiB per fold worker: folds beyond the cores wait in Ray's queue rather than share a core;
    set it above the cores to run more folds at once on shared cores)."""

    workers_per_fold: int = Field(2, ge=1, le=1024)
    """DDP workers per fold (gloo on CPU, NCCL with GPUs)."""
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    gpus_per_worker: float = Field(1.0, gt=0, le=64)
    """With use_gpu; a fraction (e.g. 0.25) lets small folds share a GPU."""
    #: restarts of a fold whose worker died (OOM kill, lost node): the warm task's max_retries or Ray Train's
    #: FailureConfig(max_failures); the fold continues from its last checkpoint (mid_fold_resume), else from scratch
    #: with the same seed.  A failure after the retries fails the trial (status=failed).
    fold_retries: int = Field(1, ge=0, le=100)
    mid_fold_resume: bool = True
    """A restarted fold (fold_retries, or a `--resume`d sweep) continues from its last evaluation's checkpoint
    (stored under the study's folds/<run>/ckpt/) instead of from scratch; false = from scratch (for comparison)."""
    max_concurrent_trials: int = Field(1, ge=1, le=1024)
    num_cpus: int | None = Field(None, ge=1, le=1_000_000)
    fold_executor: Literal["auto", "warm", "train"] = "auto"
    """How a fold runs: "warm" = single-worker folds on reused Ray worker processes (workers_per_fold 1 only),
    "train" = always a Ray Train TorchTrainer, "auto" = warm when workers_per_fold is 1, else train."""
    max_concurrent_studies: int | None = Field(None, ge=1, le=1024)
    """Studies (dataset × loss) in flight at once, each with its own searcher and max_concurrent_trials trials.
    null = on a cluster (--address) no limit (Ray's queue holds the folds that do not fit yet); on the embedded
    local Ray as many studies as its CPUs (and GPUs) hold at full demand — floor(CPUs / (max_concurrent_trials ×
    folds × workers_per_fold × cpus_per_worker)), at least 1 — so a laptop is not oversubscribed."""
    trial_retries: int = Field(0, ge=0, le=100)
    """Reruns of a trial whose Tune actor died (e.g. with its node): Tune FailureConfig(max_failures).  The rerun
    finds its finished folds by their result directories and does not retrain them.  0 = a lost trial errors."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.fold_executor == "warm" and self.workers_per_fold != 1:
            raise FieldError(
                "fold_executor",
                f"'warm' runs single-worker folds; workers_per_fold is {self.workers_per_fold} (use 'train' or 'auto')",
            )
        need = self.workers_per_fold * self.cpus_per_worker
        if self.num_cpus is not None and self.num_cpus < need:
            raise FieldError(
                "num_cpus",
                f"{self.num_cpus} CPUs cannot hold one fold's {self.workers_per_fold} "
                f"workers × {self.cpus_per_worker} CPUs = {need:g} (its placement group "
                "would wait forever)",
            )
        return self
