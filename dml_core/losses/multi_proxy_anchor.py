"""Multi-proxy losses: the Multi-Proxy-Anchor (MPA) family, SoftTriple and ProxyAnchor.

Paper: Saeki, Kawahara & Aman, "Multi Proxy Anchor Family Loss for Several Types of Gradients"
(arXiv 2110.03997 v8; "MPA paper" below).  Equation and section numbers are the MPA paper's; the paper's settings
and the choices made where it is silent: docs/losses/multi_proxy_anchor.md.

Shared building blocks (MPA paper §3, from SoftTriple):

* :func:`pooled_class_similarity` — S(x, c) = Σ_k softmax_k(s_ick / γ) · s_ick, the soft-max
  pooling of the cosines to the K proxies of class c (Eq. 1, from SoftTriple).
* :func:`proxy_regularizer` — Σ_c Σ_{t<s} sqrt(2 + ε − 2 w_csᵀ w_ct) / (C·K·(K−1)) (Eq. 3).
* :func:`log1p_sum_exp` — log(1 + Σ_{mask} exp(z)) as a log-sum-exp with an appended zero logit
  (docs/losses/multi_proxy_anchor.md §Ambiguities resolved), so α up to 1000 stays finite in fp32.

Registered losses (all learnable, with their own optimiser — "fast proxies", lr ``loss_lr``):

===============  =====================================================================
``mpa``          class-wise MPA, Eqs. 6–7 (ProxyAnchor with K proxies)
``mpa_dw``       data-wise MPA-DW, Eqs. 12–13
``mpa_ap``       data-wise, all-paired MPA-AP, Eqs. 15–17
``soft_triple``  SoftTriple, Eqs. 2–4 (the reality check's PML ``SoftTripleLoss`` settings)
``proxy_anchor`` ProxyAnchor = ``mpa`` with K = 1 and no regulariser (MPA paper §3.2; PML
                 ``ProxyAnchorLoss``)
===============  =====================================================================

Proxies are one ``nn.Parameter`` ``proxies`` of shape (C, K, D) (class-major: proxy c·K + k),
stored raw and L2-normalised on every forward pass.  Embeddings arrive raw and are normalised
here.  Computation runs in the embeddings' dtype promoted to at least fp32 (fp16/bf16 inputs are
upcast, float64 stays float64 so gradcheck works).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses.checks import check_batch, integer, non_negative, number, positive, sizes
from dml_core.losses.registry import MLRC_BATCH, MLRC_MODEL, MLRC_PAPER, BatchSpec, ModelRecipe, register

__all__ = [
    "l2_normalize",
    "pooled_class_similarity",
    "proxy_regularizer",
    "log1p_sum_exp",
    "mpa_similarity_loss",
    "mpa_dw_similarity_losses",
    "mpa_ap_similarity_losses",
    "soft_triple_similarity_losses",
    "MultiProxyLoss",
    "MultiProxyAnchor",
    "MultiProxyAnchorDW",
    "MultiProxyAnchorAP",
    "SoftTriple",
    "ProxyAnchor",
]

MPA_PAPER = "Saeki, Kawahara & Aman, Multi Proxy Anchor Family Loss for Several Types of Gradients, arXiv 2110.03997"
SOFTTRIPLE_PAPER = "Qian et al., SoftTriple Loss: Deep Metric Learning Without Triplet Sampling, ICCV 2019"
PROXY_ANCHOR_PAPER = "Kim, Kim, Cho & Kwak, Proxy Anchor Loss for Deep Metric Learning, CVPR 2020"

#: MPA paper §4.2: batch 180 on CUB (random sampling; expressed as 45 classes × 4, see docs).
MPA_BATCH = BatchSpec(classes_per_batch=45, m=4)
#: MPA paper §4.2: cubic GeM pooling (p = 3, fixed), no LayerNorm.
MPA_MODEL = ModelRecipe(pooling="gem", layer_norm=False)

#: ε inside the regulariser's square root (SoftTriple's official code).
REGULARIZER_EPS = 1e-5


# --------------------------------------------------------------------------------------------
# building blocks (MPA paper Eqs. 1 and 3)
# --------------------------------------------------------------------------------------------
def l2_normalize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x / ||x||₂ along ``dim``, without overflow for huge inputs.

    Dividing by max|x| first keeps ||x||² finite (fp32 overflows at |x| ≈ 1e19); the result is
    the same because normalisation is scale-invariant.  Zero vectors stay zero.
    """
    scale = x.detach().abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return F.normalize(x / scale, p=2.0, dim=dim)


def pooled_class_similarity(
    embeddings: torch.Tensor, proxies: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """MPA paper Eq. 1 (SoftTriple's class similarity): ``(S, s)``.

    s_ick = x̂_iᵀ ŵ_ck (cosines, shape (B, C, K)) and
    S(x_i, c) = Σ_k p_ick s_ick with p_ic· = softmax_k(s_ic· / γ) (shape (B, C)).
    γ → 0 gives max_k s, γ → ∞ gives mean_k s; K = 1 gives the plain cosine for any γ.  The
    weights p are not detached (neither are they in SoftTriple's code).
    """
    C, K, D = proxies.shape
    x = l2_normalize(embeddings, dim=1)
    w = l2_normalize(proxies.to(x.dtype), dim=2)
    s = (x @ w.reshape(C * K, D).t()).view(-1, C, K)
    if K == 1:
        return s[..., 0], s
    p = torch.softmax(s / gamma, dim=2)
    return (p * s).sum(dim=2), s


def proxy_regularizer(proxies: torch.Tensor, eps: float = REGULARIZER_EPS) -> torch.Tensor:
    """MPA paper Eq. 3 (SoftTriple's regulariser) on the normalised proxies.

    L_reg = Σ_c Σ_{t<s} sqrt(2 + ε − 2 ŵ_csᵀ ŵ_ct) / (C·K·(K−1)): half the mean distance between
    two proxies of the same class (the paper's divisor counts ordered pairs).  ε = 1e-5 as in
    SoftTriple's code keeps the gradient finite at coincident proxies; K = 1 has no pairs and the
    0/0 is defined as 0.
    """
    C, K, D = proxies.shape
    if K < 2:
        return proxies.new_zeros(())
    w = l2_normalize(proxies, dim=2)
    gram = w @ w.transpose(1, 2)  # (C, K, K)
    iu = torch.triu_indices(K, K, offset=1, device=proxies.device)
    dist = (2.0 + eps - 2.0 * gram[:, iu[0], iu[1]]).clamp_min(0.0).sqrt()
    return dist.sum() / (C * K * (K - 1))


def log1p_sum_exp(logits: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """log(1 + Σ_{j: mask_j} exp(z_j)) along ``dim`` (the form of every MPA-family term).

    Masked-out entries are set to −inf (never multiplied by 0: exp overflow × 0 = NaN) and a
    zero logit stands for the "1"; an empty mask gives log 1 = 0.
    """
    z = logits.masked_fill(~mask, float("-inf"))
    shape = list(z.shape)
    shape[dim] = 1
    return torch.logsumexp(torch.cat([z, z.new_zeros(shape)], dim=dim), dim=dim)


def _positive_mask(S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.one_hot(labels, S.shape[1]).bool()


def mpa_similarity_loss(S: torch.Tensor, labels: torch.Tensor, alpha: float, delta: float) -> torch.Tensor:
    """MPA similarity loss, Eq. 6 (class-wise; = ProxyAnchor's loss for K = 1).

    (1/|C⁺|) Σ_{c∈C⁺} log(1 + Σ_{x∈X_c⁺} e^{−α(S(x,c)−δ)}) + (1/|C|) Σ_{c∈C} log(1 + Σ_{x∈X_c⁻} e^{α(S(x,c)+δ)}),
    C⁺ = classes present in the batch, C = all training classes (negatives of absent classes count).
    """
    pos = _positive_mask(S, labels)
    pos_term = log1p_sum_exp(-alpha * (S - delta), pos, dim=0)  # (C,)
    neg_term = log1p_sum_exp(alpha * (S + delta), ~pos, dim=0)  # (C,)
    in_batch = pos.any(dim=0)
    return pos_term[in_batch].sum() / in_batch.sum() + neg_term.sum() / S.shape[1]


def mpa_dw_similarity_losses(S: torch.Tensor, labels: torch.Tensor, alpha: float, delta: float) -> torch.Tensor:
    """Per-sample MPA-DW similarity losses (the summand of Eq. 12), shape (B,).

    ℓ_i = log(1 + e^{−α(S(x_i,c_i)−δ)}) + log(1 + Σ_{c≠c_i} e^{α(S(x_i,c)+δ)}), c over all C classes.
    """
    pos = _positive_mask(S, labels)
    s_pos = S.gather(1, labels[:, None]).squeeze(1)
    return F.softplus(-alpha * (s_pos - delta)) + log1p_sum_exp(alpha * (S + delta), ~pos, dim=1)


def mpa_ap_similarity_losses(S: torch.Tensor, labels: torch.Tensor, alpha: float, delta: float) -> torch.Tensor:
    """Per-sample MPA-AP similarity losses (the summand of Eq. 16), shape (B,).

    ℓ_i = log(1 + Σ_{c∈C} e^{α S'(x_i,c)}), S' = δ − S for the sample's class, S + δ otherwise
    (Eq. 15).  Per sample ℓ_AP ≤ ℓ_DW, ℓ_DW − ℓ_AP = log(1 + ab/(1+a+b)) (docs/losses/multi_proxy_anchor.md
    §Identities).
    """
    pos = _positive_mask(S, labels)
    s_prime = torch.where(pos, delta - S, S + delta)
    return log1p_sum_exp(alpha * s_prime, torch.ones_like(pos), dim=1)


def soft_triple_similarity_losses(S: torch.Tensor, labels: torch.Tensor, la: float, margin: float) -> torch.Tensor:
    """Per-sample SoftTriple similarity losses L_Sim (Eq. 2), shape (B,).

    Softmax cross-entropy on the logits λ(S − δ·onehot(c_i)) (λ = ``la``, δ = ``margin``).
    """
    pos = _positive_mask(S, labels)
    logits = la * (S - margin * pos.to(S.dtype))
    return F.cross_entropy(logits, labels, reduction="none")


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------
class MultiProxyLoss(nn.Module):
    """Base: K learnable proxies per class, γ-pooled class similarity (Eq. 1) + τ·L_reg (Eq. 3).

    Subclasses implement :meth:`similarity_loss` (the part before "+ τ L_Regularizer").
    """

    name = "multi_proxy"

    def __init__(self, *, num_classes: int, embedding_dim: int, num_proxies: int, gamma: float, tau: float):
        super().__init__()
        self.num_classes, self.embedding_dim = sizes(self.name, num_classes, embedding_dim)
        self.num_proxies = integer(self.name, "num_proxies", num_proxies)
        self.gamma = positive(self.name, "gamma", gamma)
        self.tau = non_negative(self.name, "tau", tau)
        self.proxies = nn.Parameter(torch.empty(self.num_classes, self.num_proxies, self.embedding_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """ProxyAnchor's init: ``kaiming_normal_(mode='fan_out')`` on the (C·K, D) view (the paper states none)."""
        with torch.no_grad():
            flat = torch.empty(self.num_classes * self.num_proxies, self.embedding_dim)
            nn.init.kaiming_normal_(flat, mode="fan_out")
            self.proxies.copy_(flat.view_as(self.proxies))

    def class_similarity(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked inputs → ``(S, labels)`` with S (B, C) of Eq. 1.

        fp16/bf16 embeddings are upcast to fp32 (the loss runs in fp32 even under AMP: exp(α·S) overflows fp16);
        float64 stays float64.  An empty batch is an error (Eq. 6 would divide by |C⁺| = 0, Eqs. 12 and 16 by N = 0).
        """
        x, y = check_batch(
            self.name, embeddings, labels, num_classes=self.num_classes, embedding_dim=self.embedding_dim, nonempty=True
        )
        S, _ = pooled_class_similarity(x, self.proxies, self.gamma)
        return S, y

    def similarity_loss(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement similarity_loss")

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S, y = self.class_similarity(embeddings, labels)
        loss = self.similarity_loss(S, y)
        if self.tau > 0 and self.num_proxies > 1:
            loss = loss + self.tau * proxy_regularizer(self.proxies.to(S.dtype))
        return loss

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, num_proxies={self.num_proxies}"


class _MPAFamily(MultiProxyLoss):
    """Shared constructor of the three MPA-family members (α, δ, γ, τ, K; defaults of MPA paper §4.2)."""

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        alpha: float = 32.0,
        delta: float = 0.1,
        gamma: float = 0.1,
        tau: float = 0.2,
        num_proxies: int = 10,
    ):
        super().__init__(
            num_classes=num_classes, embedding_dim=embedding_dim, num_proxies=num_proxies, gamma=gamma, tau=tau
        )
        self.alpha = positive(self.name, "alpha", alpha)
        self.delta = number(self.name, "delta", delta)


@register(
    "mpa",
    paper=MPA_PAPER,
    learnable=True,
    own_optimizer=True,
    batch=MPA_BATCH,
    model=MPA_MODEL,
    description="Multi-Proxy-Anchor loss (class-wise, Eqs. 6-7): ProxyAnchor with K gamma-pooled proxies per class "
    "plus SoftTriple's proxy regulariser.",
)
class MultiProxyAnchor(_MPAFamily):
    """MPA loss, Eqs. 6–7: L = L_MPASim (Eq. 6, :func:`mpa_similarity_loss`) + τ L_Regularizer.

    Class-wise: each class is an anchor and its log-sum-exp runs over the batch samples, so a
    sample's gradient depends on its batch-mates (Eqs. 8–9).  With K = 1 it is ProxyAnchor.
    Hyperparameters: α = ``alpha`` (32, ProxyAnchor's value; the paper gives none),
    δ = ``delta`` (0.1), γ = ``gamma`` (0.1), τ = ``tau`` (0.2), K = ``num_proxies`` (10 CUB/Cars).
    """

    def similarity_loss(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mpa_similarity_loss(S, labels, self.alpha, self.delta)


class _DataWise(_MPAFamily):
    """Data-wise members: the similarity loss is a mean of per-sample terms."""

    def per_sample_losses(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement per_sample_losses")

    def per_sample(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Unreduced similarity loss of each sample, shape (B,), without the regulariser."""
        S, y = self.class_similarity(embeddings, labels)
        return self.per_sample_losses(S, y)

    def similarity_loss(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.per_sample_losses(S, labels).mean()


@register(
    "mpa_dw",
    paper=MPA_PAPER,
    learnable=True,
    own_optimizer=True,
    batch=MPA_BATCH,
    model=MPA_MODEL,
    description="Data-wise MPA loss (MPA-DW, Eqs. 12-13): per-sample softplus on the positive class plus "
    "log(1+sum exp) over all negative classes; plus the proxy regulariser.",
)
class MultiProxyAnchorDW(_DataWise):
    """MPA-DW loss, Eqs. 12–13: L = (1/N) Σ_i ℓ_i^DW + τ L_Regularizer (:func:`mpa_dw_similarity_losses`).

    Eq. 6 with the order of summation swapped: a sample's gradient (×N) no longer depends on the
    other batch samples (Eq. 14).  Same hyperparameters and defaults as ``mpa``.
    """

    def per_sample_losses(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mpa_dw_similarity_losses(S, labels, self.alpha, self.delta)


@register(
    "mpa_ap",
    paper=MPA_PAPER,
    learnable=True,
    own_optimizer=True,
    batch=MPA_BATCH,
    model=MPA_MODEL,
    description="Data-wise, all-paired MPA loss (MPA-AP, Eqs. 15-17): one log(1+sum exp) per sample over the "
    "margin-folded similarities of all classes; plus the proxy regulariser.",
)
class MultiProxyAnchorAP(_DataWise):
    """MPA-AP loss, Eqs. 15–17: L = (1/N) Σ_i ℓ_i^AP + τ L_Regularizer (:func:`mpa_ap_similarity_losses`).

    One soft-plus per sample couples the positive and negative similarities (P–N relations,
    Eq. 18).  Per sample ℓ_AP ≤ ℓ_DW.  Same hyperparameters and defaults as ``mpa``.
    """

    def per_sample_losses(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mpa_ap_similarity_losses(S, labels, self.alpha, self.delta)


@register(
    "soft_triple",
    paper=f"{SOFTTRIPLE_PAPER}; settings: {MLRC_PAPER} (PML SoftTripleLoss)",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="SoftTriple: softmax cross-entropy on la*(S - margin*onehot) with K gamma-pooled centres per class, "
    "plus reg_weight * the centre regulariser (MPA paper Eqs. 1-4).",
)
class SoftTriple(MultiProxyLoss):
    """SoftTriple loss (MPA paper Eqs. 2–4, §3.1), the reality check's PML ``SoftTripleLoss``.

    L = mean_i CE(λ(S_i − δ·onehot(c_i)), c_i) + τ L_Regularizer, with S from Eq. 1 over the
    K = ``num_proxies`` centres (PML ``centers_per_class``).  Eq. 4 sums over the batch; the
    official code and PML take the mean, as here.  Names are PML's / the reality check's:
    λ = ``la`` (20), γ = ``gamma`` (0.1), τ = ``reg_weight`` (0.2), δ = ``margin`` (0.01).
    The centres are initialised as in PML/SoftTriple (``kaiming_uniform_(a=√5)`` on the (D, C·K)
    matrix).  The regulariser uses ε = 1e-5 (SoftTriple's code) where MLRC-era PML used the
    smallest normal float; the values differ by < sqrt(1e-5)/2 ≈ 0.0016.
    """

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        la: float = 20.0,
        gamma: float = 0.1,
        reg_weight: float = 0.2,
        margin: float = 0.01,
        num_proxies: int = 10,
    ):
        reg_weight = non_negative(self.name, "reg_weight", reg_weight)  # validated here to name PML's field
        super().__init__(
            num_classes=num_classes, embedding_dim=embedding_dim, num_proxies=num_proxies, gamma=gamma, tau=reg_weight
        )
        self.la = positive(self.name, "la", la)
        self.margin = number(self.name, "margin", margin)

    @property
    def reg_weight(self) -> float:
        return self.tau

    def reset_parameters(self) -> None:
        with torch.no_grad():
            fc = torch.empty(self.embedding_dim, self.num_classes * self.num_proxies)
            nn.init.kaiming_uniform_(fc, a=math.sqrt(5))
            self.proxies.copy_(fc.t().reshape_as(self.proxies))

    def similarity_loss(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return soft_triple_similarity_losses(S, labels, self.la, self.margin).mean()


@register(
    "proxy_anchor",
    paper=f"{PROXY_ANCHOR_PAPER}, as PML ProxyAnchorLoss; batch and model: {MLRC_PAPER} (not one of its 14 methods)",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Proxy-Anchor loss (one proxy per class; = mpa with K=1, MPA paper §3.2), as PML ProxyAnchorLoss.",
)
class ProxyAnchor(MultiProxyLoss):
    """ProxyAnchor loss = MPA's Eq. 6 with K = 1 (MPA paper §3.2), i.e. PML ``ProxyAnchorLoss``.

    (1/|C⁺|) Σ_{c∈C⁺} log(1 + Σ_{x∈X_c⁺} e^{−α(cos(x,w_c)−δ)}) + (1/|C|) Σ_c log(1 + Σ_{x∈X_c⁻} e^{α(cos(x,w_c)+δ)}).
    Names are PML's: α = ``alpha`` (32), δ = ``margin`` (0.1).  One proxy per class, initialised
    as PML/ProxyAnchor (``kaiming_normal_(mode='fan_out')``); no regulariser.
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, alpha: float = 32.0, margin: float = 0.1):
        super().__init__(num_classes=num_classes, embedding_dim=embedding_dim, num_proxies=1, gamma=1.0, tau=0.0)
        self.alpha = positive(self.name, "alpha", alpha)
        self.margin = number(self.name, "margin", margin)

    def similarity_loss(self, S: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mpa_similarity_loss(S, labels, self.alpha, self.margin)
