"""Benchmark: orchestration overhead of a sweep (Ray Tune trial → 4 Ray Train DDP folds → MLflow).

Runs one small real sweep in this process (``pipelines.sweep.run_sweep``: synthetic data, a tiny CNN, one loss,
``--trials`` BO trials + 2 reproductions, 4 folds × ``--workers`` gloo workers, one trial at a time), then reads
the wall-clock marks every fold run carries in MLflow:

    time.fit_start    the trial driver calls TorchTrainer.fit()
    time.start        the worker function starts (controller, placement group, worker actors, torch.distributed up)
    time.train_start  dml_core.train.train_fold starts (dataset table from the object store, transforms, model, loss,
                      MLflow client built)
    time.end          train_fold returned (its own train_seconds ≈ time.end − time.train_start)
    time.fit_end      fit() returned (test embedding for reproductions, checkpoint written, report, teardown)

and prints, per fold, the phases above and the overhead = fit wall time − in-worker training time (seconds and
percent of the fold's wall time); per trial, the driver's own time outside its folds; and for the sweep, its wall
time against the summed in-worker training time.

    python bench/overhead_bench.py                       # 2 trials, 2 workers per fold, 8 iterations per epoch
    python bench/overhead_bench.py --iters 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _config(storage: Path, trials: int, workers: int, iters: int, epochs: int) -> dict:
    return {
        "name": "overhead",
        "seed": 0,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 12, "image_size": 16}],
        "losses": ["contrastive"],
        "model": {"trunk": "tiny", "embedding_dim": 32, "freeze_bn": False},
        "protocol": {"trials": trials, "startup_trials": 1, "reproductions": 2, "iters_per_epoch": iters,
                     "eval_every": 1, "patience": epochs, "max_epochs": epochs,
                     "train": {"classes_per_batch": 8, "m": 4, "trunk_lr": 1e-3, "embedder_lr": 1e-3,
                               "eval_batch_size": 64}},
        "resources": {"workers_per_fold": workers, "max_concurrent_trials": 1},
        "storage": str(storage),
    }


def _stats(xs: list[float]) -> str:
    return f"mean {statistics.fmean(xs):6.1f}  median {statistics.median(xs):6.1f}  max {max(xs):6.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="DDP workers per fold")
    ap.add_argument("--iters", type=int, default=8, help="iterations per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient

    from pipelines.config import parse_config
    from pipelines.sweep import run_sweep
    from pipelines.tracking import search_all

    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(_config(Path(tmp), args.trials, args.workers, args.iters, args.epochs))
        t0 = time.time()
        outcome = run_sweep(cfg)
        wall = time.time() - t0
        c = MlflowClient(outcome.tracking_uri)
        runs = search_all(c, outcome.experiment_id, "")

    folds = [r.data.metrics for r in runs if r.data.tags.get("stage") == "fold"]
    parents = [r for r in runs if r.data.tags.get("stage") in ("trial", "reproduction")]
    phase = {
        "launch (fit() → worker fn)": [m["time.start"] - m["time.fit_start"] for m in folds],
        "setup (worker fn → train_fold)": [m["time.train_start"] - m["time.start"] for m in folds],
        "train_fold (in-worker training)": [m["train_seconds"] for m in folds],
        "finish (train_fold → fit() returns)": [m["time.fit_end"] - m["time.end"] for m in folds],
    }
    fit_wall = [m["time.fit_end"] - m["time.fit_start"] for m in folds]
    overhead = [w - m["train_seconds"] for w, m in zip(fit_wall, folds)]
    percent = [100 * o / w for o, w in zip(overhead, fit_wall)]
    trial_walls, driver_extra = [], []
    by_parent: dict[str, list] = {}
    for r in runs:
        if r.data.tags.get("stage") == "fold":
            by_parent.setdefault(r.data.tags["mlflow.parentRunId"], []).append(r.data.metrics)
    for p in parents:
        tw = (p.info.end_time - p.info.start_time) / 1000
        fs = by_parent[p.info.run_id]
        span = max(m["time.fit_end"] for m in fs) - min(m["time.fit_start"] for m in fs)
        trial_walls.append(tw)
        driver_extra.append(tw - span)
    train_sum = sum(m["train_seconds"] for m in folds)

    print(f"\nsweep: {len(parents)} trials ({args.trials} BO + 2 reproductions) × 4 folds × {args.workers} workers, "
          f"{args.iters} iterations/epoch × {args.epochs} epochs, one trial at a time")
    print(f"  sweep wall time                    {wall:8.1f} s")
    print(f"  Σ in-worker training (train_fold)  {train_sum:8.1f} s over {len(folds)} folds "
          f"(the 4 folds of a trial run concurrently, so ideal wall ≈ Σ/4 = {train_sum / 4:.1f} s)")
    print(f"  Σ trial wall times                 {sum(trial_walls):8.1f} s; outside trials (preflight, Ray and MLflow "
          f"start, Tune, CIs, artifacts): {wall - sum(trial_walls):.1f} s")
    print("\nper fold (seconds):")
    for name, xs in phase.items():
        print(f"  {name:38s} {_stats(xs)}")
    print(f"  {'fit() wall time':38s} {_stats(fit_wall)}")
    print(f"  {'overhead = fit wall − train_fold':38s} {_stats(overhead)}")
    print(f"  {'overhead, % of fit wall':38s} {_stats(percent)}")
    print(f"per trial: driver time outside its folds (MLflow runs, aggregation, test metrics): {_stats(driver_extra)} s")
    result = {
        "wall_s": wall, "train_sum_s": train_sum, "folds": len(folds), "trials": len(parents),
        "workers_per_fold": args.workers, "iters_per_epoch": args.iters, "epochs": args.epochs,
        "phases_s": {k: statistics.fmean(v) for k, v in phase.items()},
        "fold_overhead_s_mean": statistics.fmean(overhead), "fold_overhead_pct_mean": statistics.fmean(percent),
        "trial_driver_extra_s_mean": statistics.fmean(driver_extra), "outside_trials_s": wall - sum(trial_walls),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
