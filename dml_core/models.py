"""Embedding models: trunk → global pooling → [LayerNorm] → linear embedder.

The MLRC model (docs/protocol.md §Model): an ImageNet-pretrained **BN-Inception** trunk whose 1024-d global-average-
pooled feature feeds one ``Linear(1024, 128)`` (no ReLU, no BN); the trunk's BatchNorm layers are frozen (kept
in eval mode); embeddings are raw (losses and the evaluator normalise).  This module builds that recipe and
the variants the newer papers use:

Trunks (``trunk=``) — resolved by :func:`dml_core.trunks.resolve_trunk` (user guide: ``docs/trunks.md``)
    ``bninception`` BN-Inception (Ioffe & Szegedy 2015), 1024-d — **the MLRC trunk** (docs/protocol.md §Model), written
                   in :mod:`dml_core.trunks.bninception` with ``pretrainedmodels.bninception``'s exact state-dict
                   layout, so its ImageNet file (``bn_inception-52deb4733.pth``) loads as-is.  Its weights expect BGR
                   input in [0, 255] minus the mean (104, 117, 128): give the data transforms
                   ``preprocessing=model.preprocessing``.
    ``googlenet``  torchvision GoogLeNet (Inception v1 with BatchNorm after every convolution), 1024-d, the closest
                   torchvision architecture to BN-Inception (same Inception v1 topology, slightly different modules).
    ``resnet50``   torchvision ResNet-50, 2048-d — what most later papers use (ProxyNCA++ §4.1, RSW, MPA).
    ``resnet18``   torchvision ResNet-18, 512-d — a cheaper ResNet for smoke runs on a GPU.
    ``tiny``       a small conv-BN-ReLU CNN (256-d) for CPU tests and Omniglot-sized images (any size ≥ 16 px).
    ``timm:<model>``  any model of the timm registry (``timm.create_model(name, pretrained=False, num_classes=0,
                   global_pool="")``): its unpooled feature map; token models (ViT) give timm's pooled pre-logits and
                   accept only ``pooling="avg"``.
    ``package.module:callable`` or an entry-point name of the group ``dml_reality_check.trunks`` — a trunk from
                   user code (contract in ``docs/trunks.md``).

    torchvision trunks are built with ``weights=None`` (GoogLeNet: ``aux_logits=False, init_weights=True``)
    and keep everything up to the last feature map; their pooling and classifier are dropped.  Nothing is
    downloaded: pretrained weights come only from ``pretrained=``, a local file or an ``s3://`` object (fetched
    through :mod:`dml_core.storage`), holding a state dict of the full classifier: its classifier entries
    (torchvision ``fc.*``/``aux*``, BN-Inception ``last_linear.*``, timm's ``pretrained_cfg["classifier"]``) are
    ignored, every trunk entry must match.  For GoogLeNet with pretrained weights the input is re-normalised like
    torchvision does for its ImageNet weights (``transform_input=True``): those weights expect inputs scaled to
    [-1, 1], while the data layer normalises with the ImageNet mean/std.

Pooling (``pooling=``) over the trunk's last feature map
    ``avg``      global average pooling — MLRC (BN-Inception's pooled feature).
    ``max``      global max pooling — ProxyNCA++'s "+max" (ProxyNCA++ §3.5; docs/losses/proxynca.md §Paper settings).
    ``avg+max``  the **sum** of the two (not a concatenation), as the Realigned-Softmax-Warping code does
                 (RSW paper §IV-B; docs/losses/rsw.md §Official code settings; also its ProxyNCA++ rerun).
                 ProxyNCA++ itself evaluates GAP, GMP and K-max only (its Eq. 7), never GMP+GAP.
    ``gem``      generalised-mean pooling (mean_hw clamp(x, 1e-6)^p)^(1/p) with a fixed p = 3: the MPA paper's
                 "cubic GeM" (MPA paper §4.2; docs/losses/multi_proxy_anchor.md §Paper settings).  ``gem:P`` sets
                 another fixed p ≥ 1 (p = 1 is ``avg``; p → ∞ tends to ``max``).
    ``kmax:K``   global K-max pooling, ProxyNCA++ Eq. 7 (from WELDON): per channel, the mean of its K largest
                 activations over the H·W positions.  K = 1 is ``max``, K = H·W is ``avg``; K larger than the
                 feature map is an error (the sweep's preflight checks it before training).

LayerNorm (``layer_norm=True``)
    ``LayerNorm(d, elementwise_affine=False)`` on the pooled trunk feature, **before** the linear embedder —
    ProxyNCA++ "+norm" (§3.7; placement from its code, docs/losses/proxynca.md §Paper settings) and RSW (same
    placement).  It has no parameters; it lives inside ``model.embedder`` so that everything after pooling is one
    parameter group.

Parameter groups
    ``model.trunk`` and ``model.embedder`` get separate optimisers (MLRC: RMSprop 1e-6 each).

Frozen BatchNorm (``freeze_bn=True``, the MLRC default)
    Every BatchNorm layer of the trunk stays in eval mode even after ``model.train()``, so its running
    statistics never change and batches are normalised with them.  This is exactly what MLRC does (PML
    ``maybe_freeze_trunk_batchnorm`` sets the layers to eval): the BN **affine** parameters are still trained
    there (docs/protocol.md §Model).  ``freeze_bn_affine=True`` additionally stops
    their gradients (``requires_grad=False``) for a fully frozen BN.  ProxyNCA++/RSW/MPA train with BN in
    train mode (``freeze_bn=False``).  A ``tiny`` trunk trained from scratch has fresh running statistics
    (mean 0, var 1), so frozen BN there is a plain affine layer; use ``freeze_bn=False`` for it.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dml_core.trunks import BUILTIN_TRUNKS, Preprocessing, TinyCNN, resolve_trunk

__all__ = ["TRUNKS", "POOLINGS", "TinyCNN", "GlobalPooling", "EmbeddingModel", "build_model", "parse_pooling"]

#: The built-in trunk names; ``timm:<model>``, import paths and entry points are accepted too (docs/trunks.md).
TRUNKS = BUILTIN_TRUNKS
#: Pooling names; ``gem`` and ``kmax`` take an argument after a colon (``gem:3``, ``kmax:4``).
POOLINGS = ("avg", "max", "avg+max", "gem", "kmax")
#: "cubic" GeM (MPA paper §4.2) and GeM's clamp floor (the usual GeM formulation; p is not said to be learnt).
GEM_P = 3.0
GEM_EPS = 1e-6


def parse_pooling(spec: str) -> tuple[str, float | int | None]:
    """``"avg"`` → ``("avg", None)``, ``"gem"`` → ``("gem", 3.0)``, ``"gem:2.5"`` → ``("gem", 2.5)``,
    ``"kmax:4"`` → ``("kmax", 4)``; anything else is a ``ValueError`` saying what is accepted."""
    accepted = "one of avg, max, avg+max, gem, gem:P (P >= 1), kmax:K (K >= 1)"
    if not isinstance(spec, str):
        raise ValueError(f"pooling must be {accepted}, got {spec!r}")
    name, sep, arg = spec.partition(":")
    if name not in POOLINGS or (sep and name not in ("gem", "kmax")):
        raise ValueError(f"pooling must be {accepted}, got {spec!r}")
    if name == "gem":
        if not sep:
            return name, GEM_P
        try:
            p = float(arg)
        except ValueError:
            p = float("nan")
        if not (math.isfinite(p) and p >= 1):
            raise ValueError(f"pooling {spec!r}: GeM's p must be a finite number >= 1, got {arg!r}")
        return name, p
    if name == "kmax":
        if not sep or not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"pooling {spec!r}: K-max pooling needs a positive integer K, e.g. 'kmax:4'")
        return name, int(arg)
    return name, None


class GlobalPooling(nn.Module):
    """(B, C, H, W) → (B, C): ``avg``, ``max``, ``avg+max`` (the sum of the two), ``gem[:P]`` or ``kmax:K``
    (see the module docstring)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, spec: str) -> None:
        self.kind, self.arg = parse_pooling(spec)
        self._mode = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "avg":
            return x.mean(dim=(2, 3))
        if self.kind == "max":
            return x.amax(dim=(2, 3))
        if self.kind == "gem":
            # MPA paper §4.2 "cubic GeM": the clamp keeps the fractional power defined (trunk maps end in a ReLU).
            p = cast(float, self.arg)  # parse_pooling gives gem its power
            return x.clamp(min=GEM_EPS).pow(p).mean(dim=(2, 3)).pow(1.0 / p)
        if self.kind == "kmax":
            positions = x.shape[2] * x.shape[3]
            K = cast(int, self.arg)  # parse_pooling gives kmax its K
            if K > positions:
                raise ValueError(
                    f"pooling {self.mode!r}: K = {K} exceeds the {x.shape[2]}×{x.shape[3]} = "
                    f"{positions} positions of the trunk's feature map"
                )
            # ProxyNCA++ Eq. 7: the mean of each channel's K largest activations.
            return x.flatten(2).topk(K, dim=2).values.mean(dim=2)
        return x.mean(dim=(2, 3)) + x.amax(dim=(2, 3))

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


class EmbeddingModel(nn.Module):
    """trunk → global pooling → [LayerNorm] → Linear; ``forward(images) -> (B, embedding_dim)`` raw embeddings.

    Attributes: ``trunk`` (feature-map extractor), ``pool``, ``embedder`` (``[layer_norm,] linear``),
    ``feature_dim`` (pooled trunk width), ``embedding_dim``, ``trunk_name``, ``preprocessing`` (the
    :class:`dml_core.trunks.Preprocessing` the trunk's weights expect — pass it to the data transforms).  ``trunk``
    is any name :func:`dml_core.trunks.resolve_trunk` accepts; ``pretrained`` a local file or an ``s3://`` URI.
    See the module docstring for the choices.
    """

    def __init__(
        self,
        trunk: str,
        pooling: str = "avg",
        layer_norm: bool = False,
        embedding_dim: int = 128,
        pretrained: str | os.PathLike | None = None,
        freeze_bn: bool = True,
        freeze_bn_affine: bool = False,
    ):
        super().__init__()
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive integer, got {embedding_dim!r}")
        for name, flag in (
            ("layer_norm", layer_norm),
            ("freeze_bn", freeze_bn),
            ("freeze_bn_affine", freeze_bn_affine),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if freeze_bn_affine and not freeze_bn:
            raise ValueError("freeze_bn_affine=True needs freeze_bn=True")

        # validate the trunk and pooling names before the (slower) trunk is built; the weights file is checked
        # (or fetched from S3) by spec.build before the trunk is constructed
        spec = resolve_trunk(trunk)
        self.pool = GlobalPooling(pooling)
        self.trunk_name = trunk
        self.embedding_dim = embedding_dim
        self.freeze_bn = freeze_bn
        self.trunk, self.feature_dim = spec.build(pretrained)
        #: the input convention of the trunk's weights: give it to the data transforms (``preprocessing=``)
        self.preprocessing: Preprocessing = spec.preprocessing_for(self.trunk)
        if getattr(self.trunk, "pooled_features_only", False) and self.pool.kind != "avg":
            raise ValueError(
                f"trunk {trunk!r} gives pooled features (timm's pre-logits of a token model), not a "
                f"feature map: only pooling 'avg' applies, got {pooling!r}"
            )
        embedder: list[tuple[str, nn.Module]] = []
        if layer_norm:
            embedder.append(("layer_norm", nn.LayerNorm(self.feature_dim, elementwise_affine=False)))
        embedder.append(("linear", nn.Linear(self.feature_dim, embedding_dim)))  # default init, as MLRC's MLP
        self.embedder = nn.Sequential(OrderedDict(embedder))

        if freeze_bn_affine:
            for m in self._trunk_batchnorms():
                for p in m.parameters():
                    p.requires_grad_(False)
        self.train()  # a fresh nn.Module is in train mode; apply the BN freeze to that state too

    @property
    def pooling(self) -> str:
        return self.pool.mode

    @property
    def layer_norm(self) -> bool:
        return "layer_norm" in self.embedder._modules

    def _trunk_batchnorms(self):
        return [m for m in self.trunk.modules() if isinstance(m, _BatchNorm)]

    def train(self, mode: bool = True) -> EmbeddingModel:
        """Like ``nn.Module.train``, but with ``freeze_bn`` the trunk's BatchNorm layers stay in eval mode."""
        super().train(mode)
        if self.freeze_bn:
            for m in self._trunk_batchnorms():
                m.eval()
        return self

    def pooled_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images → (B, feature_dim) pooled trunk features (before LayerNorm/embedder).

        MLRC also evaluates these ("untrained trunk", docs/protocol.md §Test evaluation)."""
        if images.dim() != 4 or images.size(1) != 3:
            raise ValueError(f"images must be a (B, 3, H, W) tensor, got shape {tuple(images.shape)}")
        fmap = self.trunk(images)
        if fmap.dim() != 4 or fmap.size(1) != self.feature_dim:
            raise ValueError(
                f"trunk {self.trunk_name!r} returned shape {tuple(fmap.shape)}, expected a (B, "
                f"{self.feature_dim}, H, W) feature map (its feature_dim is {self.feature_dim})"
            )
        return self.pool(fmap)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.embedder(self.pooled_features(images))

    def extra_repr(self) -> str:
        return (
            f"trunk={self.trunk_name!r}, feature_dim={self.feature_dim}, "
            f"embedding_dim={self.embedding_dim}, freeze_bn={self.freeze_bn}"
        )


def build_model(**kwargs) -> EmbeddingModel:
    """:class:`EmbeddingModel` from a config dict (``build_model(**cfg)``); unknown keys are an error."""
    allowed = ("trunk", "pooling", "layer_norm", "embedding_dim", "pretrained", "freeze_bn", "freeze_bn_affine")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"build_model: unknown model field(s) {unknown}; known: {list(allowed)}")
    if "trunk" not in kwargs:
        raise ValueError(
            f"build_model: field 'trunk' is required (a built-in name {TRUNKS}, 'timm:<model>', "
            "'package.module:callable' or an entry-point name; docs/trunks.md)"
        )
    return EmbeddingModel(**kwargs)
