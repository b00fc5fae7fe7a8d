"""What input a trunk's pretrained weights expect: channel order, value range, per-channel mean and std.

:class:`Preprocessing` is the record; :func:`dml_core.trunks.trunk_preprocessing` returns it for a trunk name and
the protocol transforms (:class:`dml_core.data.TrainTransform` / :class:`~dml_core.data.EvalTransform`) apply its
normalisation part (``channel_order``, ``value_scale``, ``mean``, ``std``) when given ``preprocessing=``.  The
geometry fields (``input_size``, ``interpolation``, ``crop_pct``) describe how the weights were trained and are kept
for the record; the protocol's own crop size and bilinear resizing stay in force
(docs/protocol.md §Preprocessing: one set of transforms for every trunk), see ``docs/trunks.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from dml_core.protocol import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "Preprocessing",
    "IMAGENET_PREPROCESSING",
    "BNINCEPTION_PREPROCESSING",
    "CHANNEL_ORDERS",
    "VALUE_SCALES",
    "INTERPOLATIONS",
]

CHANNEL_ORDERS = ("RGB", "BGR")
#: 1.0: pixel values in [0, 1] (torchvision, timm); 255.0: [0, 255] (Caffe-trained weights such as BN-Inception).
VALUE_SCALES = (1.0, 255.0)
#: PIL resampling filters (timm's ``pretrained_cfg["interpolation"]`` uses these names).
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


def _triple(name: str, value) -> tuple[float, float, float]:
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"Preprocessing.{name} must be 3 numbers (one per channel), got {value!r}") from None
    if len(out) != 3 or not all(math.isfinite(v) for v in out):
        raise ValueError(f"Preprocessing.{name} must be 3 finite numbers (one per channel), got {value!r}")
    return out


@dataclass(frozen=True)
class Preprocessing:
    """A trunk's input convention.  The defaults are the torchvision ImageNet one (RGB in [0, 1], ImageNet mean/std,
    224-px crops of a 256-px bilinear resize).

    ``mean``/``std`` are given in the trunk's channel order (``channel_order``) and in its value range: a pixel
    becomes ``(x · value_scale − mean) / std`` with ``x`` in [0, 1].  ``input_size`` is the pretraining crop
    ``(height, width)`` (an int means a square; timm's ``(3, H, W)`` is accepted), ``None`` for a trunk without one
    (``tiny``).  ``crop_pct`` is the evaluation crop over the resized short side (0.875 = 224/256).
    """

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    value_scale: float = 1.0
    channel_order: str = "RGB"
    input_size: tuple[int, int] | None = (224, 224)
    interpolation: str = "bilinear"
    crop_pct: float = 0.875

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise the fields once, here
        set_(self, "mean", _triple("mean", self.mean))
        set_(self, "std", _triple("std", self.std))
        if not all(s > 0 for s in self.std):
            raise ValueError(f"Preprocessing.std must be positive, got {self.std!r}")
        try:
            scale = float(self.value_scale)
        except (TypeError, ValueError):
            scale = float("nan")
        if isinstance(self.value_scale, bool) or scale not in VALUE_SCALES:
            raise ValueError(
                f"Preprocessing.value_scale must be 1.0 (values in [0, 1]) or 255.0 (values in [0, 255]), "
                f"got {self.value_scale!r}"
            )
        set_(self, "value_scale", scale)
        order = self.channel_order.upper() if isinstance(self.channel_order, str) else self.channel_order
        if order not in CHANNEL_ORDERS:
            raise ValueError(f"Preprocessing.channel_order must be 'RGB' or 'BGR', got {self.channel_order!r}")
        set_(self, "channel_order", order)
        set_(self, "input_size", self._size(self.input_size))
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"Preprocessing.interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        try:
            crop = float(self.crop_pct)
        except (TypeError, ValueError):
            crop = float("nan")
        if isinstance(self.crop_pct, bool) or not 0 < crop <= 1:
            raise ValueError(f"Preprocessing.crop_pct must be in (0, 1], got {self.crop_pct!r}")
        set_(self, "crop_pct", crop)

    @staticmethod
    def _size(value) -> tuple[int, int] | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value, value)
        try:
            size = tuple(value)
        except TypeError:
            size = ()
        if len(size) == 3:  # timm's (channels, height, width)
            size = size[1:]
        if len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
            raise ValueError(
                f"Preprocessing.input_size must be a positive int, (height, width) or (3, height, width), got {value!r}"
            )
        return size

    @classmethod
    def coerce(cls, value, *, where: str = "preprocessing") -> Preprocessing:
        """A :class:`Preprocessing` from itself, a dict of its fields (unknown keys are an error) or ``None``
        (the ImageNet default).  ``where`` names the value in error messages."""
        if value is None:
            return IMAGENET_PREPROCESSING
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"{where}: unknown Preprocessing field(s) {unknown}; known: {sorted(known)}")
            try:
                return cls(**value)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        raise ValueError(
            f"{where} must be a dml_core.trunks.Preprocessing or a dict of its fields, got {type(value).__name__}"
        )

    def as_dict(self) -> dict:
        """Plain JSON-able values (lists for tuples), e.g. to record on a run; ``Preprocessing(**d)`` restores it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def describe(self) -> str:
        """One line for reprs and logs: ``RGB x1 mean=(…) std=(…)``."""
        fmt = lambda t: "(" + ", ".join(f"{v:g}" for v in t) + ")"  # noqa: E731 - a one-line formatter, used only here
        return f"{self.channel_order} x{self.value_scale:g} mean={fmt(self.mean)} std={fmt(self.std)}"


#: torchvision's ImageNet convention — the ``tiny`` trunk and the torchvision trunks (and today's transforms).
IMAGENET_PREPROCESSING = Preprocessing()

#: pretrainedmodels' ``bninception`` "imagenet" settings (Caffe-trained weights ported by Y. Xiong): BGR, values in
#: [0, 255], mean (104, 117, 128) in BGR order, std 1, 224-px crops; its ``utils.TransformImage`` resizes to
#: 224/0.875 = 256 with bilinear resampling.  MLRC itself crops 227 px (docs/protocol.md §Preprocessing).
BNINCEPTION_PREPROCESSING = Preprocessing(
    mean=(104.0, 117.0, 128.0),
    std=(1.0, 1.0, 1.0),
    value_scale=255.0,
    channel_order="BGR",
    input_size=(224, 224),
    interpolation="bilinear",
    crop_pct=0.875,
)
