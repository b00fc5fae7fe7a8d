"""Realigned Softmax Warping (rsw) and Eq. 4 (euclidean_softmax): properties of the paper's Eqs. 4, 7 and 8
(numbered UT1–UT6 below).

Oracles are written from the paper's equations here, independently of dml_core.losses.rsw:
Eq. 4 via torch.cdist (exact, non-mm mode) and explicit log(1 + Σ exp(...)).
"""

from __future__ import annotations

import math

import pytest
import torch

from dml_core.losses import ModelRecipe, build_loss, loss_info
from dml_core.losses.rsw import avg_distance_to_proxy, euclidean_distances, warped_softmax_loss

torch.set_num_threads(1)
F64 = torch.float64


def _cdist(e, p):
    return torch.cdist(e, p, compute_mode="donot_use_mm_for_euclid_dist")


def _eq4_oracle(e, p, y, s):
    """Eq. 4 as printed: mean_i log(1 + Σ_{j≠y_i} exp(s(||e_i − p_{y_i}|| − ||e_i − p_j||)))."""
    t = _cdist(e, p)
    t1 = t.gather(1, y[:, None])
    other = torch.ones_like(t, dtype=torch.bool).scatter(1, y[:, None], False)
    terms = torch.exp(s * (t1 - t)) * other
    return torch.log1p(terms.sum(1)).mean()


def _rsw(**kw):
    kw.setdefault("num_classes", 5)
    kw.setdefault("embedding_dim", 4)
    return build_loss("rsw", **kw).double()


def _random_batch(seed=0, b=12, c=5, d=4, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(b, d, generator=g, dtype=F64) * spread
    p = torch.randn(c, d, generator=g, dtype=F64) * spread
    y = torch.randint(0, c, (b,), generator=g)
    return e, p, y


# ---------------------------------------------------------------------------------------------
# UT1: k1 = k2 = 1 (m = 1) is Eq. 4; Eq. 4's positive and negative distance gradients cancel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 2.5, math.inf])
def test_rsw_with_unit_slopes_equals_eq4_value_and_gradients(alpha):
    e, p, y = _random_batch()
    s = 0.7
    loss = _rsw(k1=1.0, k2=1.0, alpha=alpha, scale=s, delta_mult=1.0)
    eq4 = build_loss("euclidean_softmax", num_classes=5, embedding_dim=4, scale=s).double()
    with torch.no_grad():
        loss.proxies.copy_(p)
        eq4.proxies.copy_(p)

    ours_e = e.clone().requires_grad_()
    value = loss(ours_e, y)
    value.backward()
    ref_e, ref_p = e.clone().requires_grad_(), p.clone().requires_grad_()
    ref = _eq4_oracle(ref_e, ref_p, y, s)
    ref.backward()

    torch.testing.assert_close(value, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ours_e.grad, ref_e.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss.proxies.grad, ref_p.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(eq4(e, y), ref.detach(), rtol=0, atol=1e-10)


def test_eq4_distance_gradients_are_equal_and_opposite():
    """Sec. II-B: Σ_j ∂L/∂t_ij = 0 for every sample (pull on t_iy = push on the others)."""
    t = (torch.rand(9, 6, dtype=F64) * 10).requires_grad_()
    y = torch.arange(9) % 6
    warped_softmax_loss(t, y, k1=1.0, k2=1.0, alpha=4.0, scale=1.3).backward()
    torch.testing.assert_close(t.grad.sum(1), torch.zeros(9, dtype=F64), rtol=0, atol=1e-14)
    assert (t.grad.gather(1, y[:, None]) > 0).all()


# ---------------------------------------------------------------------------------------------
# UT2: the warp rescales only the positive gradient, by k1 inside α and k2 outside (Eq. 7 with Δ)
# ---------------------------------------------------------------------------------------------
def _distances_around(alpha, b=10, c=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(b, c, generator=g, dtype=F64) * 20 + 1
    y = torch.arange(b) % c
    own = torch.linspace(0.3 * alpha, 1.7 * alpha, b, dtype=F64)  # half inside, half outside α
    return t.scatter(1, y[:, None], own[:, None]), y, own < alpha


def test_gradient_ratio_is_k1_inside_alpha_and_k2_outside():
    k1, k2, alpha = 0.3, 1.7, 8.0
    t, y, inside = _distances_around(alpha)
    assert inside.any() and (~inside).any()
    t.requires_grad_()
    warped_softmax_loss(t, y, k1=k1, k2=k2, alpha=alpha, scale=0.9, delta_mult=1.0).backward()
    pos = t.grad.gather(1, y[:, None]).squeeze(1)
    neg = t.grad.sum(1) - pos
    ratio = pos / -neg
    # k1 (not 1) inside α also proves Δ carries no gradient: a non-detached Δ would give k1 + m(1 − k1) = 1.
    torch.testing.assert_close(ratio[inside], torch.full_like(ratio[inside], k1), rtol=0, atol=1e-12)
    torch.testing.assert_close(ratio[~inside], torch.full_like(ratio[~inside], k2), rtol=0, atol=1e-12)
    # and the two branches' ratio across α is k1 / k2
    assert ratio[inside][0] / ratio[~inside][0] == pytest.approx(k1 / k2, abs=1e-12)


def test_delta_keeps_the_eq4_value_inside_alpha():
    t, y, _ = _distances_around(alpha=10.0)  # own distances in [3, 17]: all < α = 100
    warped = warped_softmax_loss(t, y, k1=0.25, k2=2.0, alpha=100.0, scale=1.1, delta_mult=1.0)
    plain = warped_softmax_loss(t, y, k1=1.0, k2=1.0, alpha=100.0, scale=1.1)
    torch.testing.assert_close(warped, plain, rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# UT3: binary case, fixed proxies: descent converges to distance α from p_c, away from p_c'
# ---------------------------------------------------------------------------------------------
def _descend(loss, starts, steps=900, lr0=2.0, decay=0.992):
    """Normalised gradient descent on the embeddings only (proxies frozen), per-sample unit steps."""
    e = torch.tensor(starts, dtype=F64)
    y = torch.zeros(len(starts), dtype=torch.long)
    lr = lr0
    for _ in range(steps):
        e.requires_grad_()
        (g,) = torch.autograd.grad(loss(e, y), e)
        e = (e - lr * g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)).detach()
        lr = max(lr * decay, 1e-3)
    return e


def _binary(alpha, k1, k2):
    loss = build_loss("rsw", num_classes=2, embedding_dim=2, k1=k1, k2=k2, alpha=alpha, scale=1.0, delta_mult=1.0)
    loss = loss.double().eval()
    with torch.no_grad():
        loss.proxies.copy_(torch.tensor([[0.0, 0.0], [10.0, 0.0]]))
    loss.proxies.requires_grad_(False)
    return loss


@pytest.mark.parametrize("alpha,k1,k2", [(3.0, 0.65, 1.5), (7.75, 0.25, 2.25)])
def test_binary_point_of_attraction_is_at_alpha_on_the_far_side(alpha, k1, k2):
    e = _descend(_binary(alpha, k1, k2), [(0.5, 0.7), (3.0, -2.0), (-40.0, 30.0)])
    target = torch.tensor([-alpha, 0.0], dtype=F64).expand_as(e)
    assert (e - target).norm(dim=1).max() < 0.05, e


def test_half_warps_diverge_or_collapse():
    """Sec. III-D: α = ∞ (k1 < 1 everywhere) pushes outward without bound; α = 0 (k2 > 1) collapses."""
    out = _descend(_binary(math.inf, 0.5, 1.5), [(1.0, 1.0)], steps=300, lr0=1.0, decay=1.0)
    assert out.norm() > 200
    inward = _descend(_binary(0.0, 0.5, 1.5), [(-5.0, 4.0), (3.0, -2.0)], steps=600)
    assert inward.norm(dim=1).max() < 0.05


# ---------------------------------------------------------------------------------------------
# UT4: Lemma III.1 — on a circle around p_c', the extrema lie on the line through both proxies
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("r", [3.0, 10.0, 15.0])
def test_extrema_on_a_circle_lie_on_the_proxy_line(r):
    pc, pc2 = torch.tensor([0.0, 0.0], dtype=F64), torch.tensor([10.0, 0.0], dtype=F64)
    theta = torch.linspace(0, 2 * math.pi, 3601, dtype=F64)[:-1]
    e = pc2 + r * torch.stack([theta.cos(), theta.sin()], 1)
    t = euclidean_distances(e, torch.stack([pc, pc2]))
    y = torch.zeros(len(e), dtype=torch.long)
    per_sample = warped_softmax_loss(t, y, k1=0.65, k2=1.5, alpha=3.0, scale=1.0, reduction="none")
    towards = (pc - pc2) / (pc - pc2).norm()
    torch.testing.assert_close(e[per_sample.argmin()], pc2 + r * towards, rtol=0, atol=1e-9)  # e_*
    torch.testing.assert_close(e[per_sample.argmax()], pc2 - r * towards, rtol=0, atol=1e-9)  # e^*


# ---------------------------------------------------------------------------------------------
# UT5: continuity at α (m = 1), the margin jump s(m − 1)(1 − k1)α (m > 1), warped ≥ Eq. 4
# ---------------------------------------------------------------------------------------------
def _binary_exponent(t1, t2, **hp):
    t = torch.tensor([[t1, t2]], dtype=F64)
    value = warped_softmax_loss(t, torch.tensor([0]), **hp)
    return torch.log(torch.expm1(value)).item()  # L = log(1 + e^x)  ->  x = s(f1(t1) - t2)


def test_continuity_at_alpha_and_margin_jump():
    k1, k2, alpha, s, eps = 0.4, 1.3, 6.0, 0.8, 1e-9
    hp = dict(k1=k1, k2=k2, alpha=alpha, scale=s)
    for m, jump in ((1.0, 0.0), (2.5, s * 1.5 * (1 - k1) * alpha)):
        inside = _binary_exponent(alpha - eps, 9.0, delta_mult=m, **hp)
        outside = _binary_exponent(alpha, 9.0, delta_mult=m, **hp)
        assert inside - outside == pytest.approx(jump, abs=1e-6)


def test_warped_loss_is_at_least_eq4_for_delta_mult_at_least_one():
    t, y, _ = _distances_around(alpha=7.0, b=40, c=8, seed=3)
    eq4 = warped_softmax_loss(t, y, k1=1.0, k2=1.0, alpha=7.0, scale=1.0, reduction="none")
    for m in (1.0, 1.3, 3.0):
        warped = warped_softmax_loss(t, y, k1=0.6, k2=1.4, alpha=7.0, scale=1.0, delta_mult=m, reduction="none")
        assert (warped >= eq4 - 1e-12).all()
    # m = 0 drops Δ: inside α the loss is then *below* Eq. 4 (the "handicap" Δ corrects)
    no_delta = warped_softmax_loss(t, y, k1=0.6, k2=1.4, alpha=7.0, scale=1.0, delta_mult=0.0, reduction="none")
    inside = t.gather(1, y[:, None]).squeeze(1) < 7.0
    assert (no_delta[inside] < eq4[inside]).all()


# ---------------------------------------------------------------------------------------------
# UT6: Euclidean invariances, no hidden normalisation, and the proxy gradients (Eq. 8 with Δ held fixed)
# ---------------------------------------------------------------------------------------------
def test_rigid_motion_invariance_and_no_normalisation():
    e, p, y = _random_batch(seed=4)
    loss = _rsw(k1=0.5, k2=1.6, alpha=5.0, scale=0.6, delta_mult=1.2)
    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(5)))
    b = torch.tensor([3.0, -1.0, 0.5, 2.0], dtype=F64)

    def value_and_grad(emb, prox):
        with torch.no_grad():
            loss.proxies.copy_(prox)
        emb = emb.clone().requires_grad_()
        v = loss(emb, y)
        (g,) = torch.autograd.grad(v, emb)
        return v.detach(), g

    v0, g0 = value_and_grad(e, p)
    v1, g1 = value_and_grad(e @ q.T + b, p @ q.T + b)
    torch.testing.assert_close(v1, v0, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g0 @ q.T, rtol=0, atol=1e-12)  # gradients rotate with the space
    v2, _ = value_and_grad(2 * e, 2 * p)
    assert abs(v2 - v0) > 1e-3  # an accidental L2 normalisation would make this scale-invariant


@pytest.mark.parametrize("own_distance,kappa", [(1.0, 0.3), (20.0, 1.8)])
def test_proxy_gradients_pull_own_proxy_by_kappa_and_push_the_others(own_distance, kappa):
    """Eq. 8 differentiated with Δ fixed: ∇_{p_y} L = −s κ (1 − q_y) u_y, ∇_{p_j} L = s q_j u_j, u_j = (e − p_j)/t_j."""
    s, alpha = 0.5, 10.0
    loss = _rsw(num_classes=4, embedding_dim=3, k1=0.3, k2=1.8, alpha=alpha, scale=s, delta_mult=1.0)
    e = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    p = torch.tensor([[own_distance, 0, 0], [0, 6.0, 0], [0, 0, 9.0], [-4.0, 3.0, 0]], dtype=F64)
    with torch.no_grad():
        loss.proxies.copy_(p)
    loss(e, torch.tensor([0])).backward()
    t = (e - p).norm(dim=1)
    u = (e - p) / t[:, None]
    q = torch.softmax(-s * t, dim=0)  # m = 1: the warped value equals t inside α; outside α f1(t) ≠ t
    if own_distance >= alpha:
        w = t.clone()
        w[0] = kappa * t[0] + (1 - kappa) * alpha
        q = torch.softmax(-s * w, dim=0)
    expected = s * q[:, None] * u
    expected[0] = -s * kappa * (1 - q[0]) * u[0]
    torch.testing.assert_close(loss.proxies.grad, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the two-phase schedule (step counter inside the module)
# ---------------------------------------------------------------------------------------------
def test_two_phase_schedule_switches_after_phase2_step_training_calls():
    phase1 = dict(k1=0.9, k2=1.2, alpha=4.0, scale=2.0)
    phase2 = dict(k1=0.5, k2=1.6, alpha=2.0, scale=1.0)
    loss = _rsw(**phase1, delta_mult=1.3, phase2_step=2, **{f"phase2_{k}": v for k, v in phase2.items()})
    e, p, y = _random_batch(seed=6)
    with torch.no_grad():
        loss.proxies.copy_(p)
    t = _cdist(e, p)
    expect1 = warped_softmax_loss(t, y, delta_mult=1.3, **phase1)
    expect2 = warped_softmax_loss(t, y, delta_mult=1.3, **phase2)
    assert abs(expect1 - expect2) > 1e-3

    loss.eval()
    torch.testing.assert_close(loss(e, y), expect1)  # eval calls do not count
    assert int(loss.step) == 0 and loss.phase == 1
    loss.train()
    got = [loss(e, y).detach() for _ in range(4)]
    for value, want in zip(got, (expect1, expect1, expect2, expect2)):
        torch.testing.assert_close(value, want, rtol=0, atol=1e-10)
    assert int(loss.step) == 4 and loss.phase == 2
    assert loss.hyperparameters() == {**phase2, "delta_mult": 1.3}

    # the counter is part of the state: a resumed run continues in phase 2
    fresh = _rsw(**phase1, delta_mult=1.3, phase2_step=2, **{f"phase2_{k}": v for k, v in phase2.items()})
    fresh.load_state_dict(loss.state_dict())
    assert fresh.phase == 2


def test_phase2_values_default_to_phase1_and_need_a_step():
    loss = _rsw(k1=0.8, k2=1.3, alpha=5.0, scale=3.0, phase2_step=0, phase2_scale=1.0)
    assert loss.hyperparameters() == {"k1": 0.8, "k2": 1.3, "alpha": 5.0, "scale": 1.0, "delta_mult": 1.3}
    with pytest.raises(ValueError, match=r"loss 'rsw': phase2_alpha, phase2_scale given without phase2_step"):
        _rsw(phase2_alpha=2.0, phase2_scale=1.0)


# ---------------------------------------------------------------------------------------------
# numerics, errors, metadata
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rsw", "euclidean_softmax"])
def test_extreme_inputs_stay_finite_in_float32(name):
    torch.manual_seed(0)
    loss = build_loss(name, num_classes=6, embedding_dim=8, scale=50.0)
    e = (torch.randn(12, 8) * 1e4).requires_grad_()
    y = torch.arange(12) % 6
    with torch.no_grad():
        loss.proxies[0] = e[0].detach()  # an embedding exactly on its own proxy
    value = loss(e, y)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(e.grad).all() and torch.isfinite(loss.proxies.grad).all()


def test_avg_distance_to_proxy_is_class_balanced_eq9():
    p = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    e = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 3.0], [10.0, 2.0]])
    y = torch.tensor([0, 0, 0, 1])
    # class 0: (5 + 1 + 3)/3 = 3; class 1: 2  ->  (3 + 2)/2 = 2.5 (a sample mean would give 2.75)
    assert avg_distance_to_proxy(e, y, p).item() == pytest.approx(2.5)
    loss = build_loss("rsw", num_classes=2, embedding_dim=2)
    with torch.no_grad():
        loss.proxies.copy_(p)
    assert loss.avg_distance_to_proxy(e, y).item() == pytest.approx(2.5)


@pytest.mark.parametrize(
    "params,message",
    [
        ({"k1": 0.0}, r"loss 'rsw': k1 must be a finite number > 0, got 0.0"),
        ({"k2": -1.0}, r"loss 'rsw': k2 must be"),
        ({"alpha": float("nan")}, r"loss 'rsw': alpha must be a number >= 0, got nan"),
        ({"scale": 0}, r"loss 'rsw': scale must be"),
        ({"delta_mult": -0.5}, r"loss 'rsw': delta_mult must be a finite number >= 0, got -0.5"),
        ({"phase2_step": -1}, r"loss 'rsw': phase2_step must be an integer >= 0 \(or null for one phase\)"),
        ({"phase2_step": 5, "phase2_k2": 0.0}, r"loss 'rsw': phase2_k2 must be"),
        ({"margin": 1.0}, r"loss 'rsw': unknown parameter\(s\) margin"),
    ],
)
def test_bad_parameters_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        build_loss("rsw", num_classes=4, embedding_dim=3, **params)


def test_bad_labels_name_the_field():
    loss = build_loss("euclidean_softmax", num_classes=4, embedding_dim=3)
    with pytest.raises(ValueError, match=r"loss 'euclidean_softmax': labels contain class id 4, outside"):
        loss(torch.randn(2, 3), torch.tensor([0, 4]))


def test_metadata_and_proxy_initialisation():
    for name in ("rsw", "euclidean_softmax"):
        info = loss_info(name)
        assert info.learnable and info.own_optimizer
        assert info.model == ModelRecipe(pooling="avg+max", layer_norm=True)
        assert (info.batch.classes_per_batch, info.batch.m) == (8, 8)
        assert info.loss_weight_decay == 1e-7  # official code (docs/losses/rsw.md §Official code settings)
    torch.manual_seed(0)
    loss = build_loss("rsw", num_classes=400, embedding_dim=256)
    assert [n for n, _ in loss.named_parameters()] == ["proxies"]
    assert loss.proxies.std().item() == pytest.approx(
        math.sqrt(2 / 400), rel=0.02
    )  # N(0, 2/C), the official code's init
