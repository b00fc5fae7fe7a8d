"""Benchmark: a fold's CPU time against its floor, the bare training step, in one run on one machine; and whether
bf16 + channels-last and fp32 + channels-last train the same curves.

    .venv/bin/python bench/fold_floor_bench.py                          # Omniglot fold 0, the zoo's recipe
    .venv/bin/python bench/fold_floor_bench.py --iters 400 --seeds 1    # a quick look
    .venv/bin/python bench/fold_floor_bench.py --skip-streaming         # without the old (streaming) path

The recipe is configs/omniglot-zoo.yaml's: tiny CNN from scratch at 32 px, embedding 64, batches of 8 classes × 4,
Adam 1e-3 for trunk and embedder, a validation MAP@R every 200 iterations; the loss is contrastive at its paper
defaults.  Every number is process CPU time (``time.process_time``: all of this process's threads, not the wall
clock), so that other load on a shared machine changes it less; one torch thread, as a sweep's fold has.

* Bare step: forward + backward + Adam step of one fixed 32-image batch, in the fold's numerics: ``--steps`` steps
  after a warm-up, measured right before and right after every fold, so that a fold and its floor see the same load
  on a shared machine; the fold's floor is the mean of the two.
* Fold: ``train_fold`` on fold 0 of the mlrc layout (91 train / 30 val classes), ``--iters`` iterations with the
  evaluations at 0, 200, ... (the untrained model's included), from the datasets' construction to the result —
  images decoded once (``dml_core.decoded``) or, with the bound at 0, streamed as before (``--skip-streaming`` leaves
  those out); CPU seconds per 1,000 iterations and their ratio to 1,000 bare steps.
* Curves: the decoded folds of seeds 0 … ``--seeds``−1 in both numerics; each evaluation's val MAP@R, and whether
  the bf16 mean of the final MAP@R lies within 2 standard deviations of the fp32 seeds' (the seeds' noise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dml_core.decoded as decoded  # noqa: E402

# faiss loads with a process's first evaluation: loaded here, so that no timed fold pays the one-off import
import dml_core.evaluation.metrics  # noqa: E402, F401
from dml_core.data import ImageDataset, eval_transform, read_omniglot, train_transform  # noqa: E402
from dml_core.losses import build_loss  # noqa: E402
from dml_core.models import build_model  # noqa: E402
from dml_core.splits import FoldManifest  # noqa: E402
from dml_core.training.loop import TrainConfig, train_fold  # noqa: E402
from dml_core.training.numerics import cpu_flags, cpu_model  # noqa: E402

OMNIGLOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "omniglot"
IMAGE, EMB, LR = 32, 64, 1e-3
NUMERICS = {"fp32+channels_last": {"cpu_amp": False}, "bf16+channels_last": {"cpu_amp": True}}
LOSS = {"pos_margin": -0.2, "neg_margin": 0.3841}  # tune_spaces/contrastive.yaml's paper_defaults


def bare_step_cpu(cpu_amp: bool, steps: int) -> float:
    """CPU seconds per training step of one fixed batch (after 10 warm-up steps)."""
    torch.manual_seed(0)
    model = build_model(trunk="tiny", embedding_dim=EMB, freeze_bn=False).train()
    model.to(memory_format=torch.channels_last)
    loss = build_loss("contrastive", num_classes=8, embedding_dim=EMB, **LOSS)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x = torch.randn(32, 3, IMAGE, IMAGE).contiguous(memory_format=torch.channels_last)
    y = torch.arange(8).repeat_interleave(4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_amp):
            emb = model(x)
        value = loss(emb.float(), y)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()

    for _ in range(10):
        step()
    t0 = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - t0) / steps


def fold_run(table, fold, seed: int, iters: int, numerics: dict, decode: bool) -> dict:
    """One fold of the zoo's recipe: CPU seconds (datasets built, decoded or not, trained, evaluated) and history."""
    saved = decoded.DECODE_ONCE_MAX_BYTES
    decoded.DECODE_ONCE_MAX_BYTES = saved if decode else 0  # 0: nothing fits, the streaming path
    try:
        t0 = time.process_time()
        train = ImageDataset(table.subset(fold.train_classes), train_transform(IMAGE))
        val = ImageDataset(table.subset(fold.val_classes), eval_transform(IMAGE))
        torch.manual_seed(seed)
        model = build_model(trunk="tiny", embedding_dim=EMB, freeze_bn=False)
        loss = build_loss("contrastive", num_classes=len(fold.train_classes), embedding_dim=EMB, **LOSS)
        cfg = TrainConfig(
            iters_per_epoch=100,
            max_epochs=iters // 100,
            eval_every=2,
            patience=None,
            optimizer="adam",
            trunk_lr=LR,
            embedder_lr=LR,
            eval_batch_size=256,
            seed=seed,
            channels_last=True,
            **numerics,
        )
        res = train_fold(model, loss, train, val, cfg)
        cpu = time.process_time() - t0
    finally:
        decoded.DECODE_ONCE_MAX_BYTES = saved
    if res.status != "ok":
        raise RuntimeError(f"seed {seed} {numerics}: {res.status} {res.reason}")
    return {
        "cpu": cpu,
        "iterations": res.iterations,
        "numerics": res.numerics,
        "curve": [(r["iteration"], r["metrics"]["map_at_r"]) for r in res.history],
        "eval_wall": sum(r["eval_seconds"] for r in res.history),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1000, help="iterations per fold (a multiple of 200)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="bare steps before and after each fold")
    ap.add_argument("--skip-streaming", action="store_true")
    ap.add_argument("--omniglot", type=Path, default=OMNIGLOT)
    args = ap.parse_args()
    if args.iters < 200 or args.iters % 200:
        ap.error(f"--iters must be a positive multiple of 200, got {args.iters}")
    if not args.omniglot.is_dir():
        ap.error(f"--omniglot: no directory {args.omniglot} (the images_background_small*.zip files)")
    torch.set_num_threads(1)
    bf16 = sorted(f for f in cpu_flags() if f in ("avx512_bf16", "amx_bf16"))
    print(f"CPU: {cpu_model()}; native bf16: {' '.join(bf16) or 'no'}; torch {torch.__version__}; 1 thread", flush=True)

    table = read_omniglot(args.omniglot)
    fold = FoldManifest.from_labels(table.labels, 4, "mlrc").folds[0]
    print(
        f"\nfold 0 of Omniglot ({len(fold.train_classes)} train / {len(fold.val_classes)} val classes), "
        f"{args.iters} iterations, evaluations every 200 (at 0 too)",
        flush=True,
    )
    paths = [("decoded once", True)] + ([] if args.skip_streaming else [("streaming", False)])
    runs: dict[tuple[str, str, int], dict] = {}
    for seed in range(args.seeds):
        for name, num in NUMERICS.items():
            for path, decode in paths:
                if not decode and seed > 0:
                    continue  # the old path: one seed is enough for its cost
                before = bare_step_cpu(bool(num["cpu_amp"]), args.steps)
                r = fold_run(table, fold, seed, args.iters, num, decode)
                after = bare_step_cpu(bool(num["cpu_amp"]), args.steps)
                r["step"] = (before + after) / 2
                runs[(name, path, seed)] = r
                per_k = 1000 * r["cpu"] / r["iterations"]
                print(
                    f"  seed {seed} {r['numerics']} {path}: {r['cpu']:.1f} CPU s, {per_k:.1f} CPU s / 1,000 it; "
                    f"bare step {1000 * before:.1f} / {1000 * after:.1f} ms before / after: "
                    f"{per_k / (1000 * r['step']):.2f}× its 1,000 steps; evaluations {r['eval_wall']:.1f} s wall; "
                    f"final val MAP@R {r['curve'][-1][1]:.4f}",
                    flush=True,
                )

    print(
        "\nCPU per 1,000 iterations against the bare step "
        "(numerics | path | bare step ms | fold CPU s / 1,000 it | × 1,000 bare steps):"
    )
    for name in NUMERICS:
        for path, _ in paths:
            rs = [r for (n, p, _), r in runs.items() if n == name and p == path]
            per_k = statistics.fmean(1000 * r["cpu"] / r["iterations"] for r in rs)
            ratio = sum(r["cpu"] for r in rs) / sum(r["iterations"] * r["step"] for r in rs)
            step_ms = 1000 * statistics.fmean(r["step"] for r in rs)
            print(f"  {name} | {path} | {step_ms:.1f} | {per_k:.1f} | {ratio:.2f}  ({len(rs)} fold(s))")

    print("\ncurves (decoded folds): val MAP@R at each evaluation, fp32+cl / bf16+cl")
    finals: dict[str, list[float]] = {k: [] for k in NUMERICS}
    for seed in range(args.seeds):
        a, b = (runs[(name, "decoded once", seed)]["curve"] for name in NUMERICS)
        print(f"  seed {seed}: " + "  ".join(f"{i}: {x:.4f}/{y:.4f}" for (i, x), (_, y) in zip(a, b)))
        for name in NUMERICS:
            finals[name].append(runs[(name, "decoded once", seed)]["curve"][-1][1])
    ref = finals["fp32+channels_last"]
    sd = statistics.stdev(ref) if len(ref) > 1 else float("nan")
    for name, vals in finals.items():
        mean = statistics.fmean(vals)
        spread = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        delta = mean - statistics.fmean(ref)
        verdict = (
            "" if vals is ref else f"; Δ {delta:+.4f}, within 2 sd of fp32: {'yes' if abs(delta) <= 2 * sd else 'no'}"
        )
        print(f"  final val MAP@R {name}: {mean:.4f} ± {spread:.4f} (sd over {len(vals)} seeds){verdict}")


if __name__ == "__main__":
    main()
