"""Spherical Embedding Constraint (SEC) / L2-reg wrappers and the SEC paper's base losses.

Property tests of the paper's equations and statements; equation, proposition and appendix numbers are the paper's
(Zhang et al., NeurIPS 2020; docs/losses/sec.md).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dml_core.losses import build_loss, loss_info
from dml_core.losses.baselines import MultiSimilarity, Triplet
from dml_core.losses.sec import (
    L2NormRegularizer,
    NormalizedNPair,
    SemihardTriplet,
    SphericalEmbeddingConstraint,
    l2_norm_regularizer,
    spherical_embedding_constraint,
)

torch.set_num_threads(1)

KW = dict(num_classes=8, embedding_dim=16)


def _batch(classes=4, per_class=3, dim=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(classes * per_class, dim, generator=g, dtype=dtype)
    f = f * (0.5 + 3 * torch.rand(len(f), 1, generator=g, dtype=dtype))  # spread the norms
    labels = torch.arange(classes).repeat_interleave(per_class)
    return f, labels


def _unit2d(degrees, norms=None):
    """2-D embeddings at the given angles (raw norms given separately: the losses must normalise)."""
    rad = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    f = torch.stack([torch.cos(rad), torch.sin(rad)], dim=1)
    return f if norms is None else f * torch.tensor(norms, dtype=torch.float64)[:, None]


def _cos(deg):
    return math.cos(math.radians(deg))


# ---------------------------------------------------------------------------------------------
# SEC is the batch variance of the norms (Eq. 17)
# ---------------------------------------------------------------------------------------------
def test_sec_zero_at_equal_norms_and_equals_norm_variance():
    f, _ = _batch(classes=10, per_class=12, dim=32)  # B = 120 as in the paper
    n = f.norm(dim=1)
    assert spherical_embedding_constraint(f).item() == pytest.approx(n.var(unbiased=False).item(), rel=1e-12)
    assert spherical_embedding_constraint(f).item() > 0.1
    same_norm = 2.7 * F.normalize(f, dim=1)
    assert spherical_embedding_constraint(same_norm).item() == pytest.approx(0.0, abs=1e-12)
    # SEC attached after normalisation does nothing (docs/losses/sec.md §Ambiguities resolved, "Where SEC attaches")
    assert spherical_embedding_constraint(F.normalize(f, dim=1)).item() == pytest.approx(0.0, abs=1e-12)


def test_sec_scales_quadratically_and_is_permutation_and_rotation_invariant():
    f, _ = _batch(dim=8)
    base = spherical_embedding_constraint(f)
    assert spherical_embedding_constraint(3.0 * f).item() == pytest.approx(9.0 * base.item(), rel=1e-10)
    perm = torch.randperm(len(f), generator=torch.Generator().manual_seed(1))
    assert spherical_embedding_constraint(f[perm]).item() == pytest.approx(base.item(), rel=1e-12)
    q, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    assert spherical_embedding_constraint(f @ q).item() == pytest.approx(base.item(), rel=1e-10)


# ---------------------------------------------------------------------------------------------
# gradient = Eq. 18, radial, gradcheck
# ---------------------------------------------------------------------------------------------
def test_sec_gradient_matches_eq18_with_and_without_detached_mu():
    f, _ = _batch(dim=8)
    f.requires_grad_(True)
    (g_detached,) = torch.autograd.grad(spherical_embedding_constraint(f), f)
    n = f.norm(dim=1)
    not_detached = (n - n.mean()).pow(2).mean()  # μ kept in the graph
    (g_graph,) = torch.autograd.grad(not_detached, f)
    with torch.no_grad():
        n = f.norm(dim=1)
        eq18 = (2.0 / len(f)) * (n - n.mean())[:, None] * f / n[:, None]
    torch.testing.assert_close(g_detached, eq18, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_graph, eq18, rtol=1e-10, atol=1e-12)
    # Eq. 18: the gradient is radial, (I − f̂ f̂ᵀ) g = 0 for every row
    f_hat = F.normalize(f.detach(), dim=1)
    tangential = g_detached - (g_detached * f_hat).sum(1, keepdim=True) * f_hat
    assert tangential.abs().max().item() < 1e-12


def test_sec_wrapper_gradcheck():
    torch.manual_seed(0)
    loss = build_loss("sec:npair", num_classes=3, embedding_dim=3, sec_eta=0.7, scale=2.0).double()
    f = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    assert torch.autograd.gradcheck(lambda x: loss(x, labels), (f,))
    assert torch.autograd.gradcheck(lambda x: spherical_embedding_constraint(x), (f,))


# ---------------------------------------------------------------------------------------------
# one SGD step on SEC alone contracts norms radially (Eq. 18); EMA variant (App. D, Eq. 31)
# ---------------------------------------------------------------------------------------------
def test_sgd_step_on_sec_pulls_norms_to_the_mean_without_turning():
    f, _ = _batch(dim=8)
    f.requires_grad_(True)
    (g,) = torch.autograd.grad(spherical_embedding_constraint(f), f)
    lr = 0.5
    n0 = f.detach().norm(dim=1)
    mu = n0.mean()
    f1 = f.detach() - lr * g
    n1 = f1.norm(dim=1)
    N = len(f)
    torch.testing.assert_close(n1 - mu, (1 - 2 * lr / N) * (n0 - mu), rtol=1e-10, atol=1e-12)
    assert ((n1 - mu).abs() < (n0 - mu).abs()).all()
    assert n1.var(unbiased=False) < n0.var(unbiased=False)
    assert n1.mean().item() == pytest.approx(mu.item(), rel=1e-12)
    cos_old_new = F.cosine_similarity(f1, f.detach(), dim=1)
    assert (cos_old_new > 1 - 1e-12).all()


def test_sec_ema_rho_one_is_sec_and_rho_zero_freezes_first_batch_mean():
    f1, labels = _batch(seed=1)
    f2, _ = _batch(seed=2)
    zero_base = build_loss("triplet", **KW, margin=-10.0).double()  # the hinge never fires: base loss = 0
    plain = SphericalEmbeddingConstraint(zero_base, eta=1.0)
    ema1 = SphericalEmbeddingConstraint(zero_base, eta=1.0, rho=1.0)
    for f in (f1, f2):
        assert ema1(f, labels).item() == pytest.approx(plain(f, labels).item(), rel=1e-12)
        assert plain(f, labels).item() == pytest.approx(f.norm(dim=1).var(unbiased=False).item(), rel=1e-12)

    frozen = SphericalEmbeddingConstraint(zero_base, eta=1.0, rho=0.0).double()
    mu0 = f1.norm(dim=1).mean()
    frozen(f1, labels)
    value = frozen(f2, labels)
    assert frozen.mu.item() == pytest.approx(mu0.item(), rel=1e-12)
    assert value.item() == pytest.approx((f2.norm(dim=1) - mu0).pow(2).mean().item(), rel=1e-12)


def test_sec_ema_update_order_detached_gradient_buffer_and_eval_mode():
    f1, labels = _batch(seed=1)
    f2, _ = _batch(seed=2)
    rho = 0.3
    wrapper = build_loss("sec:triplet", **KW, margin=-10.0, sec_eta=1.0, sec_rho=rho).double()
    wrapper(f1, labels)
    m1 = f1.norm(dim=1).mean()
    # Eq. 31, μ updated *before* L_sec from the current batch's mean
    mu2 = (1 - rho) * m1 + rho * f2.norm(dim=1).mean()
    x = f2.clone().requires_grad_(True)
    value = wrapper(x, labels)
    assert wrapper.mu.item() == pytest.approx(mu2.item(), rel=1e-12)
    assert value.item() == pytest.approx((f2.norm(dim=1) - mu2).pow(2).mean().item(), rel=1e-12)
    (g,) = torch.autograd.grad(value, x)
    n = f2.norm(dim=1)
    torch.testing.assert_close(g, (2 / len(n)) * (n - mu2)[:, None] * f2 / n[:, None])  # detached μ_t
    assert "mu" in wrapper.state_dict() and "mu_initialized" in wrapper.state_dict()
    wrapper.eval()
    wrapper(f1, labels)
    assert wrapper.mu.item() == pytest.approx(mu2.item(), rel=1e-12)  # eval does not advance μ_t
    wrapper.reset_ema()
    wrapper.train()
    wrapper(f1, labels)
    assert wrapper.mu.item() == pytest.approx(m1.item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# L2-reg = SEC with μ = 0 (Eq. 30); the wrapper adds η·term on the raw embeddings
# ---------------------------------------------------------------------------------------------
def test_l2_reg_is_sec_with_mu_zero_and_has_gradient_two_f_over_n():
    f, _ = _batch(dim=8)
    f.requires_grad_(True)
    value = l2_norm_regularizer(f)
    assert value.item() == pytest.approx(f.detach().norm(dim=1).pow(2).mean().item(), rel=1e-12)
    assert value.item() == pytest.approx(spherical_embedding_constraint(f, mu=0.0).item(), rel=1e-12)
    (g,) = torch.autograd.grad(value, f)
    torch.testing.assert_close(g, 2 * f.detach() / len(f))


@pytest.mark.parametrize("base", ["triplet", "semihard_triplet", "npair", "multi_similarity"])
def test_wrappers_add_eta_times_term_to_the_base_loss_on_raw_embeddings(base):
    f, labels = _batch()
    torch.manual_seed(0)
    plain = build_loss(base, **KW).double()
    sec = build_loss(f"sec:{base}", **KW, sec_eta=0.5).double()
    sec_by_param = build_loss(base, **KW, sec_eta=0.5).double()
    l2 = build_loss(f"l2_reg:{base}", **KW, l2_reg_eta=1e-3).double()
    assert isinstance(sec, SphericalEmbeddingConstraint) and isinstance(l2, L2NormRegularizer)
    assert isinstance(sec_by_param, SphericalEmbeddingConstraint) and sec_by_param.eta == 0.5
    metric = plain(f, labels)
    # the base (angular) loss gets the same value from f and from F.normalize(f): only SEC sees norms
    assert plain(F.normalize(f, dim=1), labels).item() == pytest.approx(metric.item(), rel=1e-9)
    var = f.norm(dim=1).var(unbiased=False)
    assert sec(f, labels).item() == pytest.approx((metric + 0.5 * var).item(), rel=1e-10)
    assert sec_by_param(f, labels).item() == pytest.approx((metric + 0.5 * var).item(), rel=1e-10)
    assert l2(f, labels).item() == pytest.approx((metric + 1e-3 * f.pow(2).sum(1).mean()).item(), rel=1e-10)
    assert loss_info(f"sec:{base}") == loss_info(base)


def test_wrapper_keeps_learnable_parameters_and_rejects_bad_parameters():
    wrapped = build_loss("sec:cosface", num_classes=5, embedding_dim=4, sec_eta=0.25)
    names = [n for n, _ in wrapped.named_parameters()]
    assert names == ["base.loss.W"]
    both = build_loss("triplet", **KW, sec_eta=0.5, l2_reg_eta=1e-4)
    assert isinstance(both, SphericalEmbeddingConstraint) and isinstance(both.base, L2NormRegularizer)
    with pytest.raises(ValueError, match="sec_rhoo"):
        build_loss("sec:triplet", **KW, sec_rhoo=0.1)
    with pytest.raises(ValueError, match="sec_eta must be a finite number >= 0"):
        build_loss("sec:triplet", **KW, sec_eta=-1.0)
    with pytest.raises(ValueError, match=r"sec_rho must be a number in \[0, 1\]"):
        build_loss("sec:triplet", **KW, sec_rho=1.5)
    with pytest.raises(ValueError, match="l2_reg_eta"):
        build_loss("l2_reg:npair", **KW, l2_reg_eta=float("nan"))
    with pytest.raises(ValueError, match="embeddings must be a"):
        build_loss("sec:npair", **KW)(torch.randn(4), torch.zeros(4, dtype=torch.long))


def test_sec_in_half_precision_is_computed_in_fp32():
    f, labels = _batch(dtype=torch.float32)
    sec = build_loss("sec:npair", **KW, sec_eta=1.0)
    value = sec(f.half(), labels)
    assert value.dtype == torch.float32 and math.isfinite(value.item())
    assert spherical_embedding_constraint(f.half()).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# the angular base losses: gradient ⟂ f_i (Prop. 1, Eq. 5) and ∝ 1/||f_i|| (Eq. 1/4)
# ---------------------------------------------------------------------------------------------
SEC_BASES = {
    "triplet (T)": lambda: Triplet(**KW, margin=1.0, squared=True, reduction="all"),
    "semihard_triplet (SHT)": lambda: SemihardTriplet(**KW, margin=0.2),
    "npair (NNP)": lambda: NormalizedNPair(**KW, scale=25.0),
    "multi_similarity (MS)": lambda: MultiSimilarity(**KW, alpha=2.0, beta=40.0, base=0.5, epsilon=0.1),
}


@pytest.mark.parametrize("make", list(SEC_BASES.values()), ids=list(SEC_BASES))
def test_angular_base_loss_gradient_is_orthogonal_and_scales_inversely_with_norm(make):
    loss = make().double()
    f, labels = _batch(classes=4, per_class=3, dim=8, seed=3)
    x = f.clone().requires_grad_(True)
    value = loss(x, labels)
    (g,) = torch.autograd.grad(value, x)
    assert g.abs().max() > 1e-6, "test batch gives no gradient"
    radial = (g * f).sum(dim=1)
    assert radial.abs().max().item() < 1e-10 * max(1.0, g.abs().max().item())
    c, i = 3.5, 4
    scaled = f.clone()
    scaled[i] *= c
    y = scaled.requires_grad_(True)
    value_c = loss(y, labels)
    (g_c,) = torch.autograd.grad(value_c, y)
    assert value_c.item() == pytest.approx(value.item(), rel=1e-10)
    torch.testing.assert_close(g_c[i], g[i] / c)


def test_distance_identities_kappa_and_eq1():
    # Eqs. 1 and 4: ||f̂_i − f̂_j||² = 2 − 2 cos; ∂cos/∂f_i = (f̂_j − cos f̂_i)/||f_i||; κ = 2 for the distance
    f = torch.tensor([[3.0, 1.0, -2.0], [0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    fh = F.normalize(f, dim=1)
    cos = (fh[0] * fh[1]).sum()
    dist = (fh[0] - fh[1]).pow(2).sum()
    assert dist.item() == pytest.approx(2 - 2 * cos.item(), rel=1e-12)
    (g_cos,) = torch.autograd.grad(cos, f, retain_graph=True)
    (g_dist,) = torch.autograd.grad(dist, f)
    n0 = f[0].detach().norm()
    fh0, fh1 = fh[0].detach(), fh[1].detach()
    torch.testing.assert_close(g_cos[0], (fh1 - cos.detach() * fh0) / n0)
    torch.testing.assert_close(g_dist[0], (2 / n0) * (-fh1 + cos.detach() * fh0))


# ---------------------------------------------------------------------------------------------
# base losses against hand-computed values (reductions of docs/losses/sec.md §Base losses)
# ---------------------------------------------------------------------------------------------
# Four 2-D embeddings at 0°, 60°, 100°, 210° (labels 0, 0, 1, 1) with unequal raw norms.
ANGLES = [0.0, 60.0, 100.0, 210.0]
NORMS = [2.0, 0.5, 3.0, 1.3]
LABELS4 = torch.tensor([0, 0, 1, 1])


def test_vanilla_triplet_sec_reading_hand_computed():
    # D = ||f̂_a − f̂_b||² = 2 − 2cos.  With m = 1 the active triplets (a, p, n) are
    # (1,0,2): 2cos40 − 2cos60 + 1,  (2,3,0): 2cos100 − 2cos110 + 1,  (2,3,1): 2cos40 − 2cos110 + 1;
    # the other 5 of the B(K−1)(B−K) = 8 triplets are ≤ 0.  SEC code: mean over all 8
    # (Eq. 2, docs/losses/sec.md §Base losses).
    active = [
        2 * _cos(40) - 2 * _cos(60) + 1,
        2 * _cos(100) - 2 * _cos(110) + 1,
        2 * _cos(40) - 2 * _cos(110) + 1,
    ]
    f = _unit2d(ANGLES, NORMS)
    t = Triplet(**KW, margin=1.0, squared=True, reduction="all")
    assert t(f, LABELS4).item() == pytest.approx(sum(active) / 8, rel=1e-9)
    # the MLRC reading (mean over non-zero triplets) of the same squared distances
    t_nonzero = Triplet(**KW, margin=1.0, squared=True, reduction="nonzero")
    assert t_nonzero(f, LABELS4).item() == pytest.approx(sum(active) / 3, rel=1e-9)


def _semihard_reference(f, labels, margin):
    """Brute-force TF triplet_semihard_loss on squared normalised distances (docs/losses/sec.md §Base losses)."""
    fh = F.normalize(f, dim=1)
    D = 2 - 2 * fh @ fh.T
    total, count = 0.0, 0
    for a in range(len(f)):
        for p in range(len(f)):
            if a == p or labels[a] != labels[p]:
                continue
            negs = [D[a, n].item() for n in range(len(f)) if labels[n] != labels[a]]
            outside = [d for d in negs if d > D[a, p].item()]
            d_neg = min(outside) if outside else max(negs)
            total += max(0.0, margin + D[a, p].item() - d_neg)
            count += 1
    return total / count


def test_semihard_triplet_hand_computed_and_brute_force():
    f = _unit2d(ANGLES, NORMS)
    # m = 0.2: only pair (2,3) is active; no negative of anchor 2 is farther than D_23 = 2 − 2cos110,
    # so the farthest negative D_20 = 2 − 2cos100 is used: 0.2 + 2cos100 − 2cos110.  Mean over 4 pairs.
    expected = (0.2 + 2 * _cos(100) - 2 * _cos(110)) / 4
    assert SemihardTriplet(**KW, margin=0.2)(f, LABELS4).item() == pytest.approx(expected, rel=1e-9)
    # m = 1.5: pair (0,1) takes the *closest* semi-hard negative D_02 (not D_03); pair (1,0) skips the
    # easy-but-inside D_12 and takes D_13; (2,3) the farthest negative; (3,2) D_30 = D_31.
    expected = (
        (1.5 + (2 - 2 * _cos(60)) - (2 - 2 * _cos(100)))
        + max(0.0, 1.5 + (2 - 2 * _cos(60)) - (2 - 2 * _cos(150)))
        + (1.5 + 2 * _cos(100) - 2 * _cos(110))
        + (1.5 + (2 - 2 * _cos(110)) - (2 - 2 * _cos(150)))
    ) / 4
    assert SemihardTriplet(**KW, margin=1.5)(f, LABELS4).item() == pytest.approx(expected, rel=1e-9)
    f, labels = _batch(classes=5, per_class=3, dim=6, seed=7)
    for m in (0.2, 0.8):
        got = SemihardTriplet(**KW, margin=m)(f, labels).item()
        assert got == pytest.approx(_semihard_reference(f, labels, m), rel=1e-9)


def test_semihard_triplet_degenerate_batches_give_zero_with_graph():
    loss = SemihardTriplet(**KW)
    f = torch.randn(4, 5, requires_grad=True)
    for labels in (torch.zeros(4, dtype=torch.long), torch.arange(4)):  # no negatives / no positives
        value = loss(f, labels)
        assert value.item() == 0.0 and value.requires_grad


def test_npair_hand_computed_structure():
    # anchors = first sample of each class, positives = second; negatives of a_c = other classes' positives
    f = _unit2d([0.0, 30.0, 90.0, 150.0], [1.0, 2.0, 0.7, 1.9])
    for s in (1.0, 25.0):
        class0 = math.log1p(math.exp(s * (_cos(150) - _cos(30))))  # a0 = 0°, p0 = 30°, p1 = 150°
        class1 = math.log1p(math.exp(s * (_cos(60) - _cos(60))))  # a1 = 90°: cos to p0 and p1 both 0.5
        got = NormalizedNPair(**KW, scale=s)(f, LABELS4).item()
        assert got == pytest.approx((class0 + class1) / 2, rel=1e-9)


def test_npair_uses_first_two_samples_per_class_and_skips_singletons():
    torch.manual_seed(0)
    f = torch.randn(9, 5, dtype=torch.float64)
    labels = torch.tensor([2, 0, 2, 0, 2, 0, 1, 3, 3])  # class 1 is a singleton; 3rd samples unused
    a, p = NormalizedNPair.anchor_positive_indices(labels)
    assert a.tolist() == [1, 0, 7] and p.tolist() == [3, 2, 8]
    loss = NormalizedNPair(**KW, scale=4.0)
    fh = F.normalize(f, dim=1)
    logits = 4.0 * fh[[1, 0, 7]] @ fh[[3, 2, 8]].T
    expected = torch.stack([torch.logsumexp(logits[c], 0) - logits[c, c] for c in range(3)]).mean()
    assert loss(f, labels).item() == pytest.approx(expected.item(), rel=1e-12)
    changed = f.clone()
    changed[4] += 10.0  # a third sample of class 2 does not enter the loss
    assert loss(changed, labels).item() == pytest.approx(expected.item(), rel=1e-12)
    order = torch.tensor([6, 7, 1, 8, 0, 3, 2, 5, 4])  # shuffle keeping each class's internal order
    assert loss(f[order], labels[order]).item() == pytest.approx(expected.item(), rel=1e-12)
    assert loss(f[:2], labels[:2]).item() == 0.0  # no class with two samples


def _ms_official_reference(f, labels, alpha, beta, lam, eps):
    """The multi-similarity loss + mining loop of the official MS code (docs/losses/sec.md §Base losses)
    (self excluded by index; anchors with an empty mined set skipped; sum / B)."""
    S = F.normalize(f, dim=1) @ F.normalize(f, dim=1).T
    total = 0.0
    for i in range(len(f)):
        pos = [S[i, j].item() for j in range(len(f)) if j != i and labels[j] == labels[i]]
        neg = [S[i, k].item() for k in range(len(f)) if labels[k] != labels[i]]
        if not pos or not neg:
            continue
        neg_m = [s for s in neg if s + eps > min(pos)]
        pos_m = [s for s in pos if s - eps < max(neg)]
        if not neg_m or not pos_m:
            continue
        total += math.log1p(sum(math.exp(-alpha * (s - lam)) for s in pos_m)) / alpha
        total += math.log1p(sum(math.exp(beta * (s - lam)) for s in neg_m)) / beta
    return total / len(f)


def test_multi_similarity_sec_reading_hand_computed_and_official_loop():
    f = _unit2d(ANGLES, NORMS)
    # S_01 = cos60, S_12 = cos40, S_02 = cos100, S_23 = cos110, S_03 = cos210 = S_13 = cos150.
    # Anchor 0: no negative with S + 0.1 > 0.5 -> skipped.  Anchor 3: S_30 = S_31 = cos150, cos150 + 0.1 < cos110 ->
    # skipped.  Anchor 1: P' = {cos60}, N' = {cos40}.  Anchor 2: P' = {cos110}, N' = {cos100, cos40}.
    a, b, lam = 2.0, 40.0, 0.5
    l1 = math.log1p(math.exp(-a * (_cos(60) - lam))) / a + math.log1p(math.exp(b * (_cos(40) - lam))) / b
    l2 = (
        math.log1p(math.exp(-a * (_cos(110) - lam))) / a
        + math.log1p(math.exp(b * (_cos(100) - lam)) + math.exp(b * (_cos(40) - lam))) / b
    )
    ms = MultiSimilarity(**KW, alpha=a, beta=b, base=lam, epsilon=0.1)
    assert ms(f, LABELS4).item() == pytest.approx((l1 + l2) / 4, rel=1e-9)
    # random batches (K = 5 as in the paper): PML loss + miner == the official loop
    for seed in range(3):
        f, labels = _batch(classes=4, per_class=5, dim=6, seed=seed)
        f = f * 0.3
        got = ms(f, labels).item()
        assert got == pytest.approx(_ms_official_reference(f, labels, a, b, lam, 0.1), rel=1e-9)
