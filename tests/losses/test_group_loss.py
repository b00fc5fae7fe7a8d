"""The Group Loss: properties of the paper's equations (Eqs. 1-9) and of docs/losses/group_loss.md §Tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dml_core.losses import build_loss, loss_info
from dml_core.losses.group_loss import (
    anchor_mask,
    consistency,
    pearson_similarity,
    replicator_dynamics,
)

torch.set_num_threads(1)


def _loss(C=100, D=64, seed=0, **params):
    torch.manual_seed(seed)
    return build_loss("group_loss", num_classes=C, embedding_dim=D, **params).double()


def _batch(P=6, K=9, D=64, C=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    classes = torch.randperm(C, generator=g)[:P]
    y = classes.repeat_interleave(K)[torch.randperm(P * K, generator=g)]  # classes interleaved in batch order
    z = torch.randn(P * K, D, generator=g, dtype=torch.float64)
    return z, y


# --------------------------------------------------------------------------------------------
# row-stochastic after every iteration, anchors stay one-hot, X(0) = temperature softmax (Eqs. 4, 9)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 3, 10])
def test_rows_stochastic_and_anchors_one_hot_after_every_iteration(T):
    loss = _loss(num_iterations=T, anchors_per_class=2, temperature=24.0)
    z, y = _batch()
    r = loss.refine(z, y)
    assert len(r.X) == T + 1
    assert r.anchors.sum() == 6 * 2
    onehot = F.one_hot(y, 100).double()
    for X in r.X:
        assert (X >= 0).all()
        assert torch.allclose(X.sum(1), torch.ones(54, dtype=X.dtype), atol=1e-6, rtol=0)
        assert torch.equal(X[r.anchors], onehot[r.anchors])
    unlabelled = ~r.anchors
    assert torch.allclose(r.X[0][unlabelled], torch.softmax(r.logits[unlabelled] / 24.0, dim=1), atol=1e-15, rtol=0)


def test_anchors_are_the_first_occurrences_of_each_class_in_batch_order():
    y = torch.tensor([3, 1, 3, 3, 1, 0, 1, 3])
    assert anchor_mask(y, 2).tolist() == [True, True, True, False, True, True, False, False]
    assert anchor_mask(y, 0).tolist() == [False] * 8
    assert anchor_mask(y, 9).all()


# --------------------------------------------------------------------------------------------
# zero-similarity / degenerate rows give no NaN and keep their distribution
# --------------------------------------------------------------------------------------------
def test_zero_similarity_rows_are_finite_and_unchanged():
    D = 8
    g = torch.Generator().manual_seed(1)
    base = torch.randn(D, generator=g, dtype=torch.float64)
    # samples 1..5 are noisy copies of `base`; sample 0 is its negation -> correlation < 0 with all -> zero W row
    z = torch.stack([-base] + [base + 0.05 * torch.randn(D, generator=g, dtype=torch.float64) for _ in range(5)])
    y = torch.tensor([0, 1, 1, 2, 2, 2])
    loss = _loss(C=3, D=D, num_iterations=5, anchors_per_class=1)
    r = loss.refine(z, y)
    assert (r.W[0] == 0).all() and (r.W[:, 0] == 0).all()
    assert r.anchors[0]  # sample 0 is class 0's anchor, with zero support: it stays one-hot
    assert torch.equal(r.X[-1][0], F.one_hot(torch.tensor(0), 3).double())
    zz = z.clone().requires_grad_()
    value = loss(zz, y)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(zz.grad).all()
    assert torch.isfinite(loss.classifier.weight.grad).all()

    # an unlabelled zero-support row keeps its prior exactly
    no_anchor = torch.zeros(6, dtype=torch.bool)
    r = loss.refine(z, y, anchors=no_anchor)
    assert torch.allclose(r.X[-1][0], r.X[0][0], atol=1e-12, rtol=0)


def test_degenerate_batches_do_not_produce_nan():
    loss = _loss(C=4, D=5, num_iterations=3, anchors_per_class=1)
    cases = {
        "one sample": (torch.randn(1, 5, dtype=torch.float64), torch.tensor([2])),
        "constant embedding": (
            torch.cat([torch.full((1, 5), 3.0), torch.randn(3, 5)]).double(),
            torch.tensor([0, 1, 1, 0]),
        ),
        "all equal embeddings": (torch.ones(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3])),
    }
    for what, (z, y) in cases.items():
        z = z.clone().requires_grad_()
        value = loss(z, y)
        value.backward()
        assert torch.isfinite(value), what
        assert torch.isfinite(z.grad).all(), what
        r = loss.refine(z.detach(), y)
        assert torch.equal(r.X[-1][r.anchors], F.one_hot(y, 4).double()[r.anchors]), what
    # fp32 with huge embeddings: saturated priors, still finite
    loss32 = build_loss("group_loss", num_classes=4, embedding_dim=5, num_iterations=3)
    z = (torch.randn(8, 5) * 1e20).requires_grad_()
    value = loss32(z, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(z.grad).all()


def test_anchor_without_support_for_its_class_stays_one_hot():
    # sample 0 (anchor of class 0) is only similar to sample 1, whose prior gives class 0 (almost) no mass
    W = torch.tensor([[0.0, 0.9, 0.0], [0.9, 0.0, 0.2], [0.0, 0.2, 0.0]], dtype=torch.float64)
    X0 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    for X in replicator_dynamics(W, X0, 4, trace=True):
        assert torch.equal(X[0], X0[0])
        assert torch.allclose(X.sum(1), torch.ones(3, dtype=X.dtype), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------------------
# Fig. 2 toy propagation
# --------------------------------------------------------------------------------------------
def test_fig2_toy_propagation():
    # A = anchor of class 0, B = anchor of class 1, C unlabelled with a uniform prior
    W = torch.tensor([[0.0, 0.0, 0.8], [0.0, 0.0, 0.4], [0.8, 0.4, 0.0]], dtype=torch.float64)
    X0 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    xs = replicator_dynamics(W, X0, 30, trace=True)
    for t, X in enumerate(xs):
        assert abs(X[2, 0] / X[2, 1] - 2.0**t) < 1e-9 * 2.0**t
    assert xs[-1][2, 0] > 1 - 1e-8  # C -> one-hot(class of A)
    swapped = W.clone()
    swapped[0, 2] = swapped[2, 0] = 0.4
    swapped[1, 2] = swapped[2, 1] = 0.8
    assert replicator_dynamics(swapped, X0, 30)[2, 1] > 1 - 1e-8


# --------------------------------------------------------------------------------------------
# Baum–Eagon — F(X) = trace(XᵀWX) never decreases (Eqs. 7–8)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("zero_diag", [True, False])
def test_consistency_is_non_decreasing(zero_diag):
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        W = pearson_similarity(torch.randn(20, 6, generator=g, dtype=torch.float64), zero_diag)
        X = torch.softmax(3 * torch.randn(20, 7, generator=g, dtype=torch.float64), dim=1)
        values = [consistency(W, X).item() for X in replicator_dynamics(W, X, 20, trace=True)]
        for before, after in zip(values, values[1:]):
            assert after >= before - 1e-9 * abs(before)
        assert values[-1] > values[0]
    # a stationary point stays fixed: uniform X with constant off-diagonal W
    W = torch.full((5, 5), 0.3, dtype=torch.float64).fill_diagonal_(0.0)
    X = torch.full((5, 4), 0.25, dtype=torch.float64)
    assert torch.allclose(replicator_dynamics(W, X, 5), X, atol=1e-15, rtol=0)


# --------------------------------------------------------------------------------------------
# similarity-matrix properties (Eq. 1 + ReLU, App. 0.G)
# --------------------------------------------------------------------------------------------
def test_similarity_matrix_is_relu_pearson_and_affine_invariant():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(12, 10, generator=g, dtype=torch.float64)
    W = pearson_similarity(z, zero_diag=True)
    assert torch.equal(W, W.t())
    assert (W >= 0).all() and (W <= 1 + 1e-12).all()
    assert (W.diagonal() == 0).all()
    expected = np.maximum(np.corrcoef(z.numpy()), 0.0)
    off = ~np.eye(12, dtype=bool)
    assert np.allclose(W.numpy()[off], expected[off], atol=1e-12)
    a = torch.rand(12, 1, generator=g, dtype=torch.float64) * 5 + 0.1
    b = torch.randn(12, 1, generator=g, dtype=torch.float64) * 3
    assert torch.allclose(pearson_similarity(a * z + b, zero_diag=True), W, atol=1e-10, rtol=0)
    # the official code's choice: w_ii = 1
    assert torch.allclose(pearson_similarity(z, zero_diag=False).diagonal(), torch.ones(12, dtype=z.dtype))


# --------------------------------------------------------------------------------------------
# degenerate-case equivalences and gradients
# --------------------------------------------------------------------------------------------
def test_zero_iterations_is_temperature_cross_entropy_on_unlabelled_samples():
    z, y = _batch(seed=4)
    loss = _loss(num_iterations=0, aux_ce_weight=0.0, temperature=5.0)
    r = loss.refine(z, y)
    u = ~r.anchors
    ce = F.cross_entropy(r.logits[u] / 5.0, y[u], reduction="sum") / len(y)  # anchors add -log(1 + 1e-12) ≈ 0
    assert abs(loss(z, y).item() - ce.item()) < 1e-9
    loss.nll_average = "non_anchors"
    assert abs(loss(z, y).item() - F.cross_entropy(r.logits[u] / 5.0, y[u]).item()) < 1e-9
    # the auxiliary cross-entropy of the official code adds CE on the raw logits
    loss.nll_average, loss.aux_ce_weight = "batch", 0.5
    assert abs(loss(z, y).item() - (ce + 0.5 * F.cross_entropy(r.logits, y)).item()) < 1e-9


def test_all_anchors_give_zero_group_term():
    z, y = _batch(seed=5)
    loss = _loss(num_iterations=2, aux_ce_weight=0.0, anchors_per_class=9)
    assert loss(z, y).item() < 1e-11


def test_gradients_reach_embeddings_and_classifier_but_not_anchor_logits():
    z, y = _batch(seed=6)
    loss = _loss(num_iterations=2, aux_ce_weight=0.0)
    zz = z.clone().requires_grad_()
    r = loss.refine(zz, y)
    r.logits.retain_grad()
    loss.loss_from(r).backward()
    assert zz.grad.abs().sum() > 0 and loss.classifier.weight.grad.abs().sum() > 0
    assert (r.logits.grad[r.anchors] == 0).all()
    assert (r.logits.grad[~r.anchors].abs().sum(1) > 0).all()
    # with a uniform prior the classifier plays no role, and z still gets gradient through W alone
    loss.zero_grad()
    zz = z.clone().requires_grad_()
    with torch.no_grad():
        loss.classifier.weight.zero_()
        loss.classifier.bias.zero_()
    loss(zz, y).backward()
    assert zz.grad.abs().sum() > 0


def test_gradcheck_float64():
    loss = _loss(C=4, D=5, num_iterations=2, anchors_per_class=1)
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    params = {n: p.detach().clone().requires_grad_() for n, p in loss.named_parameters()}

    def fn(zz, w, b):
        return torch.func.functional_call(loss, {"classifier.weight": w, "classifier.bias": b}, (zz, y))

    assert torch.autograd.gradcheck(fn, (z, params["classifier.weight"], params["classifier.bias"]))


# --------------------------------------------------------------------------------------------
# permutations: what invariance holds (anchors depend on the within-class order)
# --------------------------------------------------------------------------------------------
def test_permutation_invariance_given_the_same_anchors():
    z, y = _batch(seed=8)
    loss = _loss(num_iterations=3)
    reference = loss(z, y)
    anchors = anchor_mask(y, 2)
    # (a) any permutation, anchors passed along explicitly
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    assert abs(loss(z[perm], y[perm], anchors=anchors[perm]).item() - reference.item()) < 1e-12
    # (b) a permutation keeping each class's within-class order: the default anchors are the same samples
    order = torch.argsort(y, stable=True)  # group by class, stable inside each class
    assert torch.equal(anchor_mask(y[order], 2), anchors[order])
    assert abs(loss(z[order], y[order]).item() - reference.item()) < 1e-12
    # (c) reversing the batch changes the within-class order, hence which samples are anchors
    rev = torch.arange(len(y) - 1, -1, -1)
    assert not torch.equal(anchor_mask(y[rev], 2), anchors[rev])


# --------------------------------------------------------------------------------------------
# metadata and errors
# --------------------------------------------------------------------------------------------
def test_metadata():
    info = loss_info("group_loss")
    assert info.learnable and info.own_optimizer
    assert (info.batch.classes_per_batch, info.batch.m, info.batch.anchors_per_class) == (6, 9, 2)
    assert info.loss_weight_decay == 1e-6
    loss = build_loss("group_loss", num_classes=7, embedding_dim=3)
    assert loss.anchors_per_class == info.batch.anchors_per_class
    assert {n: tuple(p.shape) for n, p in loss.named_parameters()} == {
        "classifier.weight": (7, 3),
        "classifier.bias": (7,),
    }


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"'group_loss'.*temperature must be a finite number > 0"):
        build_loss("group_loss", num_classes=4, embedding_dim=8, temperature=0.0)
    with pytest.raises(ValueError, match=r"'group_loss'.*num_iterations must be an integer >= 0"):
        build_loss("group_loss", num_classes=4, embedding_dim=8, num_iterations=1.5)
    with pytest.raises(ValueError, match=r"'group_loss'.*anchors_per_class must be an integer >= 0"):
        build_loss("group_loss", num_classes=4, embedding_dim=8, anchors_per_class=-1)
    with pytest.raises(ValueError, match=r"'group_loss'.*nll_average must be one of"):
        build_loss("group_loss", num_classes=4, embedding_dim=8, nll_average="mean")
    with pytest.raises(ValueError, match=r"'group_loss'.*zero_diag must be true or false"):
        build_loss("group_loss", num_classes=4, embedding_dim=8, zero_diag=1)
    loss = build_loss("group_loss", num_classes=4, embedding_dim=8)
    with pytest.raises(ValueError, match=r"class id 7, outside \[0, num_classes=4\)"):
        loss(torch.randn(3, 8), torch.tensor([0, 1, 7]))
    with pytest.raises(ValueError, match=r"anchors must be a bool tensor of shape \(3,\)"):
        loss(torch.randn(3, 8), torch.tensor([0, 1, 2]), anchors=torch.tensor([1, 0, 0]))
