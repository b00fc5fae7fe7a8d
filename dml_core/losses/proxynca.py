"""ProxyNCA and ProxyNCA++ (Teh, DeVries & Taylor, ECCV 2020; equation numbers from that paper).

Both compare L2-normalised embeddings x̂_i with L2-normalised class proxies p̂_c (one per class)
by the squared Euclidean distance d_ic = ||x̂_i − p̂_c||² = 2 − 2·x̂_iᵀp̂_c ∈ [0, 4], divided by a
temperature T (logits z_ic = −d_ic / T ∈ [−4/T, 0]):

* Eq. 3 (ProxyNCA, ``prob=False``): L_i = −log( e^{z_{i,y_i}} / Σ_{c≠y_i} e^{z_ic} ) — the
  denominator runs over the *other* proxies only, so L_i can be negative (≥ log(C−1) − 4/T).
* Eqs. 4–6/8 (ProxyNCA++ "+prob", ``prob=True``): L_i = −log P_i with
  P_i = softmax_c(z_ic)[y_i] over *all* proxies, i.e. ``cross_entropy(−d/T, y)``.
  Per sample L_prob = softplus(L_classic) (docs/losses/proxynca.md §Identities).

Registered losses:

* ``proxynca`` — the reality-check baseline.  MLRC trained PML's ``ProxyNCALoss``, whose
  loss is −log softmax(−softmax_scale·d)[y] over all proxies: this module with
  ``softmax_scale`` = 1/T and ``prob=True`` (the default).  ``prob=False`` gives the ProxyNCA
  paper's Eq. 3.  Proxies start N(0, 1) like PML's.
* ``proxynca_pp`` — ProxyNCA++: ``temperature`` T (default 1/9, §4.1), ``prob=True``; proxies
  start randn/8 (official code; the init norm sets the effective proxy lr, docs/losses/proxynca.md §Identities).
  The paper's other components are declared as metadata: "+max" and "+norm" as the model recipe
  (global max pooling, LayerNorm without affine before the embedding layer), "+cbs" as the batch
  (8 classes × 4), "+fast" as ``own_optimizer`` (the proxies' lr is the searched ``loss_lr``).

Both losses are batch means (official code ``loss.mean()``).  Everything is computed in the
embeddings' precision (fp16/bf16 upcast to fp32) with log-sum-exp, so T down to
1e-3 (logits −4000) stays finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses.checks import check_batch, fail, flag, positive, sizes
from dml_core.losses.registry import MLRC_BATCH, MLRC_MODEL, MLRC_PAPER, BatchSpec, ModelRecipe, register

__all__ = [
    "normalized_squared_distances",
    "proxy_nca_loss",
    "ProxyNCA",
    "ProxyNCAPlusPlus",
]

PAPER_PP = (
    "Teh, DeVries & Taylor, ProxyNCA++: Revisiting and Revitalizing Proxy Neighborhood Component Analysis, ECCV 2020"
)
PAPER_NCA = "Movshovitz-Attias et al., No Fuss Distance Metric Learning using Proxies, ICCV 2017"


def normalized_squared_distances(embeddings: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    """d_ic = ||x̂_i − p̂_c||²_2 = 2 − 2 x̂_iᵀp̂_c, shape (B, C), clamped at 0 (never square-rooted)."""
    x = F.normalize(embeddings, dim=1)
    p = F.normalize(proxies, dim=1)
    return (2 - 2 * x @ p.t()).clamp_min(0)


def proxy_nca_loss(
    sq_distances: torch.Tensor, labels: torch.Tensor, *, temperature: float, prob: bool = True, reduction: str = "mean"
) -> torch.Tensor:
    """Eq. 6/8 (``prob=True``) or Eq. 3 with temperature (``prob=False``) on a (B, C) matrix of d/1."""
    logits = -sq_distances / temperature
    if prob:
        return F.cross_entropy(logits, labels, reduction=reduction)
    own = F.one_hot(labels, logits.shape[1]).bool()
    positive = logits.gather(1, labels[:, None]).squeeze(1)
    losses = torch.logsumexp(logits.masked_fill(own, float("-inf")), dim=1) - positive
    if reduction == "none":
        return losses
    if reduction == "mean":
        return losses.mean()
    raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")


class _ProxyNCABase(nn.Module):
    """Proxies ``self.proxies`` (C, D), temperature ``self.temperature``, switch ``self.prob``."""

    name: str  # given by @register on each loss

    def __init__(self, num_classes: int, embedding_dim: int, temperature: float, prob: bool, init_std: float):
        super().__init__()
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        prob = flag(self.name, "prob", prob)
        if not prob and num_classes < 2:
            fail(self.name, f"prob=false (Eq. 3) needs num_classes >= 2, got {num_classes}")
        self.num_classes, self.embedding_dim = num_classes, embedding_dim
        self.temperature, self.prob = temperature, prob
        self.proxies = nn.Parameter(torch.randn(num_classes, embedding_dim) * init_std)

    def distances(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp16/bf16 are upcast by check_batch; float64 stays float64 (proxies follow the embeddings).
        x, y = check_batch(
            self.name, embeddings, labels, num_classes=self.num_classes, embedding_dim=self.embedding_dim
        )
        dtype = torch.promote_types(x.dtype, self.proxies.dtype)  # float64 in, float64 throughout
        return normalized_squared_distances(x.to(dtype), self.proxies.to(dtype)), y

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        d, y = self.distances(embeddings, labels)
        return proxy_nca_loss(d, y, temperature=self.temperature, prob=self.prob)

    @torch.no_grad()
    def assignment_probabilities(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Eq. 4 for every class: P_ic = softmax_c(−d_ic / T), shape (B, C)."""
        labels = torch.zeros(embeddings.shape[0], dtype=torch.long, device=embeddings.device)
        d, _ = self.distances(embeddings, labels)
        return torch.softmax(-d / self.temperature, dim=1)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, temperature={self.temperature:g}, prob={self.prob}"


@register(
    "proxynca",
    paper=f"{PAPER_NCA}; Eq. 3 of {PAPER_PP}; settings: {MLRC_PAPER} (PML ProxyNCALoss)",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="ProxyNCA: softmax over -softmax_scale * squared distances between normalised embeddings and "
    "normalised proxies (MLRC/PML ProxyNCALoss); prob=false gives Eq. 3 (positive left out of the denominator).",
)
class ProxyNCA(_ProxyNCABase):
    """ProxyNCA as the reality check ran it (PML ``ProxyNCALoss``), or the paper's Eq. 3.

    * ``softmax_scale`` (default 1.0, PML's default; MLRC searched [0.01, 100] linear) = 1/T.
    * ``prob`` (default True = PML/MLRC: positive proxy inside the softmax denominator;
      False = Eq. 3, the positive left out).

    One deliberate difference from PML: PML drops a sample whose positive probability
    underflows to exactly 0 (its ``non_zero`` filter); here every sample counts with its exact
    −log P via log-sum-exp.  The two agree whenever PML keeps every sample.
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, softmax_scale: float = 1.0, prob: bool = True):
        softmax_scale = positive(self.name, "softmax_scale", softmax_scale)
        super().__init__(num_classes, embedding_dim, 1.0 / softmax_scale, prob, init_std=1.0)
        self.softmax_scale = softmax_scale


@register(
    "proxynca_pp",
    paper=PAPER_PP,
    learnable=True,
    own_optimizer=True,
    # +cbs: 8 classes x 4 images per batch (Table 1, CUB/Cars; §3.7).
    batch=BatchSpec(classes_per_batch=8, m=4),
    # +max: global max pooling (§3.5); +norm: LayerNorm without affine before the embedding layer (§3.7; the
    # placement is the official code's).
    model=ModelRecipe(pooling="max", layer_norm=True),
    # Official code: weight decay 0 on every group; decay would shrink ||p|| and so raise the effective proxy lr
    # (the gradient scales as 1/||p||; docs/losses/proxynca.md §Identities).  proxynca keeps MLRC's 1e-4 (registry
    # default).
    loss_weight_decay=0.0,
    description="ProxyNCA++: softmax over all proxies of -||x^ - p^||^2 / T at low temperature (T = 1/9), fast "
    "proxies with their own learning rate, global max pooling + LayerNorm (Eqs. 4-8).",
)
class ProxyNCAPlusPlus(_ProxyNCABase):
    """ProxyNCA++, Eq. 8: L = mean_i −log softmax_c(−||x̂_i − p̂_c||² / T)[y_i].

    * ``temperature`` T (default 1/9, §4.1; T = 1 is the "−scale" ablation).
    * ``prob`` (default True; False is the "−prob" ablation: Eq. 3 at the same T).

    The official code multiplies x̂ and p̂ by sqrt(1/T) = 3 before the squared distance;
    ||3x̂ − 3p̂||² = d/T is the same number (docs/losses/proxynca.md §Identities).
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, temperature: float = 1 / 9, prob: bool = True):
        temperature = positive(self.name, "temperature", temperature)
        super().__init__(num_classes, embedding_dim, temperature, prob, init_std=1 / 8)
