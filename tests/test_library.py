"""dml_core used directly, as a researcher would: fixed-budget training without a validation set,
the same training as the sweep (defaults, the loss's own weight decay), embedding unlabelled images, and a clear
up-front error for a table passed where a dataset belongs."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

import dml_core.training.loop as train_mod
from dml_core.data import ImageDataset, eval_transform, synthetic
from dml_core.losses import build_loss, loss_info, registered_info
from dml_core.models import EmbeddingModel
from dml_core.training.loop import TrainConfig, embed, embed_images, train_fold
from pipelines.config.presets import DEMO
from pipelines.config.schema import ProtocolSpec, parse_config

IMAGE, DIM = 16, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _table():
    return synthetic(12, 6, image_size=IMAGE, seed=0)


def _sets():
    table = _table()
    classes = np.unique(table.labels)
    return ImageDataset(table.subset(classes[:8])), ImageDataset(table.subset(classes[8:]))


def _model(seed=0):
    torch.manual_seed(seed)
    return EmbeddingModel(trunk="tiny", embedding_dim=DIM)


def _cfg(**kw) -> TrainConfig:
    base = dict(
        classes_per_batch=4,
        m=2,
        iters_per_epoch=2,
        max_epochs=3,
        eval_every=1,
        patience=None,
        trunk_lr=1e-3,
        embedder_lr=1e-3,
        loss_lr=1e-2,
        eval_batch_size=16,
        seed=0,
        device="cpu",
    )
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------------------ fixed budget
def test_fixed_budget_trains_without_validation_and_keeps_the_final_state(monkeypatch):
    def no_eval(*a, **k):
        raise AssertionError("fixed-budget mode must not evaluate")

    monkeypatch.setattr(train_mod, "_evaluate", no_eval)
    train, _ = _sets()
    model, loss = _model(), build_loss("proxynca_pp", num_classes=8, embedding_dim=DIM)
    seen = []
    result = train_fold(model, loss, train, None, _cfg(max_epochs=3, eval_every=1, patience=0), on_eval=seen.append)
    assert result.status == "ok" and not result.stopped_early  # patience is moot without validation
    assert (result.iterations, result.epochs, result.best_epoch) == (6, 3, 3)
    assert [r["epoch"] for r in result.history] == [1, 2, 3]  # no epoch-0 evaluation
    assert all(r["metrics"] == {} and np.isfinite(r["train_loss"]) for r in result.history)
    assert seen == result.history and result.best_metrics == {}
    for k, v in model.state_dict().items():
        assert torch.equal(result.best_state["model"][k], v)
    for k, v in loss.state_dict().items():
        assert torch.equal(result.best_state["loss"][k], v)


def test_fixed_budget_trains_the_same_iterations_as_with_validation():
    train, val = _sets()
    a_model, b_model = _model(), _model()
    a_loss = build_loss("contrastive", num_classes=8, embedding_dim=DIM)
    b_loss = build_loss("contrastive", num_classes=8, embedding_dim=DIM)
    train_fold(a_model, a_loss, train, None, _cfg())
    train_fold(b_model, b_loss, train, val, _cfg())
    for (k, a), b in zip(a_model.state_dict().items(), b_model.state_dict().values()):
        assert torch.equal(a, b), k


# ------------------------------------------------------------------------------------ same training as the sweep
@pytest.mark.parametrize("name", ["proxynca_pp", "margin", "group_loss", "proxynca"])
def test_train_fold_applies_the_losses_own_weight_decay(name):
    """A direct caller leaving loss_weight_decay unset trains exactly like an explicit loss_info(...) value."""
    train, _ = _sets()
    info = loss_info(name)
    finals = {}
    for label, wd in (("default", None), ("registry", info.loss_weight_decay), ("other", info.loss_weight_decay + 0.5)):
        torch.manual_seed(1)
        loss = build_loss(name, num_classes=8, embedding_dim=DIM)
        model = _model()
        kw = {} if wd is None else {"loss_weight_decay": wd}
        assert train_fold(model, loss, train, None, _cfg(max_epochs=2, loss_lr=0.1, **kw)).status == "ok"
        finals[label] = [p.detach().clone() for p in loss.parameters()]
    assert finals["default"], f"{name} has no parameters"
    assert all(torch.equal(a, b) for a, b in zip(finals["default"], finals["registry"]))
    assert not all(torch.equal(a, b) for a, b in zip(finals["default"], finals["other"]))


def test_build_loss_records_its_registry_name():
    assert registered_info(build_loss("proxynca_pp", num_classes=4, embedding_dim=DIM)).loss_weight_decay == 0.0
    wrapped = build_loss("sec:triplet", num_classes=4, embedding_dim=DIM)
    assert wrapped.registry_name == "sec:triplet" and registered_info(wrapped) is loss_info("triplet")
    assert "registry_name" not in wrapped.state_dict()
    assert registered_info(torch.nn.Identity()) is None


def test_a_plain_module_gets_mlrcs_loss_weight_decay():
    cfg = TrainConfig()
    assert cfg.loss_weight_decay is None
    assert train_mod.loss_weight_decay_for(torch.nn.Linear(2, 2), cfg) == 1e-4  # docs/protocol.md §Optimisers


# docs/protocol.md §Schedule: an epoch is 100 iterations; the CUB-200-2011 row (the reality check's released
# default) evaluates every 2 epochs with patience 9, for at most 1000 epochs.  Stated here, not read from the code.
MLRC_SCHEDULE = {"iters_per_epoch": 100, "eval_every": 2, "patience": 9, "max_epochs": 1000}


def test_sweep_protocol_defaults_are_the_mlrc_schedule():
    """TrainConfig's defaults, the sweep schema's defaults and an unset protocol block all give the reality check's
    CUB-200-2011 schedule (docs/protocol.md §Schedule): a researcher calling train_fold and a sweep train the same."""
    lib = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    proto = {name: f.default for name, f in ProtocolSpec.model_fields.items()}  # pydantic schema
    doc = copy.deepcopy(DEMO)
    for key in MLRC_SCHEDULE:
        doc.get("protocol", {}).pop(key, None)
    parsed = parse_config(doc).protocol
    for key, want in MLRC_SCHEDULE.items():
        assert lib[key] == want, f"TrainConfig.{key} = {lib[key]}, the reality check's is {want}"
        assert proto[key] == want, f"ProtocolSpec.{key} = {proto[key]}, the reality check's is {want}"
        assert getattr(parsed, key) == want, f"an unset protocol.{key} parses to {getattr(parsed, key)}, not {want}"


# ------------------------------------------------------------------------------------ tables are not datasets
def test_an_image_table_is_rejected_up_front_with_what_to_pass(monkeypatch):
    def no_loader(*a, **k):
        raise AssertionError("rejected only after the DataLoader was built")

    train, val = _sets()
    table = _table()
    monkeypatch.setattr(train_mod, "DataLoader", no_loader)
    model, loss = _model(), build_loss("contrastive", num_classes=12, embedding_dim=DIM)
    what = r"is an image table \(ImageTable.*ImageDataset\(table, {}\(image_size\)\)"
    with pytest.raises(ValueError, match="train_set " + what.format("train_transform")):
        train_fold(model, loss, table, val, _cfg())
    with pytest.raises(ValueError, match="val_set " + what.format("eval_transform")):
        train_fold(model, loss, train, table, _cfg())


# ------------------------------------------------------------------------------------ embedding unlabelled images
def test_embed_images_from_tensors_arrays_tables_and_datasets():
    table = _table()
    model = _model()
    model.train()
    ds = ImageDataset(table, eval_transform(IMAGE))
    expected, _ = embed(model, ds, batch_size=7)
    assert model.training, "mode restored"

    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        model.eval()
        direct = model(x)
        model.train()
    got_tensor = embed_images(model, x, batch_size=5)
    assert got_tensor.shape == (len(table), DIM) and got_tensor.device.type == "cpu"
    torch.testing.assert_close(got_tensor, direct)
    torch.testing.assert_close(embed_images(model, list(x), batch_size=64), direct)

    arrays = list(table.images)  # HxWx3 uint8, no labels anywhere
    torch.testing.assert_close(embed_images(model, arrays, image_size=IMAGE), expected)
    torch.testing.assert_close(embed_images(model, table, image_size=IMAGE, batch_size=3), expected)
    torch.testing.assert_close(embed_images(model, ds), expected)  # a dataset of (image, label) pairs
    assert model.training


def test_embed_images_needs_a_size_for_encoded_images():
    with pytest.raises(ValueError, match="image_size"):
        embed_images(_model(), list(_table().images[:3]))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        embed_images(_model(), torch.zeros(3, 16, 16))
    with pytest.raises(ValueError, match="no images"):
        embed_images(_model(), [])
