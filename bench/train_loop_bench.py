"""Benchmark: ``dml_core.training.loop.train_fold``'s training loop against a bare PyTorch loop doing the same work.

Both loops train the same tiny CNN (``EmbeddingModel(trunk="tiny")``, 16-px synthetic images held as tensors, so
decoding does not dilute the comparison) with the same m-per-class batches (``MPerClassBatchSampler``, one
``DataLoader``, no worker processes), the same loss (``proxynca_pp`` by default: a learnable loss, so the
loss-parameter optimiser runs too), the same RMSprop settings per parameter group (trunk, embedder, loss:
docs/protocol.md §Optimisers), one thread, ``--iters`` iterations (300 = 3 "epochs" of 100).

* bare: what a researcher would write — move the batch, remap labels to 0..C-1, forward, loss, ``zero_grad``,
  ``backward``, ``step``, accumulate the loss on the device.  No finiteness check, no DDP, no bookkeeping.
* train_fold: the library in its fixed-budget mode (``val_set=None``: no evaluation at all).  On a library without
  that mode the bench gives it a 2-class val set and subtracts the evaluations' own ``eval_seconds``.

Timed: everything after the model and loss exist (optimiser, sampler and loader set-up, the iterations), as
process CPU time (one thread, so CPU time is the work done and barely moves when other jobs share the cores) and
wall time.  Each repeat runs every variant, rotating which goes first (interleaved, so drift of a shared machine
hits all alike), after ``--warmup`` untimed rounds.  Prints per-repeat times, the medians, and the median of the
per-repeat ratios (bare time / train_fold time: 1.0 = the library costs nothing, 0.95 = it is 5 % slower).
``--before FILE`` adds another version of ``dml_core/training/loop.py`` (e.g.
``git show REV:dml_core/training/loop.py > f``) as a third variant in the same run.

    python bench/train_loop_bench.py                 # 9 repeats of 300 iterations
    python bench/train_loop_bench.py --repeats 15 --before /tmp/train_before.py

Measured figures, with the command and machine of each: bench/README_train_loop.md.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from dml_core.training.loop import TrainConfig, train_fold
from dml_core.training.samplers import MPerClassBatchSampler


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


def config(args, iters_per_epoch: int, epochs: int, cls=TrainConfig) -> TrainConfig:
    return cls(
        classes_per_batch=8,
        m=4,
        iters_per_epoch=iters_per_epoch,
        max_epochs=epochs,
        eval_every=1,
        patience=None,
        loss_lr=1e-3,
        loss_weight_decay=0.0,
        seed=0,
        device="cpu",
    )


class Clock:
    """CPU and wall seconds since construction."""

    def __init__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def stop(self) -> tuple[float, float]:
        return time.process_time() - self.cpu, time.perf_counter() - self.wall


def run_bare(args, data: TensorImages) -> tuple[float, float]:
    """The anchor: a plain loop, same model/sampler/optimiser settings (one RMSprop, three parameter groups)."""
    model, loss = build(args, len(np.unique(data.labels)))
    clock = Clock()
    cfg = config(args, args.iters, 1)
    classes = torch.as_tensor(np.unique(data.labels))
    trunk = list(model.trunk.parameters())
    trunk_ids = {id(p) for p in trunk}
    groups = [
        {"params": trunk, "lr": cfg.trunk_lr, "weight_decay": cfg.weight_decay},
        {
            "params": [p for p in model.parameters() if id(p) not in trunk_ids],
            "lr": cfg.embedder_lr,
            "weight_decay": cfg.weight_decay,
        },
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
    sampler.set_epoch(1)
    for images, labels in loader:
        labels = torch.searchsorted(classes, labels)
        value = loss(model(images), labels)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        total += value.detach()
    seconds = clock.stop()
    if not torch.isfinite(total):
        raise RuntimeError("bare loop diverged")
    return seconds


def run_library(args, data: TensorImages, val: TensorImages, module=None) -> tuple[float, float]:
    """train_fold for the same iterations, in fixed-budget mode (no evaluation); a library without that mode gets a
    2-class val set and its evaluations' own eval_seconds are subtracted (from both clocks: they are compute)."""
    fold, cls = (module.train_fold, module.TrainConfig) if module is not None else (train_fold, TrainConfig)
    model, loss = build(args, len(np.unique(data.labels)))
    cfg = config(args, args.iters, 1, cls)
    clock = Clock()
    try:
        result = fold(model, loss, data, None, cfg)
        cpu, wall = clock.stop()
    except ValueError:
        clock = Clock()
        result = fold(model, loss, data, val, cfg)
        cpu, wall = clock.stop()
        evals = sum(r["eval_seconds"] for r in result.history)
        cpu, wall = cpu - evals, wall - evals
    if result.status != "ok" or result.iterations != args.iters:
        raise RuntimeError(f"train_fold: {result.status} {result.reason} after {result.iterations} iterations")
    return cpu, wall


def load_before(path: str):
    """Another version of dml_core/training/loop.py, imported under its own module name."""
    spec = importlib.util.spec_from_file_location("train_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--loss", default="proxynca_pp")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--size", type=int, default=16, help="image side in pixels")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", help="another dml_core/training/loop.py to time as a third variant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    data = make_data(32, 12, args.size)
    val = make_data(2, 2, args.size)
    variants = {"bare": lambda: run_bare(args, data), "train_fold": lambda: run_library(args, data, val)}
    if args.before:
        before = load_before(args.before)
        variants["before"] = lambda: run_library(args, data, val, before)
    names = list(variants)
    print(
        f"# train loop bench: {args.loss}, tiny CNN, {args.size}px, batch 8x4, {args.iters} iterations, "
        f"{args.threads} thread(s), torch {torch.__version__}, {platform.machine()}, "
        f"{args.warmup} warm-up round(s), {args.repeats} timed rounds (interleaved: {', '.join(names)})",
        flush=True,
    )
    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    times = {n: {"cpu": [], "wall": []} for n in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            cpu, wall = variants[n]()
            times[n]["cpu"].append(cpu)
            times[n]["wall"].append(wall)
        print(
            f"round {r} (first: {order[0]}): "
            + "  ".join(f"{n} cpu {times[n]['cpu'][-1]:.3f} s wall {times[n]['wall'][-1]:.3f} s" for n in names),
            flush=True,
        )
    for clock in ("cpu", "wall"):
        print(f"\n{clock} time, median over {args.repeats} rounds:")
        for n in names:
            med = statistics.median(times[n][clock])
            print(f"  {n:<11} {med:.3f} s  ({1e3 * med / args.iters:.2f} ms/it)")
        for n in names[1:]:
            ratios = [b / t for b, t in zip(times["bare"][clock], times[n][clock])]
            print(
                f"  bare/{n}: median of paired ratios {statistics.median(ratios):.3f} "
                f"(quartiles {np.percentile(ratios, 25):.3f}-{np.percentile(ratios, 75):.3f}), ratio of medians "
                f"{statistics.median(times['bare'][clock]) / statistics.median(times[n][clock]):.3f}"
            )


if __name__ == "__main__":
    sys.exit(main())
