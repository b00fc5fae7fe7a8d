"""The built-in trunks: ``tiny`` (a small CNN), the torchvision classifiers ``resnet18``, ``resnet50``, ``googlenet``
and ``bninception`` (MLRC's trunk, :mod:`dml_core.trunks.bninception`).  ``dml_core.models``'s docstring describes
them; this module builds them.

torchvision is imported only when a torchvision trunk is built (it loads ``torch._dynamo``, ~150 MB per process,
which a ``tiny``-trunk fold process does not need: ``bench/README_overhead.md``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dml_core.trunks.bninception import BNINCEPTION_FEATURE_DIM, BNINCEPTION_HEAD_PREFIXES, BNInception
from dml_core.trunks.preprocessing import BNINCEPTION_PREPROCESSING, IMAGENET_PREPROCESSING, Preprocessing

__all__ = ["BUILTIN_TRUNKS", "FEATURE_DIMS", "TinyCNN", "build_builtin", "builtin_preprocessing", "head_prefixes"]

BUILTIN_TRUNKS = ("tiny", "resnet18", "resnet50", "googlenet", "bninception")
FEATURE_DIMS = {
    "tiny": 256,
    "resnet18": 512,
    "resnet50": 2048,
    "googlenet": 1024,
    "bninception": BNINCEPTION_FEATURE_DIM,
}
# Children of the torchvision classifiers that come after the last feature map (or are auxiliary heads).
_TORCHVISION_HEAD_PREFIXES = ("fc.", "avgpool.", "dropout.", "aux1.", "aux2.")


class TinyCNN(nn.Sequential):
    """Four conv3×3-BN-ReLU blocks (32, 64, 128, 256 channels), 2×2 max-pool after the first three.

    A 16-px input leaves a 2×2 map, a 64-px input 8×8; about 0.4 M parameters, cheap on a CPU.
    """

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256)):
        layers: list[nn.Module] = []
        c_in = 3
        for i, c_out in enumerate(widths):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c_out
        super().__init__(*layers)


class _GoogLeNetInputTransform(nn.Module):
    """torchvision's ``GoogLeNet._transform_input``: ImageNet mean/std normalisation → (x − 0.5)/0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = x.new_tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        mean = x.new_tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        return x * (std / 0.5) + (mean - 0.5) / 0.5


def _torchvision_trunk(name: str, pretrained_transform: bool) -> nn.Sequential:
    """The torchvision classifier ``name`` (``weights=None``) up to its last feature map, as a Sequential
    whose child names (and so state_dict keys) are torchvision's."""
    # torchvision loads torch._dynamo (~150 MB per process): only its own trunks import it
    import torchvision.models as tvm

    if name == "googlenet":
        full = tvm.googlenet(weights=None, aux_logits=False, init_weights=True)
    else:
        full = getattr(tvm, name)(weights=None)
    children = [(n, m) for n, m in full.named_children() if m is not None and n + "." not in _TORCHVISION_HEAD_PREFIXES]
    if name == "googlenet" and pretrained_transform:
        children.insert(0, ("transform_input", _GoogLeNetInputTransform()))
    return nn.Sequential(OrderedDict(children))


def build_builtin(name: str, pretrained: bool) -> nn.Module:
    """The trunk ``name`` with fresh weights; ``pretrained`` says weights will be loaded next (GoogLeNet then
    re-normalises its input as torchvision does for its ImageNet weights, ``transform_input=True``)."""
    if name == "tiny":
        return TinyCNN()
    if name == "bninception":
        return BNInception()
    return _torchvision_trunk(name, pretrained)


def head_prefixes(name: str) -> tuple[str, ...]:
    """State-dict prefixes of the classifier head a pretrained file may carry and the trunk drops."""
    if name == "bninception":
        return BNINCEPTION_HEAD_PREFIXES
    return _TORCHVISION_HEAD_PREFIXES if name != "tiny" else ()


def builtin_preprocessing(name: str) -> Preprocessing:
    """ImageNet RGB [0, 1] for ``tiny`` (any input size) and the torchvision trunks; BN-Inception's BGR [0, 255]."""
    if name == "bninception":
        return BNINCEPTION_PREPROCESSING
    if name == "tiny":
        return Preprocessing(input_size=None)
    return IMAGENET_PREPROCESSING
