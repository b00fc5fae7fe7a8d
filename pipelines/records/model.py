"""The typed records of a study (pydantic): what one finished trial or reproduction leaves in a records folder.

* :class:`StudyHeader` — ``study.json``: the study, its protocol fingerprint (fields and hash), the search's size.
* :class:`TrialRecord` — ``trial-NNN.json``: a search trial's values, objective, status and every fold's curve.
* :class:`ReproductionRecord` — ``reproduction-N.json``: a reproduction's folds and its test metrics (both modes).
* :class:`FoldRecord` — one fold inside either: its validation curve (iteration, val MAP@R), where and why it
  stopped, its CPU seconds, the CPU and the numerics it trained with.

Every model refuses unknown keys and non-finite numbers, so a hand-edited record fails validation with the field
named instead of entering a report.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["SCHEMA", "FoldRecord", "TrialRecord", "ReproductionRecord", "StudyHeader", "Record"]

#: The records' format; a reader refuses any other.
SCHEMA = "dmlrc.records/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)


class FoldRecord(_Strict):
    fold: int = Field(ge=0)
    #: every evaluation: ``[iteration, validation MAP@R]`` (iteration 0: the untrained network)
    curve: list[tuple[int, float]]
    #: patience (no better val MAP@R within ``protocol.patience`` epochs), cap (``max_epochs`` reached), or diverged
    stopped: Literal["patience", "cap", "diverged"]
    iterations: int = Field(ge=0)
    best_iteration: int = Field(ge=0)
    #: the best checkpoint's validation metrics
    best_val: dict[str, float]
    cpu_seconds: float = Field(ge=0)
    numerics: str
    cpu_model: str


class _Run(_Strict):
    schema_: Literal["dmlrc.records/1"] = Field(alias="schema")
    study: str
    #: the hash of the study's protocol fingerprint (the fields are in study.json)
    fingerprint: str
    params: dict[str, Any]
    seed: int
    status: Literal["ok", "diverged", "pruned"]
    reason: str = ""
    folds: list[FoldRecord]
    #: what the trial held (pipelines.execution.folds.trial.fold_cost summed over its folds): wall_seconds, cpu_seconds,
    # ...
    cost: dict[str, float]
    #: CPU seconds the folds' processes used (measured, not reserved)
    cpu_seconds: float = Field(ge=0)
    written: str  # ISO time the record was written
    package_version: str

    @field_validator("params")
    @classmethod
    def _finite_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k, x in v.items():
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"params.{k} is {x}")
        return v


class TrialRecord(_Run):
    kind: Literal["trial"]
    #: the trial's place in the search (0-based): the order its result reached the searcher
    index: int = Field(ge=0)
    trial_id: str
    #: the fold mean of the best validation MAP@R (0 for a diverged trial; a pruned trial's last reported mean)
    objective: float
    objective_sem: float


class ReproductionRecord(_Run):
    kind: Literal["reproduction"]
    #: the reproduction's index (its seed is pipelines.names.reproduction_seed of the sweep's seed and this)
    index: int = Field(ge=0)
    #: mode ("concat", "separated") → metric → value
    test: dict[str, dict[str, float]]


class StudyHeader(_Strict):
    schema_: Literal["dmlrc.records/1"] = Field(alias="schema")
    kind: Literal["study"]
    study: str
    dataset: str
    loss: str
    #: {"hash": ..., "fields": {...}} (pipelines.results.fingerprint.Fingerprint.to_json)
    fingerprint: dict[str, Any]
    trials: int = Field(ge=1)
    reproductions: int = Field(ge=1)
    #: the study's search space: name → its definition (pipelines.config.spaces.Param's fields)
    searched: dict[str, dict[str, Any]]
    #: the untrained network's test metrics (the report's reference row), once the study computed them
    untrained: dict[str, float] = Field(default_factory=dict)


Record = TrialRecord | ReproductionRecord
