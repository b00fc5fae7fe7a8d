"""train_fold's loop is bit-identical to a plain reference loop written out here (CPU, fixed seed).

The reference spells out the loop in its plainest form: three separate optimisers (trunk, embedder, loss:
docs/protocol.md §Optimisers), the m-per-class sampler re-seeded per epoch, the per-rank torch seed, a finiteness
check before every step.  Any change to train_fold that alters a single bit of
the per-iteration loss, the mean train loss it reports, or the final weights fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dml_core.data import ImageDataset, synthetic
from dml_core.losses import build_loss
from dml_core.models import EmbeddingModel
from dml_core.training.loop import TrainConfig, train_fold
from dml_core.training.samplers import MPerClassBatchSampler

IMAGE, DIM = 16, 8


class Recording(nn.Module):
    """Wraps a loss and records every value it returns (as a Python float, after the fact)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.values: list[torch.Tensor] = []

    def forward(self, emb, labels):
        value = self.base(emb, labels)
        self.values.append(value.detach().clone())
        return value


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _data():
    table = synthetic(12, 6, image_size=IMAGE, seed=0)
    classes = np.unique(table.labels)
    return ImageDataset(table.subset(classes[:8])), ImageDataset(table.subset(classes[8:]))


def _fresh(loss_name: str):
    torch.manual_seed(123)
    model = EmbeddingModel(trunk="tiny", embedding_dim=DIM)
    loss = Recording(build_loss(loss_name, num_classes=8, embedding_dim=DIM))
    return model, loss


def _config(optimizer: str) -> TrainConfig:
    return TrainConfig(
        classes_per_batch=4,
        m=2,
        iters_per_epoch=3,
        max_epochs=4,
        eval_every=2,
        patience=None,
        trunk_lr=1e-3,
        embedder_lr=2e-3,
        loss_lr=5e-2,
        weight_decay=1e-4,
        loss_weight_decay=1e-4,
        momentum=0.9,
        optimizer=optimizer,
        eval_batch_size=16,
        seed=3,
        device="cpu",
    )


def _reference(model, loss, train_set, cfg: TrainConfig) -> list[float]:
    """The loop as specified: returns the mean loss of each eval_every block of epochs (float64 sums)."""
    labels = np.asarray(train_set.labels)
    table = torch.as_tensor(np.unique(labels), dtype=torch.long)
    seed = int(np.random.SeedSequence([cfg.seed, 0]).generate_state(1)[0])
    torch.manual_seed(seed)

    def make(params, lr, wd):
        if cfg.optimizer == "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, weight_decay=wd, momentum=cfg.momentum)
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=wd, momentum=cfg.momentum)
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)

    trunk_ids = {id(p) for p in model.trunk.parameters()}
    opts = [
        make(list(model.trunk.parameters()), cfg.trunk_lr, cfg.weight_decay),
        make([p for p in model.parameters() if id(p) not in trunk_ids], cfg.embedder_lr, cfg.weight_decay),
    ]
    if list(loss.parameters()):
        opts.append(make(list(loss.parameters()), cfg.loss_lr, cfg.loss_weight_decay))
    sampler = MPerClassBatchSampler(
        labels, cfg.m, cfg.classes_per_batch, iters_per_epoch=cfg.iters_per_epoch, seed=cfg.seed, num_replicas=1, rank=0
    )
    loader = DataLoader(train_set, batch_sampler=sampler, generator=torch.Generator().manual_seed(seed))
    model.train()
    loss.train()
    means, total, count = [], torch.zeros((), dtype=torch.float64), 0
    for epoch in range(1, cfg.max_epochs + 1):
        sampler.set_epoch(epoch)
        for images, y in loader:
            value = loss(model(images), torch.searchsorted(table, y))
            assert torch.isfinite(value)
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            value.backward()
            for opt in opts:
                opt.step()
            total += value.detach()
            count += 1
        if epoch % cfg.eval_every == 0:
            means.append(float(total.item() / count))
            total.zero_()
            count = 0
    return means


@pytest.mark.parametrize("optimizer", ["rmsprop", "adam"])
@pytest.mark.parametrize("loss_name", ["proxynca_pp", "contrastive"])
def test_train_fold_is_bit_identical_to_the_reference_loop(optimizer, loss_name):
    train_set, val_set = _data()
    cfg = _config(optimizer)
    model_a, loss_a = _fresh(loss_name)
    result = train_fold(model_a, loss_a, train_set, val_set, cfg)
    model_b, loss_b = _fresh(loss_name)
    means = _reference(model_b, loss_b, train_set, cfg)

    assert result.status == "ok" and result.iterations == cfg.iters_per_epoch * cfg.max_epochs
    assert len(loss_a.values) == len(loss_b.values) == result.iterations
    for i, (a, b) in enumerate(zip(loss_a.values, loss_b.values)):
        assert torch.equal(a, b), f"iteration {i + 1}: loss {a.item()!r} != reference {b.item()!r}"
    assert [r["train_loss"] for r in result.history if r["train_loss"] is not None] == means
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), f"model {name} differs from the reference loop"
    for (name, a), b in zip(loss_a.state_dict().items(), loss_b.state_dict().values()):
        assert torch.equal(a, b), f"loss {name} differs from the reference loop"
