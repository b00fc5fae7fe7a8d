"""Reality-check baselines (dml_core/losses/baselines.py): equality with the PML classes MLRC used,
learnable parameters and metadata, one behavioural / hand-computed check per loss, input errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml
from pytorch_metric_learning import miners as pml_miners

from dml_core.losses import build_loss, loss_info

torch.set_num_threads(1)

C, D = 6, 8
KW = dict(num_classes=C, embedding_dim=D)
LEARNABLE = {"margin", "normalized_softmax", "cosface", "arcface"}
PAIR_BASED = {"contrastive", "triplet", "ntxent", "multi_similarity"}


def _batch(seed=0, classes=C, per_class=4, dim=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(classes * per_class, dim, generator=g, dtype=dtype) * 2.0
    labels = torch.arange(classes).repeat_interleave(per_class)
    return f, labels


def _unit2d(degrees, norms):
    rad = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return torch.stack([torch.cos(rad), torch.sin(rad)], 1) * torch.tensor(norms, dtype=torch.float64)[:, None]


# ---------------------------------------------------------------------------------------------
# metadata and parameters
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LEARNABLE | PAIR_BASED))
def test_metadata_and_parameters(name):
    info = loss_info(name)
    assert info.learnable == (name in LEARNABLE)
    assert info.own_optimizer == (name in LEARNABLE)
    assert (info.batch.classes_per_batch, info.batch.m) == (8, 4)  # MLRC: batch 32, m = 4
    assert (info.model.pooling, info.model.layer_norm) == ("avg", False)
    loss = build_loss(name, **KW)
    params = dict(loss.named_parameters())
    if name in LEARNABLE:
        assert params, f"{name}: learnable parameters must be parameters of the module"
        f, labels = _batch()
        loss(f, labels).backward()
        for pname, p in params.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}.{pname} gets no gradient"
    else:
        assert not params


def test_learnable_parameter_shapes():
    assert build_loss("normalized_softmax", **KW).loss.W.shape == (D, C)
    assert build_loss("cosface", **KW).loss.W.shape == (D, C)
    assert build_loss("arcface", **KW).loss.W.shape == (D, C)
    assert build_loss("margin", **KW, beta=0.7).loss.beta.shape == (1,)
    per_class = build_loss("margin", **KW, beta=0.7, beta_per_class=True)
    assert isinstance(per_class.loss.beta, torch.nn.Parameter) and per_class.loss.beta.shape == (C,)
    assert torch.allclose(per_class.loss.beta.detach(), torch.full((C,), 0.7))


# ---------------------------------------------------------------------------------------------
# equality with the PML class called directly (MLRC's implementation)
# ---------------------------------------------------------------------------------------------
PML_CASES = {
    "contrastive": (
        dict(pos_margin=0.1, neg_margin=0.8),
        lambda: pml.ContrastiveLoss(pos_margin=0.1, neg_margin=0.8),
        None,
    ),
    "triplet": (dict(margin=0.1), lambda: pml.TripletMarginLoss(margin=0.1), None),
    "ntxent": (dict(temperature=0.1), lambda: pml.NTXentLoss(temperature=0.1), None),
    "multi_similarity": (
        dict(alpha=3.0, beta=30.0, base=0.4),
        lambda: pml.MultiSimilarityLoss(alpha=3.0, beta=30.0, base=0.4),
        None,
    ),
    "multi_similarity+miner": (
        dict(alpha=2.0, beta=40.0, base=0.5, epsilon=0.1),
        lambda: pml.MultiSimilarityLoss(alpha=2.0, beta=40.0, base=0.5),
        lambda: pml_miners.MultiSimilarityMiner(epsilon=0.1),
    ),
    "margin": (dict(margin=0.1, beta=0.9), lambda: pml.MarginLoss(margin=0.1, beta=0.9, learn_beta=True), None),
    "margin/class": (
        dict(margin=0.1, beta=0.9, beta_per_class=True),
        lambda: pml.MarginLoss(margin=0.1, beta=0.9, learn_beta=True, num_classes=C),
        None,
    ),
    "normalized_softmax": (
        dict(temperature=0.1),
        lambda: pml.NormalizedSoftmaxLoss(num_classes=C, embedding_size=D, temperature=0.1),
        None,
    ),
    "cosface": (
        dict(margin=0.3, scale=20.0),
        lambda: pml.CosFaceLoss(num_classes=C, embedding_size=D, margin=0.3, scale=20.0),
        None,
    ),
    "arcface": (
        dict(margin=25.0, scale=20.0),
        lambda: pml.ArcFaceLoss(num_classes=C, embedding_size=D, margin=25.0, scale=20.0),
        None,
    ),
}


@pytest.mark.parametrize("case", list(PML_CASES))
def test_equals_pml_class_called_directly(case):
    name = case.split("+")[0].split("/")[0]
    params, make_pml, make_miner = PML_CASES[case]
    torch.manual_seed(0)
    ours = build_loss(name, **KW, **params)
    ref = make_pml()
    ref.load_state_dict(ours.loss.state_dict())  # same W / beta
    miner = make_miner() if make_miner else None
    for seed in range(2):
        f, labels = _batch(seed)
        x = f.clone().requires_grad_(True)
        r = f.clone().requires_grad_(True)
        value = ours(x, labels)
        expected = ref(r, labels, miner(r, labels) if miner else None)
        value.backward()
        expected.backward()
        assert value.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
        assert value.item() != 0.0
        torch.testing.assert_close(x.grad, r.grad)
        for (_, p), (_, q) in zip(ours.loss.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad)


# ---------------------------------------------------------------------------------------------
# behaviour / hand-computed values
# ---------------------------------------------------------------------------------------------
def test_contrastive_zero_when_margins_are_met_and_hand_value_otherwise():
    # classes at 0° and 90°: d_pos = ||f̂_0 − f̂_1|| = 2 sin(5°) ≈ 0.174, d_neg ≥ 2 sin(40°) ≈ 1.29
    f = _unit2d([0.0, 10.0, 90.0, 100.0], [1.0, 3.0, 0.5, 2.0])
    labels = torch.tensor([0, 0, 1, 1])
    assert build_loss("contrastive", **KW, pos_margin=0.2, neg_margin=1.2)(f, labels).item() == 0.0
    # pos_margin 0: each positive pair contributes d_pos; neg_margin 1.5: negatives at 80°, 90°, 100°
    loss = build_loss("contrastive", **KW, pos_margin=0.0, neg_margin=1.5)(f, labels).item()
    d_pos = 2 * math.sin(math.radians(5))
    d_neg = [2 * math.sin(math.radians(a / 2)) for a in (90, 100, 80, 90)]  # (0,2) (0,3) (1,2) (1,3)
    neg_terms = [1.5 - d for d in d_neg if 1.5 - d > 0]
    assert loss == pytest.approx(d_pos + sum(neg_terms) / len(neg_terms), rel=1e-9)  # mean of non-zero per term


def test_triplet_default_is_mlrc_reading_zero_when_margin_met():
    f = _unit2d([0.0, 10.0, 90.0, 100.0], [1.0, 3.0, 0.5, 2.0])
    labels = torch.tensor([0, 0, 1, 1])
    t = build_loss("triplet", **KW)
    assert (t.squared, t.reduction, t.loss.margin) == (False, "nonzero", 0.05)
    assert t(f, labels).item() == 0.0  # d_an − d_ap ≥ 1.29 − 0.17 > 0.05
    # margin 1.5: every triplet (a, p, n) has d_ap − d_an + 1.5 > 0; mean over the 8 non-zero ones
    d_ap = 2 * math.sin(math.radians(5))
    d_an = {(0, 2): 90, (0, 3): 100, (1, 2): 80, (1, 3): 90, (2, 0): 90, (2, 1): 80, (3, 0): 100, (3, 1): 90}
    terms = [d_ap - 2 * math.sin(math.radians(a / 2)) + 1.5 for a in d_an.values()]
    assert all(v > 0 for v in terms)
    got = build_loss("triplet", **KW, margin=1.5)(f, labels).item()
    assert got == pytest.approx(sum(terms) / len(terms), rel=1e-9)


def test_ntxent_hand_computed():
    f = _unit2d([0.0, 30.0, 90.0, 150.0], [1.0, 2.0, 0.7, 1.9])
    labels = torch.tensor([0, 0, 1, 1])
    tau = 0.5
    deg = [0.0, 30.0, 90.0, 150.0]
    terms = []
    for a, p in ((0, 1), (1, 0), (2, 3), (3, 2)):
        s = lambda j: math.cos(math.radians(deg[a] - deg[j])) / tau  # noqa: E731
        negs = [j for j in range(4) if labels[j] != labels[a]]
        terms.append(-(s(p) - math.log(math.exp(s(p)) + sum(math.exp(s(n)) for n in negs))))
    got = build_loss("ntxent", **KW, temperature=tau)(f, labels).item()
    assert got == pytest.approx(sum(terms) / 4, rel=1e-6)


def test_multi_similarity_without_miner_hand_computed():
    f = _unit2d([0.0, 30.0, 90.0, 150.0], [1.0, 2.0, 0.7, 1.9])
    labels = torch.tensor([0, 0, 1, 1])
    a, b, lam = 2.0, 10.0, 0.5
    deg = [0.0, 30.0, 90.0, 150.0]
    S = lambda i, j: math.cos(math.radians(deg[i] - deg[j]))  # noqa: E731
    total = 0.0
    for i in range(4):
        pos = [S(i, j) for j in range(4) if j != i and labels[j] == labels[i]]
        neg = [S(i, j) for j in range(4) if labels[j] != labels[i]]
        total += math.log1p(sum(math.exp(-a * (s - lam)) for s in pos)) / a
        total += math.log1p(sum(math.exp(b * (s - lam)) for s in neg)) / b
    got = build_loss("multi_similarity", **KW, alpha=a, beta=b, base=lam)(f, labels).item()
    assert got == pytest.approx(total / 4, rel=1e-9)


def test_margin_zero_inside_boundary_and_beta_learns():
    f = _unit2d([0.0, 10.0, 90.0, 100.0], [1.0, 3.0, 0.5, 2.0])
    labels = torch.tensor([0, 0, 1, 1])
    # d_ap ≈ 0.17 < β − margin = 0.5 and d_an ≥ 1.29 > β + margin = 0.9: no term is active
    assert build_loss("margin", **KW, beta=0.7, margin=0.2)(f, labels).item() == 0.0
    loss = build_loss("margin", **KW, beta=1.2, margin=0.2)  # negatives at 80° are inside β + margin
    value = loss(f, labels)
    assert value.item() > 0
    value.backward()
    beta_before = loss.loss.beta.detach().clone()
    with torch.no_grad():
        loss.loss.beta -= 0.1 * loss.loss.beta.grad  # one SGD step
    assert loss.loss.beta.item() < beta_before.item()  # active negatives push β down
    per_class = build_loss("margin", **KW, beta=1.2, margin=0.2, beta_per_class=True)
    per_class(f, labels).backward()
    grad = per_class.loss.beta.grad
    assert grad[:2].abs().min() > 0 and grad[2:].abs().max() == 0  # only the batch's classes 0, 1


def test_normalized_softmax_and_cosface_hand_computed_from_weights():
    torch.manual_seed(0)
    f, labels = _batch(dtype=torch.float64)
    ns = build_loss("normalized_softmax", **KW, temperature=0.2).double()
    cos = F.normalize(f, dim=1) @ F.normalize(ns.loss.W.detach(), dim=0)  # (B, C) = cos θ_{i,k}
    assert ns(f, labels).item() == pytest.approx(F.cross_entropy(cos / 0.2, labels).item(), rel=1e-9)
    cf = build_loss("cosface", **KW, margin=0.35, scale=30.0).double()
    cos = F.normalize(f, dim=1) @ F.normalize(cf.loss.W.detach(), dim=0)
    logits = 30.0 * (cos - 0.35 * F.one_hot(labels, C).to(cos))  # SEC paper Eq. 19: s(cos θ_{i,y_i} − m)
    assert cf(f, labels).item() == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-9)
    # embeddings on their class weights with a small temperature: near-zero loss
    on_weights = ns.loss.W.detach().T[labels] * 3.0
    assert ns(on_weights, labels).item() < ns(f, labels).item()


def test_arcface_margin_in_degrees_hand_computed_and_finite_when_parallel():
    torch.manual_seed(0)
    f, labels = _batch(dtype=torch.float64)
    af = build_loss("arcface", **KW, margin=30.0, scale=16.0).double()
    cos = F.normalize(f, dim=1) @ F.normalize(af.loss.W.detach(), dim=0)
    theta = torch.acos(cos.gather(1, labels[:, None]))
    target = torch.cos(theta + math.radians(30.0))  # θ + m ≤ 180° for these samples
    assert (theta + math.radians(30.0) <= math.pi).all()
    logits = 16.0 * cos.scatter(1, labels[:, None], target)
    assert af(f, labels).item() == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-9)
    # an embedding exactly on its class weight: arccos'(1) = ∞ — the clamp keeps gradients finite
    af32 = build_loss("arcface", **KW, margin=0.0, scale=64.0)
    x = af32.loss.W.detach().T[labels].clone().requires_grad_(True)
    value = af32(x, labels)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(x.grad).all() and torch.isfinite(af32.loss.W.grad).all()


# ---------------------------------------------------------------------------------------------
# precision, errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LEARNABLE | PAIR_BASED))
def test_float64_and_half_inputs(name):
    torch.manual_seed(0)
    f, labels = _batch(dtype=torch.float64)
    loss = build_loss(name, **KW).double()
    x = f.clone().requires_grad_(True)
    value = loss(x, labels)
    value.backward()
    assert value.dtype == torch.float64 and torch.isfinite(x.grad).all()
    loss32 = build_loss(name, **KW)
    half = loss32(f.half(), labels)  # AMP-style input: computed in fp32, parameters stay fp32
    assert half.dtype == torch.float32 and math.isfinite(half.item())
    assert all(p.dtype == torch.float32 for p in loss32.parameters())


def test_bad_parameters_and_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"loss 'triplet': unknown parameter\(s\) temprature"):
        build_loss("triplet", **KW, temprature=0.1)
    with pytest.raises(ValueError, match="loss 'ntxent': temperature must be a finite number > 0, got 0.0"):
        build_loss("ntxent", **KW, temperature=0.0)
    with pytest.raises(ValueError, match="loss 'triplet': reduction must be one of"):
        build_loss("triplet", **KW, reduction="sum")
    with pytest.raises(ValueError, match="loss 'triplet': squared must be true or false"):
        build_loss("triplet", **KW, squared="yes")
    with pytest.raises(
        ValueError, match=r"loss 'multi_similarity': epsilon must be a finite number >= 0 \(or null for no miner\)"
    ):
        build_loss("multi_similarity", **KW, epsilon=-0.1)
    with pytest.raises(ValueError, match="loss 'cosface': scale must be a finite number > 0, got -1.0"):
        build_loss("cosface", **KW, scale=-1.0)
    with pytest.raises(ValueError, match="loss 'contrastive': num_classes must be an integer >= 1, got 0"):
        build_loss("contrastive", num_classes=0, embedding_dim=4)
    f, labels = _batch()
    with pytest.raises(ValueError, match=r"loss 'cosface': labels contain class id 6, outside \[0, num_classes=6\)"):
        build_loss("cosface", **KW)(f, labels + 1)
    with pytest.raises(ValueError, match="loss 'margin': labels contain class id -1"):
        build_loss("margin", **KW, beta_per_class=True)(f, labels - 1)
    with pytest.raises(ValueError, match="loss 'triplet': labels must be integer class ids"):
        build_loss("triplet", **KW)(f, labels.float())
    with pytest.raises(ValueError, match=r"loss 'ntxent': labels must be a \(24,\) tensor"):
        build_loss("ntxent", **KW)(f, labels[:5])
    with pytest.raises(ValueError, match="loss 'contrastive': embeddings must be floating point"):
        build_loss("contrastive", **KW)(labels[:, None], labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(LEARNABLE | PAIR_BASED))
def test_cuda_matches_cpu(name):
    torch.manual_seed(0)
    cpu = build_loss(name, **KW, sec_eta=0.5)
    gpu = build_loss(name, **KW, sec_eta=0.5)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    f, labels = _batch()
    x = f.cuda().requires_grad_(True)
    value = gpu(x, labels.cuda())
    value.backward()
    assert value.item() == pytest.approx(cpu(f, labels).item(), rel=1e-4, abs=1e-5)
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    assert torch.isfinite(x.grad).all()


def test_contrastive_warns_when_its_negative_term_can_never_act():
    """A distance is >= 0, so [neg_margin - d]_+ with neg_margin <= 0 is always 0: legal, but worth a word."""
    import warnings

    from dml_core.losses import build_loss

    with pytest.warns(UserWarning, match="neg_margin=-0.1 <= 0 on a distance: the negative term can never act"):
        build_loss("contrastive", num_classes=4, embedding_dim=8, neg_margin=-0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_loss("contrastive", num_classes=4, embedding_dim=8, neg_margin=0.5)
