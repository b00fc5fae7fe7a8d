"""Properties every registered loss must have (parametrised over ``list_losses()`` + wrapped ones).

* gradients: ``torch.autograd.gradcheck`` in float64 w.r.t. the embeddings *and* the loss's own
  parameters (proxies, class weights, β), on B=8, D=4, 4 classes × 2 samples, at the paper's
  hyperparameters except that large logit scales are lowered (``GRADCHECK_PARAMS``) so the softmaxes
  are not saturated and the finite differences test something.  Hinges, mining and max/argmax are
  only piecewise smooth; random generic inputs lie away from their kinks with probability one, so
  no loss needs ``nondet_tol``.  One special case: RSW's deliberate stop-gradient (Eq. 7's Δ) makes
  its gradient differ from the derivative of its value, so it is checked with ``delta_mult=0``;
* no NaN/inf in the loss or its gradients with float32 embeddings scaled ×1e4 and ×1e-4
  (paper-default hyperparameters);
* invariance of the loss value to permuting the batch — except Group Loss (anchors = the first
  ``anchors_per_class`` samples of each class in batch order) and N-pair (anchor / positive = the
  first / second sample of each class), which are tested for permutations that keep the
  within-class order (Group Loss also for any permutation given the same ``anchors=`` set).  Under
  DDP the gathered batch is the single-process batch in the same order, so their choice agrees;
* every loss trains a few iterations through ``train_fold`` with status ``ok``;
* (slow, DDP) 2 gloo ranks × 16 = 1 process × 32 through ``train_fold`` for a proxy loss
  (``proxy_anchor``), a pair loss (``contrastive``) and ``group_loss``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dml_core.data import ImageDataset, synthetic
from dml_core.losses import build_loss, list_losses, loss_info
from dml_core.models import EmbeddingModel
from dml_core.training.loop import TrainConfig, train_fold

WRAPPED = ["sec:triplet", "l2_reg:triplet"]
ALL_LOSSES = list_losses() + WRAPPED

#: Lower logit scales for gradcheck only (paper values saturate the softmax at B=8, D=4).
GRADCHECK_PARAMS: dict[str, dict] = {
    "arcface": {"scale": 4.0},
    "cosface": {"scale": 4.0},
    "group_loss": {"anchors_per_class": 1},  # 2 samples per class: 1 anchor + 1 labelled by the dynamics
    "mpa": {"alpha": 4.0, "num_proxies": 2},
    "mpa_ap": {"alpha": 4.0, "num_proxies": 2},
    "mpa_dw": {"alpha": 4.0, "num_proxies": 2},
    "multi_similarity": {"beta": 5.0},
    "normalized_softmax": {"temperature": 0.5},
    "npair": {"scale": 4.0},
    "ntxent": {"temperature": 0.5},
    "proxy_anchor": {"alpha": 4.0},
    "proxynca_pp": {"temperature": 0.5},
    # RSW's Δ = m·(1 − k1)·sg(t1) (Eq. 7) is a stop-gradient on purpose: its gradient is *not* the
    # derivative of its value, so gradcheck runs with m = delta_mult = 0 (Eq. 7 without Δ); the sg
    # term itself is tested in tests/losses/test_rsw.py.
    "rsw": {"delta_mult": 0.0},
    "soft_triple": {"la": 4.0, "num_proxies": 2},
}
#: Order-dependent by design: the first sample(s) of each class *in batch order* play a role.
ORDER_DEPENDENT = {
    "group_loss": "anchors = first anchors_per_class samples of each class",
    "npair": "anchor / positive = first / second sample of each class (SEC Eq. 3; docs/losses/sec.md §Base losses)",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _base(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def _build(name: str, num_classes: int, dim: int, gradcheck: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    params = dict(GRADCHECK_PARAMS.get(_base(name), {})) if gradcheck else {}
    return build_loss(name, num_classes=num_classes, embedding_dim=dim, **params)


def _batch(classes: int, per_class: int, dim: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    emb = torch.randn(classes * per_class, dim, generator=g, dtype=dtype)
    return emb, labels


def _ids(names):
    return [n.replace(":", "_") for n in names]


def test_the_zoo_is_registered():
    # Guards the parametrisation: an import error in a loss module would silently shrink the list.
    expected = {"contrastive", "triplet", "proxy_anchor", "proxynca", "proxynca_pp", "mpa", "group_loss", "rsw"}
    assert expected <= set(list_losses()), sorted(expected - set(list_losses()))


# ------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("name", ALL_LOSSES, ids=_ids(ALL_LOSSES))
def test_gradcheck_float64_embeddings_and_loss_parameters(name):
    loss = _build(name, 4, 4, gradcheck=True).double()
    emb, labels = _batch(4, 2, 4, seed=1)
    names = [n for n, p in loss.named_parameters() if p.requires_grad]
    params = [p.detach().clone().requires_grad_(True) for n, p in loss.named_parameters() if p.requires_grad]
    buffers = dict(loss.named_buffers())

    def f(e, *ps):
        return torch.func.functional_call(loss, ({**dict(zip(names, ps)), **buffers},), (e, labels))

    e = emb.clone().requires_grad_(True)
    value = f(e, *params)
    assert value.dim() == 0 and torch.isfinite(value), value
    # The check must test something: the embedding gradient is not identically zero.
    g = torch.autograd.grad(value, e)[0]
    assert g.abs().max() > 1e-8, f"{name}: zero gradient on generic inputs (saturated or detached)"
    assert torch.autograd.gradcheck(f, (e, *params), eps=1e-6, atol=1e-5, rtol=1e-3)


# ------------------------------------------------------------------------------------ extremes
@pytest.mark.parametrize("scale", [1e4, 1e-4], ids=["x1e4", "x1e-4"])
@pytest.mark.parametrize("name", ALL_LOSSES, ids=_ids(ALL_LOSSES))
def test_finite_loss_and_gradients_at_extreme_embedding_scales(name, scale):
    loss = _build(name, 8, 16)  # paper defaults
    emb, labels = _batch(8, 4, 16, seed=2, dtype=torch.float32)
    e = (emb * scale).requires_grad_(True)
    value = loss(e, labels)
    assert torch.isfinite(value), f"{name}: loss {value} at embeddings ×{scale:g}"
    value.backward()
    assert torch.isfinite(e.grad).all(), f"{name}: non-finite embedding gradient at ×{scale:g}"
    for n, p in loss.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient of {n} at ×{scale:g}"


# ------------------------------------------------------------------------------------ permutations
def _within_class_order_kept(labels: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``perm`` re-ordered so that each class's samples keep their original relative order."""
    perm = perm.clone()
    permuted = labels[perm]
    for c in labels.unique():
        perm[permuted == c] = torch.nonzero(labels == c).flatten()
    return perm


@pytest.mark.parametrize("name", ALL_LOSSES, ids=_ids(ALL_LOSSES))
@torch.no_grad()
def test_loss_is_invariant_to_permuting_the_batch(name):
    loss = _build(name, 8, 16)
    emb, labels = _batch(8, 4, 16, seed=3, dtype=torch.float32)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(4))
    ref = float(loss(emb, labels))
    if _base(name) in ORDER_DEPENDENT:
        # The first samples of each class keep their role → same loss.
        keep = _within_class_order_kept(labels, perm)
        assert not torch.equal(keep, torch.arange(len(labels)))
        assert float(loss(emb[keep], labels[keep])) == pytest.approx(ref, rel=1e-5, abs=1e-5)
        if _base(name) != "group_loss":
            return
        anchors = torch.zeros(len(labels), dtype=torch.bool)
        anchors[[0, 5, 9, 14, 18, 23, 27, 30]] = True  # one per class, not the first ones
        ref_a = float(loss(emb, labels, anchors=anchors))
        got_a = float(loss(emb[perm], labels[perm], anchors=anchors[perm]))
        assert got_a == pytest.approx(ref_a, rel=1e-5, abs=1e-5)
    else:
        assert float(loss(emb[perm], labels[perm])) == pytest.approx(ref, rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def tiny_data():
    table = synthetic(10, 4, image_size=16, seed=0)
    return ImageDataset(table.subset(range(6))), ImageDataset(table.subset(range(6, 10)))


@pytest.mark.parametrize("name", ALL_LOSSES, ids=_ids(ALL_LOSSES))
def test_every_loss_trains_through_train_fold(name, tiny_data):
    train, val = tiny_data
    m = max(2, loss_info(name).batch.anchors_per_class + 1)  # Group Loss needs non-anchors per class
    torch.manual_seed(0)
    model = EmbeddingModel(trunk="tiny", embedding_dim=8)
    loss = _build(name, 6, 8)
    before = [p.detach().clone() for p in list(model.parameters()) + list(loss.parameters())]
    cfg = TrainConfig(
        classes_per_batch=4,
        m=m,
        iters_per_epoch=2,
        max_epochs=1,
        eval_every=2,
        patience=None,
        trunk_lr=1e-3,
        embedder_lr=1e-3,
        loss_lr=1e-3,
        eval_batch_size=20,
    )
    res = train_fold(model, loss, train, val, cfg)
    assert res.status == "ok", res.reason
    assert res.iterations == 2
    after = list(model.parameters()) + list(loss.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), f"{name}: nothing was updated"


# ------------------------------------------------------------------------------------ DDP
DDP_LOSSES = {"proxy_anchor": {}, "contrastive": {}, "group_loss": {}}


def _ddp_runs():
    # lr 0.05: float32 rounding alone makes the contrastive gradient differ by ~3e-4 (relative) from
    # its float64 value (measured; cancellations in the hinge terms), so updates must stay ~1e-2 for
    # an absolute 1e-5 check to test DDP and not rounding.  A wrong gradient scale (×2) moves every
    # update by its own size (> 1e-4), far outside the tolerance.
    table = synthetic(12, 6, image_size=16, seed=0)
    train, val = ImageDataset(table.subset(range(8))), ImageDataset(table.subset(range(8, 12)))
    cfg = TrainConfig(
        classes_per_batch=8,
        m=4,
        iters_per_epoch=2,
        max_epochs=1,
        eval_every=1,
        patience=None,
        optimizer="sgd",
        momentum=0.9,
        trunk_lr=0.05,
        embedder_lr=0.05,
        loss_lr=0.05,
        weight_decay=0.0,
        loss_weight_decay=0.0,
        eval_batch_size=8,
    )
    out = {}
    for name, params in DDP_LOSSES.items():
        torch.manual_seed(3)
        model = EmbeddingModel(trunk="tiny", embedding_dim=8)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(4)
        loss = build_loss(name, num_classes=8, embedding_dim=8, **params)
        values: list[float] = []
        loss.register_forward_hook(lambda mod, args, output: values.append(float(output.detach())))
        res = train_fold(model, loss, train, val, cfg)
        out[name] = dict(
            status=res.status,
            values=values,
            update={k: v - init[k] for k, v in model.state_dict().items() if v.is_floating_point()},
            loss={k: v.detach().clone() for k, v in loss.state_dict().items()},
            metrics=[r["metrics"] for r in res.history],
        )
    return out


def _ddp_worker(rank: int, world: int):
    return _ddp_runs()


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_ranks_of_16_equal_one_process_of_32_for_proxy_pair_and_group_losses():
    from ddp_util import run_ddp

    ref = _ddp_runs()
    ranks = run_ddp(_ddp_worker, 2)
    for name, single in ref.items():
        assert single["status"] == "ok"
        assert max(float(u.abs().max()) for u in single["update"].values()) > 1e-4, (
            f"{name}: update too small to compare"
        )
        for r, got in enumerate(ranks):
            got = got[name]
            where = f"{name} rank {r}"
            assert got["status"] == "ok", where
            np.testing.assert_allclose(got["values"], single["values"], rtol=1e-5, atol=1e-6, err_msg=where)
            for k, u in single["update"].items():
                torch.testing.assert_close(got["update"][k], u, rtol=1e-5, atol=1e-5, msg=f"{where} {k}")
            for k, v in single["loss"].items():
                torch.testing.assert_close(got["loss"][k], v, rtol=1e-5, atol=1e-5, msg=f"{where} loss {k}")
            for m1, m2 in zip(got["metrics"], single["metrics"]):
                assert m1 == pytest.approx(m2, abs=1e-6), where
