"""The protocol transforms (PIL + torch, dml_core.data) equal torchvision's v2 pipeline bit for bit.

The reference below is the definition `dml_core.data` used before it dropped torchvision (issue #11): for the same
torch seed, every output tensor must be `torch.equal` and torch's RNG must end in the same state (the same draws in
the same order), across image sizes, aspect ratios (including ones where RandomResizedCrop falls back to its centre
crop), PIL modes and crop sizes.  Only this test imports torchvision.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dml_core.data import IMAGENET_MEAN, IMAGENET_STD, ImageDataset, ImageTable, eval_transform, train_transform

v2 = pytest.importorskip("torchvision.transforms.v2")


class _RefToRGB:
    def __call__(self, img):
        if isinstance(img, torch.Tensor):
            return img.expand(3, *img.shape[-2:]) if img.ndim >= 3 and img.shape[-3] == 1 else img
        return img if img.mode == "RGB" else img.convert("RGB")


def _ref_tail():
    return [v2.ToImage(), _RefToRGB(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def _ref_train(size):
    return v2.Compose([_RefToRGB(), v2.RandomResizedCrop(size, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
                       v2.RandomHorizontalFlip(0.5), *_ref_tail()])


def _ref_eval(size):
    return v2.Compose([_RefToRGB(), v2.Resize(round(size * 256 / 227), antialias=True), v2.CenterCrop(size),
                       *_ref_tail()])


def _image(rng, h, w, mode="RGB"):
    # smooth gradients plus noise: resampling differences would show in every pixel
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 7 + yy * 3) % 256, (yy * 5) % 256, (xx * yy) % 256], -1)
    arr = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr)
    return img if mode == "RGB" else img.convert(mode)


# (height, width): square, portrait, landscape, tiny, extreme aspect ratios (centre-crop fallback), odd sizes
SHAPES = [(64, 64), (80, 48), (48, 80), (16, 16), (9, 13), (300, 20), (20, 300), (257, 255), (227, 227), (31, 500)]


@pytest.mark.parametrize("size", [16, 32, 227])
def test_train_transform_equals_torchvision_for_many_seeds_and_shapes(size):
    rng = np.random.default_rng(size)
    ours, ref = train_transform(size), _ref_train(size)
    for k, (h, w) in enumerate(SHAPES):
        for mode in ("RGB", "L") if k % 3 == 0 else ("RGB",):
            img = _image(rng, h, w, mode)
            for seed in range(12):
                torch.manual_seed(1000 * k + seed)
                a = ours(img)
                after_ours = torch.rand(3)
                torch.manual_seed(1000 * k + seed)
                b = ref(img)
                after_ref = torch.rand(3)
                assert a.shape == (3, size, size) and a.dtype == torch.float32
                assert torch.equal(a, b), f"{size=} {h}x{w} {mode} seed {seed}: max diff {(a - b).abs().max()}"
                assert torch.equal(after_ours, after_ref), f"{size=} {h}x{w} seed {seed}: different RNG draws"


def test_train_transform_fallback_centre_crop_equals_torchvision():
    # 500x9: no crop of area >= 16 % with ratio in [3/4, 4/3] fits in 10 attempts for most seeds
    img = _image(np.random.default_rng(0), 9, 500)
    ours, ref = train_transform(16), _ref_train(16)
    crops = set()
    for seed in range(20):
        torch.manual_seed(seed)
        crops.add(ours.crop_params(9, 500))
        torch.manual_seed(seed)
        a = ours(img)
        torch.manual_seed(seed)
        assert torch.equal(a, ref(img))
    assert (0, 244, 9, 12) in crops  # the fallback: full height, width = round(9 · 4/3), centred


@pytest.mark.parametrize("size", [16, 28, 32, 227])
def test_eval_transform_equals_torchvision(size):
    rng = np.random.default_rng(7)
    ours, ref = eval_transform(size), _ref_eval(size)
    shapes = SHAPES + [(round(size * 256 / 227), 90), (size, size)]  # short side already at the resize target
    for h, w in shapes:
        for mode in ("RGB", "L", "1", "RGBA", "P"):
            img = _image(rng, h, w, mode)
            torch.manual_seed(0)
            a = ours(img)
            assert torch.rand(1).item() == (torch.manual_seed(0), torch.rand(1).item())[1]  # draws nothing
            b = ref(img)
            assert a.shape == (3, size, size) and torch.equal(a, b), f"{size=} {h}x{w} {mode}"


def test_dataset_without_transform_equals_torchvision_to_image_to_dtype():
    from torchvision.transforms.v2 import functional as F

    img = _image(np.random.default_rng(3), 21, 34)
    x, _ = ImageDataset(ImageTable([np.asarray(img)], np.array([0])))[0]
    assert type(x) is torch.Tensor and torch.equal(x, F.to_dtype(F.to_image(img), torch.float32, scale=True))


def test_transforms_refuse_non_pil_input_with_one_line():
    with pytest.raises(TypeError, match="train_transform takes a PIL image"):
        train_transform(16)(torch.zeros(3, 20, 20))
    with pytest.raises(TypeError, match="eval_transform takes a PIL image"):
        eval_transform(16)(np.zeros((20, 20, 3), np.uint8))
