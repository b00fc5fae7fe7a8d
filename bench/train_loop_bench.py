"""Benchmark: ``dml_core.train.train_fold``'s training loop against a bare PyTorch loop doing the same work.

Both loops train the same tiny CNN (``EmbeddingModel(trunk="tiny")``, 16-px synthetic images held as tensors, so
decoding does not dilute the comparison) with the same m-per-class batches (``MPerClassBatchSampler``, one
``DataLoader``, no worker processes), the same loss (``proxynca_pp`` by default: a learnable loss, so the
loss-parameter optimiser runs too), the same RMSprop settings per parameter group (trunk, embedder, loss: MLRC
protocol spec §3), one thread, ``--iters`` iterations (300 = 3 "epochs" of 100).

* bare: what a researcher would write — move the batch, remap labels to 0..C-1, forward, loss, ``zero_grad``,
  ``backward``, ``step``, accumulate the loss on the device.  No finiteness check, no DDP, no bookkeeping.
* train_fold: the library in its fixed-budget mode (``val_set=None``: no evaluation at all).  On a library without
  that mode the bench gives it a 2-class val set and subtracts the evaluations' own ``eval_seconds``.

Each repeat runs both, alternating which goes first (interleaved, so drift of a shared machine hits both alike),
after ``--warmup`` untimed pairs.  Prints per-repeat times, the medians, and the median of the per-repeat ratios
(bare time / train_fold time: 1.0 = the library costs nothing, 0.95 = it is 5 % slower).

    python bench/train_loop_bench.py                 # 7 repeats of 300 iterations
    python bench/train_loop_bench.py --repeats 11 --loss triplet
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dml_core.data import synthetic
from dml_core.losses import build_loss
from dml_core.models import EmbeddingModel
from dml_core.samplers import MPerClassBatchSampler
from dml_core.train import TrainConfig, train_fold


class TensorImages(Dataset):
    """Pre-decoded images as one float tensor (N, 3, S, S) in [0, 1]; ``.labels`` for the sampler."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def make_data(num_classes: int, per_class: int, size: int) -> TensorImages:
    table = synthetic(num_classes, per_class, image_size=size, seed=0)
    x = torch.from_numpy(np.stack(table.images)).permute(0, 3, 1, 2).float().div_(255)
    return TensorImages(x.contiguous(), table.labels)


def build(args, num_classes: int):
    torch.manual_seed(0)
    model = EmbeddingModel(trunk="tiny", embedding_dim=args.dim)
    loss = build_loss(args.loss, num_classes=num_classes, embedding_dim=args.dim)
    return model, loss


def config(args, iters_per_epoch: int, epochs: int) -> TrainConfig:
    return TrainConfig(classes_per_batch=8, m=4, iters_per_epoch=iters_per_epoch, max_epochs=epochs, eval_every=1,
                       patience=None, loss_lr=1e-3, loss_weight_decay=0.0, seed=0, device="cpu")


def run_bare(args, data: TensorImages) -> float:
    """The anchor: a plain loop, same model/sampler/optimiser settings (one RMSprop, three parameter groups)."""
    model, loss = build(args, len(np.unique(data.labels)))
    cfg = config(args, args.iters, 1)
    classes = torch.as_tensor(np.unique(data.labels))
    trunk = list(model.trunk.parameters())
    trunk_ids = {id(p) for p in trunk}
    groups = [
        {"params": trunk, "lr": cfg.trunk_lr, "weight_decay": cfg.weight_decay},
        {"params": [p for p in model.parameters() if id(p) not in trunk_ids], "lr": cfg.embedder_lr,
         "weight_decay": cfg.weight_decay},
    ]
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    if loss_params:
        groups.append({"params": loss_params, "lr": cfg.loss_lr, "weight_decay": 0.0})
    opt = torch.optim.RMSprop(groups, momentum=cfg.momentum)
    sampler = MPerClassBatchSampler(data.labels, cfg.m, cfg.classes_per_batch, iters_per_epoch=args.iters, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=0, generator=torch.Generator().manual_seed(0))
    model.train()
    loss.train()
    total = torch.zeros((), dtype=torch.float64)
    t0 = time.perf_counter()
    sampler.set_epoch(1)
    for images, labels in loader:
        labels = torch.searchsorted(classes, labels)
        value = loss(model(images), labels)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        total += value.detach()
    seconds = time.perf_counter() - t0
    if not torch.isfinite(total):
        raise RuntimeError("bare loop diverged")
    return seconds


def run_library(args, data: TensorImages, val: TensorImages) -> float:
    """train_fold for the same iterations; its own train_seconds minus evaluations (none in fixed-budget mode)."""
    model, loss = build(args, len(np.unique(data.labels)))
    cfg = config(args, args.iters, 1)
    try:
        result = train_fold(model, loss, data, None, cfg)
        seconds = result.train_seconds
    except ValueError:  # a library without the fixed-budget mode: subtract its evaluations
        cfg = config(args, args.iters, 1)
        result = train_fold(model, loss, data, val, cfg)
        seconds = result.train_seconds - sum(r["eval_seconds"] for r in result.history)
    if result.status != "ok" or result.iterations != args.iters:
        raise RuntimeError(f"train_fold: {result.status} {result.reason} after {result.iterations} iterations")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--loss", default="proxynca_pp")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--size", type=int, default=16, help="image side in pixels")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    data = make_data(32, 12, args.size)
    val = make_data(2, 2, args.size)
    print(f"# train loop bench: {args.loss}, tiny CNN, {args.size}px, batch 8x4, {args.iters} iterations, "
          f"{args.threads} thread(s), torch {torch.__version__}, {platform.machine()}, "
          f"{args.warmup} warm-up pair(s), {args.repeats} timed pairs (interleaved)", flush=True)
    for _ in range(args.warmup):
        run_bare(args, data)
        run_library(args, data, val)
    bare, lib, ratios = [], [], []
    for r in range(args.repeats):
        order = ("bare", "lib") if r % 2 == 0 else ("lib", "bare")
        t = {}
        for which in order:
            t[which] = run_bare(args, data) if which == "bare" else run_library(args, data, val)
        bare.append(t["bare"])
        lib.append(t["lib"])
        ratios.append(t["bare"] / t["lib"])
        print(f"repeat {r}: bare {t['bare']:.3f} s  train_fold {t['lib']:.3f} s  ratio {ratios[-1]:.3f}  "
              f"(first: {order[0]})", flush=True)
    print(f"median bare        {statistics.median(bare):.3f} s  ({1e3 * statistics.median(bare) / args.iters:.2f} ms/it)")
    print(f"median train_fold  {statistics.median(lib):.3f} s  ({1e3 * statistics.median(lib) / args.iters:.2f} ms/it)")
    print(f"ratio bare/train_fold: median of paired ratios {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); ratio of medians "
          f"{statistics.median(bare) / statistics.median(lib):.3f}")


if __name__ == "__main__":
    sys.exit(main())
