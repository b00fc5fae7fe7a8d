"""Benchmark: the CPU speed options of ``TrainConfig`` — ``channels_last`` and ``cpu_amp`` (bfloat16 autocast of the
training forward) — against today's fp32 path, for the Omniglot preset's network (tiny CNN, 32 px, embedding 64,
batches of 8 classes × 4, RMSprop 1e-4, contrastive), and whether the trained model's validation MAP@R stays within
the fp32 path's run-to-run noise.

    .venv/bin/python bench/cpu_speed_bench.py                      # speed and accuracy, Omniglot if ../shared has it
    .venv/bin/python bench/cpu_speed_bench.py --skip-accuracy      # speed only
    .venv/bin/python bench/cpu_speed_bench.py --seeds 4 --epochs 6 # a tighter noise estimate
    .venv/bin/python bench/cpu_speed_bench.py --accuracy-variants fp32,channels_last   # skip the slow ones

Speed: forward + backward + step of one training batch, ``--iters`` iterations per variant after a warm-up, the
variants interleaved ``--repeats`` times; the median ms per iteration and its ratio to fp32.  Accuracy: one fold
(fold 0 of the ``mlrc`` layout: 91 train / 30 val classes on Omniglot) trained ``--epochs`` epochs of 100
iterations per variant and seed (the same seeds for every variant), validation MAP@R at the end; a variant is
*within noise* when |mean − fp32 mean| <= 2 × the fp32 runs' standard deviation.  The CPU's bf16 features
(``avx512_bf16``, ``amx_bf16``) are printed: without them bf16 arithmetic is emulated and slower.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dml_core.data import ImageDataset, eval_transform, read_omniglot, synthetic, train_transform  # noqa: E402
from dml_core.losses import build_loss  # noqa: E402
from dml_core.models import build_model  # noqa: E402
from dml_core.splits import FoldManifest  # noqa: E402
from dml_core.training.loop import TrainConfig, train_fold  # noqa: E402

OMNIGLOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "omniglot"
VARIANTS = {
    "fp32": {},
    "channels_last": {"channels_last": True},
    "bf16": {"cpu_amp": True},
    "bf16+channels_last": {"cpu_amp": True, "channels_last": True},
}
IMAGE, EMB = 32, 64


def cpu_features() -> str:
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    return f"{model}; {' '.join(have) or 'no AVX2'}"


def step_times(variant: dict, iters: int) -> list[float]:
    """Seconds of each of ``iters`` training steps of one batch (after 5 warm-up steps)."""
    torch.manual_seed(0)
    model = build_model(trunk="tiny", embedding_dim=EMB, freeze_bn=False).train()
    loss = build_loss("contrastive", num_classes=8, embedding_dim=EMB)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-4)
    fmt = torch.channels_last if variant.get("channels_last") else torch.contiguous_format
    model.to(memory_format=fmt)
    x = torch.randn(32, 3, IMAGE, IMAGE).to(memory_format=fmt)
    y = torch.arange(8).repeat_interleave(4)
    out = []
    for i in range(iters + 5):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(variant.get("cpu_amp"))):
            emb = model(x)
        value = loss(emb.float(), y)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return out


def data(use_omniglot: bool, omniglot: Path = OMNIGLOT):
    if use_omniglot:
        table = read_omniglot(omniglot)
        name = f"Omniglot ({omniglot})"
    else:
        table = synthetic(64, 20, IMAGE, 0)
        name = "synthetic (64 classes × 20)"
    manifest = FoldManifest.from_labels(table.labels, 4, "mlrc")
    fold = manifest.folds[0]
    train = ImageDataset(table.subset(fold.train_classes), train_transform(IMAGE))
    val = ImageDataset(table.subset(fold.val_classes), eval_transform(IMAGE))
    return name, train, val, len(fold.train_classes)


def accuracy(train, val, n_train: int, variant: dict, seed: int, epochs: int) -> tuple[float, float]:
    """(final validation MAP@R, seconds) of one fold trained with ``variant``."""
    torch.manual_seed(seed)
    model = build_model(trunk="tiny", embedding_dim=EMB, freeze_bn=False)
    loss = build_loss("contrastive", num_classes=n_train, embedding_dim=EMB)
    cfg = TrainConfig(
        classes_per_batch=8,
        m=4,
        iters_per_epoch=100,
        max_epochs=epochs,
        eval_every=epochs,
        patience=None,
        optimizer="rmsprop",
        trunk_lr=1e-4,
        embedder_lr=1e-4,
        momentum=0.0,
        eval_batch_size=256,
        seed=seed,
        **variant,
    )
    t0 = time.perf_counter()
    res = train_fold(model, loss, train, val, cfg)
    if res.status != "ok":
        raise RuntimeError(f"{variant} seed {seed}: {res.status} {res.reason}")
    return res.history[-1]["metrics"]["map_at_r"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--synthetic", action="store_true", help="synthetic data even if Omniglot is there")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument(
        "--accuracy-variants",
        default=",".join(VARIANTS),
        help="comma-separated variants to train for the accuracy check (fp32 always included): where bf16 is "
        "emulated (no avx512_bf16/amx_bf16) each bf16 fold costs many times an fp32 one",
    )
    args = ap.parse_args()
    checked = ["fp32"] + [v for v in args.accuracy_variants.split(",") if v and v != "fp32"]
    unknown = [v for v in checked if v not in VARIANTS]
    if unknown:
        ap.error(f"--accuracy-variants: unknown {unknown} (known: {', '.join(VARIANTS)})")
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_features()}; torch {torch.__version__}; {args.threads} thread(s)", flush=True)

    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):  # interleaved, so that a change in the machine's load hits every variant alike
        for name, variant in VARIANTS.items():
            per[name] += step_times(variant, args.iters)
    base = statistics.median(per["fp32"])
    print(
        f"\nspeed: forward+backward+step of a 32-image batch, {args.iters} iterations × {args.repeats} interleaved "
        "repeats"
    )
    print("variant | ms / iteration (median) | ms per 100 iterations | × fp32")
    for name, ts in per.items():
        m = statistics.median(ts)
        print(f"{name} | {1000 * m:.1f} | {100 * 1000 * m:.0f} | {m / base:.2f}")

    if args.skip_accuracy:
        return
    name, train, val, n_train = data(OMNIGLOT.is_dir() and not args.synthetic)
    print(
        f"\naccuracy: fold 0 of {name}, {n_train} train classes, {args.epochs} epochs × 100 iterations, "
        f"seeds 0..{args.seeds - 1}, final val MAP@R",
        flush=True,
    )
    results: dict[str, list[float]] = {v: [] for v in checked}
    seconds: dict[str, list[float]] = {v: [] for v in checked}
    for seed in range(args.seeds):
        for vname in checked:
            variant = VARIANTS[vname]
            m, s = accuracy(train, val, n_train, variant, seed, args.epochs)
            results[vname].append(m)
            seconds[vname].append(s)
            print(f"  {vname} seed {seed}: MAP@R {m:.4f} in {s:.1f} s", flush=True)
    ref = results["fp32"]
    sd = statistics.stdev(ref) if len(ref) > 1 else float("nan")
    print("variant | val MAP@R mean ± sd | Δ vs fp32 | within noise (|Δ| <= 2 sd of fp32) | fold seconds (mean)")
    for vname, vals in results.items():
        mean = statistics.fmean(vals)
        spread = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        delta = mean - statistics.fmean(ref)
        ok = "—" if vname == "fp32" else ("yes" if abs(delta) <= 2 * sd else "no")
        print(f"{vname} | {mean:.4f} ± {spread:.4f} | {delta:+.4f} | {ok} | {statistics.fmean(seconds[vname]):.1f}")


if __name__ == "__main__":
    main()
