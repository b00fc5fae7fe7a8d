"""ProxyNCA (proxynca) and ProxyNCA++ (proxynca_pp): the identities of docs/losses/proxynca.md §Identities.

External anchors: the paper's equations written out here (explicit differences, explicit exp), the official
code's scale trick ||3x̂ − 3p̂||², and pytorch-metric-learning's ProxyNCALoss (what the reality check ran).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning.losses import ProxyNCALoss

from dml_core.losses import BatchSpec, ModelRecipe, build_loss, loss_info
from dml_core.losses.proxynca import proxy_nca_loss

torch.set_num_threads(1)
F64 = torch.float64


def _batch(seed=0, b=16, c=10, d=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=F64) * 3
    p = torch.randn(c, d, generator=g, dtype=F64)
    y = torch.randint(0, c, (b,), generator=g)
    return x, p, y


def _loss(name, p, **kw):
    loss = build_loss(name, num_classes=p.shape[0], embedding_dim=p.shape[1], **kw).double()
    with torch.no_grad():
        loss.proxies.copy_(p)
    return loss


def _sq_dist_oracle(x, p):
    """||x̂_i − p̂_c||² from explicit differences (not the 2 − 2cos expansion the module uses)."""
    xh = x / x.norm(dim=1, keepdim=True)
    ph = p / p.norm(dim=1, keepdim=True)
    return ((xh[:, None, :] - ph[None, :, :]) ** 2).sum(-1)


# ---------------------------------------------------------------------------------------------
# cross-entropy on −d/T, the official scale trick, NormSoftMax(T/2)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1 / 9, 1.0, 0.03])
def test_proxynca_pp_is_cross_entropy_on_negative_squared_distance_over_t(temperature):
    x, p, y = _batch()
    value = _loss("proxynca_pp", p, temperature=temperature)(x, y)
    d = _sq_dist_oracle(x, p)
    torch.testing.assert_close(value, F.cross_entropy(-d / temperature, y), rtol=0, atol=1e-12)
    # official code: both normalised vectors times sqrt(1/T), then the squared distance
    s = math.sqrt(1 / temperature)
    xh, ph = F.normalize(x, dim=1), F.normalize(p, dim=1)
    official = ((s * xh[:, None] - s * ph[None]) ** 2).sum(-1)
    torch.testing.assert_close(value, F.cross_entropy(-official, y), rtol=0, atol=1e-12)
    # the same as a cosine softmax with logit scale 2/T (NormSoftMax at temperature T/2)
    torch.testing.assert_close(value, F.cross_entropy(xh @ ph.T * (2 / temperature), y), rtol=0, atol=1e-11)


# ---------------------------------------------------------------------------------------------
# T → 0 makes P one-hot on the nearest proxy; T → ∞ makes it uniform (loss → log C)
# ---------------------------------------------------------------------------------------------
def test_assignment_becomes_one_hot_as_temperature_goes_to_zero():
    x, p, y = _batch(seed=1)
    nearest = _sq_dist_oracle(x, p).argmin(1)
    peak = []
    for temperature in (1.0, 1 / 9, 1e-2, 1e-3):
        probs = _loss("proxynca_pp", p, temperature=temperature).assignment_probabilities(x)
        torch.testing.assert_close(probs.sum(1), torch.ones(len(x), dtype=F64))
        assert torch.equal(probs.argmax(1), nearest)
        peak.append(probs.max(1).values)
    for lo, hi in zip(peak, peak[1:]):
        assert (hi >= lo).all()
    assert (peak[-1] > 1 - 1e-6).all()

    hot = _loss("proxynca_pp", p, temperature=1e3)
    torch.testing.assert_close(hot.assignment_probabilities(x), torch.full((16, 10), 0.1, dtype=F64), rtol=0, atol=1e-3)
    assert hot(x, y).item() == pytest.approx(math.log(10), abs=1e-3)


# ---------------------------------------------------------------------------------------------
# per sample L_prob = softplus(L_classic); Eq. 3 can be negative, Eq. 8 never is
# ---------------------------------------------------------------------------------------------
def test_prob_is_softplus_of_classic_and_classic_can_be_negative():
    x, p, y = _batch(seed=2)
    d = _sq_dist_oracle(x, p)
    for temperature in (1 / 9, 1.0):
        classic = proxy_nca_loss(d, y, temperature=temperature, prob=False, reduction="none")
        prob = proxy_nca_loss(d, y, temperature=temperature, prob=True, reduction="none")
        softplus = torch.logaddexp(torch.zeros_like(classic), classic)  # exact (F.softplus is linear above 20)
        torch.testing.assert_close(prob, softplus, rtol=0, atol=1e-12)
        assert (prob > 0).all()
        # Eq. 3 written with explicit exps (the positive left out of the denominator)
        z = torch.exp(-d / temperature)
        own = F.one_hot(y, 10).bool()
        eq3 = -torch.log(z[own] / z.masked_fill(own, 0).sum(1))
        torch.testing.assert_close(classic, eq3, rtol=0, atol=1e-12)

    # x̂ = p̂_y and the other proxies orthogonal / opposite: Eq. 3 < 0 at T = 1/9
    p = torch.eye(4, dtype=F64)
    p[3] = -p[0]
    x = torch.tensor([[2.0, 0, 0, 0]], dtype=F64)
    classic = _loss("proxynca_pp", p, prob=False)(x, torch.tensor([0]))
    assert classic.item() < 0
    assert _loss("proxynca_pp", p, prob=True)(x, torch.tensor([0])).item() > 0


# ---------------------------------------------------------------------------------------------
# ∂L/∂d = (Y − P)/(T·B); raw-parameter gradients ⟂ parameters and ∝ 1/norm
# ---------------------------------------------------------------------------------------------
def test_gradient_with_respect_to_distances():
    x, p, y = _batch(seed=3)
    d = _sq_dist_oracle(x, p).requires_grad_()
    temperature = 1 / 9
    proxy_nca_loss(d, y, temperature=temperature).backward()
    expected = (F.one_hot(y, 10) - torch.softmax(-d.detach() / temperature, 1)) / (temperature * len(y))
    torch.testing.assert_close(d.grad, expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", ["proxynca", "proxynca_pp"])
def test_proxy_and_embedding_gradients_are_orthogonal_and_scale_inversely(name):
    x, p, y = _batch(seed=4)

    def grads(xs, ps):
        loss = _loss(name, ps)
        xs = xs.clone().requires_grad_()
        value = loss(xs, y)
        value.backward()
        return value.detach(), xs.grad, loss.proxies.grad

    v, gx, gp = grads(x, p)
    torch.testing.assert_close((p * gp).sum(1), torch.zeros(10, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close((x * gx).sum(1), torch.zeros(16, dtype=F64), rtol=0, atol=1e-12)
    v10, gx10, gp10 = grads(10 * x, 10 * p)
    torch.testing.assert_close(v10, v, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp10, gp / 10, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx10, gx / 10, rtol=0, atol=1e-12)


def test_gradient_scales_as_inverse_temperature_at_equidistant_configuration():
    p = torch.eye(5, dtype=F64)
    x = torch.ones(1, 5, dtype=F64)
    norms = []
    for temperature in (1.0, 1 / 3, 1 / 9, 1 / 27):
        loss = _loss("proxynca_pp", p, temperature=temperature)
        loss(x, torch.tensor([2])).backward()
        norms.append(loss.proxies.grad.norm().item() * temperature)
    assert max(norms) - min(norms) < 1e-12 * max(norms)


# ---------------------------------------------------------------------------------------------
# the reality-check baseline: proxynca = PML ProxyNCALoss with softmax_scale = 1/T
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("softmax_scale", [0.01, 1.0, 9.0, 100.0])
def test_proxynca_matches_pml_proxynca_loss(softmax_scale):
    x, p, y = _batch(seed=5)
    ours = _loss("proxynca", p, softmax_scale=softmax_scale)
    pml = ProxyNCALoss(num_classes=10, embedding_size=8, softmax_scale=softmax_scale)
    with torch.no_grad():
        pml.proxies.data = p.clone()
    xo, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    value, reference = ours(xo, y), pml(xp, y)
    value.backward()
    reference.backward()
    torch.testing.assert_close(value, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(ours.proxies.grad, pml.proxies.grad, rtol=1e-8, atol=1e-12)


def test_softmax_scale_is_inverse_temperature():
    x, p, y = _batch(seed=6)
    torch.testing.assert_close(_loss("proxynca", p, softmax_scale=9.0)(x, y), _loss("proxynca_pp", p)(x, y))
    torch.testing.assert_close(
        _loss("proxynca", p, softmax_scale=3.0, prob=False)(x, y),
        _loss("proxynca_pp", p, temperature=1 / 3, prob=False)(x, y),
    )


# ---------------------------------------------------------------------------------------------
# bounds, numerics, errors, metadata
# ---------------------------------------------------------------------------------------------
def test_bounds_of_both_forms():
    temperature, c = 1 / 9, 10
    for seed in range(3):
        x, p, y = _batch(seed=10 + seed, c=c)
        x[0] = p[y[0]] * 5  # one sample exactly on its proxy's direction
        d = _sq_dist_oracle(x, p)
        assert ((d >= -1e-12) & (d <= 4 + 1e-12)).all()
        prob = proxy_nca_loss(d, y, temperature=temperature, reduction="none")
        classic = proxy_nca_loss(d, y, temperature=temperature, prob=False, reduction="none")
        assert ((prob > 0) & (prob <= 4 / temperature + math.log(c))).all()
        assert (classic >= math.log(c - 1) - 4 / temperature - 1e-9).all()


@pytest.mark.parametrize("prob", [True, False])
def test_extreme_temperature_stays_finite_in_float32(prob):
    torch.manual_seed(0)
    loss = build_loss("proxynca_pp", num_classes=6, embedding_dim=8, temperature=1e-3, prob=prob)
    x = torch.randn(12, 8) * 1e3
    x[0] = 0.0  # a zero embedding: F.normalize's eps keeps it finite
    x = x.requires_grad_()
    with torch.no_grad():
        loss.proxies[1] = -x[1]  # sample 1 as far from its own proxy as possible: logit −4000
    value = loss(x, torch.arange(12) % 6)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(x.grad).all() and torch.isfinite(loss.proxies.grad).all()


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("proxynca_pp", {"temperature": 0.0}, r"loss 'proxynca_pp': temperature must be a finite number > 0, got 0.0"),
        ("proxynca", {"softmax_scale": -1}, r"loss 'proxynca': softmax_scale must be a finite number > 0"),
        ("proxynca", {"prob": "yes"}, r"loss 'proxynca': prob must be true or false"),
        ("proxynca", {"temperature": 0.1}, r"loss 'proxynca': unknown parameter\(s\) temperature"),
    ],
)
def test_bad_parameters_name_the_field(name, params, message):
    with pytest.raises(ValueError, match=message):
        build_loss(name, num_classes=4, embedding_dim=3, **params)


def test_eq3_needs_two_classes_and_labels_are_checked():
    with pytest.raises(ValueError, match=r"loss 'proxynca_pp': prob=false \(Eq. 3\) needs num_classes >= 2"):
        build_loss("proxynca_pp", num_classes=1, embedding_dim=3, prob=False)
    loss = build_loss("proxynca", num_classes=4, embedding_dim=3)
    with pytest.raises(ValueError, match=r"loss 'proxynca': labels contain class id -1"):
        loss(torch.randn(2, 3), torch.tensor([0, -1]))


def test_metadata_and_proxy_initialisation():
    pp = loss_info("proxynca_pp")
    assert pp.learnable and pp.own_optimizer
    assert pp.model == ModelRecipe(pooling="max", layer_norm=True)  # +max, +norm
    assert pp.batch == BatchSpec(classes_per_batch=8, m=4)  # +cbs
    assert pp.loss_weight_decay == 0.0  # official code: no decay on the proxies (docs/losses/proxynca.md §Identities)
    base = loss_info("proxynca")
    assert base.own_optimizer and base.model == ModelRecipe(pooling="avg", layer_norm=False)
    assert base.loss_weight_decay == 1e-4  # MLRC's loss optimiser (docs/protocol.md §Optimisers)
    torch.manual_seed(0)
    assert build_loss("proxynca_pp", num_classes=500, embedding_dim=64).proxies.std().item() == pytest.approx(
        1 / 8, rel=0.02
    )
    assert build_loss("proxynca", num_classes=500, embedding_dim=64).proxies.std().item() == pytest.approx(
        1.0, rel=0.02
    )
