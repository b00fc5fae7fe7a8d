"""A trunk of one's own: a small conv-BN-ReLU network, twice as wide as dml-reality-check's ``tiny``.

A trunk factory returns an ``nn.Module`` mapping (B, 3, H, W) images to a (B, C, H', W') feature map, with an int
attribute ``feature_dim`` (= C); dml-reality-check adds the pooling and the embedder."""

from __future__ import annotations

from torch import nn


def wide_tiny() -> nn.Module:
    layers: list[nn.Module] = []
    c_in = 3
    widths = (64, 128, 256)
    for i, c_out in enumerate(widths):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
        if i < len(widths) - 1:
            layers.append(nn.MaxPool2d(2))
        c_in = c_out
    trunk = nn.Sequential(*layers)
    trunk.feature_dim = widths[-1]
    return trunk
