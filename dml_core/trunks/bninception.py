"""BN-Inception (Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing Internal
Covariate Shift", arXiv:1502.03167) — the trunk of the Metric Learning Reality Check (docs/protocol.md §Model).

The layout is ``pretrainedmodels.bninception``'s (Cadene's pretrained-models.pytorch, the port of Y. Xiong's
Caffe-trained ImageNet model that MLRC loads), written as a table instead of 700 unrolled lines: every parameter and
buffer has the same name and shape, so that project's ImageNet state dict (``bn_inception-52deb4733.pth``) loads
strictly, its classifier ``last_linear.*`` aside.  The forward pass is that model's ``features()``: the 1024-channel
map after inception 5b (7×7 at a 224-px input); its ``global_pool``/``last_linear`` head is left out — pooling is
:class:`dml_core.models.EmbeddingModel`'s.

Input: BGR, values in [0, 255], minus the mean (104, 117, 128), std 1 (``BNINCEPTION_PREPROCESSING``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BNInception", "BNINCEPTION_FEATURE_DIM", "BNINCEPTION_HEAD_PREFIXES"]

BNINCEPTION_FEATURE_DIM = 1024
#: Entries of the pretrainedmodels state dict that belong to the dropped classifier head.
BNINCEPTION_HEAD_PREFIXES = ("last_linear.",)

# Inception blocks: (name, in_channels, 1x1, 3x3 reduce, 3x3, double-3x3 reduce, double-3x3, pool, pool projection).
# ``1x1 = 0`` and ``pool projection = 0`` mark the two grid-reduction blocks (3c, 4e): stride-2 3x3 convolutions and a
# stride-2 max-pool branch passed through unprojected.  ``pool`` is "avg" (3×3, stride 1), "max" (3×3, stride 1,
# block 5b) or "max/2" (3×3, stride 2).  Channel counts are pretrainedmodels' (= the BN-Inception paper's Fig. 5).
_BLOCKS = (
    ("inception_3a", 192, 64, 64, 64, 64, 96, "avg", 32),
    ("inception_3b", 256, 64, 64, 96, 64, 96, "avg", 64),
    ("inception_3c", 320, 0, 128, 160, 64, 96, "max/2", 0),
    ("inception_4a", 576, 224, 64, 96, 96, 128, "avg", 128),
    ("inception_4b", 576, 192, 96, 128, 96, 128, "avg", 128),
    ("inception_4c", 576, 160, 128, 160, 128, 160, "avg", 128),
    ("inception_4d", 608, 96, 128, 192, 160, 192, "avg", 128),
    ("inception_4e", 608, 0, 128, 192, 192, 256, "max/2", 0),
    ("inception_5a", 1056, 352, 192, 320, 160, 224, "avg", 128),
    ("inception_5b", 1024, 352, 192, 320, 192, 224, "max", 128),
)


def _pool(kind: str) -> nn.Module:
    # pretrainedmodels' pooling layers, ceil_mode and count_include_pad included (they decide the map sizes).
    if kind == "avg":
        return nn.AvgPool2d(3, stride=1, padding=1, ceil_mode=True, count_include_pad=True)
    if kind == "max":
        return nn.MaxPool2d((3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), ceil_mode=True)
    return nn.MaxPool2d((3, 3), stride=(2, 2), dilation=(1, 1), ceil_mode=True)


class BNInception(nn.Module):
    """(B, 3, H, W) BGR 0–255 mean-subtracted images → (B, 1024, H/32, W/32) feature map (ceil rounding).

    Every convolution is followed by ``<conv name>_bn`` (BatchNorm2d, affine) and a ReLU; the modules are direct
    children named as in pretrainedmodels, so ``state_dict()`` keys are flat (``inception_3a_1x1.weight``,
    ``inception_3a_1x1_bn.running_mean``, …) and come in the same order.
    """

    feature_dim = BNINCEPTION_FEATURE_DIM

    def __init__(self):
        super().__init__()
        self._unit("conv1_7x7_s2", 3, 64, 7, stride=2, padding=3)
        self.pool1_3x3_s2 = _pool("max/2")
        self._unit("conv2_3x3_reduce", 64, 64, 1)
        self._unit("conv2_3x3", 64, 192, 3, padding=1)
        self.pool2_3x3_s2 = _pool("max/2")
        self._blocks = []
        for name, c_in, c1, c3r, c3, cdr, cd, pool, proj in _BLOCKS:
            stride = 1 if c1 else 2  # grid-reduction blocks have no 1x1 branch
            if c1:
                self._unit(f"{name}_1x1", c_in, c1, 1)
            self._unit(f"{name}_3x3_reduce", c_in, c3r, 1)
            self._unit(f"{name}_3x3", c3r, c3, 3, stride=stride, padding=1)
            self._unit(f"{name}_double_3x3_reduce", c_in, cdr, 1)
            self._unit(f"{name}_double_3x3_1", cdr, cd, 3, padding=1)
            self._unit(f"{name}_double_3x3_2", cd, cd, 3, stride=stride, padding=1)
            self.add_module(f"{name}_pool", _pool(pool))
            if proj:
                self._unit(f"{name}_pool_proj", c_in, proj, 1)
            self._blocks.append((name, bool(c1), bool(proj)))

    def _unit(self, name: str, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0) -> None:
        self.add_module(name, nn.Conv2d(c_in, c_out, kernel_size=kernel, stride=stride, padding=padding))
        self.add_module(f"{name}_bn", nn.BatchNorm2d(c_out, affine=True))

    def _run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        conv, bn = cast(nn.Module, self._modules[name]), cast(nn.Module, self._modules[f"{name}_bn"])  # added by _unit
        return F.relu(bn(conv(x)), inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1_3x3_s2(self._run("conv1_7x7_s2", x))
        x = self._run("conv2_3x3", self._run("conv2_3x3_reduce", x))
        x = self.pool2_3x3_s2(x)
        for name, has_1x1, has_proj in self._blocks:
            branches = []
            if has_1x1:
                branches.append(self._run(f"{name}_1x1", x))
            branches.append(self._run(f"{name}_3x3", self._run(f"{name}_3x3_reduce", x)))
            d = self._run(f"{name}_double_3x3_reduce", x)
            branches.append(self._run(f"{name}_double_3x3_2", self._run(f"{name}_double_3x3_1", d)))
            pooled = cast(nn.Module, self._modules[f"{name}_pool"])(x)
            branches.append(self._run(f"{name}_pool_proj", pooled) if has_proj else pooled)
            x = torch.cat(branches, 1)
        return x
