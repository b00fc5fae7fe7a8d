"""Benchmark: forward + backward time of every registered loss on CPU.

For each loss of ``list_losses()`` (so it covers every loss module that has landed) it times
``loss(embeddings, labels).backward()`` on a batch of B = 128 raw embeddings of D = 512:

* with C = 100 classes (CUB-like) for every loss;
* also with C = 11,318 classes (SOP-like) for losses with learnable per-class parameters
  (``loss_info(name).learnable``: proxies / class weights), whose cost grows with C.

The batch has the loss's own composition (``loss_info(name).batch.m`` samples per class, B/m
classes).  Hyperparameters: the ``paper_defaults`` and ``fixed`` values of
``tune_spaces/<name>.yaml`` (``loss_lr`` dropped), or the constructor defaults where a loss has
no space file.  Each cell is the median over ``--reps`` timed repetitions after ``--warmup``
untimed ones (fewer when a cell's timed reps exceed ``--budget`` seconds, at least 3), in
milliseconds, with the interquartile range and the number of reps.  Prints a markdown table.

    python bench/losses_bench.py                               # all losses, 20 reps
    python bench/losses_bench.py --losses rsw proxynca_pp --reps 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from dml_core.losses import build_loss, list_losses, loss_info

CUB_CLASSES = 100
SOP_CLASSES = 11318


def _space_params() -> dict[str, tuple[dict, str]]:
    """Per loss: (build_loss kwargs from its tune space's paper_defaults + fixed, where they came from)."""
    try:
        from pipelines.config.spaces import LOSS_LR, all_spaces
    except ImportError:  # pipelines not importable: constructor defaults only
        return {}
    out = {}
    for name, space in all_spaces().items():
        params = {**space.paper_defaults, **space.fixed}
        params.pop(LOSS_LR, None)
        out[name] = (params, "paper_defaults")
    return out


def _labels(num_classes: int, batch: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` labels: ceil(batch/m) random classes with m samples each, cut to ``batch``."""
    k = min(num_classes, -(-batch // m))
    classes = torch.randperm(num_classes, generator=gen)[:k]
    return classes.repeat_interleave(m).repeat(-(-batch // (k * m)))[:batch]


def time_loss(
    name: str,
    params: dict,
    *,
    num_classes: int,
    batch: int,
    dim: int,
    reps: int,
    warmup: int,
    device: str,
    budget: float,
):
    """Forward + backward times (seconds) of one loss; fresh embeddings (and zeroed grads) every rep.

    Stops after ``reps`` timed reps, or earlier once at least 3 timed reps took ``budget`` seconds in all.
    """
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    loss = build_loss(name, num_classes=num_classes, embedding_dim=dim, **params).to(device).train()
    labels = _labels(num_classes, batch, loss_info(name).batch.m, gen).to(device)
    times = []
    for i in range(warmup + reps):
        emb = torch.randn(batch, dim, generator=gen).to(device).requires_grad_()
        loss.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        value = loss(emb, labels)
        value.backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if not torch.isfinite(value):
            raise RuntimeError(f"non-finite loss {value.item()}")
        if len(times) >= 3 and sum(times) > budget:
            break
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--losses", nargs="+", help="registry names (default: every registered loss)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per cell (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timed reps per cell before stopping early")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a shared machine)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")

    torch.set_num_threads(args.threads)
    names = args.losses or list_losses()
    known = set(list_losses())
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown loss(es) {', '.join(unknown)}; registered: {', '.join(sorted(known))}")
    spaces = _space_params()

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("n/a",) * 3
    print(
        f"# losses bench: B={args.batch}, D={args.dim}, device={args.device}, torch {torch.__version__}, "
        f"threads={args.threads}, reps={args.reps} (+{args.warmup} warm-up), "
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load avg at start "
        f"{', '.join(f'{x:.2f}' if isinstance(x, float) else x for x in load)}\n"
    )
    print("| loss | C | batch (classes x m) | hyperparameters | fwd+bwd median ms | IQR ms | reps |")
    print("|---|---:|---|---|---:|---:|---:|")
    failed = 0
    for name in names:
        info = loss_info(name)
        params, source = spaces.get(name, ({}, "constructor defaults"))
        sizes = [CUB_CLASSES] + ([SOP_CLASSES] if info.learnable else [])
        for c in sizes:
            m = info.batch.m
            shape = f"{-(-args.batch // m)} x {m}"
            try:
                t = time_loss(
                    name,
                    params,
                    num_classes=c,
                    batch=args.batch,
                    dim=args.dim,
                    reps=args.reps,
                    warmup=args.warmup,
                    device=args.device,
                    budget=args.budget,
                )
            except Exception as e:  # report and go on: one broken loss must not hide the others
                failed += 1
                print(f"| {name} | {c} | {shape} | {source} | error: {type(e).__name__}: {str(e)[:80]} | | |")
                continue
            ms = sorted(x * 1e3 for x in t)
            q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0], ms[0], ms[0]]
            print(
                f"| {name} | {c} | {shape} | {source} | {statistics.median(ms):.2f} | "
                f"{q[0]:.2f}-{q[2]:.2f} | {len(ms)} |",
                flush=True,
            )
    if hasattr(os, "getloadavg"):
        print(f"\nload avg at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
