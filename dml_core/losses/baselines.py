"""Reality-check baselines: thin adapters around pytorch-metric-learning (PML) losses.

"A Metric Learning Reality Check" (Musgrave, Belongie & Lim, ECCV 2020; "MLRC") trained every
baseline with the PML class of the same name, so wrapping PML *is* the reference implementation.
Each adapter

* builds the PML loss with the settings MLRC used (PML defaults apart from the searched
  hyperparameters; no miner unless stated) and keeps it as the submodule ``self.loss``, so
  learnable class weights ``W`` / margins ``beta`` are parameters of the adapter;
* takes raw embeddings: PML L2-normalises inside its distance (``normalize_embeddings=True``);
* upcasts fp16/bf16 embeddings to fp32 (loss reductions in fp32; PML would otherwise cast its
  learnable weights down in place), and checks its inputs and hyperparameters with
  :mod:`dml_core.losses.checks` (errors name the loss and the field).

``triplet`` and ``multi_similarity`` are also base losses of the Spherical Embedding Constraint
paper (SEC, Zhang et al. NeurIPS 2020).  Their defaults are the MLRC/PML reading; the options
``squared``/``reduction`` (triplet) and ``epsilon`` (multi-similarity miner) give SEC's reading
(``docs/losses/baselines.md`` maps one onto the other).  The other SEC base losses
(``semihard_triplet``, ``npair``) and the SEC / L2-reg wrappers live in :mod:`dml_core.losses.sec`.

Hyperparameter names are PML's / MLRC's (which are the papers' symbols): ``margin``,
``pos_margin``, ``neg_margin``, ``temperature``, ``scale``, ``alpha``, ``beta``, ``base``.
"""

from __future__ import annotations

import warnings

import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.reducers import AvgNonZeroReducer, MeanReducer
from torch import nn

from dml_core.losses.checks import check_batch, choice, flag, number, positive, sizes
from dml_core.losses.registry import MLRC_BATCH, MLRC_MODEL, MLRC_PAPER, register

__all__ = [
    "PMLLoss",
    "Contrastive",
    "Triplet",
    "NTXent",
    "Margin",
    "NormalizedSoftmax",
    "CosFace",
    "ArcFace",
    "MultiSimilarity",
]


class PMLLoss(nn.Module):
    """``loss(embeddings, labels) -> scalar`` around a PML loss (``self.loss``) and optional miner.

    Subclasses set ``name`` and, when the loss has per-class parameters, ``checks_labels`` /
    ``checks_dim``; tuple losses accept any embedding width, as PML does.
    """

    name = "pml"
    #: labels index per-class parameters (W columns, per-class beta): check their range.
    checks_labels = False
    #: the loss has class weights W of shape (embedding_dim, num_classes): check the embedding width.
    checks_dim = False

    def __init__(self, loss: nn.Module, miner: nn.Module | None = None, *, num_classes: int, embedding_dim: int):
        super().__init__()
        self.loss = loss
        self.miner = miner
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x, y = check_batch(
            self.name,
            embeddings,
            labels,
            num_classes=self.num_classes if self.checks_labels else None,
            embedding_dim=self.embedding_dim if self.checks_dim else None,
        )
        indices_tuple = self.miner(x, y) if self.miner is not None else None
        return self.loss(x, y, indices_tuple)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


# --------------------------------------------------------------------------------------------
# pair / tuple losses
# --------------------------------------------------------------------------------------------
@register(
    "contrastive",
    paper=f"Hadsell, Chopra & LeCun, CVPR 2006; settings: {MLRC_PAPER}",
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Contrastive loss on normalised Euclidean distances (PML ContrastiveLoss).",
)
class Contrastive(PMLLoss):
    """Contrastive loss (PML ``ContrastiveLoss``), the MLRC form with two margins.

    With d_ij = ||f̂_i − f̂_j||_2 (normalised, not squared; PML ``LpDistance``):
    positive pairs contribute [d_ij − pos_margin]_+, negative pairs [neg_margin − d_ij]_+, every
    ordered pair i ≠ j of the batch is used, and each of the two terms is averaged over its
    *non-zero* pairs (PML ``AvgNonZeroReducer``), the two averages added.
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, pos_margin: float = 0.0, neg_margin: float = 1.0):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        pos_margin = number(self.name, "pos_margin", pos_margin)
        neg_margin = number(self.name, "neg_margin", neg_margin)
        if neg_margin <= 0:
            # d_ij >= 0, so [neg_margin - d_ij]_+ is always 0: the loss never pushes negatives apart (legal, but
            # almost certainly not meant: a search space reaching below 0 is the usual cause)
            warnings.warn(
                f"contrastive: neg_margin={neg_margin:g} <= 0 on a distance: the negative term can never "
                "act, only positives are pulled together",
                UserWarning,
                stacklevel=3,
            )
        loss = pml_losses.ContrastiveLoss(pos_margin=pos_margin, neg_margin=neg_margin)
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)


_TRIPLET_REDUCTIONS = {"nonzero": AvgNonZeroReducer, "all": MeanReducer}


@register(
    "triplet",
    paper=f"Weinberger & Saul, JMLR 2009 / Schroff et al., CVPR 2015; settings: {MLRC_PAPER}; "
    "SEC reading: Zhang et al., NeurIPS 2020, Eq. 2",
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Triplet margin loss over all batch triplets (PML TripletMarginLoss); SEC's vanilla triplet "
    "via squared=True, reduction='all', margin=1.0.",
)
class Triplet(PMLLoss):
    """Triplet margin loss over every (anchor, positive, negative) of the batch.

    ℓ(a,p,n) = [d(f̂_a, f̂_p) − d(f̂_a, f̂_n) + margin]_+    (SEC paper Eq. 2 with d squared)

    * ``squared=False`` (default, MLRC = PML ``TripletMarginLoss`` defaults): d = ||f̂_a − f̂_b||_2.
      ``squared=True`` (SEC paper Eq. 2 and its code): d = ||f̂_a − f̂_b||²_2 = 2 − 2 cos θ_ab.
    * ``reduction="nonzero"`` (default, MLRC/PML ``AvgNonZeroReducer``): mean over the triplets
      with ℓ > 0.  ``reduction="all"`` (SEC code, docs/losses/sec.md §Base losses): mean over all
      B(K−1)(B−K) triplets, zero-loss triplets included (PML ``MeanReducer``).
    * Triplets: all valid ones (PML ``triplets_per_anchor="all"``, no miner) in both readings.

    The SEC paper's vanilla triplet is ``margin=1.0, squared=True, reduction="all"``.
    """

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        margin: float = 0.05,
        squared: bool = False,
        reduction: str = "nonzero",
    ):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        margin = number(self.name, "margin", margin)
        squared = flag(self.name, "squared", squared)
        reduction = choice(self.name, "reduction", reduction, sorted(_TRIPLET_REDUCTIONS))
        loss = pml_losses.TripletMarginLoss(
            margin=margin,
            triplets_per_anchor="all",
            distance=LpDistance(normalize_embeddings=True, p=2, power=2 if squared else 1),
            reducer=_TRIPLET_REDUCTIONS[reduction](),
        )
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)
        self.squared, self.reduction = squared, reduction


@register(
    "ntxent",
    paper="Sohn, NeurIPS 2016 (N-pair) / Oord et al. 2018 (InfoNCE) / Chen et al., ICML 2020 (NT-Xent); "
    f"settings: {MLRC_PAPER}",
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="NT-Xent / InfoNCE over all positive pairs of the batch (PML NTXentLoss).",
)
class NTXent(PMLLoss):
    """NT-Xent (PML ``NTXentLoss``), MLRC's "NTXent" (its N-pairs / InfoNCE representative).

    For every positive pair (a, p), with s = cos θ on normalised embeddings and τ = temperature:
    ℓ_ap = −log( e^{s_ap/τ} / (e^{s_ap/τ} + Σ_{n: y_n ≠ y_a} e^{s_an/τ}) ), averaged over all
    positive pairs (PML ``MeanReducer``).  PML subtracts the row maximum before exponentiating.
    """

    def __init__(self, *, num_classes: int, embedding_dim: int, temperature: float = 0.07):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        temperature = positive(self.name, "temperature", temperature)
        loss = pml_losses.NTXentLoss(temperature=temperature)
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)


@register(
    "margin",
    paper="Wu, Manmatha, Smola & Krähenbühl, Sampling Matters in Deep Embedding Learning, ICCV 2017; "
    f"settings: {MLRC_PAPER}",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Margin loss with a learnable boundary beta (one, or one per class: MLRC 'Margin / class') "
    "(PML MarginLoss, learn_beta=True).",
    # MLRC trained beta without weight decay (its plot files are named *_no_weight_decay; docs/protocol.md
    # §Optimisers).
    loss_weight_decay=0.0,
)
class Margin(PMLLoss):
    """Margin loss (PML ``MarginLoss``, ``learn_beta=True``) over all batch triplets.

    With d = ||f̂_a − f̂_b||_2 and a learnable boundary β (``beta`` is its initial value):
    for each triplet, [d_ap − β + margin]_+ + [β − d_an + margin]_+; the sum is divided by the
    number of non-zero terms (PML ``DivisorReducer``), plus ν·β (``nu``, 0 in MLRC).
    ``beta_per_class=True`` gives one β per class, indexed by the anchor's label (MLRC
    "Margin / class"; Wu et al.'s class-specific β).  β is ``self.loss.beta``, an
    ``nn.Parameter`` trained by the loss's own optimiser (lr = ``loss_lr``; MLRC ran it
    without weight decay).  No distance-weighted sampling: MLRC used PML's all-triplets default.
    """

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        margin: float = 0.2,
        beta: float = 1.2,
        beta_per_class: bool = False,
        nu: float = 0.0,
    ):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        margin = number(self.name, "margin", margin)
        beta = number(self.name, "beta", beta)
        nu = number(self.name, "nu", nu)
        beta_per_class = flag(self.name, "beta_per_class", beta_per_class)
        loss = pml_losses.MarginLoss(
            margin=margin,
            nu=nu,
            beta=beta,
            triplets_per_anchor="all",
            learn_beta=True,
            num_classes=num_classes if beta_per_class else None,
        )
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)
        self.checks_labels = beta_per_class


@register(
    "multi_similarity",
    paper=f"Wang et al., Multi-Similarity Loss with General Pair Weighting, CVPR 2019; settings: {MLRC_PAPER}; "
    "SEC reading: Zhang et al., NeurIPS 2020 §4.1",
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Multi-similarity loss (PML MultiSimilarityLoss); epsilon adds the MS miner "
    "(MLRC 'MS + miner', SEC paper: alpha=2, beta=40, base=0.5, epsilon=0.1).",
)
class MultiSimilarity(PMLLoss):
    """Multi-similarity loss (PML ``MultiSimilarityLoss``), optionally with the MS miner.

    With S_ij = cos θ_ij, for each anchor i (docs/losses/sec.md §Base losses; λ = ``base``):
    L_i = (1/α) log(1 + Σ_{p ∈ P_i} e^{−α(S_ip − λ)}) + (1/β) log(1 + Σ_{n ∈ N_i} e^{β(S_in − λ)}),
    L = Σ_i L_i / B (PML ``MeanReducer`` over all B anchors; anchors without pairs give 0).

    * ``epsilon=None`` (default; MLRC "Multi Similarity"): P_i, N_i = all positives / negatives.
    * ``epsilon=ε`` (MLRC "MS + miner"; SEC paper ε = 0.1): PML ``MultiSimilarityMiner(ε)`` keeps
      negatives with S_in + ε > min_p S_ip and positives with S_ip − ε < max_n S_in — the MS
      "sampling" step of the official code.  The official code skips an anchor when either mined
      set is empty; PML keeps it, but for ε ≥ 0 one set is empty iff the other is, so the two agree.
      The official code drops self-similarities by value (S < 1 − 1e−5); PML drops them by index.

    The SEC paper's MS is ``alpha=2, beta=40, base=0.5, epsilon=0.1``.  PML computes the two
    log-sum-exps with ``torch.logsumexp`` (stable for β up to the MLRC bound 100).
    """

    def __init__(
        self,
        *,
        num_classes: int,
        embedding_dim: int,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        epsilon: float | None = None,
    ):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        alpha = positive(self.name, "alpha", alpha)
        beta = positive(self.name, "beta", beta)
        base = number(self.name, "base", base)
        epsilon = number(self.name, "epsilon", epsilon, ge=0, null="no miner")
        miner = None if epsilon is None else pml_miners.MultiSimilarityMiner(epsilon=epsilon)
        loss = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=base)
        super().__init__(loss, miner, num_classes=num_classes, embedding_dim=embedding_dim)
        self.epsilon = epsilon


# --------------------------------------------------------------------------------------------
# classification losses with learnable class weights W (shape embedding_dim x num_classes)
# --------------------------------------------------------------------------------------------
@register(
    "normalized_softmax",
    paper=f"Zhai & Wu, Classification is a Strong Baseline for Deep Metric Learning, BMVC 2019; settings: {MLRC_PAPER}",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Softmax over cosines to learnable normalised class weights, divided by a temperature "
    "(PML NormalizedSoftmaxLoss).",
)
class NormalizedSoftmax(PMLLoss):
    """Normalised softmax (PML ``NormalizedSoftmaxLoss``).

    L = mean_i −log( e^{cos(f_i, w_{y_i})/τ} / Σ_k e^{cos(f_i, w_k)/τ} ), τ = ``temperature``;
    W = ``self.loss.W`` (embedding_dim × num_classes, PML's N(0, 1) init) is a learnable
    parameter with its own optimiser (lr = ``loss_lr``).
    """

    checks_labels = checks_dim = True

    def __init__(self, *, num_classes: int, embedding_dim: int, temperature: float = 0.05):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        temperature = positive(self.name, "temperature", temperature)
        loss = pml_losses.NormalizedSoftmaxLoss(
            num_classes=num_classes, embedding_size=embedding_dim, temperature=temperature
        )
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)


@register(
    "cosface",
    paper=f"Wang et al., CosFace: Large Margin Cosine Loss, CVPR 2018; settings: {MLRC_PAPER}",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Large-margin cosine loss with learnable class weights (PML CosFaceLoss).",
)
class CosFace(PMLLoss):
    """CosFace / large-margin cosine loss (PML ``CosFaceLoss``); SEC paper Eq. 19.

    L = mean_i −log( e^{s(cos θ_{i,y_i} − m)} / (e^{s(cos θ_{i,y_i} − m)} + Σ_{j≠y_i} e^{s cos θ_{i,j}}) ),
    cos θ_{i,k} = ⟨f̂_i, ŵ_k⟩, m = ``margin``, s = ``scale``; W = ``self.loss.W`` is learnable.
    """

    checks_labels = checks_dim = True

    def __init__(self, *, num_classes: int, embedding_dim: int, margin: float = 0.35, scale: float = 64.0):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        margin = number(self.name, "margin", margin)
        scale = positive(self.name, "scale", scale)
        loss = pml_losses.CosFaceLoss(num_classes=num_classes, embedding_size=embedding_dim, margin=margin, scale=scale)
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)


class _ClampedArcFaceLoss(pml_losses.ArcFaceLoss):
    """PML ``ArcFaceLoss`` whose arccos input is kept inside (−1, 1).

    PML clamps to [−1, 1]; d arccos(x)/dx = −1/sqrt(1 − x²) is infinite at ±1, which gives
    inf/NaN gradients when an embedding is exactly parallel to its class weight (possible in
    fp32).  Clamping one ulp inside changes angles by < 1e−3 rad only at |cos| > 1 − eps.
    """

    def get_angles(self, cosine_of_target_classes):
        eps = torch.finfo(cosine_of_target_classes.dtype).eps
        return super().get_angles(cosine_of_target_classes.clamp(-1 + eps, 1 - eps))


@register(
    "arcface",
    paper=f"Deng et al., ArcFace: Additive Angular Margin Loss, CVPR 2019; settings: {MLRC_PAPER}",
    learnable=True,
    own_optimizer=True,
    batch=MLRC_BATCH,
    model=MLRC_MODEL,
    description="Additive angular margin loss with learnable class weights; margin in degrees (PML ArcFaceLoss).",
)
class ArcFace(PMLLoss):
    """ArcFace / additive angular margin (PML ``ArcFaceLoss``).

    L = mean_i −log( e^{s cos(θ_{i,y_i} + m)} / (e^{s cos(θ_{i,y_i} + m)} + Σ_{j≠y_i} e^{s cos θ_{i,j}}) ),
    m = ``margin`` in **degrees** (PML / MLRC convention; bounds [0, 90]), s = ``scale``.  For
    θ + m > 180° PML uses cos θ − m·sin m to keep the target logit monotone.  The only change to
    PML: the arccos input is clamped one ulp inside (−1, 1) (see :class:`_ClampedArcFaceLoss`).
    """

    checks_labels = checks_dim = True

    def __init__(self, *, num_classes: int, embedding_dim: int, margin: float = 28.6, scale: float = 64.0):
        num_classes, embedding_dim = sizes(self.name, num_classes, embedding_dim)
        margin = number(self.name, "margin", margin)
        scale = positive(self.name, "scale", scale)
        loss = _ClampedArcFaceLoss(num_classes=num_classes, embedding_size=embedding_dim, margin=margin, scale=scale)
        super().__init__(loss, num_classes=num_classes, embedding_dim=embedding_dim)
