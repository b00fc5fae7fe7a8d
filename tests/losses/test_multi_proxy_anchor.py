"""MPA family (mpa, mpa_dw, mpa_ap), SoftTriple and ProxyAnchor.

External anchors: pytorch-metric-learning's ProxyAnchorLoss / SoftTripleLoss, and the closed forms
and properties of the MPA paper's equations (Eqs. 1, 3, 6, 8, 12, 14-18; docs/losses/multi_proxy_anchor.md
§Identities).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning.losses import ProxyAnchorLoss, SoftTripleLoss

from dml_core.losses import build_loss, loss_info
from dml_core.losses.multi_proxy_anchor import (
    mpa_ap_similarity_losses,
    mpa_dw_similarity_losses,
    mpa_similarity_loss,
    pooled_class_similarity,
    proxy_regularizer,
    soft_triple_similarity_losses,
)

torch.set_num_threads(1)
MPA_FAMILY = ("mpa", "mpa_dw", "mpa_ap")
ALL = MPA_FAMILY + ("soft_triple", "proxy_anchor")


def _batch(B=24, D=32, C=9, seed=0, present=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=dtype)
    classes = present if present is not None else C
    y = torch.randint(0, classes, (B,), generator=g)
    return x, y


def _build(name, C, D, seed=0, **params):
    torch.manual_seed(seed)
    return build_loss(name, num_classes=C, embedding_dim=D, **params).double()


# --------------------------------------------------------------------------------------------
# K = 1 reduces to ProxyAnchor (MPA paper §3.2; PML ProxyAnchorLoss as the external reference)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.1, 1.0])
def test_mpa_with_one_proxy_equals_pml_proxy_anchor(gamma):
    C, D = 9, 32
    x, y = _batch(C=C, D=D, present=6)  # classes 6..8 absent: |C+| = 6 but the negative term averages over C = 9
    mpa = _build("mpa", C, D, num_proxies=1, alpha=32.0, delta=0.1, gamma=gamma, tau=0.2)
    pml = ProxyAnchorLoss(num_classes=C, embedding_size=D, margin=0.1, alpha=32.0)
    pml.proxies.data = mpa.proxies.detach()[:, 0, :].clone()

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = mpa(x1, y), pml(x2, y)
    assert abs(ours.item() - ref.item()) < 1e-12
    ours.backward()
    ref.backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-12, rtol=0)
    assert torch.allclose(mpa.proxies.grad[:, 0, :], pml.proxies.grad, atol=1e-12, rtol=0)
    assert proxy_regularizer(mpa.proxies).item() == 0.0


def test_proxy_anchor_loss_equals_pml_and_mpa_k1():
    C, D = 7, 16
    x, y = _batch(B=20, C=C, D=D, seed=3)
    pa = _build("proxy_anchor", C, D, alpha=16.0, margin=0.2)
    pml = ProxyAnchorLoss(num_classes=C, embedding_size=D, margin=0.2, alpha=16.0)
    pml.proxies.data = pa.proxies.detach()[:, 0, :].clone()
    mpa = _build("mpa", C, D, num_proxies=1, alpha=16.0, delta=0.2)
    mpa.proxies.data.copy_(pa.proxies.data)
    assert abs(pa(x, y).item() - pml(x, y).item()) < 1e-12
    assert abs(pa(x, y).item() - mpa(x, y).item()) < 1e-12


# --------------------------------------------------------------------------------------------
# SoftTriple: PML SoftTripleLoss for the similarity part; MLRC-era PML regulariser formula
# --------------------------------------------------------------------------------------------
def _mlrc_era_center_reg(proxies, eps):
    """MLRC-era PML: sum over same-class upper-triangle centre pairs of sqrt(2+eps-2cos) / (2 * #pairs)."""
    C, K, D = proxies.shape
    fc = F.normalize(proxies.reshape(C * K, D), dim=1)
    same_class_upper = torch.zeros(C * K, C * K, dtype=torch.bool)
    for c in range(C):
        same_class_upper[c * K : (c + 1) * K, c * K : (c + 1) * K] = torch.ones(K, K).triu(diagonal=1).bool()
    sims = (fc @ fc.t())[same_class_upper]
    return torch.sqrt(2.0 + eps - 2.0 * sims).sum() / (2 * same_class_upper.sum())


@pytest.mark.parametrize("la,gamma,margin,K", [(20.0, 0.1, 0.01, 10), (3.0, 1.5, 0.3, 3)])
def test_soft_triple_equals_pml_soft_triple(la, gamma, margin, K):
    C, D = 6, 16
    x, y = _batch(B=18, C=C, D=D, seed=1)
    ours = _build("soft_triple", C, D, la=la, gamma=gamma, margin=margin, reg_weight=0.0, num_proxies=K)
    pml = SoftTripleLoss(num_classes=C, embedding_size=D, centers_per_class=K, la=la, gamma=gamma, margin=margin)
    pml.fc.data = ours.proxies.detach().reshape(C * K, D).t().clone()  # PML: (D, C*K), class-major columns
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ours(x1, y), pml(x2, y)
    assert abs(a.item() - b.item()) < 1e-12
    a.backward()
    b.backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-12, rtol=0)

    # PML 2.x dropped SoftTriple's centre regulariser; MLRC-era PML had it with weight reg_weight.
    ours_reg = _build("soft_triple", C, D, la=la, gamma=gamma, margin=margin, reg_weight=0.35, num_proxies=K)
    ours_reg.proxies.data.copy_(ours.proxies.data)
    expected = b.item() + 0.35 * _mlrc_era_center_reg(ours.proxies.detach(), 1e-5).item()
    assert abs(ours_reg(x, y).item() - expected) < 1e-12


def test_soft_triple_init_matches_pml_layout():
    """Same seed → same centres as PML's (D, C·K) kaiming_uniform init, in class-major order."""
    C, D, K = 5, 8, 3
    torch.manual_seed(11)
    ours = build_loss("soft_triple", num_classes=C, embedding_dim=D, num_proxies=K)
    torch.manual_seed(11)
    pml = SoftTripleLoss(num_classes=C, embedding_size=D, centers_per_class=K)
    assert torch.equal(ours.proxies.detach().reshape(C * K, D).t(), pml.fc.detach())


# --------------------------------------------------------------------------------------------
# per sample L_AP <= L_DW, with the closed-form gap (docs/losses/multi_proxy_anchor.md §Identities)
# --------------------------------------------------------------------------------------------
def test_mpa_ap_le_mpa_dw_per_sample():
    C, D = 12, 16
    x, y = _batch(B=30, C=C, D=D, seed=2)
    for alpha, delta in [(32.0, 0.1), (4.0, -0.3), (64.0, 0.5)]:
        dw = _build("mpa_dw", C, D, alpha=alpha, delta=delta, num_proxies=4)
        ap = _build("mpa_ap", C, D, alpha=alpha, delta=delta, num_proxies=4)
        ap.proxies.data.copy_(dw.proxies.data)
        l_dw, l_ap = dw.per_sample(x, y), ap.per_sample(x, y)
        assert l_dw.shape == l_ap.shape == (30,)
        assert (l_ap <= l_dw + 1e-12).all()
        # gap = log(1 + ab / (1 + a + b)), a = e^{α(δ − S_pos)}, b = Σ_{c≠c_i} e^{α(S_c + δ)}
        S, _ = pooled_class_similarity(x, dw.proxies, dw.gamma)
        pos = F.one_hot(y, C).bool()
        a = torch.exp(alpha * (delta - S[pos]))
        b = torch.exp(alpha * (S + delta)).masked_fill(pos, 0).sum(1)
        assert torch.allclose(l_dw - l_ap, torch.log1p(a * b / (1 + a + b)), rtol=1e-9, atol=1e-12)
        # the module's value is the mean of the per-sample terms plus tau * regulariser (Eqs. 13, 17)
        reg = proxy_regularizer(dw.proxies)
        assert abs(dw(x, y).item() - (l_dw.mean() + 0.2 * reg).item()) < 1e-12


# --------------------------------------------------------------------------------------------
# data-wise losses ignore the other batch samples; class-wise MPA does not (MPA paper §3.3)
# --------------------------------------------------------------------------------------------
def _scaled_grad_x0(loss, x, y):
    x = x.clone().requires_grad_()
    loss(x, y).backward()
    return x.shape[0] * x.grad[0]


def test_data_wise_gradients_do_not_depend_on_batch_mates():
    C, D = 8, 16
    x, y = _batch(B=16, C=C, D=D, seed=4)
    x_other, y_other = _batch(B=16, C=C, D=D, seed=5)
    x2, y2 = x_other.clone(), y_other.clone()
    x2[0], y2[0] = x[0], y[0]  # keep sample 0, replace samples 1..B-1
    deltas = {}
    for name in MPA_FAMILY:
        loss = _build(name, C, D, num_proxies=3)
        loss.tau = 0.0  # proxies fixed: the regulariser does not touch x
        deltas[name] = (_scaled_grad_x0(loss, x, y) - _scaled_grad_x0(loss, x2, y2)).abs().max().item()
    assert deltas["mpa_dw"] < 1e-10 and deltas["mpa_ap"] < 1e-10
    assert deltas["mpa"] > 1e-3, deltas


# --------------------------------------------------------------------------------------------
# gradient signs, bounds and closed forms (Eqs. 8, 14, 18) with respect to S
# --------------------------------------------------------------------------------------------
def test_gradient_signs_bounds_and_closed_forms():
    g = torch.Generator().manual_seed(6)
    B, C, alpha, delta = 10, 5, 8.0, 0.1
    S0 = torch.rand(B, C, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 3, (B,), generator=g)  # classes 3, 4 absent
    pos = F.one_hot(y, C).bool()
    neg = ~pos

    grads = {}
    for name, fn in (
        ("mpa", lambda S: mpa_similarity_loss(S, y, alpha, delta)),
        ("dw", lambda S: mpa_dw_similarity_losses(S, y, alpha, delta).mean()),
        ("ap", lambda S: mpa_ap_similarity_losses(S, y, alpha, delta).mean()),
    ):
        S = S0.clone().requires_grad_()
        fn(S).backward()
        grads[name] = S.grad
        assert (S.grad[pos] < 0).all() and (S.grad[neg] > 0).all(), name

    # Eq. 8 (MPA): class-wise shares of the batch
    lp = torch.exp(-alpha * (S0 - delta)) * pos
    ln = torch.exp(alpha * (S0 + delta)) * neg
    n_present = pos.any(0).sum()
    eq8 = torch.where(pos, -alpha * lp / (1 + lp.sum(0)) / n_present, alpha * ln / (1 + ln.sum(0)) / C)
    assert torch.allclose(grads["mpa"], eq8, atol=1e-8, rtol=0)
    for c in range(3):
        assert grads["mpa"][pos[:, c], c].abs().sum() < alpha / n_present
    assert (grads["mpa"].masked_fill(pos, 0).sum(0) < alpha / C).all()

    # Eq. 14 (MPA-DW): per-sample positive softplus + negatives' softmax-like share
    s_pos = S0[pos]
    ln_row = torch.exp(alpha * (S0 + delta)) * neg
    eq14 = (
        torch.where(
            pos,
            (-alpha / (torch.exp(alpha * (s_pos - delta)) + 1))[:, None].expand(B, C),
            alpha * ln_row / (1 + ln_row.sum(1, keepdim=True)),
        )
        / B
    )
    assert torch.allclose(grads["dw"], eq14, atol=1e-8, rtol=0)
    assert (B * grads["dw"].abs().sum(1) < 2 * alpha).all()

    # Eq. 18 (MPA-AP): one softmax-like share over all classes, sign flipped for the positive
    s_prime = torch.where(pos, delta - S0, S0 + delta)
    e = torch.exp(alpha * s_prime)
    eq18 = torch.where(pos, -1.0, 1.0) * alpha * e / (1 + e.sum(1, keepdim=True)) / B
    assert torch.allclose(grads["ap"], eq18, atol=1e-8, rtol=0)
    assert (B * grads["ap"].abs().sum(1) < alpha).all()


# --------------------------------------------------------------------------------------------
# SoftTriple is blind to S -> S + const; the MPA family is not (MPA paper §3.1)
# --------------------------------------------------------------------------------------------
def test_similarity_shift_sensitivity():
    g = torch.Generator().manual_seed(7)
    S = torch.rand(12, 6, generator=g, dtype=torch.float64) * 1.4 - 0.7
    y = torch.randint(0, 6, (12,), generator=g)
    st = lambda s: soft_triple_similarity_losses(s, y, 20.0, 0.1).mean()  # noqa: E731
    for t in (0.3, -0.3):
        assert abs(st(S + t).item() - st(S).item()) < 1e-12
    # α = 8 keeps the log-sum-exps out of their linear (saturated) regime, where MPA's positive slope
    # −α·(|C⁺|/|C⁺|) and negative slope +α·(|C|/|C|) cancel and it becomes shift-invariant too.
    for fn in (
        lambda s: mpa_similarity_loss(s, y, 8.0, 0.1),
        lambda s: mpa_dw_similarity_losses(s, y, 8.0, 0.1).mean(),
        lambda s: mpa_ap_similarity_losses(s, y, 8.0, 0.1).mean(),
    ):
        # each term is convex in the shift t, so L(t) can match L(0) at t = +0.3 by chance but not on both sides
        change = max(abs(fn(S + t).item() - fn(S).item()) for t in (0.3, -0.3))
        assert change > 1e-2


# --------------------------------------------------------------------------------------------
# pooling limits and regulariser values (Eqs. 1 and 3)
# --------------------------------------------------------------------------------------------
def test_pooling_limits_and_replicated_proxies():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, 8, generator=g, dtype=torch.float64)
    W = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    S, s = pooled_class_similarity(x, W, 0.1)
    assert (s.mean(2) <= S + 1e-12).all() and (S <= s.amax(2) + 1e-12).all()
    assert (pooled_class_similarity(x, W, 1e-4)[0] - s.amax(2)).abs().max() < 1e-4
    assert (pooled_class_similarity(x, W, 1e4)[0] - s.mean(2)).abs().max() < 1e-4
    replicated = W[:, :1, :].expand(4, 5, 8)
    cos = F.normalize(x, dim=1) @ F.normalize(W[:, 0, :], dim=1).t()
    for gamma in (0.01, 0.1, 10.0):
        assert torch.allclose(pooled_class_similarity(x, replicated, gamma)[0], cos, atol=1e-12, rtol=0)


def test_regularizer_values_and_gradcheck():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(3, 1, 6, generator=g, dtype=torch.float64)
    assert abs(proxy_regularizer(w.expand(3, 4, 6)).item() - math.sqrt(1e-5) / 2) < 1e-12  # identical proxies
    assert proxy_regularizer(w).item() == 0.0  # K = 1: no pairs, defined as 0
    antipodal = torch.cat([w[:1], -w[:1]], dim=1)  # one class, K = 2, distance 2, divisor K(K-1) = 2
    assert abs(proxy_regularizer(antipodal).item() - 1.0) < 1e-5
    proxies = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(proxy_regularizer, (proxies,))
    coincident = w.expand(3, 4, 6).clone().requires_grad_()
    proxy_regularizer(coincident).backward()
    assert torch.isfinite(coincident.grad).all()


def test_full_loss_gradcheck_float64():
    C, D, K = 3, 4, 2
    x, y = _batch(B=5, C=C, D=D, seed=10)
    for name in MPA_FAMILY + ("soft_triple",):
        loss = _build(name, C, D, num_proxies=K, **({"alpha": 4.0} if name in MPA_FAMILY else {"la": 4.0}))
        proxies = loss.proxies.detach().clone().requires_grad_()

        def fn(xx, pp, loss=loss):  # functional call, so gradcheck perturbs the proxies too
            return torch.func.functional_call(loss, {"proxies": pp}, (xx, y))

        assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(), proxies)), name


# --------------------------------------------------------------------------------------------
# numerics, dtypes, metadata, errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_extreme_values_stay_finite_in_fp32(name):
    C, D = 6, 8
    scale_param = {"la": 100.0} if name == "soft_triple" else {"alpha": 1000.0}
    torch.manual_seed(0)
    loss = build_loss(name, num_classes=C, embedding_dim=D, **scale_param)
    y = torch.arange(C).repeat_interleave(3)
    for scale in (1e-30, 1.0, 1e25):
        x = (torch.randn(18, D) * scale).requires_grad_()
        value = loss(x, y)
        value.backward()
        assert value.dtype == torch.float32 and torch.isfinite(value), (scale, value)
        assert torch.isfinite(x.grad).all() and torch.isfinite(loss.proxies.grad).all()
        loss.zero_grad()
    half = loss(torch.randn(18, D, dtype=torch.bfloat16), y)  # upcast: computed in fp32
    assert half.dtype == torch.float32 and torch.isfinite(half)


@pytest.mark.parametrize("name", ALL)
def test_metadata_and_fast_proxies(name):
    info = loss_info(name)
    assert info.learnable and info.own_optimizer
    loss = build_loss(name, num_classes=5, embedding_dim=7, **({} if name == "proxy_anchor" else {"num_proxies": 3}))
    params = dict(loss.named_parameters())
    assert list(params) == ["proxies"]
    K = 1 if name == "proxy_anchor" else 3
    assert params["proxies"].shape == (5, K, 7)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"'mpa'.*num_proxies must be an integer >= 1"):
        build_loss("mpa", num_classes=4, embedding_dim=8, num_proxies=0)
    with pytest.raises(ValueError, match=r"'mpa_ap'.*gamma must be a finite number > 0"):
        build_loss("mpa_ap", num_classes=4, embedding_dim=8, gamma=0.0)
    with pytest.raises(ValueError, match=r"'mpa_dw'.*alpha must be a finite number > 0"):
        build_loss("mpa_dw", num_classes=4, embedding_dim=8, alpha=-1.0)
    with pytest.raises(ValueError, match=r"'soft_triple'.*la must be a finite number > 0"):
        build_loss("soft_triple", num_classes=4, embedding_dim=8, la=0)
    with pytest.raises(ValueError, match=r"'soft_triple'.*reg_weight must be a finite number >= 0"):
        build_loss("soft_triple", num_classes=4, embedding_dim=8, reg_weight=-0.5)
    with pytest.raises(ValueError, match=r"'mpa'.*tau must be a finite number >= 0"):
        build_loss("mpa", num_classes=4, embedding_dim=8, tau=-0.1)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) centers_per_class"):
        build_loss("soft_triple", num_classes=4, embedding_dim=8, centers_per_class=2)
    loss = build_loss("mpa", num_classes=4, embedding_dim=8)
    with pytest.raises(ValueError, match=r"class id 4, outside \[0, num_classes=4\)"):
        loss(torch.randn(3, 8), torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match=r"embeddings have dimension 6, expected embedding_dim=8"):
        loss(torch.randn(3, 6), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"labels must be a \(3,\) tensor"):
        loss(torch.randn(3, 8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must be integer class ids"):
        loss(torch.randn(3, 8), torch.tensor([0.0, 1.0, 2.0]))
