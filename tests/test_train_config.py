"""``TrainConfig`` is the one record of a fold's training settings: built and checked by a trial's driver without
torch, carried to the fold's process inside ``FoldConfig``, and the sweep schema's choices are its own."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dml_core.train_config import AMP_DTYPE_NAMES, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_train_config_loads_without_torch():
    code = (
        "import json, sys; from dml_core.train_config import TrainConfig; "
        "TrainConfig(max_epochs=3); print(json.dumps('torch' in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) is False, "importing dml_core.train_config loaded torch"


def test_the_amp_dtype_names_are_the_ones_training_maps_to_torch():
    from dml_core.train_step import AMP_DTYPES

    assert set(AMP_DTYPES) == set(AMP_DTYPE_NAMES)


def test_a_fold_config_carries_a_checked_train_config_across_a_pickle():
    from pipelines.execution.fold_config import FoldClasses, FoldConfig

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
