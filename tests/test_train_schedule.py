"""The learning-rate schedule of ``TrainConfig`` (``lr_warmup_iters``, ``lr_schedule``): validated like every field,
stepped once per iteration on every parameter group, absent by default, and settable from a sweep config.

The rates are read from the checkpoint states ``train_fold`` hands ``on_checkpoint`` after every evaluation: the
optimiser's ``lr`` there is the one the next iteration trains with.  (Resume of a scheduled fold:
tests/test_train_resume.py.)
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from dml_core.data import ImageDataset, synthetic
from dml_core.models import EmbeddingModel
from dml_core.training.loop import TrainConfig, train_fold

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

IMAGE = 16
RATES = {"trunk": 1e-3, "embedder": 2e-3}


def _fold(**kw):
    """A 4-epoch fold of 2 iterations each, evaluated every epoch; returns its result and checkpoint states."""
    table = synthetic(12, 6, image_size=IMAGE, seed=0)
    classes = np.unique(table.labels)
    train, val = ImageDataset(table.subset(classes[:8])), ImageDataset(table.subset(classes[8:]))
    torch.manual_seed(0)
    model = EmbeddingModel(trunk="tiny", embedding_dim=8)
    cfg = dict(classes_per_batch=4, m=2, iters_per_epoch=2, max_epochs=4, eval_every=1, patience=None)
    cfg.update(eval_batch_size=16, trunk_lr=RATES["trunk"], embedder_lr=RATES["embedder"], device="cpu", **kw)
    states: list[dict] = []
    res = train_fold(model, _Pairs(), train, val, TrainConfig(**cfg), on_checkpoint=states.append)
    return res, model, states


class _Pairs(torch.nn.Module):
    """A parameter-free pair loss: only the model's two groups (trunk, embedder) train."""

    def forward(self, emb, labels):
        d = torch.cdist(emb, emb)
        same = labels[:, None] == labels[None, :]
        return d[same].mean() + torch.relu(1.0 - d[~same]).mean()


def _rates(state) -> dict[str, float]:
    return {g["name"]: g["lr"] for g in state["optimizer"]["param_groups"]}


def test_warm_up_then_cosine_sets_every_groups_rate_per_iteration():
    res, _, states = _fold(lr_warmup_iters=3, lr_schedule="cosine")
    assert res.status == "ok" and [s["iteration"] for s in states] == [0, 2, 4, 6, 8]

    def factor(done: int) -> float:  # the rate of iteration done + 1, written out by hand
        if done < 3:
            return (done + 1) / 3
        return 0.5 * (1 + math.cos(math.pi * (done - 3) / (8 - 3)))

    for s in states:
        want = {name: base * factor(s["iteration"]) for name, base in RATES.items()}
        assert _rates(s) == pytest.approx(want, rel=1e-12, abs=1e-18), s["iteration"]
        assert s["scheduler"]["last_epoch"] == s["iteration"]
    assert _rates(states[0])["trunk"] == pytest.approx(RATES["trunk"] / 3)  # warm-up starts below the base rate
    assert _rates(states[-1])["trunk"] == pytest.approx(0.0, abs=1e-18)  # decayed to 0 at the last iteration


def test_warm_up_alone_keeps_the_base_rate_afterwards():
    _, _, states = _fold(lr_warmup_iters=4)
    assert [_rates(s)["embedder"] for s in states] == pytest.approx([2e-3 / 4, 2e-3 * 3 / 4, 2e-3, 2e-3, 2e-3])


def test_the_default_has_no_scheduler_and_trains_as_without_one():
    res, model, states = _fold()
    assert all(s["scheduler"] is None and _rates(s) == RATES for s in states)
    assert all("initial_lr" not in g for g in states[-1]["optimizer"]["param_groups"])  # no scheduler touched it
    _, scheduled, _ = _fold(lr_warmup_iters=4)
    assert any(not torch.equal(v, scheduled.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(lr_schedule="step"), "TrainConfig.lr_schedule must be one of"),
        (dict(lr_warmup_iters=-1), "TrainConfig.lr_warmup_iters must be a non-negative integer"),
        (dict(lr_warmup_iters=1.5), "TrainConfig.lr_warmup_iters must be a non-negative integer"),
        (dict(lr_warmup_iters=200, lr_schedule="cosine"), r"TrainConfig.lr_warmup_iters \(200\) leaves no iteration"),
    ],
)
def test_bad_schedule_settings_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(iters_per_epoch=10, max_epochs=20, **kw)


def test_a_sweep_config_sets_the_schedule_and_names_a_bad_one():
    from pipelines.config.presets import DEMO
    from pipelines.config.schema import ConfigError, parse_config

    doc = copy.deepcopy(DEMO)
    doc.setdefault("protocol", {}).setdefault("train", {}).update(lr_warmup_iters=50, lr_schedule="cosine")
    train = parse_config(doc).protocol.train
    assert (train["lr_warmup_iters"], train["lr_schedule"]) == (50, "cosine")
    TrainConfig(**train)  # what the sweep hands every fold
    doc["protocol"]["train"]["lr_schedule"] = "linear"
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == "protocol.train.lr_schedule", str(info.value)
