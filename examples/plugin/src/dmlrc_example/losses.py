"""Circle loss (Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity Optimization", CVPR 2020), pair
form, with the paper's self-paced weights α and margins Δ (its Sec. 3):

    L = softplus( logsumexp_j  γ α_n^j (s_n^j − Δ_n)  +  logsumexp_i  −γ α_p^i (s_p^i − Δ_p) ),
    α_p = [1 + m − s_p]_+,  α_n = [s_n + m]_+,  Δ_p = 1 − m,  Δ_n = m,

per anchor over its positives i and negatives j (cosine similarities), averaged over the anchors that have both.
The weights α are not differentiated through (the paper treats them as constants)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dml_core.losses import loss_metadata


@loss_metadata(
    paper="Sun et al., Circle Loss: A Unified Perspective of Pair Similarity Optimization, CVPR 2020",
    description="pair-based Circle loss with self-paced weights",
    space="dmlrc_example:circle.yaml",
)
class CircleLoss(torch.nn.Module):
    def __init__(self, num_classes: int, embedding_dim: int, m: float = 0.4, gamma: float = 80.0):
        super().__init__()
        self.m, self.gamma = float(m), float(gamma)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.normalize(embeddings, dim=1)
        s = x @ x.T
        same = labels[:, None] == labels[None, :]
        eye = torch.eye(len(labels), dtype=torch.bool, device=s.device)
        pos, neg = same & ~eye, ~same
        alpha_p = (1 + self.m - s.detach()).clamp_min(0)
        alpha_n = (s.detach() + self.m).clamp_min(0)
        logit_p = (-self.gamma * alpha_p * (s - (1 - self.m))).masked_fill(~pos, float("-inf"))
        logit_n = (self.gamma * alpha_n * (s - self.m)).masked_fill(~neg, float("-inf"))
        rows = pos.any(dim=1) & neg.any(dim=1)
        if not rows.any():
            return embeddings.sum() * 0.0
        per_anchor = F.softplus(torch.logsumexp(logit_p[rows], dim=1) + torch.logsumexp(logit_n[rows], dim=1))
        return per_anchor.mean()
