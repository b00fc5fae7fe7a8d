"""A fold's images decoded once, in the fold's process, when they fit a memory bound; the training batches augmented
as tensors, a batch at a time; the validation images stored after the evaluation transform's resize and crop.

Streaming (:class:`dml_core.data.ImageDataset`) decodes every image at every iteration and at every evaluation; for a
small dataset at a small crop size (Omniglot at 32 px: 105×105 1-bit PNGs) that decoding adds about a third of the
training step's CPU (bench/README_cpu_speed.md).  :func:`decode_fold` replaces a fold's datasets, when they are the
protocol's (an ``ImageDataset`` with :class:`~dml_core.data.TrainTransform` / :class:`~dml_core.data.EvalTransform`)
and their decoded pixels fit ``max_bytes`` together (:data:`DECODE_ONCE_MAX_BYTES`, 1 GiB):

* :class:`DecodedEvalSet` — every validation image as the evaluation transform's uint8 ``size × size`` crop (the same
  PIL resize and centre crop), normalised a batch at a time by :func:`dml_core.data.normalise_batch`: the same
  tensors, bit for bit, as the streaming path's.
* :class:`DecodedTrainSet` — every training image as uint8 pixels at its stored size (one channel where every row
  is grayscale or 1-bit), augmented a batch at a time with the protocol's training transform: RandomResizedCrop
  (scale (0.16, 1), ratio (3/4, 4/3), torchvision's draws: ten tries, then the centre crop), bilinear resize with
  PIL's antialiasing filter, horizontal flip with p = 0.5, ToTensor's 1/255 steps, the trunk's normalisation.  The
  resize is PIL's filter (a triangle of width ``max(1, crop / size)`` pixels, per output pixel normalised over the
  crop) written as two matrix products per batch, each pass rounded to whole grey levels as PIL's are; float
  weights instead of PIL's fixed-point ones break some ties the other way, so a pixel may differ by one grey level
  (most are equal: tests/test_decoded_images.py).  The crop and flip draws come from torch's global RNG, a batch
  at a time: the same distribution as the streaming transform's, another sequence of draws for a given seed.
  Images larger than :data:`DENSE_MAX_PIXELS` go through the streaming transform's own PIL ops, one image at a
  time, without decoding.

Larger datasets (CUB, Cars196, SOP at 227 px) keep the streaming path.  :class:`DecodedBatches` is the training
loop's loader over a ``DecodedTrainSet``: no DataLoader worker, the batches built in the fold's process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from dml_core.data import EvalTransform, ImageDataset, TrainTransform, normalise_batch

__all__ = [
    "DECODE_ONCE_MAX_BYTES",
    "DENSE_MAX_PIXELS",
    "DecodedBatches",
    "DecodedEvalSet",
    "DecodedTrainSet",
    "decode_eval_set",
    "decode_fold",
    "decode_train_set",
    "random_resized_crop_params",
]

#: The decoded pixels one fold's process may hold (train and validation together).  A trial's 4 folds run at once
#: on one machine, so 4 GiB in all; Omniglot's fold 0 takes 22 MB, CUB's (about 4,400 training images of
#: ~500×375 RGB) would take ~2.5 GB and streams.
DECODE_ONCE_MAX_BYTES = 1 << 30
#: Up to this many pixels per (padded) image the crop-and-resize runs as dense matrix products over the whole image
#: (cost ∝ height × width × crop size); above it, one PIL resize per image (cost ∝ the crop's rows).
DENSE_MAX_PIXELS = 160 * 160
#: Rows whose decoded size is measured before the whole table is decoded.
_SAMPLE_ROWS = 32


def _is_protocol(dataset: Any, transform: type) -> bool:
    return type(dataset) is ImageDataset and type(dataset.transform) is transform


# --------------------------------------------------------------------------------------------- validation


class _DecodedRows:
    """What both decoded sets share: uint8 ``pixels`` (one byte a value) and their rows' ``labels``."""

    pixels: torch.Tensor
    _labels: np.ndarray

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def nbytes(self) -> int:
        return self.pixels.numel()

    def __len__(self) -> int:
        return len(self._labels)


class DecodedEvalSet(_DecodedRows, torch.utils.data.Dataset):
    """Validation rows after the evaluation transform's resize and centre crop: ``pixels`` is ``N×3×S×S`` uint8,
    ``labels`` the rows' labels.  ``dataset[i]`` is the streaming dataset's item, bit for
    bit; :meth:`batch` normalises rows ``start:stop`` at once."""

    def __init__(self, pixels: torch.Tensor, labels: np.ndarray, transform: EvalTransform) -> None:
        self.pixels, self._labels, self.transform = pixels, np.asarray(labels), transform

    def __getitem__(self, i):
        i = int(i)
        return self.batch(i, i + 1)[0], int(self._labels[i])

    def batch(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as the trunk's input (float32, contiguous as the streaming batches)."""
        return normalise_batch(self.pixels[start:stop], self.transform.preprocessing)


def decode_eval_set(dataset: Any, max_bytes: int = DECODE_ONCE_MAX_BYTES) -> DecodedEvalSet | None:
    """``dataset`` decoded once (:class:`DecodedEvalSet`), or None: not the protocol's evaluation dataset, or its
    ``N × 3 × size²`` bytes over ``max_bytes``."""
    if not _is_protocol(dataset, EvalTransform):
        return None
    tf: EvalTransform = dataset.transform
    n = len(dataset)
    if n == 0 or n * 3 * tf.size * tf.size > max_bytes:
        return None
    hwc = np.empty((n, tf.size, tf.size, 3), dtype=np.uint8)
    for i in range(n):
        hwc[i] = np.asarray(tf.pixels(dataset.decode(i)))
    return DecodedEvalSet(torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous(), dataset.labels, tf)


# --------------------------------------------------------------------------------------------- training


def random_resized_crop_params(
    heights: torch.Tensor, widths: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, left, crop height, crop width) of one crop per image of ``heights × widths`` (int64 tensors), drawn
    as torchvision's RandomResizedCrop draws them (and :meth:`TrainTransform.crop_params`), for all images at once:
    up to ten tries of a uniform area fraction in ``scale`` and a log-uniform aspect ratio, the first crop that
    fits kept, its top-left corner uniform over the positions where it fits; the largest centred crop within the
    ratio bounds where none of the ten fitted."""
    n = len(heights)
    log_ratio = torch.log(torch.tensor(ratio)).double().numpy()  # float32 logs, as torchvision keeps them
    # one draw from torch's RNG (seeded and checkpointed with the fold), the arithmetic in numpy: small arrays
    u = torch.rand(n, 22, dtype=torch.float64).numpy()
    h_img, w_img = heights.numpy().astype(np.float64), widths.numpy().astype(np.float64)
    target = (h_img * w_img)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[:, :10])
    aspect = np.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[:, 10:20])
    w_try, h_try = np.round(np.sqrt(target * aspect)), np.round(np.sqrt(target / aspect))
    fits = (w_try > 0) & (w_try <= w_img[:, None]) & (h_try > 0) & (h_try <= h_img[:, None])
    first = fits.argmax(axis=1)  # the first try that fits
    h, w = h_try[np.arange(n), first], w_try[np.arange(n), first]
    top = np.floor(u[:, 20] * (h_img - h + 1))
    left = np.floor(u[:, 21] * (w_img - w + 1))
    for i in np.flatnonzero(~fits.any(axis=1)):  # no try fitted: the centred crop of TrainTransform.crop_params
        hi, wi = int(h_img[i]), int(w_img[i])
        in_ratio = wi / hi
        if in_ratio < min(ratio):
            cw, ch = wi, int(round(wi / min(ratio)))
        elif in_ratio > max(ratio):
            ch, cw = hi, int(round(hi * max(ratio)))
        else:
            cw, ch = wi, hi
        top[i], left[i], h[i], w[i] = (hi - ch) // 2, (wi - cw) // 2, ch, cw
    return tuple(torch.from_numpy(v.astype(np.int64)) for v in (top, left, h, w))  # type: ignore[return-value]


def _bilinear_matrix(start: torch.Tensor, length: torch.Tensor, size_in: int, size_out: int) -> torch.Tensor:
    """``n × size_out × size_in``: PIL's bilinear resampling of the pixels ``start … start+length−1`` of an axis to
    ``size_out`` pixels.  Output pixel ``i`` is centred at ``start + (i + ½)·length/size_out``; its weights are the
    triangle ``max(0, 1 − |x + ½ − centre| / s)`` with ``s = max(1, length / size_out)`` (PIL antialiases when it
    shrinks) over the pixels ``x`` inside the span, normalised to sum 1."""
    start, length = start.to(torch.float32), length.to(torch.float32)
    step = length / size_out
    inv_support = 1.0 / step.clamp(min=1.0)
    centre = start[:, None] + (torch.arange(size_out, dtype=torch.float32) + 0.5)[None, :] * step[:, None]
    x = torch.arange(size_in, dtype=torch.float32) + 0.5
    dist = (x[None, None, :] - centre[:, :, None]).abs_().mul_(inv_support[:, None, None])
    weights = dist.neg_().add_(1.0).clamp_(min=0.0)
    inside = (x[None, :] > start[:, None]) & (x[None, :] < (start + length)[:, None])
    weights.mul_(inside[:, None, :])
    return weights.div_(weights.sum(dim=2, keepdim=True))


class DecodedTrainSet(_DecodedRows):
    """Training rows decoded once: ``pixels`` is ``N×C×H×W`` uint8 (C = 1 when every row is grayscale, else 3;
    H × W the largest stored size, smaller rows at the top left), ``sizes`` each row's own ``(height, width)``.
    :meth:`batch` applies the protocol's training transform to a batch of rows (module docstring)."""

    def __init__(self, pixels: torch.Tensor, sizes: torch.Tensor, labels: np.ndarray, transform: TrainTransform):
        self.pixels, self.sizes, self._labels, self.transform = pixels, sizes, np.asarray(labels), transform
        self.dense = pixels.shape[2] * pixels.shape[3] <= DENSE_MAX_PIXELS
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _resize_tables(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every crop's resampling matrix, as windows of two tables: ``rows[L − 1, :, H − top]`` is the
        ``size × H`` matrix of the crop of rows ``top … top+L−1`` (the ``size × L`` matrix of a crop at 0, placed at
        ``top``); ``cols`` the same for columns, ``cols[W + L − 1]`` mirrored (the flip)."""
        if size not in self._tables:
            height, width = self.pixels.shape[2:]

            def windows(n: int, mirrored: bool) -> torch.Tensor:
                table = _bilinear_matrix(torch.zeros(n), torch.arange(1, n + 1), n, size)  # L − 1 → size × n
                if mirrored:
                    table = torch.cat([table, table.flip(1)])
                padded = torch.zeros(len(table), size, 2 * n)
                padded[:, :, n:] = table
                return padded.unfold(2, n, 1)  # [k, :, n − start] = the matrix placed at start

            self._tables[size] = (windows(height, False), windows(width, True))
        return self._tables[size]

    def batch(self, indices) -> torch.Tensor:
        """Rows ``indices`` augmented: ``n × 3 × size × size`` float32, the trunk's input."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if not self.dense:
            return torch.stack([self.transform(self._pil(i)) for i in idx.tolist()])
        tf, (_, c, height, width) = self.transform, self.pixels.shape
        sizes = self.sizes.index_select(0, idx)
        top, left, h, w = random_resized_crop_params(sizes[:, 0], sizes[:, 1], tf.scale, tf.ratio)
        flip = torch.rand(len(idx)) < tf.flip_p  # torchvision: no flip when rand >= p
        row_table, col_table = self._resize_tables(tf.size)
        rows = row_table[h - 1, :, height - top][:, None]  # n × 1 × size × H
        cols = col_table[w - 1 + flip.long() * width, :, width - left][:, None]  # n × 1 × size × W
        images = self.pixels.index_select(0, idx).to(torch.float32)  # n × C × H × W
        # PIL's two passes, horizontal first, each rounded to whole grey levels (its uint8 intermediate image)
        wide = torch.matmul(images, cols.transpose(-1, -2)).add_(0.5).floor_()  # n × C × H × size
        out = torch.matmul(rows, wide).add_(0.5).floor_().clamp_(0, 255)
        if c == 1:
            out = out.repeat(1, 3, 1, 1)
        return normalise_batch(out, tf.preprocessing)

    def _pil(self, i: int):
        h, w = self.sizes[i].tolist()
        hwc = self.pixels[i, :, :h, :w].permute(1, 2, 0).numpy()
        return Image.fromarray(np.ascontiguousarray(hwc[..., 0] if hwc.shape[2] == 1 else hwc))


def _decoded_rows(dataset: ImageDataset, rows) -> tuple[list[np.ndarray], bool]:
    """The rows as uint8 arrays (H×W for grayscale and 1-bit rows, H×W×3 else) and whether all were grayscale."""
    out, grey = [], True
    for i in rows:
        im = dataset.decode(int(i), rgb=False)
        if im.mode in ("1", "L"):
            out.append(np.array(im.convert("L") if im.mode == "1" else im))
        else:
            out.append(np.array(im.convert("RGB") if im.mode != "RGB" else im))
            grey = False
    return out, grey


def decode_train_set(dataset: Any, max_bytes: int = DECODE_ONCE_MAX_BYTES) -> DecodedTrainSet | None:
    """``dataset`` decoded once (:class:`DecodedTrainSet`), or None: not the protocol's training dataset, or its
    decoded pixels (padded to the largest image) over ``max_bytes``.  A sample of rows is decoded first: a table
    whose sample already says it will not fit is not decoded at all."""
    n = len(dataset) if _is_protocol(dataset, TrainTransform) else 0
    if n == 0 or n > max_bytes:  # not the protocol's, or not even a byte per image (0: stream)
        return None
    sample, _ = _decoded_rows(dataset, np.linspace(0, n - 1, min(n, _SAMPLE_ROWS)).round().astype(int))
    largest = max(a.shape[0] for a in sample) * max(a.shape[1] for a in sample)
    if n * largest > max_bytes:  # even one channel would not fit
        return None
    images, grey = _decoded_rows(dataset, range(n))
    height, width = max(a.shape[0] for a in images), max(a.shape[1] for a in images)
    channels = 1 if grey else 3
    if n * channels * height * width > max_bytes:
        return None
    pixels = torch.zeros((n, channels, height, width), dtype=torch.uint8)
    for i, a in enumerate(images):
        t = torch.from_numpy(a)
        pixels[i, :, : a.shape[0], : a.shape[1]] = _chw(t) if channels == 3 else t
    sizes = torch.tensor([a.shape[:2] for a in images], dtype=torch.long)
    return DecodedTrainSet(pixels, sizes, dataset.labels, dataset.transform)


def _chw(t: torch.Tensor) -> torch.Tensor:
    """An H×W (grayscale: three equal channels, as its RGB conversion) or H×W×3 array as 3×H×W."""
    return t[None].expand(3, -1, -1) if t.ndim == 2 else t.permute(2, 0, 1)


class DecodedBatches:
    """The training loop's loader over a :class:`DecodedTrainSet`: each of ``batch_sampler``'s index lists as an
    ``(images, labels)`` batch, built in this process."""

    def __init__(self, train: DecodedTrainSet, batch_sampler) -> None:
        self.train, self.batch_sampler = train, batch_sampler
        self.labels = torch.as_tensor(train.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for indices in self.batch_sampler:
            idx = torch.as_tensor(indices, dtype=torch.long)
            yield self.train.batch(idx), self.labels.index_select(0, idx)


def decode_fold(train_set: Any, val_set: Any, max_bytes: int | None = None) -> tuple[DecodedTrainSet | None, Any]:
    """A fold's datasets decoded once where they are the protocol's and fit ``max_bytes`` together (``None``:
    :data:`DECODE_ONCE_MAX_BYTES` as it is when called; 0 streams both): (the decoded training set or None to stream
    it, the validation set — decoded, or ``val_set`` as it was).  The validation set (small: ``size × size`` per
    image) is decoded first, the training set within what is left."""
    if max_bytes is None:
        max_bytes = DECODE_ONCE_MAX_BYTES
    val = decode_eval_set(val_set, max_bytes) if val_set is not None else None
    left = max_bytes - (val.nbytes if val is not None else 0)
    train = decode_train_set(train_set, left)
    return train, (val if val is not None else val_set)
