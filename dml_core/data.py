"""Image tables, the dataset over them, readers, a synthetic generator and the MLRC protocol transforms.

* `ImageTable` — one row per image: encoded bytes (PNG/JPEG), a file path, or an HxW[xC] uint8 array, plus an
  int64 label.  `ShardedTable` (dml_core.shards) has the same surface over parquet shards without holding bytes.
* `ImageDataset(table, transform)` — decodes (always to RGB: Omniglot is 1-bit PNG) and transforms in the
  DataLoader worker; `.labels` for the m-per-class batch sampler.
* Readers (image folders and CSV listings: :mod:`dml_core.datasets`): `read_parquet_manifest` (prepared shards, local or
  S3), `read_omniglot` (the `images_background_small*.zip` files).
* `synthetic(...)` — compositional toy classes with several modes each, for smoke tests and the demo.
* `train_transform` / `eval_transform` — the reality check's transforms (docs/protocol.md §Preprocessing), PIL + torch
  only: bit-identical to torchvision v2's, without importing it; `preprocessing=` normalises for a trunk's weights
  (BN-Inception: BGR, 0–255, mean-subtracted; `dml_core.trunks.Preprocessing`, docs/trunks.md).
* `check_classes_fill_folds` — fail before training when the classes cannot fill 4 folds of m-per-class batches.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dml_core.protocol import IMAGENET_MEAN, IMAGENET_STD
from dml_core.splits import class_disjoint_folds
from dml_core.trunks.preprocessing import IMAGENET_PREPROCESSING, Preprocessing

__all__ = [
    "ImageTable",
    "ImageDataset",
    "decode_image",
    "normalise_batch",
    "read_parquet_manifest",
    "read_omniglot",
    "synthetic",
    "train_transform",
    "eval_transform",
    "TrainTransform",
    "EvalTransform",
    "check_classes_fill_folds",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
]

# torchvision.datasets.folder.IMG_EXTENSIONS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# --------------------------------------------------------------------------------------------- table


@dataclass
class ImageTable:
    """One row per image.

    images: encoded bytes (PNG/JPEG), a file path (str / PathLike), or an HxW / HxWxC uint8 array.
    labels: int64 class ids (any non-negative ids; the per-dataset conventions are in dml_core.datasets).
    class_names: names of the distinct labels in sorted label order, i.e. `class_names[k]` names
        `np.unique(labels)[k]` (for labels 0..C-1 that is simply `class_names[label]`); or None.
    meta: optional per-row columns (numpy arrays of len(labels)), e.g. `split` (the dataset's original
        split) and `relpath`; kept aligned by `subset` / `take`.
    """

    images: list
    labels: np.ndarray
    class_names: list[str] | None = None
    meta: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        labels = np.asarray(self.labels)
        if labels.ndim != 1:
            raise ValueError(f"ImageTable.labels must be 1-D, got shape {labels.shape}")
        if labels.size and not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"ImageTable.labels must be integer class ids, got dtype {labels.dtype}")
        self.labels = labels.astype(np.int64, copy=False)
        if len(self.images) != len(self.labels):
            raise ValueError(f"ImageTable: {len(self.images)} images but {len(self.labels)} labels")
        if self.labels.size and self.labels.min() < 0:
            bad = np.flatnonzero(self.labels < 0)[:5].tolist()
            raise ValueError(f"ImageTable.labels must be >= 0; negative at rows {bad}")
        if self.class_names is not None:
            self.class_names = list(self.class_names)
            n = len(np.unique(self.labels))
            if len(self.class_names) != n:
                raise ValueError(f"ImageTable.class_names has {len(self.class_names)} names for {n} distinct labels")
        meta = {}
        for k, v in self.meta.items():
            v = np.asarray(v)
            if len(v) != len(self.labels):
                raise ValueError(f"ImageTable.meta[{k!r}] has {len(v)} rows, expected {len(self.labels)}")
            meta[k] = v
        self.meta = meta

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices) -> ImageTable:
        """Rows `indices`, in that order (labels unchanged)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        names = None
        if self.class_names is not None:
            lookup = dict(zip(np.unique(self.labels).tolist(), self.class_names))
            names = [lookup[l] for l in np.unique(self.labels[idx]).tolist()]
        return ImageTable(
            images=[self.images[i] for i in idx],
            labels=self.labels[idx],
            class_names=names,
            meta={k: v[idx] for k, v in self.meta.items()},
        )

    def subset(self, classes) -> ImageTable:
        """The rows whose label is in `classes` (labels unchanged)."""
        keep = np.isin(self.labels, np.asarray(list(classes), dtype=np.int64))
        return self.take(np.flatnonzero(keep))

    def row_name(self, i: int) -> str:
        """How errors name row i."""
        img = self.images[i]
        if isinstance(img, (str, os.PathLike)):
            return f"row {i} ({os.fspath(img)})"
        if "relpath" in self.meta:
            return f"row {i} ({self.meta['relpath'][i]})"
        return f"row {i}"


# --------------------------------------------------------------------------------------------- decoding


def decode_image(image):
    """bytes / path / uint8 array -> PIL RGB image.  Grayscale and 1-bit images become 3 identical channels."""
    im = _open_image(image)
    return im if im.mode == "RGB" else im.convert("RGB")


def _open_image(image):
    """bytes / path / uint8 array -> the loaded PIL image in its own mode (1-bit, grayscale, RGB, ...)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"array images must be HxW or HxWx{{1,3,4}} uint8, got {image.dtype} {image.shape}")
        im = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        im = Image.open(io.BytesIO(bytes(image)))
    elif isinstance(image, (str, os.PathLike)):
        im = Image.open(image)
    else:
        raise TypeError(f"unsupported image type {type(image).__name__}")
    im.load()
    return im


class ImageDataset(torch.utils.data.Dataset):
    """`dataset[i] -> (transform(image) as a float CxHxW tensor, int label)`.

    Decoding happens here, i.e. inside DataLoader workers.  The table must be picklable (ImageTable is;
    ShardedTable drops its open files when pickled).  Without a transform the image becomes a float tensor in
    [0, 1] (3 channels).  A row that fails to decode raises a ValueError naming the row (shard and row for
    sharded tables).
    """

    def __init__(self, table, transform=None):
        self.table = table
        self.transform = transform

    @property
    def labels(self) -> np.ndarray:
        return self.table.labels

    def __len__(self) -> int:
        return len(self.table)

    def decode(self, i: int, *, rgb: bool = True):
        """Row ``i`` as a loaded PIL image: RGB (as the transforms get it), or with ``rgb=False`` in its own mode
        (1-bit and grayscale rows stay one channel); a row that fails to decode raises a CorruptImageError naming
        it."""
        # pyarrow (dml_core.shards) loads only where a table is read: decode_image and the transforms (a registered
        # model's preprocessing) do without it
        from dml_core.shards import CorruptImageError

        try:
            return decode_image(self.table.images[i]) if rgb else _open_image(self.table.images[i])
        except CorruptImageError:
            raise
        except Exception as e:
            raise CorruptImageError(f"cannot decode image at {self.table.row_name(i)}: {e}") from e

    def __getitem__(self, i):
        i = int(i)
        img = self.decode(i)
        if self.transform is None:
            x = _to_tensor(img)
        else:
            x = self.transform(img)
        return x, int(self.table.labels[i])


# --------------------------------------------------------------------------------------------- transforms


def _rgb(img):
    """Any PIL mode -> RGB (Omniglot is 1-bit PNG, some JPEGs are grayscale or CMYK)."""
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_pil(img, who: str):
    if not isinstance(img, Image.Image):
        raise TypeError(f"{who} takes a PIL image (dml_core.data.decode_image's output), got {type(img).__name__}")


def _resize_bilinear(img, height: int, width: int):
    """PIL bilinear resize (PIL always antialiases when it shrinks), skipped when the size is already right —
    torchvision's PIL resize kernel, hence the same pixels."""
    if (img.height, img.width) == (height, width):
        return img
    return img.resize((width, height), resample=Image.Resampling.BILINEAR)


def _to_tensor(img) -> torch.Tensor:
    """PIL RGB -> float32 CxHxW in [0, 1]: uint8 HWC array viewed as CHW, converted, times 1/255 (the exact
    float ops of torchvision's ToImage + ToDtype(float32, scale=True), so the values are bit-identical)."""
    hwc = torch.as_tensor(np.array(img, copy=True)).view(img.height, img.width, len(img.getbands()))
    return hwc.permute(2, 0, 1).to(torch.float32).mul_(1.0 / 255)


def _preprocessing(value, who: str):
    """``preprocessing=`` of a transform as a :class:`dml_core.trunks.Preprocessing` (``None``: ImageNet)."""
    return Preprocessing.coerce(value, where=f"{who}(preprocessing=...)")


def _normalise(x: torch.Tensor, pre=None) -> torch.Tensor:
    """RGB [0, 1] CxHxW -> the trunk's input: channels reordered (BGR), scaled (x 255), then (x - mean) / std per
    channel as two float32 tensor ops (torchvision's Normalize).  ``pre`` is a ``Preprocessing``; ``None`` or the
    ImageNet default run exactly the ops of the ImageNet mean/std normalisation (bit-identical to torchvision)."""
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if pre is None else (pre.mean, pre.std)
    if pre is not None and pre.channel_order == "BGR":
        x = x.flip(-3)  # a copy: C is the first dim of a single image, the second of a batch
    if pre is not None and pre.value_scale != 1.0:
        x = x.mul_(pre.value_scale)  # powerful-benchmarker / pretrainedmodels: ToTensor, then x 255, then Normalize
    mean = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return x.sub(mean).div_(std)


def normalise_batch(pixels: torch.Tensor, preprocessing=None) -> torch.Tensor:
    """A uint8 (or integer-valued float) ``N×C×H×W`` batch of RGB pixels -> the trunk's input, float32: the ops of
    ToTensor and the normalisation that the transforms apply to one image, elementwise, hence the same values as
    stacking the transforms' outputs.  ``preprocessing``: a :class:`~dml_core.trunks.Preprocessing` (``None``:
    ImageNet)."""
    return _normalise(pixels.to(torch.float32).mul_(1.0 / 255), preprocessing)


def _describe_normalise(pre) -> str:
    return "Normalize(ImageNet)" if pre == IMAGENET_PREPROCESSING else f"Normalize({pre.describe()})"


class TrainTransform:
    """MLRC training augmentation (docs/protocol.md §Preprocessing): RandomResizedCrop(size, scale=(0.16, 1),
    ratio=(3/4, 4/3)) with bilinear resampling, RandomHorizontalFlip(0.5), ToTensor, ImageNet Normalize;
    grayscale becomes 3 channels.

    PIL + torch only (no torchvision import: it pulls in ``torch._dynamo``, ~165 MB per fold process).  The random
    draws are torchvision's (``transforms.v2``), call for call on torch's global RNG — per attempt a uniform area
    fraction, a log-uniform aspect ratio, then ``randint`` top and left; the centre-crop fallback after 10 misses;
    then one ``rand`` for the flip — so ``torch.manual_seed`` reproduces torchvision's output bit for bit
    (``tests/test_transforms.py``).

    ``preprocessing`` (a :class:`dml_core.trunks.Preprocessing` or a dict of its fields, e.g. ``model.preprocessing``
    or ``trunk_preprocessing(name)``) replaces the final ImageNet normalisation by the trunk's: channel order, value
    scale, mean and std — BN-Inception's gives BGR values in [0, 255] minus (104, 117, 128).  Its geometry fields are
    not used: crop size, scale range and bilinear resampling stay the protocol's (``docs/trunks.md``).  ``None``
    (the default) is the ImageNet normalisation.
    """

    def __init__(
        self, size: int = 227, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3), flip_p: float = 0.5, preprocessing=None
    ):
        self.size, self.scale, self.ratio, self.flip_p = int(size), tuple(scale), tuple(ratio), float(flip_p)
        self.preprocessing = _preprocessing(preprocessing, "train_transform")
        # float32 logs, as torchvision keeps them: the uniform bounds must be the same doubles.
        self._log_ratio = tuple(float(v) for v in torch.log(torch.tensor(self.ratio)))

    def crop_params(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, crop height, crop width) for an image of ``height × width``."""
        area = height * width
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = torch.exp(torch.empty(1).uniform_(self._log_ratio[0], self._log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return top, left, h, w
        in_ratio = width / height  # no crop fitted: the largest centred crop within the ratio bounds
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img) -> torch.Tensor:
        _check_pil(img, "train_transform")
        img = _rgb(img)
        top, left, h, w = self.crop_params(img.height, img.width)
        img = _resize_bilinear(img.crop((left, top, left + w, top + h)), self.size, self.size)
        if bool(torch.rand(1) < self.flip_p):  # torchvision: no flip when rand >= p
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _normalise(_to_tensor(img), self.preprocessing)

    def __repr__(self) -> str:
        return (
            f"TrainTransform(RandomResizedCrop({self.size}, scale={self.scale}, ratio={self.ratio}, bilinear), "
            f"HorizontalFlip(p={self.flip_p}), ToTensor, {_describe_normalise(self.preprocessing)})"
        )


class EvalTransform:
    """MLRC evaluation (docs/protocol.md §Preprocessing): Resize(round(size·256/227)) of the short side, bilinear
    — i.e. Resize(256) at the paper's 227 — then CenterCrop(size), ToTensor, ImageNet Normalize; grayscale becomes
    3 channels.  PIL + torch only, the same pixels as torchvision's ``Resize`` + ``CenterCrop`` on PIL images.
    ``preprocessing`` replaces the ImageNet normalisation by a trunk's, as for :class:`TrainTransform`."""

    def __init__(self, size: int = 227, preprocessing=None):
        self.size = int(size)
        self.resize = round(self.size * 256 / 227)
        self.preprocessing = _preprocessing(preprocessing, "eval_transform")

    def __call__(self, img) -> torch.Tensor:
        _check_pil(img, "eval_transform")
        return _normalise(_to_tensor(self.pixels(img)), self.preprocessing)

    def pixels(self, img):
        """The geometric part alone: the resized, centre-cropped RGB PIL image (``size × size``, uint8)."""
        img = _rgb(img)
        h, w = img.height, img.width
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.resize, int(self.resize * long / short)
        img = _resize_bilinear(img, *((new_long, new_short) if w <= h else (new_short, new_long)))
        # the short side is now round(size·256/227) >= size, so the centred crop always fits (no padding)
        top = int(round((img.height - self.size) / 2.0))
        left = int(round((img.width - self.size) / 2.0))
        return img.crop((left, top, left + self.size, top + self.size))

    def __repr__(self) -> str:
        return (
            f"EvalTransform(Resize({self.resize}, bilinear), CenterCrop({self.size}), ToTensor, "
            f"{_describe_normalise(self.preprocessing)})"
        )


def train_transform(size: int = 227, preprocessing=None) -> TrainTransform:
    """The protocol's training transform at crop ``size`` (:class:`TrainTransform`), normalised for the trunk's
    ``preprocessing`` (default: ImageNet mean/std, RGB in [0, 1])."""
    return TrainTransform(size, preprocessing=preprocessing)


def eval_transform(size: int = 227, preprocessing=None) -> EvalTransform:
    """The protocol's evaluation transform at crop ``size`` (:class:`EvalTransform`), normalised for the trunk's
    ``preprocessing`` (default: ImageNet mean/std, RGB in [0, 1])."""
    return EvalTransform(size, preprocessing=preprocessing)


# --------------------------------------------------------------------------------------------- readers


def read_parquet_manifest(
    uri, *, endpoint_url: str | None = None, cache_dir=None, cache_row_groups: int = 16, verify_rows: bool = True
):
    """Prepared shards (`dmlrc data prepare`) as a streaming `ShardedTable` (local dir / manifest.json / s3://).

    Labels and original splits are read up front; image bytes are read per row group on demand and checked
    against their sha256.  See dml_core.shards for the format and the cache."""
    from dml_core.shards import ShardedTable  # pyarrow: see ImageDataset.__getitem__

    return ShardedTable(
        uri, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=cache_row_groups, verify_rows=verify_rows
    )


def iter_omniglot(zip_dir: str | os.PathLike):
    """Yield (relpath 'Alphabet/characterNN/file.png', png bytes, source zip name), deduplicated across zips.

    The reading (entry names kept inside the zip, corrupt zips and members named, the two small background zips'
    shared Greek and Latin files checked identical) is :func:`dml_core.datasets.omniglot.iter_zips`'."""
    from dml_core.datasets.omniglot import iter_zips  # pyarrow (its records are dml_core.shards'): as above

    for rel, data, source in iter_zips(zip_dir):
        yield rel, data, Path(source.split(": ")[0]).name


def read_omniglot(zip_dir: str | os.PathLike) -> ImageTable:
    """Omniglot from its zips: class = "alphabet/character", labels 0..C-1 in sorted class-name order, images as
    PNG bytes (105x105, 1-bit).  The two small background zips give 8 alphabets, 242 characters x 20 drawers =
    4,840 images after removing the Greek and Latin duplicates."""
    rows = sorted(iter_omniglot(zip_dir))
    rel = [r[0] for r in rows]
    cls = ["/".join(r.split("/")[:2]) for r in rel]
    names = sorted(set(cls))
    index = {n: i for i, n in enumerate(names)}
    return ImageTable(
        images=[r[1] for r in rows],
        labels=np.array([index[c] for c in cls], dtype=np.int64),
        class_names=names,
        meta={"relpath": np.array(rel), "split": np.array(["background"] * len(rows))},
    )


# --------------------------------------------------------------------------------------------- synthetic


def _stroke_templates(rng: np.random.Generator, n: int, size: int, strokes: int = 2) -> np.ndarray:
    """n soft-edged glyphs of `strokes` random line segments each, values in [0, 1], shape (n, size, size)."""
    g = (np.arange(size, dtype=np.float32) + 0.5) / size
    yy, xx = np.meshgrid(g, g, indexing="ij")
    pts = np.stack([yy, xx], -1)[None, None]  # 1,1,S,S,2
    a = rng.uniform(0.1, 0.9, (n, strokes, 1, 1, 2)).astype(np.float32)
    b = rng.uniform(0.1, 0.9, (n, strokes, 1, 1, 2)).astype(np.float32)
    ab = b - a
    t = np.clip(((pts - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-6), 0, 1)
    dist = np.linalg.norm(pts - (a + t[..., None] * ab), axis=-1)  # n,strokes,S,S
    width = 0.09
    return np.clip(1.5 - dist.min(1) / width, 0, 1).astype(np.float32)


def synthetic(
    num_classes: int,
    per_class: int,
    image_size: int = 32,
    seed: int = 0,
    *,
    modes_per_class: int = 2,
    parts_per_mode: int = 3,
    num_glyphs: int = 12,
    num_colours: int = 8,
) -> ImageTable:
    """Deterministic compositional toy data: `num_classes × per_class` RGB uint8 images (rows = HxWx3 arrays).

    Shared structure: a common vocabulary of `num_glyphs` stroke glyphs and `num_colours` colours.  A class has
    `modes_per_class` prototypes (modes); each mode is `parts_per_mode` (glyph, colour) parts placed in distinct
    cells of a 2x2 grid, drawn independently, so the modes of a class are distinct clusters (something for
    multi-proxy losses to find) while every class is a new combination of the same parts (so features learnt
    on some classes transfer to unseen ones).  Per image: the mode (balanced), ±S/10 position jitter per part,
    colour gain, background level and pixel noise.  Labels 0..num_classes-1, class-contiguous rows.
    """
    for name, v in (
        ("num_classes", num_classes),
        ("per_class", per_class),
        ("modes_per_class", modes_per_class),
        ("parts_per_mode", parts_per_mode),
        ("num_glyphs", num_glyphs),
        ("num_colours", num_colours),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"synthetic: {name} must be a positive integer, got {v!r}")
    if parts_per_mode > 4:
        raise ValueError(f"synthetic: parts_per_mode must be <= 4 (cells of the 2x2 grid), got {parts_per_mode}")
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 8:
        raise ValueError(f"synthetic: image_size must be an integer >= 8, got {image_size!r}")
    rng = np.random.default_rng(seed)
    S = int(image_size)
    s = max(4, round(0.42 * S))  # glyph stamp size: a 2x2 grid cell minus some margin
    glyphs = _stroke_templates(rng, num_glyphs, s)
    # Colours spread around the hue circle at high saturation, so colour ids are distinguishable.
    hue = (np.arange(num_colours) / num_colours + rng.uniform(0, 1 / num_colours)) % 1.0
    rgb = np.clip(np.abs(((hue[:, None] * 6 + np.array([0, 4, 2])) % 6) - 3) - 1, 0, 1)  # HSV -> RGB, S=V=1
    palette = (255 * (0.25 + 0.75 * rgb)).astype(np.float32)  # every channel partly lit: glyphs beat the background

    M, P = modes_per_class, parts_per_mode
    mode_glyph = rng.integers(0, num_glyphs, (num_classes, M, P))
    mode_colour = rng.integers(0, num_colours, (num_classes, M, P))
    mode_cell = np.argsort(rng.random((num_classes, M, 4)), axis=-1)[..., :P]  # distinct cells per mode

    N = num_classes * per_class
    labels = np.repeat(np.arange(num_classes, dtype=np.int64), per_class)
    mode = np.tile(np.arange(per_class) % M, num_classes)  # balanced modes
    canvas = rng.uniform(0, 40, (N, 1, 1, 1)).astype(np.float32) + np.zeros((N, S, S, 3), np.float32)
    jit = max(1, S // 10)
    margin = (S // 2 - s) // 2
    ar = np.arange(s)
    n_idx = np.arange(N)[:, None, None]
    for p in range(P):
        cell = mode_cell[labels, mode, p]
        y0 = (cell // 2) * (S // 2) + margin + rng.integers(-jit, jit + 1, N)
        x0 = (cell % 2) * (S // 2) + margin + rng.integers(-jit, jit + 1, N)
        y0, x0 = np.clip(y0, 0, S - s), np.clip(x0, 0, S - s)
        colour = palette[mode_colour[labels, mode, p]] * rng.uniform(0.8, 1.2, (N, 1)).astype(np.float32)
        stamp = glyphs[mode_glyph[labels, mode, p]][..., None] * colour[:, None, None, :]  # N,s,s,3
        rows, cols = (y0[:, None] + ar)[:, :, None], (x0[:, None] + ar)[:, None, :]
        canvas[n_idx, rows, cols] = np.maximum(canvas[n_idx, rows, cols], stamp)
    canvas += rng.normal(0, 8, canvas.shape).astype(np.float32)
    pixels = np.clip(canvas, 0, 255).astype(np.uint8)
    return ImageTable(
        images=list(pixels),
        labels=labels,
        class_names=[f"synthetic_{c:04d}" for c in range(num_classes)],
        meta={"mode": mode},
    )


# --------------------------------------------------------------------------------------------- checks


def check_classes_fill_folds(
    labels, n_folds: int = 4, m: int = 4, classes_per_batch: int = 8, *, layout: str = "mlrc"
) -> None:
    """Raise one ValueError, before any training, when the trainval `labels` cannot fill the protocol's folds.

    Builds the `n_folds` class-disjoint folds of the sorted trainval classes (docs/protocol.md §Folds, via
    `dml_core.splits.class_disjoint_folds`) and requires, for every fold:
      * >= `classes_per_batch` train classes, so an m-per-class batch of `classes_per_batch` distinct classes × `m`
        images exists (classes with fewer than `m` images are sampled with replacement, as MLRC's PML
        MPerClassSampler does, so they are allowed);
      * >= 2 val classes (one class makes every retrieval metric trivially 1), each with >= 2 images (a class of
        one has R = 0, so MAP@R / R-Precision are undefined for it, docs/protocol.md §Metrics).
    """
    for name, v in (("n_folds", n_folds), ("m", m), ("classes_per_batch", classes_per_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"check_classes_fill_folds: {name} must be a positive integer, got {v!r}")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"check_classes_fill_folds: labels must be a non-empty 1-D array, got shape {labels.shape}")
    classes = np.unique(labels)
    what = (
        f"{classes.size} trainval classes cannot fill {n_folds} class-disjoint folds with batches of "
        f"{classes_per_batch} classes × m = {m}"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a single-val-class fold is an error here, reported below
            folds = class_disjoint_folds(
                classes, n_folds, layout, labels=labels, min_val_samples=2, min_train_classes=classes_per_batch
            )
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    thin = [
        f"fold {f.index}: {len(f.val_classes)} val class ({f.val_classes[0]})" for f in folds if len(f.val_classes) < 2
    ]
    if thin:
        raise ValueError(f"{what}: every fold needs >= 2 val classes; " + "; ".join(thin))
