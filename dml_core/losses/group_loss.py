"""The Group Loss (Elezi, Vascon, Torcinovich, Pelillo & Leal-Taixé, ECCV 2020).

Equation and section numbers are the paper's; "App." its supplementary appendices; "[C]" the official code
(dvl-tum/group_loss).  The choices made where the paper is silent: docs/losses/group_loss.md §Ambiguities resolved.

One forward pass on a batch (z_i, y_i), i = 1..B, C training classes (Alg. 1):

1. similarity  W = ReLU(Pearson(z_i, z_j))                  Eq. 1 + App. 0.G; w_ii = 0 (paper) or 1 ([C])
2. priors      X(0)_i = softmax(classifier(z_i) / T)        App. 0.C, Eq. 9   (non-anchors)
               X(0)_i = onehot(y_i)                         §3.2              (anchors)
3. refinement  Π = W X;  X ← Q⁻¹ (X ⊙ Π),  Q = diag((X ⊙ Π) 1)   Eqs. 2–6, ``num_iterations`` times
4. loss        L = mean_i −log(x_{i,y_i} + 1e-12)  +  aux_ce_weight · CE(logits, y)
               (the auxiliary cross-entropy on the raw logits is in [C], not in the paper)

The linear classifier ``classifier = nn.Linear(embedding_dim, num_classes)`` on the raw embeddings
is a learnable part of this module (its own optimiser, lr ``loss_lr``).  Replicator dynamics are
used only in training; retrieval uses the embeddings alone (§3.5).

Anchors: the first ``anchors_per_class`` samples of each class **in batch order** (as in [C],
whose sampler shuffles within classes; the paper says "randomly chosen").  The choice is a
deterministic function of (labels, order), so the loss is invariant to any batch permutation that
keeps the within-class order of the samples (more generally: to any permutation, given the same
anchor set, which :meth:`GroupLoss.forward` accepts as ``anchors=``).  Under DDP the all-gathered
global batch is in rank order, which equals the single-process batch, so the anchors agree too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses.checks import check_batch, choice, fail, flag, integer, non_negative, positive, sizes
from dml_core.losses.multi_proxy_anchor import l2_normalize
from dml_core.losses.registry import BatchSpec, ModelRecipe, register

__all__ = [
    "pearson_similarity",
    "anchor_mask",
    "initial_assignment",
    "replicator_dynamics",
    "consistency",
    "Refinement",
    "GroupLoss",
]

GROUP_LOSS_PAPER = (
    "Elezi, Vascon, Torcinovich, Pelillo & Leal-Taixé, The Group Loss for Deep Metric Learning, ECCV 2020"
)

#: [C] on CUB: 6 classes × 9 samples, 2 anchors per class (docs/losses/group_loss.md §Settings).
GROUP_LOSS_BATCH = BatchSpec(classes_per_batch=6, m=9, anchors_per_class=2)
#: [C]: the global-average-pooled backbone feature is the embedding (no LayerNorm).
GROUP_LOSS_MODEL = ModelRecipe(pooling="avg", layer_norm=False)

#: Added inside the log of the NLL, as in [C] (``log(X + 1e-12)``).
LOG_EPS = 1e-12
#: Support floor of the replicator step (see :func:`replicator_dynamics`).
SUPPORT_EPS = 1e-12

_NLL_AVERAGES = ("batch", "non_anchors")


def pearson_similarity(embeddings: torch.Tensor, zero_diag: bool = True) -> torch.Tensor:
    """W (B, B) = ReLU of the Pearson correlation between embeddings (Eq. 1, App. 0.G).

    Each embedding is one sample of D paired observations: centre it over its own features,
    L2-normalise, take dot products (as [C] reads Eq. 1).  Invariant to z_i → a_i z_i + b_i (a_i > 0).
    Negative correlations are clamped to 0 (the replicator step needs W ≥ 0).  ``zero_diag``:
    w_ii = 0 as in the paper (§3.2); False keeps w_ii = 1 as the official code does.  A constant
    embedding has no defined correlation and gets an all-zero row.
    """
    centred = embeddings - embeddings.mean(dim=1, keepdim=True)
    z = l2_normalize(centred, dim=1)
    W = F.relu(z @ z.t())
    if zero_diag:
        W = W.masked_fill(torch.eye(W.shape[0], dtype=torch.bool, device=W.device), 0.0)
    return W


def anchor_mask(labels: torch.Tensor, anchors_per_class: int) -> torch.Tensor:
    """Bool (B,): True for the first ``anchors_per_class`` occurrences of each class in batch order."""
    same = labels[:, None] == labels[None, :]
    earlier = torch.ones_like(same).tril(diagonal=-1)
    rank_in_class = (same & earlier).sum(dim=1)  # how many earlier samples share my label
    return rank_in_class < anchors_per_class


def initial_assignment(
    logits: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, temperature: float
) -> torch.Tensor:
    """X(0) (B, C): softmax(logits / T) (App. 0.C, Eq. 9), anchors replaced by one-hot labels (§3.2).

    Anchor rows are constants: no gradient reaches their logits through the refinement.
    """
    priors = torch.softmax(logits / temperature, dim=1)
    onehot = F.one_hot(labels, logits.shape[1]).to(priors.dtype)
    return torch.where(anchors[:, None], onehot, priors)


def replicator_dynamics(
    W: torch.Tensor, X: torch.Tensor, num_iterations: int, *, eps: float = SUPPORT_EPS, trace: bool = False
) -> torch.Tensor | list[torch.Tensor]:
    """Refine the row-stochastic X (B, C) by ``num_iterations`` replicator steps (Eqs. 2–6).

    π_iλ = Σ_j w_ij x_jλ (Eqs. 2–3);  x_iλ ← x_iλ π_iλ / Σ_μ x_iμ π_iμ (Eq. 4; matrix form Eqs. 5–6).

    Numerical guard (docs/losses/group_loss.md §Ambiguities resolved, "Zero support"): every support gets a
    floor ``eps`` (π ← π + ε), so the normaliser Q_ii ≥ ε Σ_λ x_iλ > 0.  A row with zero support (e.g. anticorrelated
    with the whole batch, or a one-sample batch) then keeps its distribution instead of becoming 0/0, and
    gradients stay bounded by 1/ε.  One-hot rows (anchors) map to themselves exactly; ε = 1e-12
    is far below any real support, so regular rows follow Eq. 4.  Returns X(T), or with
    ``trace`` the list [X(0), X(1), …, X(T)].
    """
    xs = [X]
    for _ in range(num_iterations):
        support = W @ X + eps  # Π(t), Eqs. 2–3
        weighted = X * support  # X(t) ⊙ Π(t)
        X = weighted / weighted.sum(dim=1, keepdim=True)  # Q(t)⁻¹ [X(t) ⊙ Π(t)], Eqs. 5–6
        xs.append(X)
    return xs if trace else X


def consistency(W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """F(X) = Σ_ij Σ_λ w_ij x_iλ x_jλ = trace(Xᵀ W X) (Eq. 7); non-decreasing under Eq. 4 (Eq. 8)."""
    return (X * (W @ X)).sum()


@dataclass
class Refinement:
    """Intermediate results of one Group Loss forward pass (for inspection and tests)."""

    logits: torch.Tensor  # (B, C) classifier outputs on the raw embeddings
    W: torch.Tensor  # (B, B) similarity matrix
    anchors: torch.Tensor  # (B,) bool
    X: list[torch.Tensor]  # [X(0), ..., X(T)]
    labels: torch.Tensor  # (B,) int64


@register(
    "group_loss",
    paper=GROUP_LOSS_PAPER,
    learnable=True,
    own_optimizer=True,
    batch=GROUP_LOSS_BATCH,
    model=GROUP_LOSS_MODEL,
    loss_weight_decay=1e-6,  # App. 0.B: the paper's best weight decay on CUB (1e-7 Cars, 1e-12 SOP)
    description="Group Loss: softmax priors of a linear classifier (temperature-scaled, anchors one-hot) refined "
    "by replicator dynamics on the ReLU-Pearson similarity of the batch, then NLL; plus the official code's "
    "auxiliary cross-entropy.",
)
class GroupLoss(nn.Module):
    """The Group Loss (Alg. 1; Eqs. 1–6, 9).

    Hyperparameters (defaults: the official code's CUB values, docs/losses/group_loss.md §Settings):

    * ``temperature`` T (24): priors softmax(logits / T), App. 0.C Eq. 9 (T > 1 softens).
    * ``num_iterations`` (1): replicator steps; the paper gives no value, [C] uses 1.
    * ``anchors_per_class`` A (2): labelled anchors per class (first A of each class in batch
      order); 0 = no anchors.  Should match the batch's ``BatchSpec.anchors_per_class``.
    * ``zero_diag`` (True): w_ii = 0 as in the paper; False = w_ii = 1 as in [C].
    * ``aux_ce_weight`` (1.0): weight of [C]'s auxiliary cross-entropy on the raw logits (all
      samples, no temperature); 0 gives the paper's Alg. 1 alone.
    * ``nll_average`` ("batch"): the NLL on X(T) is averaged over all B rows, anchors included
      (they contribute ≈ 0), as in [C]; "non_anchors" averages over the unlabelled rows only.
    """

    name: str  # given by @register

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        temperature: float = 24.0,
        num_iterations: int = 1,
        anchors_per_class: int = 2,
        zero_diag: bool = True,
        aux_ce_weight: float = 1.0,
        nll_average: str = "batch",
    ):
        super().__init__()
        self.num_classes, self.embedding_dim = sizes(self.name, num_classes, embedding_dim)
        self.temperature = positive(self.name, "temperature", temperature)
        self.num_iterations = integer(self.name, "num_iterations", num_iterations, ge=0)
        self.anchors_per_class = integer(self.name, "anchors_per_class", anchors_per_class, ge=0)
        self.zero_diag = flag(self.name, "zero_diag", zero_diag)
        self.aux_ce_weight = non_negative(self.name, "aux_ce_weight", aux_ce_weight)
        self.nll_average = choice(self.name, "nll_average", nll_average, _NLL_AVERAGES)
        self.classifier = nn.Linear(self.embedding_dim, self.num_classes)

    def refine(
        self, embeddings: torch.Tensor, labels: torch.Tensor, *, anchors: torch.Tensor | None = None
    ) -> Refinement:
        """Steps 1–3 of Alg. 1: similarity, priors, and the trace X(0..T) of the refinement."""
        # fp16/bf16 upcast to fp32, float64 kept (the classifier weights follow z's dtype below).
        z, y = check_batch(
            self.name, embeddings, labels, num_classes=self.num_classes, embedding_dim=self.embedding_dim, nonempty=True
        )
        if anchors is None:
            anchors = anchor_mask(y, self.anchors_per_class)
        elif not (torch.is_tensor(anchors) and anchors.dtype == torch.bool and anchors.shape == y.shape):
            got = (anchors.dtype, tuple(anchors.shape)) if torch.is_tensor(anchors) else type(anchors).__name__
            fail(self.name, f"anchors must be a bool tensor of shape ({y.shape[0]},), got {got}")
        logits = F.linear(z, self.classifier.weight.to(z.dtype), self.classifier.bias.to(z.dtype))
        W = pearson_similarity(z, self.zero_diag)
        X0 = initial_assignment(logits, y, anchors.to(z.device), self.temperature)
        xs = cast(list[torch.Tensor], replicator_dynamics(W, X0, self.num_iterations, trace=True))  # trace: a list
        return Refinement(logits=logits, W=W, anchors=anchors, X=xs, labels=y)

    def loss_from(self, r: Refinement) -> torch.Tensor:
        """Step 4: NLL on the refined X(T) (+ the auxiliary cross-entropy of [C])."""
        nll = -torch.log(r.X[-1].gather(1, r.labels[:, None]).squeeze(1) + LOG_EPS)
        if self.nll_average == "batch":
            loss = nll.mean()
        else:
            unlabelled = ~r.anchors
            loss = nll[unlabelled].sum() / unlabelled.sum().clamp_min(1)
        if self.aux_ce_weight > 0:
            loss = loss + self.aux_ce_weight * F.cross_entropy(r.logits, r.labels)
        return loss

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, *, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scalar Group Loss of the batch; ``anchors`` (bool (B,)) overrides the default anchor choice."""
        return self.loss_from(self.refine(embeddings, labels, anchors=anchors))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, temperature={self.temperature}, "
            f"num_iterations={self.num_iterations}, anchors_per_class={self.anchors_per_class}, "
            f"zero_diag={self.zero_diag}, aux_ce_weight={self.aux_ce_weight}, nll_average={self.nll_average!r}"
        )
