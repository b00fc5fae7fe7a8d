"""Realigned Softmax Warping (DeMoor & Prevost, 2024) and its Euclidean-softmax baseline.

Both losses are proxy softmax cross-entropies on **raw** (un-normalised) Euclidean distances
t_ij = ||e_i − p_j||_2 between embeddings e_i and one learnable proxy p_j per class.  Nothing
is projected onto a sphere.

* ``euclidean_softmax`` – the paper's Eq. 4 ("Softmax (Eq. 4)" / "Regular Softmax" in its
  tables), with the official code's scale s on the logits:
      L_i = log(1 + Σ_{j≠y_i} exp(s·(t_{i,y_i} − t_ij))) = CE(−s·T_i, y_i).
* ``rsw`` – Eq. 8 with the warp f1 of Eq. 7 on the own-proxy distance t1 = t_{i,y_i}
  and f2(t) = t on every other distance:
      f1(t1) = k1·t1 + Δ            for 0 ≤ t1 < α
             = k2·t1 + (1 − k2)·α   for α ≤ t1,            Δ = m·(1 − k1)·sg(t1),
      L_i = log(1 + Σ_{j≠y_i} exp(s·(f1(t_{i,y_i}) − t_ij))).
  sg = stop-gradient: with m = 1 the loss *value* inside α equals Eq. 4 while its gradient
  with respect to t1 is scaled by k1 (by k2 outside α).  m > 1 acts as a margin (Fig. 8's kΔ,
  ``margin`` in the official code); m = 0 drops Δ (Eq. 7 without Δ, the "handicapped" form).

Where the paper leaves a reading open, the official code decides (docs/losses/rsw.md §Ambiguities resolved):
s multiplies the *warped* distances, α is in raw distance units and the branch is chosen per sample from the
detached t1 with a strict ``<``, proxies start from ``kaiming_normal_(fan_out)`` = N(0, 2/C).

The paper trains in two phases (§IV-B: a larger α first, then a "followup" with other k1, k2,
α, s; the code's values in docs/losses/rsw.md §Official code settings).  ``rsw`` exposes this as loss
options: a step counter (the ``step`` buffer, +1 per forward call in training mode) switches to the ``phase2_*`` values
once it reaches ``phase2_step``.  Only the loss hyperparameters switch; the official code also lowers the
learning rates at the switch, which is the training loop's business.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses.checks import check_batch, fail, integer, non_negative, number, positive, sizes
from dml_core.losses.registry import BatchSpec, ModelRecipe, register

__all__ = [
    "euclidean_distances",
    "warp_f1",
    "warped_softmax_loss",
    "avg_distance_to_proxy",
    "EuclideanSoftmax",
    "RealignedSoftmaxWarping",
]

PAPER = "DeMoor & Prevost, Realigned Softmax Warping for Deep Metric Learning, 2024"
#: Official code, CUB: 8 classes x 8 samples per batch (docs/losses/rsw.md §Official code settings).
RSW_BATCH = BatchSpec(classes_per_batch=8, m=8)
#: Global max + avg pooling (summed) and a LayerNorm without affine before the embedding layer;
#: the embedding itself is never normalised (the official code; docs/losses/rsw.md §Official code settings).
RSW_MODEL = ModelRecipe(pooling="avg+max", layer_norm=True)
#: Official code: Adam weight_decay 1e-7 on every group, proxies included
#: (docs/losses/rsw.md §Official code settings).  The proxies are not normalised, so decay acts on them
#: directly; MLRC's 1e-4 would be 1000x the paper's.
RSW_PROXY_WEIGHT_DECAY = 1e-7


# --------------------------------------------------------------------------------------------
# the equations as functions of the distance matrix (also the unit-test oracles)
# --------------------------------------------------------------------------------------------
def euclidean_distances(embeddings: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    """T_ij = ||e_i − p_j||_2, shape (B, C): plain, not squared (Eq. 4's norm).

    Computed as sqrt(clamp(|e|² + |p|² − 2 e·p, 1e-12)) (one matmul, fast for C = 11,318);
    the clamp keeps an embedding that sits exactly on a proxy finite (the official code's formula).
    """
    sq = (
        (embeddings * embeddings).sum(1, keepdim=True) + (proxies * proxies).sum(1)[None] - 2 * embeddings @ proxies.t()
    )
    return sq.clamp_min(1e-12).sqrt()


def warp_f1(t1: torch.Tensor, *, k1: float, k2: float, alpha: float, delta_mult: float = 1.0) -> torch.Tensor:
    """Eq. 7: the warp of the own-proxy distance t1, with Δ = delta_mult·(1 − k1)·sg(t1).

    The branch is selected from the detached t1 (strict ``t1 < α``); α = inf keeps every
    sample on the k1 branch (the paper's "half-warp", Table III).
    """
    inner = k1 * t1 + delta_mult * (1 - k1) * t1.detach()
    if math.isinf(alpha):
        return inner
    outer = k2 * t1 + (1 - k2) * alpha
    return torch.where(t1.detach() < alpha, inner, outer)


def warped_softmax_loss(
    distances: torch.Tensor,
    labels: torch.Tensor,
    *,
    k1: float,
    k2: float,
    alpha: float,
    scale: float,
    delta_mult: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Eq. 8 with f1 = Eq. 7 and f2 = identity, on a (B, C) distance matrix.

    W_ij = t_ij for j ≠ y_i, W_{i,y_i} = f1(t_{i,y_i});  L_i = CE(−s·W_i, y_i)
    (= log(1 + Σ_{j≠y_i} exp(s(f1 − t_ij))), evaluated with log-sum-exp).
    k1 = k2 = 1 with delta_mult = 1 is exactly Eq. 4.
    """
    idx = labels[:, None]
    f1 = warp_f1(distances.gather(1, idx), k1=k1, k2=k2, alpha=alpha, delta_mult=delta_mult)
    warped = distances.scatter(1, idx, f1)  # only the own-class column changes
    return F.cross_entropy(-scale * warped, labels, reduction=reduction)


def avg_distance_to_proxy(embeddings: torch.Tensor, labels: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    """Eq. 9, AvgDTP: the class-balanced mean of ||e − p_c|| over the classes present.

    The paper's diagnostic (Table III): after training it tracks α.
    """
    with torch.no_grad():
        dist = (embeddings - proxies[labels]).norm(dim=1)
        classes, inverse = labels.unique(return_inverse=True)
        sums = torch.zeros(len(classes), dtype=dist.dtype, device=dist.device).index_add_(0, inverse, dist)
        counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(dist))
        return (sums / counts).mean()


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------
class _EuclideanProxyLoss(nn.Module):
    """One learnable, un-normalised proxy per class (``self.proxies``, shape (C, D))."""

    name = "euclidean_proxy"

    def __init__(self, num_classes: int, embedding_dim: int):
        super().__init__()
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        self.num_classes, self.embedding_dim = num_classes, embedding_dim
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_dim))
        # Official code: kaiming_normal_(fan_out) on (C, D) = N(0, 2/C); the paper says only "normal" (§IV-B).
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def _distances(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = check_batch(
            self.name, embeddings, labels, num_classes=self.num_classes, embedding_dim=self.embedding_dim
        )
        # fp16/bf16 are upcast by check_batch; float64 stays float64 (proxies follow the embeddings).
        dtype = torch.promote_types(x.dtype, self.proxies.dtype)
        return euclidean_distances(x.to(dtype), self.proxies.to(dtype)), y

    def avg_distance_to_proxy(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 9 (AvgDTP) of this loss's proxies on a labelled set of embeddings."""
        x, y = check_batch(
            self.name, embeddings, labels, num_classes=self.num_classes, embedding_dim=self.embedding_dim
        )
        return avg_distance_to_proxy(x, y, self.proxies.to(x.dtype))


@register(
    "euclidean_softmax",
    paper=f"{PAPER} (Eq. 4 baseline)",
    learnable=True,
    own_optimizer=True,
    batch=RSW_BATCH,
    model=RSW_MODEL,
    loss_weight_decay=RSW_PROXY_WEIGHT_DECAY,
    description="Softmax cross-entropy on raw Euclidean distances to one learnable proxy per class, "
    "logits -scale*||e - p|| (Eq. 4; the un-warped ablation of rsw).",
)
class EuclideanSoftmax(_EuclideanProxyLoss):
    """Eq. 4 with the official code's scale: L = mean_i CE(−s·||e_i − P||, y_i).

    ``scale`` = s multiplies the distances (the code's "temperature", so larger = sharper).
    Proxies (``self.proxies``) are trained by the loss's own optimiser (lr = ``loss_lr``).
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, scale: float = 4.525):
        super().__init__(num_classes, embedding_dim)
        self.scale = positive(self.name, "scale", scale)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        distances, y = self._distances(embeddings, labels)
        return F.cross_entropy(-self.scale * distances, y)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, scale={self.scale}"


@register(
    "rsw",
    paper=PAPER,
    learnable=True,
    own_optimizer=True,
    batch=RSW_BATCH,
    model=RSW_MODEL,
    loss_weight_decay=RSW_PROXY_WEIGHT_DECAY,
    description="Realigned Softmax Warping (Warped-Softmax): Euclidean proxy softmax whose own-proxy distance is "
    "warped piecewise-linearly (slope k1 inside alpha, k2 outside, stop-gradient offset Delta; Eqs. 7-8); "
    "optional two-phase schedule.",
)
class RealignedSoftmaxWarping(_EuclideanProxyLoss):
    """Warped-Softmax, Eqs. 7–8 (see the module docstring for the equations).

    Parameters (defaults: the official code's CUB phase-1 values, docs/losses/rsw.md §Official code settings):

    * ``k1`` (0.93), ``k2`` (1.15) – slopes of f1 inside / outside α.  The paper uses
      0 < k1 < 1 < k2 (outward force inside α, inward outside, minimum at distance α,
      Prop. III.2); only k1, k2 > 0 (f1 monotone, Lemma III.1) is enforced so that
      k1 = k2 = 1 (Eq. 4) and the Table III half-warps can be built.
    * ``alpha`` (28.40) – the point of attraction, in raw distance units; ``inf`` allowed.
    * ``scale`` (4.525) – s, multiplies the warped distances (the code's "temperature").
    * ``delta_mult`` (1.30) – m in Δ = m·(1 − k1)·sg(t1): 1 = plain Eq. 7, > 1 a margin
      (Fig. 8), 0 = no Δ.  Kept in phase 2, as in the official code.
    * ``phase2_step`` (None) – number of training-mode forward calls after which the
      ``phase2_k1/k2/alpha/scale`` values replace the phase-1 ones (each defaults to its
      phase-1 value; the code's CUB followup is k1 0.95, k2 1.20, α 24.68, s 1.0).

    The counter is the ``step`` buffer (saved in ``state_dict``, so a resumed run stays in its
    phase); it counts every ``forward`` while ``self.training`` and never in eval mode.
    """

    step: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        k1: float = 0.93,
        k2: float = 1.15,
        alpha: float = 28.40,
        scale: float = 4.525,
        delta_mult: float = 1.30,
        phase2_step: int | None = None,
        phase2_k1: float | None = None,
        phase2_k2: float | None = None,
        phase2_alpha: float | None = None,
        phase2_scale: float | None = None,
    ):
        super().__init__(num_classes, embedding_dim)
        phase1 = self._phase("", k1=k1, k2=k2, alpha=alpha, scale=scale)
        self.delta_mult = non_negative(self.name, "delta_mult", delta_mult)
        given2 = {"k1": phase2_k1, "k2": phase2_k2, "alpha": phase2_alpha, "scale": phase2_scale}
        phase2_step = integer(self.name, "phase2_step", phase2_step, ge=0, null="one phase")
        if phase2_step is None:
            stray = [f"phase2_{k}" for k, v in given2.items() if v is not None]
            if stray:
                fail(self.name, f"{', '.join(stray)} given without phase2_step")
            phase2 = None
        else:
            phase2 = self._phase("phase2_", **{k: phase1[k] if v is None else v for k, v in given2.items()})
        self.phase2_step = phase2_step
        self.phases = (phase1, phase2)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def _phase(self, prefix: str, *, k1, k2, alpha, scale) -> dict[str, float]:
        return {
            "k1": positive(self.name, prefix + "k1", k1),
            "k2": positive(self.name, prefix + "k2", k2),
            # α = inf keeps every sample on the k1 branch (the paper's "half-warp", Table III).
            "alpha": number(self.name, prefix + "alpha", alpha, ge=0, allow_inf=True),
            "scale": positive(self.name, prefix + "scale", scale),
        }

    @property
    def phase(self) -> int:
        """1 or 2: the phase the *next* training forward call uses."""
        if self.phase2_step is None:
            return 1
        return 2 if int(self.step) >= self.phase2_step else 1

    def hyperparameters(self) -> dict[str, float]:
        """The k1, k2, α, s, m the next training forward call uses."""
        phase = cast(dict[str, float], self.phases[self.phase - 1])  # phase 2 only where phase2_step is set
        return {**phase, "delta_mult": self.delta_mult}

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        distances, y = self._distances(embeddings, labels)
        hp: dict[str, Any] = self.hyperparameters()
        if self.training:
            self.step += 1
        return warped_softmax_loss(distances, y, **hp)

    def extra_repr(self) -> str:
        p1, p2 = self.phases
        out = f"num_classes={self.num_classes}, delta_mult={self.delta_mult}, phase1={p1}"
        return out + (f", phase2_step={self.phase2_step}, phase2={p2}" if p2 else "")
