"""``TrainConfig`` is the one record of a fold's training settings: built and checked by a trial's driver without
torch, carried to the fold's process inside ``FoldConfig``, and the sweep schema's choices are its own."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from dml_core.training.config import AMP_DTYPE_NAMES, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_train_config_loads_without_torch():
    code = (
        "import json, sys; from dml_core.training.config import TrainConfig; "
        "TrainConfig(max_epochs=3); print(json.dumps('torch' in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) is False, "importing dml_core.training.config loaded torch"


def test_the_amp_dtype_names_are_the_ones_training_maps_to_torch():
    from dml_core.training.step import AMP_DTYPES

    assert set(AMP_DTYPES) == set(AMP_DTYPE_NAMES)


def test_a_fold_config_carries_a_checked_train_config_across_a_pickle():
    from pipelines.execution.folds.config import FoldClasses, FoldConfig

    train = replace(TrainConfig(classes_per_batch=4, m=2, max_epochs=3), seed=7, loss_lr=0.01)
    cfg = FoldConfig(
        table_ref=[None], fold=FoldClasses(0, (1, 2), (3,)), test_classes=(4,), image_size=16,
        model={"trunk": "tiny"}, loss="contrastive", loss_params={}, train=train, use_gpu=False, threads=1,
        tracking_uri="sqlite:///x.db", experiment_id="1", fold_run_id="r", fold_run_tags={}, fold_run_extra_tags={},
        parent_run_id="p", evaluate_test=False, save_model=False, mid_fold_resume=True, label="d/l",
    )  # fmt: skip
    back = pickle.loads(pickle.dumps(cfg))
    assert back.train == train and back.train.seed == 7 and back.train.loss_lr == 0.01
    assert replace(back.train, device="cuda").device == "cuda"
    with pytest.raises(ValueError, match="TrainConfig.max_epochs"):
        replace(back.train, max_epochs=0)


#: The fields a calibration shortens or a fold sets for itself; every other field is the study's.
_PER_RUN = {"lr_schedule", "lr_warmup_iters", "iters_per_epoch", "eval_every", "max_epochs", "patience"}
_PER_RUN |= {"seed", "device", "loss_lr"}


@pytest.mark.parametrize("recipe", ["protocol", "paper"])
def test_the_sweep_its_calibration_and_its_fingerprint_mean_one_study_train_config(tmp_path, recipe):
    from pipelines.config.presets import DEMO
    from pipelines.config.schema import parse_config
    from pipelines.execution.plan import _train_config
    from pipelines.execution.preflight.study_plans import preflight, study_train_config
    from pipelines.execution.studies.fingerprints import study_fingerprint
    from pipelines.execution.studies.sweep_studies import SweepStudies

    doc = copy.deepcopy(DEMO)
    doc["losses"] = [{"name": "proxynca_pp"}]
    doc["storage"] = str(tmp_path / "runs")
    doc["protocol"]["recipe"] = recipe
    if recipe == "paper":  # the loss paper's batch, not the preset's
        doc["protocol"]["train"].pop("classes_per_batch")
        doc["protocol"]["train"].pop("m")
    doc["protocol"]["train"].update(weight_decay=1e-4, lr_schedule="cosine", lr_warmup_iters=3, eval_batch_size=64)
    cfg = parse_config(doc)
    (plan,) = preflight(cfg)
    train = study_train_config(cfg, plan)
    assert (train.classes_per_batch, train.m) == (plan.classes_per_batch, plan.m)
    p = cfg.protocol
    assert (train.iters_per_epoch, train.max_epochs, train.eval_every, train.patience) == (
        p.iters_per_epoch,
        p.max_epochs,
        p.eval_every,
        p.patience,
    )
    assert (train.weight_decay, train.lr_schedule, train.lr_warmup_iters) == (1e-4, "cosine", 3)

    # what every trial's folds start from
    sweep = SimpleNamespace(cfg=cfg, tracker=SimpleNamespace(uri="sqlite:///x.db", experiment_id="1"))
    sweep.study_storage = lambda plan: str(tmp_path / "study")
    assert SweepStudies._context(sweep, plan, "run", "table").train == train

    # the calibration: the study's settings, on a short schedule
    calibration = asdict(_train_config(cfg, plan, "cpu", 5))
    assert (calibration["iters_per_epoch"], calibration["max_epochs"], calibration["lr_schedule"]) == (5, 2, "constant")
    assert {k: v for k, v in calibration.items() if k not in _PER_RUN} == {
        k: v for k, v in asdict(train).items() if k not in _PER_RUN
    }

    # the fingerprint records the same values (the batch as "the loss paper's" under recipe: paper)
    recorded = study_fingerprint(cfg, plan).fields
    assert recorded["protocol.train.weight_decay"] == 1e-4 and recorded["protocol.train.lr_schedule"] == "cosine"
    expected_batch = plan.classes_per_batch if recipe == "protocol" else "the loss paper's"
    assert recorded["protocol.train.classes_per_batch"] == expected_batch
    assert recorded["protocol.eval_every"] == train.eval_every
