"""Embedding a dataset or unlabelled images with a model, in one process or under ``torch.distributed``, and the
input checks the training loop shares (a dataset of tensors with labels, a device spec).

Under DDP each rank embeds a contiguous shard of the rows and every rank gets the gathered whole
(:func:`dml_core.distributed.all_gather_uneven`); :func:`dml_core.training.loop.train_fold`'s validation uses the same
path.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from dml_core.data import decode_image, eval_transform
from dml_core.decoded import DecodedEvalSet
from dml_core.distributed import all_gather_uneven, get_rank, get_world_size, shard_bounds
from dml_core.loader_workers import init_loader_worker

__all__ = ["embed", "embed_images", "resolve_device", "check_dataset", "labels_of", "embed_gathered"]


def resolve_device(spec: str | torch.device) -> torch.device:
    """``TrainConfig.device`` (or an embedding call's ``device``) as a torch device; "cuda" = the current one."""
    spec = str(spec)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"TrainConfig.device: cannot parse {spec!r} ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"TrainConfig.device is {spec!r} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_dataset(dataset, name: str, what: str) -> None:
    """Fail up front, naming what to pass, for tables (rows of encoded images) and other non-datasets."""
    if hasattr(dataset, "images") and hasattr(dataset, "labels") and not hasattr(type(dataset), "__getitem__"):
        raise ValueError(
            f"{name} is an image table ({type(dataset).__name__}: rows of encoded images), not a dataset of "
            "tensors: pass "
            f"dml_core.data.ImageDataset(table, {what}(image_size)) (the protocol's {what}, "
            "docs/protocol.md §Preprocessing)"
        )
    if not hasattr(type(dataset), "__getitem__") or not hasattr(type(dataset), "__len__"):
        raise ValueError(
            f"{name} must be a map-style dataset (__getitem__/__len__) yielding (image_tensor, label), "
            f"got {type(dataset).__name__}"
        )


def labels_of(dataset, name: str) -> np.ndarray:
    """``dataset.labels`` as a 1-D integer array with one entry per row, or a ValueError naming ``name``."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ValueError(f"{name} must expose .labels (np.ndarray of class ids), {type(dataset).__name__} has none")
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != len(dataset) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{name}.labels must be a 1-D integer array with one entry per row ({len(dataset)}), "
            f"got shape {labels.shape} dtype {labels.dtype}"
        )
    return labels


def _images_of(batch):
    """A loader batch -> its image tensor: ``(images, labels)`` pairs or bare image tensors."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _embed_device(where: str, model: nn.Module, device) -> torch.device:
    """The device to embed on: the model's own (its first parameter or buffer; CPU if it has none) unless
    ``device`` is given, which must then be where the model is -- a model trained on a GPU and embedded with
    CPU batches (or the reverse) is a mistake to name, not to fix by moving weights behind the caller's back."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    first: torch.Tensor | None = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    here = first.device if first is not None else torch.device("cpu")
    if device is None:
        return here
    dev = resolve_device(device)
    same = dev.type == here.type and (dev.type != "cuda" or dev.index == here.index)
    if not same:
        raise ValueError(
            f"{where}: device is {str(dev)!r} but the model is on {str(here)!r}; pass device=None to "
            "embed on the model's device, or move the model first (model.to(device))"
        )
    return dev


@torch.no_grad()
def embed_gathered(
    model: nn.Module,
    dataset,
    batch_size: int,
    device: torch.device,
    num_workers: int,
    memory_format: torch.memory_format = torch.preserve_format,
) -> torch.Tensor:
    """Every row's embedding, on ``device``; under DDP each rank embeds a contiguous shard, then gather.  A
    :class:`~dml_core.decoded.DecodedEvalSet` (images decoded once) is sliced into batches in this process, any
    other dataset goes through a DataLoader.  ``memory_format``: the batches' layout on ``device`` (the model's:
    channels-last for a channels-last model; the same values either way)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    world, rank = get_world_size(), get_rank()
    if len(dataset) < world:
        raise ValueError(f"dataset has {len(dataset)} rows, fewer than the {world} distributed ranks embedding it")
    start, stop = shard_bounds(len(dataset), world, rank)
    if isinstance(dataset, DecodedEvalSet):
        batches = (dataset.batch(a, min(a + batch_size, stop)) for a in range(start, stop, batch_size))
    else:
        loader = DataLoader(
            Subset(dataset, range(start, stop)),
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            worker_init_fn=init_loader_worker,
        )
        batches = (_images_of(batch) for batch in loader)
    was_training = model.training
    model.eval()
    try:
        parts = [model(x.to(device, non_blocking=True, memory_format=memory_format)).float() for x in batches]
    finally:
        model.train(was_training)
    if not parts:  # an empty shard: the embedding width from one forward pass is not worth it; 0 rows
        raise ValueError("nothing to embed: the dataset is empty")
    return all_gather_uneven(torch.cat(parts, dim=0))


def _check_batch_size(where: str, batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{where}: batch_size must be a positive integer, got {batch_size!r}")


def embed(
    model: nn.Module,
    dataset,
    *,
    batch_size: int = 128,
    device: str | torch.device | None = None,
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings of every row of a *labelled* ``dataset`` (in row order) and its labels, both on CPU.

    Raw (un-normalised) float32 model outputs, model in eval mode (its train/eval mode is
    restored afterwards).  Computed on the model's device (``device=None``); a ``device`` other than the
    model's is refused with a ``ValueError``.  Under ``torch.distributed`` each rank embeds a contiguous shard and
    every rank returns the gathered whole.  Unlabelled images: :func:`embed_images`.
    """
    check_dataset(dataset, "dataset", "eval_transform")
    labels = torch.as_tensor(labels_of(dataset, "dataset"), dtype=torch.long)
    _check_batch_size("embed", batch_size)
    emb = embed_gathered(model, dataset, batch_size, _embed_device("embed", model, device), num_workers)
    return emb.cpu(), labels


class _Rows(torch.utils.data.Dataset):
    """Unlabelled rows (decodable images or image tensors) -> transformed image tensors."""

    def __init__(self, rows, transform):
        self.rows, self.transform = rows, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        if isinstance(row, torch.Tensor):
            return self.transform(row) if self.transform is not None else row
        if self.transform is None:
            raise ValueError(
                f"embed_images: row {i} is a {type(row).__name__}, not a tensor; pass image_size or transform"
            )

        is_pil = hasattr(row, "convert") and hasattr(row, "mode")
        return self.transform(row.convert("RGB") if is_pil else decode_image(row))


def embed_images(
    model: nn.Module,
    images,
    *,
    image_size: int | None = None,
    transform: Callable | None = None,
    batch_size: int = 128,
    device: str | torch.device | None = None,
    num_workers: int = 0,
) -> torch.Tensor:
    """Embeddings of unlabelled images, in input order, as a ``(N, D)`` float32 CPU tensor (no labels needed).

    ``images`` is one of: an ``(N, C, H, W)`` tensor or a list of ``(C, H, W)`` tensors (already preprocessed;
    used as they are unless ``transform`` is given); a list of encoded images (bytes, paths, uint8 arrays, PIL
    images), decoded to RGB and passed through ``transform`` — by default the protocol's
    ``eval_transform(image_size)`` (Resize + CenterCrop + ImageNet normalisation,
    docs/protocol.md §Preprocessing), so ``image_size`` is
    required then; an ``ImageTable``/``ShardedTable`` (its labels are ignored), treated as its list of images; a
    map-style dataset yielding image tensors or ``(image, anything)`` pairs.  Raw model outputs, as
    :func:`embed`; eval mode, restored afterwards; on the model's device, as :func:`embed`.
    """
    _check_batch_size("embed_images", batch_size)
    dev = _embed_device("embed_images", model, device)
    if isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise ValueError(f"embed_images: an image tensor must be (N, C, H, W), got shape {tuple(images.shape)}")
        rows = list(images.unbind(0)) if transform is not None else None
        dataset = _Rows(rows, transform) if rows is not None else torch.utils.data.TensorDataset(images)
        return embed_gathered(model, dataset, batch_size, dev, num_workers).cpu()
    if hasattr(images, "images") and not hasattr(type(images), "__getitem__"):  # ImageTable / ShardedTable
        images = _TableImages(images)
    elif hasattr(type(images), "__getitem__") and not isinstance(images, (list, tuple)):
        return embed_gathered(model, images, batch_size, dev, num_workers).cpu()  # a dataset
    if not hasattr(images, "__len__") or not hasattr(images, "__getitem__"):
        raise ValueError(
            f"embed_images: images must be a tensor, a list of images or tensors, an ImageTable or a dataset; "
            f"got {type(images).__name__}"
        )
    if len(images) == 0:
        raise ValueError("embed_images: no images")
    if not isinstance(images[0], torch.Tensor) and transform is None:  # the first row decides (tables are lazy)
        if image_size is None:
            raise ValueError(
                "embed_images: encoded images need image_size (for the protocol's eval_transform) or a transform"
            )
        transform = eval_transform(image_size)
    return embed_gathered(model, _Rows(images, transform), batch_size, dev, num_workers).cpu()


class _TableImages:
    """A table's image column as a sequence (``ShardedTable.images`` reads rows on demand)."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        return self.table.images[i]
