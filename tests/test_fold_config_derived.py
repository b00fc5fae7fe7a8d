"""A fold's ``FoldConfig`` is derived from its study's ``StudyContext`` in one place, and nothing falls between them.

Each input of ``pipelines.execution.folds.trial._fold_config`` (every ``StudyContext`` field, every per-fold argument)
is changed alone, and the ``FoldConfig`` fields that change with it are its reach.  Then a ``StudyContext`` field
reaches some fold field or is listed, with why, in ``trial.DRIVER_ONLY``; and every ``FoldConfig`` field is set from the
sources named in ``SOURCES`` below — a field added to either record without the other fails here, not in a sweep.
"""

from __future__ import annotations

import pickle
from dataclasses import fields, replace
from types import SimpleNamespace
from typing import Any

from dml_core.splits import Fold
from dml_core.training.config import TrainConfig
from pipelines.config.spaces import LOSS_LR
from pipelines.execution.folds.config import FoldConfig, FoldStudyPart
from pipelines.execution.folds.trial import DRIVER_ONLY, StudyContext, _fold_config

#: Where each FoldConfig field comes from: ``ctx.<field>`` of the study's context, or an argument of _fold_config.
SOURCES: dict[str, set[str]] = {
    # the study's part (FoldStudyPart): the context, and the test classes of its parsed manifest
    "table_ref": {"ctx.table_ref"},
    "test_classes": {"manifest"},
    "image_size": {"ctx.image_size"},
    "model": {"ctx.model_kwargs"},
    "loss": {"ctx.loss"},
    "use_gpu": {"ctx.use_gpu"},
    "threads": {"ctx.cpus_per_worker"},
    "tracking_uri": {"ctx.tracking_uri"},
    "experiment_id": {"ctx.experiment_id"},
    "mid_fold_resume": {"ctx.mid_fold_resume"},
    "label": {"ctx.study"},
    # per fold and trial
    "fold": {"fold"},
    "loss_params": {"ctx.fixed_params", "hparams"},
    "train": {"ctx.train", "hparams", "seed", "fold"},  # the study's settings, the searched loss_lr, the fold's seed
    "fold_run_id": {"fold_run_id"},
    "fold_run_tags": {"ctx.sweep", "ctx.study", "fold"},
    "fold_run_extra_tags": {"extra_tags"},
    "parent_run_id": {"parent_run_id"},
    "evaluate_test": {"reproduction"},
    "save_model": {"reproduction"},
    "checkpoint_uri": set(),  # set where the fold runs (FoldConfig.with_checkpoint_uri)
}


def _context() -> StudyContext:
    return StudyContext(
        sweep="sweep",
        study="cub/margin",
        dataset="cub",
        loss="margin",
        tracking_uri="sqlite:///mlflow.db",
        experiment_id="1",
        study_run_id="study-run",
        fold_storage="/runs/folds",
        table_ref=["table"],
        manifest_json="{}",
        model_kwargs={"trunk": "tiny", "embedding_dim": 8},
        fixed_params={"beta": 1.2},
        train=TrainConfig(classes_per_batch=4, m=2, max_epochs=3),
        image_size=16,
        workers_per_fold=1,
        use_gpu=False,
        cpus_per_worker=1.0,
        base_seed=0,
    )


#: _fold_config's per-fold arguments, and another value of each.
_ARGS: dict[str, Any] = {
    "fold": Fold(0, (1, 2), (3,)),
    "hparams": {LOSS_LR: 0.01, "margin": 0.1},
    "seed": 7,
    "fold_run_id": "fold-run",
    "reproduction": False,
    "manifest": SimpleNamespace(test_classes=(4, 5)),
    "parent_run_id": "trial-run",
    "extra_tags": {"loss": "margin"},
}
_OTHER_ARGS: dict[str, Any] = {
    "fold": Fold(1, (1, 3), (2,)),
    "hparams": {LOSS_LR: 0.02, "margin": 0.2},
    "seed": 8,
    "fold_run_id": "other-fold-run",
    "reproduction": True,
    "manifest": SimpleNamespace(test_classes=(4, 6)),
    "parent_run_id": "other-trial-run",
    "extra_tags": {"loss": "margin", "trial_id": "t"},
}


def _other(name: str, value: Any) -> Any:
    """Another value of a StudyContext field, by its type (a field of a new type must be taught here)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    if isinstance(value, TrainConfig):
        return replace(value, max_epochs=value.max_epochs + 1)
    raise TypeError(f"StudyContext.{name}: no other value for a {type(value).__name__}; add its type to _other")


def _changed(a: FoldConfig, b: FoldConfig) -> set[str]:
    return {f.name for f in fields(FoldConfig) if getattr(a, f.name) != getattr(b, f.name)}


def _reach() -> dict[str, set[str]]:
    """Each input (``ctx.<field>`` or an argument's name) → the FoldConfig fields that change with it alone."""
    ctx = _context()
    base = _fold_config(ctx, **_ARGS)
    reach = {}
    for f in fields(StudyContext):
        other = replace(ctx, **{f.name: _other(f.name, getattr(ctx, f.name))})
        reach[f"ctx.{f.name}"] = _changed(base, _fold_config(other, **_ARGS))
    for name, value in _OTHER_ARGS.items():
        reach[name] = _changed(base, _fold_config(ctx, **{**_ARGS, name: value}))
    return reach


def test_every_study_context_field_reaches_the_fold_or_is_driver_only():
    reach = _reach()
    names = {f.name for f in fields(StudyContext)}
    lost = sorted(n for n in names if not reach[f"ctx.{n}"] and n not in DRIVER_ONLY)
    assert not lost, (
        f"StudyContext fields that reach no FoldConfig field: {lost}; carry them in trial._study_part (study-level) "
        "or trial._fold_config, or list them with why in trial.DRIVER_ONLY"
    )
    reaching = sorted(n for n in DRIVER_ONLY if reach.get(f"ctx.{n}"))
    assert not reaching, f"trial.DRIVER_ONLY lists fields that do reach the fold: {reaching}"
    assert set(DRIVER_ONLY) <= names, f"trial.DRIVER_ONLY names no StudyContext field: {set(DRIVER_ONLY) - names}"
    assert all(why.strip() for why in DRIVER_ONLY.values()), "every DRIVER_ONLY field says why"


def test_every_fold_config_field_is_set_from_its_named_sources():
    reach = _reach()
    sources = {f.name: {src for src, hit in reach.items() if f.name in hit} for f in fields(FoldConfig)}
    assert set(sources) == set(SOURCES), (
        f"FoldConfig fields without a named source: {sorted(set(sources) - set(SOURCES))}; "
        f"named sources of no FoldConfig field: {sorted(set(SOURCES) - set(sources))}"
    )
    wrong = {name: sorted(got) for name, got in sources.items() if got != SOURCES[name]}
    assert not wrong, f"FoldConfig fields set from other inputs than SOURCES names: {wrong}"


def test_the_studys_part_is_the_same_for_every_fold_and_trial():
    per_fold = set(_OTHER_ARGS) - {"manifest"}  # the manifest is the study's (parsed once per trial)
    reach = _reach()
    study = {f.name for f in fields(FoldStudyPart)}
    assert not {name for src in per_fold for name in reach[src]} & study
    assert study < {f.name for f in fields(FoldConfig)}


def test_a_derived_fold_config_pickles_for_ray_and_takes_its_checkpoint_uri_once():
    cfg = _fold_config(_context(), **_ARGS)
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and type(back) is FoldConfig
    assert back.with_checkpoint_uri("/ckpt").with_checkpoint_uri("/other").checkpoint_uri == "/ckpt"
