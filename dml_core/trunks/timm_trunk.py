"""``trunk="timm:<model name>"``: any model of the timm registry (``timm.list_models()``), built offline.

The model is ``timm.create_model(name, pretrained=False, num_classes=0, global_pool="")`` — never a download; weights
come only from ``pretrained=`` (a local file or ``s3://`` object, :mod:`dml_core.trunks.weights`).  The trunk's output
is timm's ``forward_features``:

* a feature map (B, C, H, W) — convolutional and hierarchical models (ResNet, ConvNeXt, EfficientNet, Swin's
  NHWC maps are permuted to NCHW) — so every pooling of :class:`dml_core.models.EmbeddingModel` applies;
* for models whose features are tokens (ViT, DeiT, EVA, LeViT: (B, N, C)) there is no map to pool: the trunk
  returns timm's own pooled pre-logits (``forward_head(..., pre_logits=True)`` with the model's default
  ``global_pool``: the class token for ViT) as (B, C, 1, 1), and only ``pooling="avg"`` (the identity there) is
  accepted.

Which of the two a model is, and which of its parameters its features use, is found by one forward and backward pass
on PyTorch's ``meta`` device (shapes only: no memory, no arithmetic).  Parameters the features do not use (e.g.
MobileNetV3's ``conv_head`` or ConvNeXt's ``head.norm``, which act after timm's pooling) are frozen
(``requires_grad=False``): they would get no gradient, which DistributedDataParallel refuses.

The preprocessing comes from the model's registered ``pretrained_cfg`` (mean, std, input size, interpolation,
crop fraction), read from timm's registry without building or downloading anything.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from dml_core.trunks.preprocessing import IMAGENET_PREPROCESSING, INTERPOLATIONS, Preprocessing

__all__ = [
    "TIMM_PREFIX",
    "TimmTrunk",
    "check_timm_name",
    "build_timm_trunk",
    "timm_preprocessing",
    "timm_head_prefixes",
]

TIMM_PREFIX = "timm:"


def _timm():
    try:
        # timm (seconds, and it pulls in torchvision) only for a timm: trunk; its absence is an error only then
        import timm
    except ImportError as e:
        raise ValueError(f"timm trunks need the 'timm' package, which cannot be imported: {e}") from None
    return timm


def check_timm_name(model: str, trunk: str) -> None:
    """``model`` is a timm registry name (an optional ``.tag`` must be a registered pretrained tag); else a
    ``ValueError`` naming it, with close registry names when there are some."""
    timm = _timm()
    if not model or any(c in model for c in ":/\\"):
        # timm would treat "hf-hub:…" / "local-dir:…" as a source to fetch from; only registry names are offline
        raise ValueError(
            f"trunk {trunk!r}: {model!r} is not a timm registry model name (sources such as hf-hub: "
            "are not supported: weights come from a local file via pretrained=)"
        )
    if not timm.is_model(model):
        arch = model.split(".", 1)[0]
        close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; close names: {close}" if close else ""
        raise ValueError(
            f"trunk {trunk!r}: timm has no model {arch!r} (timm.list_models('*pattern*') lists them){hint}"
        )
    try:
        timm.models.get_pretrained_cfg(model)
    except RuntimeError as e:  # a tag that is not registered for the architecture
        raise ValueError(f"trunk {trunk!r}: {e}") from None


def timm_preprocessing(model: str) -> Preprocessing:
    """The model's registered ``pretrained_cfg`` as a :class:`Preprocessing` (RGB, values in [0, 1]); the ImageNet
    default when the architecture registers none."""
    cfg = _timm().models.get_pretrained_cfg(model)
    if cfg is None:
        return IMAGENET_PREPROCESSING
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    defaults = IMAGENET_PREPROCESSING
    interpolation = d.get("interpolation") or defaults.interpolation
    return Preprocessing(
        mean=tuple(d.get("mean") or defaults.mean),
        std=tuple(d.get("std") or defaults.std),
        value_scale=1.0,
        channel_order="RGB",
        input_size=tuple(d["input_size"]) if d.get("input_size") else defaults.input_size,
        interpolation=interpolation if interpolation in INTERPOLATIONS else defaults.interpolation,
        crop_pct=float(d.get("crop_pct") or defaults.crop_pct),
    )


def timm_head_prefixes(model: str) -> tuple[str, ...]:
    """State-dict prefixes of the model's classifier (``pretrained_cfg["classifier"]``: ``fc``, ``head``,
    ``head.fc``, or several for distilled models), which a timm checkpoint carries and a ``num_classes=0`` model
    lacks."""
    cfg = _timm().models.get_pretrained_cfg(model)
    names = getattr(cfg, "classifier", None) if cfg is not None else None
    if not names:
        return ()
    if isinstance(names, str):
        names = (names,)
    return tuple(f"{n}." for n in names)


#: A timm model: an nn.Module with timm's ``forward_features`` / ``forward_head``, which nn.Module's type does not know.
TimmModel = Any


class TimmTrunk(nn.Module):
    """A timm model as a trunk: ``forward`` returns its features as (B, C, H, W) (see the module docstring).

    ``model`` is the timm model itself (its state-dict keys, behind the ``model.`` prefix, are timm's);
    ``layout`` is ``"NCHW"``, ``"NHWC"`` or ``"pooled"``; ``feature_dim`` the channel count.
    """

    def __init__(self, model: TimmModel, layout: str, feature_dim: int, name: str):
        super().__init__()
        self.model = model
        self.layout = layout
        self.feature_dim = int(feature_dim)
        self.name = name
        #: True when the output is a pre-pooled (B, C, 1, 1) vector: only "avg" pooling is meaningful.
        self.pooled_features_only = layout == "pooled"
        #: parameters frozen because the features do not depend on them (set by build_timm_trunk)
        self.unused_parameters: tuple[str, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.model.forward_features(x)
        if self.layout == "NCHW":
            return f
        if self.layout == "NHWC":
            return f.permute(0, 3, 1, 2)
        if f.dim() != 2:
            f = self.model.forward_head(f, pre_logits=True)
        return f.reshape(f.shape[0], -1, 1, 1)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, layout={self.layout!r}, feature_dim={self.feature_dim}"


def _probe_size(model: nn.Module) -> tuple[int, int]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size") or (3, 224, 224)
    return int(size[-2]), int(size[-1])


def _layout(model: TimmModel, features: torch.Tensor, trunk: str) -> tuple[str, int]:
    """("NCHW" | "NHWC" | "pooled" | "tokens", channels) from a ``forward_features`` output; "tokens" (channels 0):
    the model, built with ``global_pool=""``, does not pool its tokens — it is rebuilt with its own pooling."""
    if features.dim() == 4:
        if getattr(model, "output_fmt", "NCHW") == "NHWC":
            return "NHWC", int(features.shape[-1])
        return "NCHW", int(features.shape[1])
    if features.dim() in (2, 3):
        pooled = features if features.dim() == 2 else model.forward_head(features, pre_logits=True)
        if pooled.dim() == 2:
            return "pooled", int(pooled.shape[1])
        if features.dim() == 3:
            return "tokens", 0
    raise ValueError(
        f"trunk {trunk!r}: timm's forward_features gives shape {tuple(features.shape)}, neither a "
        "feature map (B, C, H, W) nor tokens (B, N, C) that its head pools"
    )


def _create(timm, model: str, device: str | None, global_pool: str | None) -> tuple[nn.Module, str | None]:
    """``timm.create_model`` offline with ``num_classes=0`` and, where the model takes it, ``global_pool``;
    returns the model and the ``global_pool`` used (``None``: the model's default)."""
    kwargs = {"pretrained": False, "num_classes": 0}
    for gp in (global_pool, None) if global_pool is not None else (None,):
        try:
            if device is None:
                return timm.create_model(model, **kwargs, **({} if gp is None else {"global_pool": gp})), gp
            with torch.device(device):
                return timm.create_model(model, **kwargs, **({} if gp is None else {"global_pool": gp})), gp
        except TypeError:  # a model whose constructor takes no global_pool argument
            if gp is None:
                raise
    raise AssertionError("unreachable")


def _probe(net: TimmModel, trunk: str, device: str) -> tuple[str, int, list[str] | None]:
    """(layout, feature_dim, names of the parameters the trunk output does not depend on) from one pass of a
    1-image batch at the model's pretraining size; on the meta device also a backward pass for the unused
    parameters (``None`` on a real device, where it would cost a real pass)."""
    size = _probe_size(net)
    was_training = net.training
    net.eval()
    try:
        if device != "meta":
            with torch.no_grad():
                return (*_layout(net, net.forward_features(torch.zeros(1, 3, *size)), trunk), None)
        x = torch.empty(1, 3, *size, device="meta")
        layout, dim = _layout(net, net.forward_features(x), trunk)
        if layout == "tokens":
            return layout, dim, None
        TimmTrunk(net, layout, dim, trunk)(x).sum().backward()
        return layout, dim, [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        net.train(was_training)


def _build(timm, model: str, trunk: str, device: str | None):
    """``(model on device (None: the default), global_pool it was built with, probe result)``; token models are
    rebuilt with their own ``global_pool`` so that ``forward_head(pre_logits=True)`` pools."""
    net, gp = _create(timm, model, device, "")
    result = _probe(net, trunk, device or "cpu")
    if result[0] in ("tokens", "pooled") and gp is not None:
        net, gp = _create(timm, model, device, None)
        result = _probe(net, trunk, device or "cpu")
    if result[0] == "tokens":
        raise ValueError(f"trunk {trunk!r}: timm's forward_head does not pool this model's tokens")
    return net, gp, result


def _real(call, model: str, trunk: str):
    try:
        return call()
    except ValueError:
        raise
    except Exception as e:  # timm's own failure: keep its traceback as the cause
        raise ValueError(f"trunk {trunk!r}: building timm model {model!r} failed: {type(e).__name__}: {e}") from e


def build_timm_trunk(model: str, trunk: str) -> TimmTrunk:
    """The timm model ``model`` (fresh weights) as a :class:`TimmTrunk`; ``trunk`` is the name errors use.

    Layout and unused parameters come from a ``meta``-device copy; a model that cannot run there is probed with one
    real no-grad pass instead (and then nothing is frozen)."""
    timm = _timm()
    check_timm_name(model, trunk)
    try:
        _, gp, (layout, dim, unused) = _build(timm, model, trunk, "meta")
    except ValueError:
        raise
    except Exception:  # an op without a meta kernel, data-dependent shapes, ...
        net, _, (layout, dim, unused) = _real(lambda: _build(timm, model, trunk, None), model, trunk)
    else:
        net, _ = _real(lambda: _create(timm, model, None, gp), model, trunk)
    params = dict(net.named_parameters())
    for name in unused or ():
        params[name].requires_grad_(False)
    out = TimmTrunk(net, layout, dim, trunk)
    out.unused_parameters = tuple(unused or ())
    return out
