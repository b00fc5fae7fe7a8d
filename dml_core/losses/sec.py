"""Spherical Embedding Constraint (SEC) and the L2-reg baseline, as wrappers for any loss; plus the
SEC paper's own base losses ``semihard_triplet`` and ``npair``.

Paper: Zhang, Li & Zhang, "Deep Metric Learning with Spherical Embedding", NeurIPS 2020
(arXiv 2011.02785).  Equation, appendix and table numbers below are the paper's; its settings and the choices made
where it is silent: docs/losses/sec.md.

SEC adds to a base loss, on the same *raw* (un-normalised) embeddings f_i, the batch variance of
their norms (Eq. 17 with μ = the batch-mean norm):

    L = L_metric + η · L_sec,     L_sec = (1/N) Σ_i (||f_i||_2 − μ)²,   μ = (1/N) Σ_j ||f_j||_2.

L2-reg (Eq. 30) is the same penalty with μ = 0: L_L2 = (1/N) Σ_i ||f_i||²_2.

Use ``build_loss("sec:triplet", sec_eta=0.5)`` or ``build_loss("triplet", sec_eta=0.5)``;
``l2_reg:<base>`` / ``l2_reg_eta`` likewise.  The loss always sees the global batch (``train_fold``
all-gathers under DDP), so μ is the global-batch mean, as in the single-GPU paper (App. B.1).
The other two SEC base losses, ``triplet`` and ``multi_similarity``, are registered with the
reality-check baselines in :mod:`dml_core.losses.baselines`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses.checks import check_batch, non_negative, number, positive, sizes
from dml_core.losses.registry import BatchSpec, ModelRecipe, register, register_wrapper

__all__ = [
    "spherical_embedding_constraint",
    "l2_norm_regularizer",
    "SphericalEmbeddingConstraint",
    "L2NormRegularizer",
    "SemihardTriplet",
    "NormalizedNPair",
]

SEC_PAPER = "Zhang, Li & Zhang, Deep Metric Learning with Spherical Embedding, NeurIPS 2020"

#: Penalty weights used when none is given: the vanilla-triplet column of Table 7 (CUB200).
DEFAULT_SEC_ETA = 1.0
DEFAULT_L2_REG_ETA = 1e-4


def _fp32_at_least(f: torch.Tensor) -> torch.Tensor:
    # Norms and the variance in fp32 even under AMP (docs/losses/sec.md §Ambiguities resolved, "Precision").
    return f.float() if f.dtype in (torch.float16, torch.bfloat16) else f


def spherical_embedding_constraint(embeddings: torch.Tensor, mu: torch.Tensor | float | None = None) -> torch.Tensor:
    """L_sec = (1/N) Σ_i (||f_i||_2 − μ)²  (Eq. 17, second term).

    ``mu=None``: μ = the batch-mean norm, detached as in the official code.  Detaching does not
    change the gradient (Σ_i (n_i − μ) = 0), which is Eq. 18: ∂L_sec/∂f_i = (2/N)(||f_i|| − μ) f̂_i.
    A given ``mu`` (tensor or float) is used as a constant; ``mu=0`` gives the L2-reg value.
    """
    f = _fp32_at_least(embeddings)
    n = torch.linalg.vector_norm(f, dim=1)
    if mu is None:
        mu = n.mean().detach()
    elif torch.is_tensor(mu):
        mu = mu.detach().to(n)
    return (n - mu).pow(2).mean()


def l2_norm_regularizer(embeddings: torch.Tensor) -> torch.Tensor:
    """L_L2-reg = (1/N) Σ_i ||f_i||²_2  (Eq. 30); gradient (2/N) f_i.  No square root: smooth at 0."""
    f = _fp32_at_least(embeddings)
    return f.pow(2).sum(dim=1).mean()


def _wrapped_name(prefix: str, base: nn.Module) -> str:
    """``"sec:triplet"``: the name errors quote (the base's registry name, else its class name)."""
    return f"{prefix}:{getattr(base, 'name', type(base).__name__)}"


class SphericalEmbeddingConstraint(nn.Module):
    """``base(f, y) + η · L_sec(f)`` on the raw embeddings f (Eqs. 17, 21).

    ``rho`` selects how μ is computed:

    * ``rho = 1`` (default): μ = this batch's mean norm (the paper's SEC, Eq. 17).
    * ``0 <= rho < 1``: "SEC (EMA)", App. D Eq. 31: μ_t = (1 − ρ) μ_{t−1} + ρ · mean_i ||f_{t,i}||,
      μ_0 = the first batch's mean.  As in the official code μ_t is updated *before* L_sec is
      computed, from the detached batch mean, and is itself detached
      (docs/losses/sec.md §Ambiguities resolved, "EMA variant").  μ_t is the buffer ``mu`` (saved in
      the state dict); it advances only in training mode
      (``module.train()``, the default), and the next training batch after construction or
      :meth:`reset_ema` re-initialises it.  DML used ρ = 0.01 (Table 10).

    The base module is ``self.base`` (its parameters stay parameters of this module); the base
    loss normalises the embeddings itself where its paper does.
    """

    mu: torch.Tensor  # buffers, registered in __init__
    mu_initialized: torch.Tensor

    def __init__(self, base: nn.Module, eta: float = DEFAULT_SEC_ETA, rho: float = 1.0):
        super().__init__()
        self.base = base
        self.name = _wrapped_name("sec", base)
        self.eta = non_negative(self.name, "sec_eta", eta)
        self.rho = number(self.name, "sec_rho", rho, ge=0, le=1)
        self.register_buffer("mu", torch.zeros(()))
        self.register_buffer("mu_initialized", torch.zeros((), dtype=torch.bool))

    def reset_ema(self) -> None:
        """Forget μ_t (the next training batch sets μ_0); call at the start of a new run."""
        self.mu.zero_()
        self.mu_initialized.fill_(False)

    def _mu(self, norms: torch.Tensor) -> torch.Tensor:
        batch_mu = norms.mean().detach()
        if self.rho == 1.0:
            return batch_mu
        if self.training:
            with torch.no_grad():
                if bool(self.mu_initialized):
                    self.mu.mul_(1.0 - self.rho).add_(self.rho * batch_mu.to(self.mu))
                else:
                    self.mu.copy_(batch_mu)
                    self.mu_initialized.fill_(True)
        elif not bool(self.mu_initialized):
            return batch_mu
        return self.mu.detach().clone().to(norms)

    def constraint(self, embeddings: torch.Tensor) -> torch.Tensor:
        """η-free L_sec of this batch (advances the EMA in training mode when rho < 1)."""
        f = _fp32_at_least(embeddings)
        n = torch.linalg.vector_norm(f, dim=1)
        return spherical_embedding_constraint(f, self._mu(n))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_batch(self.name, embeddings, labels)
        return self.base(embeddings, labels) + self.eta * self.constraint(embeddings)

    def extra_repr(self) -> str:
        return f"eta={self.eta}, rho={self.rho}"


class L2NormRegularizer(nn.Module):
    """``base(f, y) + η · (1/N) Σ ||f_i||²`` (Eq. 30): the L2-reg baseline the SEC paper compares with."""

    def __init__(self, base: nn.Module, eta: float = DEFAULT_L2_REG_ETA):
        super().__init__()
        self.base = base
        self.name = _wrapped_name("l2_reg", base)
        self.eta = non_negative(self.name, "l2_reg_eta", eta)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_batch(self.name, embeddings, labels)
        return self.base(embeddings, labels) + self.eta * l2_norm_regularizer(embeddings)

    def extra_repr(self) -> str:
        return f"eta={self.eta}"


@register_wrapper("sec")
def sec(base: nn.Module, *, sec_eta: float = DEFAULT_SEC_ETA, sec_rho: float = 1.0) -> SphericalEmbeddingConstraint:
    """``sec:<base>``: η = ``sec_eta`` (paper grid {0.25, 0.5, 1.0}, Table 7), ρ = ``sec_rho`` (1 = SEC, < 1 = EMA)."""
    return SphericalEmbeddingConstraint(base, eta=sec_eta, rho=sec_rho)


@register_wrapper("l2_reg")
def l2_reg(base: nn.Module, *, l2_reg_eta: float = DEFAULT_L2_REG_ETA) -> L2NormRegularizer:
    """``l2_reg:<base>``: η = ``l2_reg_eta`` (paper grid {1e-2, 5e-3, …, 1e-5}, Table 7)."""
    return L2NormRegularizer(base, eta=l2_reg_eta)


# --------------------------------------------------------------------------------------------
# the SEC paper's base losses that the reality check does not have
# --------------------------------------------------------------------------------------------
@register(
    "semihard_triplet",
    paper="Schroff, Kalenichenko & Philbin, FaceNet, CVPR 2015 (TF triplet_semihard_loss form), "
    f"as used in {SEC_PAPER}",
    batch=BatchSpec(classes_per_batch=40, m=3),
    model=ModelRecipe(pooling="avg", layer_norm=False),
    description="Triplet loss with FaceNet semi-hard negative mining (one negative per positive pair) on "
    "squared normalised Euclidean distances.",
)
class SemihardTriplet(nn.Module):
    """Semi-hard triplet loss, FaceNet / TensorFlow ``triplet_semihard_loss`` form (docs/losses/sec.md §Base losses).

    D_ij = ||f̂_i − f̂_j||²_2 = 2 − 2 cos θ_ij.  For every positive pair (a, p), a ≠ p:
    D_neg = min{D_an : y_n ≠ y_a, D_an > D_ap} if that set is non-empty, else max_n D_an
    (the farthest negative); ℓ_ap = [margin + D_ap − D_neg]_+.  L = Σ ℓ_ap / #positive pairs
    (= B(K−1) for K per class).  The negative is chosen without gradient; the gradient flows
    through D_ap and the chosen D_an.  Pairs whose anchor has no negative in the batch (a
    one-class batch) are left out; a batch without such pairs gives 0 (with a graph).
    Paper setting: margin = 0.2 (App. B.1).
    """

    name: str  # given by @register

    def __init__(self, *, num_classes: int, embedding_dim: int, margin: float = 0.2):
        super().__init__()
        sizes(self.name, num_classes, embedding_dim)
        self.margin = number(self.name, "margin", margin)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        f, y = check_batch(self.name, embeddings, labels)
        f_hat = F.normalize(f, dim=1)
        dist = (2.0 - 2.0 * f_hat @ f_hat.T).clamp_min(0.0)  # squared normalised Euclidean
        same = y[:, None] == y[None, :]
        eye = torch.eye(len(y), dtype=torch.bool, device=y.device)
        neg = ~same
        a, p = torch.nonzero(same & ~eye, as_tuple=True)
        keep = neg[a].any(dim=1)
        a, p = a[keep], p[keep]
        if a.numel() == 0:
            return f.sum() * 0.0
        d_ap = dist[a, p]
        with torch.no_grad():
            d_an = dist[a]  # (pairs, B)
            is_neg = neg[a]
            outside = is_neg & (d_an > d_ap[:, None])
            inf = torch.tensor(float("inf"), dtype=d_an.dtype, device=d_an.device)
            closest_outside = torch.where(outside, d_an, inf).argmin(dim=1)
            farthest = torch.where(is_neg, d_an, -inf).argmax(dim=1)
            n = torch.where(outside.any(dim=1), closest_outside, farthest)
        return F.relu(self.margin + d_ap - dist[a, n]).mean()

    def extra_repr(self) -> str:
        return f"margin={self.margin}"


@register(
    "npair",
    paper=f"Sohn, Improved Deep Metric Learning with Multi-class N-pair Loss, NeurIPS 2016; normalised (tuplet) form "
    f"of {SEC_PAPER}, Eq. 3",
    batch=BatchSpec(classes_per_batch=60, m=2),
    model=ModelRecipe(pooling="avg", layer_norm=False),
    description="Normalised multi-class N-pair (tuplet) loss with scale s: one anchor and one positive per class.",
)
class NormalizedNPair(nn.Module):
    """Normalised N-pair / tuplet loss (SEC paper Eq. 3, structure from its code; docs/losses/sec.md §Base losses).

    For each class c in the batch with ≥ 2 samples, the anchor a_c is its first sample and the
    positive p_c its second (in batch order).  With s = ``scale``:
    L = mean_c log(1 + Σ_{d≠c} e^{s(⟨f̂_{a_c}, f̂_{p_d}⟩ − ⟨f̂_{a_c}, f̂_{p_c}⟩)})
      = mean_c CrossEntropy(s·⟨f̂_{a_c}, f̂_{p_·}⟩, c),
    i.e. the negatives of a_c are the positives of the other classes (Sohn's multi-class N-pair;
    not symmetric).  Samples beyond the second of a class are not used by this term (the paper
    samples K = 2); classes with one sample are skipped; < 1 usable class gives 0.
    Because the anchor is "the first sample", the value depends on the order of samples *within*
    a class (permuting whole classes, or any order-preserving shuffle, does not change it).
    Paper setting: s = 25 (s = 64 was worse, App. B.1).
    """

    name: str  # given by @register

    def __init__(self, *, num_classes: int, embedding_dim: int, scale: float = 25.0):
        super().__init__()
        sizes(self.name, num_classes, embedding_dim)
        self.scale = positive(self.name, "scale", scale)

    @staticmethod
    def anchor_positive_indices(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch indices (anchors, positives): the first and second sample of each class with ≥ 2."""
        order = torch.argsort(labels, stable=True)
        sorted_labels = labels[order]
        starts = torch.ones_like(sorted_labels, dtype=torch.bool)
        starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
        first = torch.nonzero(starts, as_tuple=True)[0]
        has_second = first + 1 < len(labels)
        first = first[has_second]
        has_second = sorted_labels[first + 1] == sorted_labels[first]
        first = first[has_second]
        return order[first], order[first + 1]

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        f, y = check_batch(self.name, embeddings, labels)
        anchors, positives = self.anchor_positive_indices(y)
        if anchors.numel() == 0:
            return f.sum() * 0.0
        f_hat = F.normalize(f, dim=1)
        logits = self.scale * f_hat[anchors] @ f_hat[positives].T  # (C, C): row c = anchor of class c
        target = torch.arange(len(anchors), device=logits.device)
        return F.cross_entropy(logits, target)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
