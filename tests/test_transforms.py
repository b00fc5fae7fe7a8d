"""The protocol transforms (PIL + torch, dml_core.data) equal torchvision's v2 pipeline bit for bit.

The reference below is the definition `dml_core.data` used before it dropped torchvision: for the same
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
    return v2.Compose(
        [
            _RefToRGB(),
            v2.RandomResizedCrop(size, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
            v2.RandomHorizontalFlip(0.5),
            *_ref_tail(),
        ]
    )


def _ref_eval(size):
    return v2.Compose(
        [_RefToRGB(), v2.Resize(round(size * 256 / 227), antialias=True), v2.CenterCrop(size), *_ref_tail()]
    )


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


# --------------------------------------------------------------------------------------------------------------
# trunk preprocessing (dml_core.trunks.Preprocessing, docs/trunks.md)


def _ref_tail_for(pre):
    """torchvision's ToTensor-style tail, then the trunk convention as MLRC's powerful-benchmarker applies it for
    BN-Inception (pretrainedmodels settings): BGR channels, x 255, Normalize(mean, std)."""
    steps = [v2.ToImage(), _RefToRGB(), v2.ToDtype(torch.float32, scale=True)]
    if pre.channel_order == "BGR":
        steps.append(v2.Lambda(lambda x: x[[2, 1, 0]]))
    if pre.value_scale != 1.0:
        steps.append(v2.Lambda(lambda x: x * pre.value_scale))
    return steps + [v2.Normalize(list(pre.mean), list(pre.std))]


@pytest.mark.parametrize("size", [16, 227])
def test_default_preprocessing_is_todays_imagenet_normalisation_bit_for_bit(size):
    from dml_core.trunks import IMAGENET_PREPROCESSING

    rng = np.random.default_rng(size)
    ref_train, ref_eval = _ref_train(size), _ref_eval(size)
    for pre in (None, IMAGENET_PREPROCESSING, IMAGENET_PREPROCESSING.as_dict()):
        tr, ev = train_transform(size, preprocessing=pre), eval_transform(size, preprocessing=pre)
        for h, w in SHAPES[:6]:
            img = _image(rng, h, w)
            torch.manual_seed(h * w)
            a = tr(img)
            torch.manual_seed(h * w)
            assert torch.equal(a, ref_train(img))
            assert torch.equal(ev(img), ref_eval(img))
        assert repr(tr).endswith("Normalize(ImageNet))") and repr(ev).endswith("Normalize(ImageNet))")


@pytest.mark.parametrize("size", [32, 227])
def test_bninception_preprocessing_gives_bgr_0_255_mean_subtracted_like_torchvision(size):
    from dml_core.trunks import BNINCEPTION_PREPROCESSING as pre

    rng = np.random.default_rng(size + 1)
    ours_train, ours_eval = train_transform(size, preprocessing=pre), eval_transform(size, preprocessing=pre)
    ref_train = v2.Compose(
        [
            _RefToRGB(),
            v2.RandomResizedCrop(size, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
            v2.RandomHorizontalFlip(0.5),
            *_ref_tail_for(pre),
        ]
    )
    ref_eval = v2.Compose(
        [_RefToRGB(), v2.Resize(round(size * 256 / 227), antialias=True), v2.CenterCrop(size), *_ref_tail_for(pre)]
    )
    for k, (h, w) in enumerate(SHAPES):
        img = _image(rng, h, w, "L" if k == 3 else "RGB")
        for seed in range(3):
            torch.manual_seed(seed)
            a = ours_train(img)
            torch.manual_seed(seed)
            assert torch.equal(a, ref_train(img)), f"{h}x{w} seed {seed}"
        b = ours_eval(img)
        assert torch.equal(b, ref_eval(img)), f"{h}x{w}"
    # by hand: the eval crop of a solid colour is that colour, BGR, in 0-255 minus (104, 117, 128)
    solid = Image.new("RGB", (40, 50), (200, 100, 10))
    out = ours_eval(solid)
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([10 - 104.0, 100 - 117.0, 200 - 128.0]), rtol=0, atol=1e-4)
    assert "BGR x255 mean=(104, 117, 128) std=(1, 1, 1)" in repr(ours_eval)


def test_same_seed_same_crop_whatever_the_preprocessing():
    """The preprocessing changes only the normalisation: the random crop and flip draws stay the protocol's."""
    from dml_core.trunks import BNINCEPTION_PREPROCESSING, Preprocessing

    img = _image(np.random.default_rng(9), 80, 60)
    identity = Preprocessing(mean=(0, 0, 0), std=(1, 1, 1))
    torch.manual_seed(5)
    x01 = train_transform(32, preprocessing=identity)(img)
    after_a = torch.rand(2)
    torch.manual_seed(5)
    bgr = train_transform(32, preprocessing=BNINCEPTION_PREPROCESSING)(img)
    after_b = torch.rand(2)
    mean = torch.tensor([104.0, 117.0, 128.0]).view(3, 1, 1)
    assert torch.equal(bgr, x01.flip(0).mul(255).sub(mean)) and torch.equal(after_a, after_b)


def test_transform_preprocessing_must_be_a_preprocessing_or_its_fields():
    with pytest.raises(ValueError, match=r"train_transform\(preprocessing=...\): unknown Preprocessing field"):
        train_transform(16, preprocessing={"order": "BGR"})
    with pytest.raises(ValueError, match=r"eval_transform\(preprocessing=...\) must be a dml_core.trunks"):
        eval_transform(16, preprocessing="BGR")
    with pytest.raises(ValueError, match="value_scale must be 1.0"):
        eval_transform(16, preprocessing={"value_scale": 256})


def test_transforms_with_preprocessing_pickle_for_dataloader_workers():
    import pickle

    from dml_core.trunks import BNINCEPTION_PREPROCESSING

    img = _image(np.random.default_rng(2), 40, 40)
    for tf in (
        train_transform(16, preprocessing=BNINCEPTION_PREPROCESSING),
        eval_transform(16, preprocessing=BNINCEPTION_PREPROCESSING.as_dict()),
    ):
        clone = pickle.loads(pickle.dumps(tf))
        assert clone.preprocessing == BNINCEPTION_PREPROCESSING
        torch.manual_seed(0)
        a = tf(img)
        torch.manual_seed(0)
        assert torch.equal(a, clone(img))
