"""Convergence of the zoo's folds under candidate recipes: validation MAP@R against iterations, and where a stopping
rule (evaluation interval, patience) would end each curve.

    .venv/bin/python bench/convergence_bench.py --out conv                       # defaults below, Omniglot fold 0
    .venv/bin/python bench/convergence_bench.py --losses contrastive --recipes zoo adam-1e-3 --iters 3000 --seeds 2
    .venv/bin/python bench/convergence_bench.py --summarise conv/curves.jsonl    # the tables again, no training

One run = one loss × one recipe × one seed: fold 0 of the mlrc 4-fold layout on Omniglot (91 train / 30 validation
classes; ``../shared/data/omniglot`` or ``--omniglot``), the zoo preset's network (``configs/omniglot-zoo.yaml``:
tiny CNN from scratch, embedding 64, batches of 8 classes × 4), the loss at its paper defaults and fixed values
(``tune_spaces/<loss>.yaml``, ``loss_lr`` included), trained ``--iters`` iterations with the validation MAP@R every
100 (``train_fold``, no early stopping).  Runs go to separate processes, ``--jobs`` at a time.

Losses by default: one of each family — ``contrastive`` (pair), ``proxy_anchor`` (proxy), ``normalized_softmax``
(classification).  Recipes (``RECIPES``): the published zoo's (RMSprop 1e-4 without momentum, constant), a larger
RMSprop rate, Adam, and Adam with a linear warm-up and cosine decay over the run (``TrainConfig.lr_warmup_iters``,
``lr_schedule``); ``zoo-64px`` is the zoo's recipe at 64-px crops.

Output: ``<out>/curves.jsonl`` (one line per run, written as each finishes) and ``<out>/summary.md``: MAP@R at
100 · 2^k iterations, the best and where it was first reached within 0.01, and for each stopping rule (evaluate
every E × 100 iterations, stop after P evaluations without improvement) the iteration where it stops and how far
below the curve's best its chosen MAP@R is.  Validation on 30 classes moves by about ±0.03 between evaluations, so a
rule that stops at the first dip stops on noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Candidate recipes: TrainConfig fields (plus ``image_size``) on top of the zoo preset's.
RECIPES = {
    "zoo": {"optimizer": "rmsprop", "trunk_lr": 1e-4, "embedder_lr": 1e-4, "momentum": 0.0},
    "rmsprop-3e-4": {"optimizer": "rmsprop", "trunk_lr": 3e-4, "embedder_lr": 3e-4, "momentum": 0.0},
    "adam-1e-3": {"optimizer": "adam", "trunk_lr": 1e-3, "embedder_lr": 1e-3},
    "adam-1e-3-cosine": {
        "optimizer": "adam",
        "trunk_lr": 1e-3,
        "embedder_lr": 1e-3,
        "lr_warmup_iters": 100,
        "lr_schedule": "cosine",
    },
    "zoo-64px": {"optimizer": "rmsprop", "trunk_lr": 1e-4, "embedder_lr": 1e-4, "momentum": 0.0, "image_size": 64},
}
LOSSES = ("contrastive", "proxy_anchor", "normalized_softmax")
#: (evaluate every E epochs of 100 iterations, patience P evaluations) rules scored on every curve.
RULES = ((1, 1), (1, 3), (1, 5), (2, 3), (2, 4), (2, 6), (4, 3), (5, 4))
EVAL_ITERS = 100


def paper_defaults(loss: str) -> dict:
    """The loss's paper defaults with its space's fixed values (``tune_spaces/<loss>.yaml``, as a sweep reads it)."""
    from pipelines.config.spaces import load_space

    return load_space(loss).defaults()


def run_one(job: dict) -> dict:
    """Train one fold and return its validation curve."""
    import torch

    from dml_core.data import ImageDataset, eval_transform, read_omniglot, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.splits import FoldManifest
    from dml_core.training.loop import TrainConfig, train_fold

    torch.set_num_threads(1)
    recipe = dict(RECIPES[job["recipe"]])
    size = recipe.pop("image_size", 32)
    table = read_omniglot(job["omniglot"])
    fold = FoldManifest.from_labels(table.labels, 4, "mlrc").folds[0]
    train = ImageDataset(table.subset(fold.train_classes), train_transform(size))
    val = ImageDataset(table.subset(fold.val_classes), eval_transform(size))
    params = paper_defaults(job["loss"])
    loss_lr = params.pop("loss_lr", 1e-4)
    torch.manual_seed(job["seed"])
    model = build_model(trunk="tiny", embedding_dim=64, freeze_bn=False)
    loss = build_loss(job["loss"], num_classes=len(fold.train_classes), embedding_dim=64, **params)
    cfg = TrainConfig(
        classes_per_batch=8,
        m=4,
        iters_per_epoch=EVAL_ITERS,
        max_epochs=job["iters"] // EVAL_ITERS,
        eval_every=1,
        patience=None,
        loss_lr=loss_lr,
        eval_batch_size=256,
        seed=job["seed"],
        device=job["device"],
        num_workers=job["workers"],
        amp=job["device"] != "cpu",
        # the zoo preset's CPU precision (bf16 autocast + channels-last) where asked: fast only where the CPU has
        # bf16 instructions (avx512_bf16 / amx_bf16), see bench/README_cpu_speed.md
        cpu_amp=job["device"] == "cpu" and job.get("cpu_amp", False),
        channels_last=job["device"] == "cpu" and job.get("cpu_amp", False),
        **recipe,
    )
    t0 = time.perf_counter()
    res = train_fold(model, loss, train, val, cfg)
    curve = [(r["iteration"], r["metrics"].get("map_at_r")) for r in res.history]
    return {**job, "status": res.status, "curve": curve, "seconds": round(time.perf_counter() - t0, 1)}


def stop_point(curve: list[tuple[int, float]], every: int, patience: int) -> tuple[int, float, bool]:
    """Where ``train_fold``'s rule stops on this curve when evaluating every ``every`` epochs: the iteration of the
    stop, the validation MAP@R of the best evaluation it kept, and whether the rule stopped (False: the run's end
    came first, i.e. the fold would have hit its cap).  Evaluations are the curve's points at multiples of
    ``every`` epochs (epoch 0 included); it stops when epoch − best epoch > patience × every."""
    points = [(it, m) for it, m in curve if (it // EVAL_ITERS) % every == 0 and m is not None]
    best_epoch, best = 0, float("-inf")
    for it, m in points:
        epoch = it // EVAL_ITERS
        if m > best:
            best_epoch, best = epoch, m
        if epoch - best_epoch > patience * every:
            return it, best, True
    return points[-1][0], best, False


def smoothed(curve: list[tuple[int, float]], window: int = 5) -> list[tuple[int, float]]:
    """The curve's trailing mean over ``window`` evaluations (from the ``window``-th on): validation on 30 classes
    moves by about ±0.03 between evaluations, so a single evaluation's best is biased upwards by the noise."""
    vals = [(it, m) for it, m in curve if m is not None]
    return [
        (vals[i][0], statistics.fmean(m for _, m in vals[i - window + 1 : i + 1])) for i in range(window - 1, len(vals))
    ]


def summarise(runs: list[dict]) -> str:
    ok = [r for r in runs if r.get("status") == "ok" and r.get("curve")]
    if not ok:
        return "no finished runs"
    top = max(it for r in ok for it, _ in r["curve"])
    marks = [m for m in (100 * 2**k for k in range(12)) if m <= top]
    lines = ["## Validation MAP@R against iterations (mean over seeds)", ""]
    lines.append(
        "| loss | recipe | seeds | " + " | ".join(str(m) for m in marks) + " | best | first within 0.01 | "
        "smoothed best | smoothed: first within 0.01 |"
    )
    lines.append("|---|---|---|" + "---|" * (len(marks) + 4))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in ok:
        groups.setdefault((r["loss"], r["recipe"]), []).append(r)
    for (loss, recipe), rs in sorted(groups.items()):
        cells = []
        for m in marks:
            vals = [dict(r["curve"]).get(m) for r in rs]
            vals = [v for v in vals if v is not None]
            cells.append(f"{statistics.fmean(vals):.3f}" if vals else "")
        bests = [max(v for _, v in r["curve"]) for r in rs]
        reach = [next(it for it, v in r["curve"] if v >= max(x for _, x in r["curve"]) - 0.01) for r in rs]
        smooth = [smoothed(r["curve"]) for r in rs]
        s_best = [max(v for _, v in c) for c in smooth]
        s_reach = [next(it for it, v in c if v >= b - 0.01) for c, b in zip(smooth, s_best)]
        lines.append(
            f"| {loss} | {recipe} | {len(rs)} | " + " | ".join(cells) + f" | {statistics.fmean(bests):.3f} | "
            f"{statistics.fmean(reach):.0f} | {statistics.fmean(s_best):.3f} | {statistics.fmean(s_reach):.0f} |"
        )
    lines += ["", "## Stopping rules: where each stops, and its kept MAP@R below the curve's best (mean over runs)", ""]
    lines.append("| loss | recipe | " + " | ".join(f"every {e}, patience {p}" for e, p in RULES) + " |")
    lines.append("|---|---|" + "---|" * len(RULES))
    for (loss, recipe), rs in sorted(groups.items()):
        cells = []
        for e, p in RULES:
            stops = [stop_point(r["curve"], e, p) for r in rs]
            gaps = [max(v for _, v in r["curve"]) - kept for r, (_, kept, _) in zip(rs, stops)]
            capped = sum(not stopped for _, _, stopped in stops)
            cells.append(
                f"{statistics.fmean(it for it, _, _ in stops):.0f} it, −{statistics.fmean(gaps):.3f}"
                + (f" ({capped} at cap)" if capped else "")
            )
        lines.append(f"| {loss} | {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("convergence"))
    ap.add_argument("--losses", nargs="+", default=list(LOSSES))
    ap.add_argument(
        "--recipes",
        nargs="+",
        choices=sorted(RECIPES),
        default=["zoo", "rmsprop-3e-4", "adam-1e-3", "adam-1e-3-cosine"],
    )
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2400, help="iterations per run (a multiple of 100)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per run")
    ap.add_argument("--device", default="auto", help="auto = cuda where torch sees a GPU, else cpu")
    ap.add_argument(
        "--cpu-amp", action="store_true", help="on a CPU: bf16 autocast + channels-last, as configs/omniglot-zoo.yaml"
    )
    ap.add_argument("--omniglot", type=Path, default=ROOT.parent / "shared" / "data" / "omniglot")
    ap.add_argument("--deadline", type=float, default=None, help="seconds after which no further run starts")
    ap.add_argument("--summarise", type=Path, default=None, help="print the tables of a curves.jsonl and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_one(json.loads(a.child))), flush=True)
        return 0
    if a.summarise:
        print(summarise([json.loads(line) for line in a.summarise.read_text().splitlines() if line.strip()]))
        return 0
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not a.omniglot.is_dir():
        print(f"convergence_bench: no Omniglot at {a.omniglot} (--omniglot)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    curves = a.out / "curves.jsonl"
    jobs = [
        {
            "loss": loss,
            "recipe": r,
            "seed": s,
            "iters": a.iters,
            "device": a.device,
            "workers": a.workers,
            "cpu_amp": a.cpu_amp,
            "omniglot": str(a.omniglot.resolve()),
        }
        for s in range(a.seeds)
        for r in a.recipes
        for loss in a.losses
    ]
    print(f"{len(jobs)} runs, {a.jobs} at a time, {a.iters} iterations each, on {a.device}", flush=True)
    t0 = time.time()
    running: list[tuple[subprocess.Popen, dict]] = []
    runs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while jobs or running:
        while jobs and len(running) < a.jobs and (a.deadline is None or time.time() - t0 < a.deadline):
            job = jobs.pop(0)
            cmd = [sys.executable, __file__, "--child", json.dumps(job)]
            running.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT), job))
        if a.deadline is not None and time.time() - t0 >= a.deadline and jobs:
            print(f"deadline: {len(jobs)} runs not started", flush=True)
            jobs.clear()
        time.sleep(0.5)
        for proc, job in list(running):
            if proc.poll() is None:
                continue
            running.remove((proc, job))
            out = proc.stdout.read().strip().splitlines()
            try:
                res = json.loads(out[-1])
            except (IndexError, ValueError):
                res = {**job, "status": f"exit {proc.returncode}"}
            runs.append(res)
            with open(curves, "a") as f:
                f.write(json.dumps(res) + "\n")
            last = res.get("curve") or [(0, None)]
            print(
                f"{res['loss']} / {res['recipe']} / seed {res['seed']}: {res['status']}, final MAP@R {last[-1][1]}, "
                f"{res.get('seconds')} s",
                flush=True,
            )
    text = summarise(runs)
    (a.out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
