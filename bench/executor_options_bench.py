"""Benchmark: the ways of running warm single-worker folds on Ray, measured on the same folds ("measure the
options before you choose").

The same ``--trials`` × 4 demo folds (``pipelines/config/demo.yaml``'s data, model and training budget, contrastive
loss, one seed per trial) are trained four ways, one after the other in one run:

1. **bare loop** — ``dml_core.training.loop.train_fold`` in this process, fold after fold: the anchor;
2. **tasks** — what :mod:`pipelines.execution.folds.warm` does: one Ray task per fold with ``max_calls=0`` (Ray keeps
   the worker process for the next task), a trial's four folds submitted together, trials one after another;
3. **actors** — a pool of four long-lived actors (``ray.util.ActorPool``), each holding its process for the whole
   run, a trial's four folds mapped onto the pool;
4. **repeater** — Ray Tune's ``Repeater(searcher, repeat=4, set_index=True)``: one Tune trial per fold
   (``__trial_index__`` = fold), ``reuse_actors=True``, four trials in flight.

Per option it prints wall time, wall / bare loop, Σ ``train_fold`` seconds, per-fold overhead (the fold's wall time
from submission to result minus its ``train_fold`` seconds; median after each process's first fold) and the number
of processes that trained folds.  Only the fold work is timed the same way; the product's MLflow logging, result
directories and CI tables are not part of any option here (see ``bench/overhead_bench.py`` for the whole sweep).

    python bench/executor_options_bench.py [--trials 3] [--cpus 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FOLDS = 4


def _demo():
    import yaml

    return yaml.safe_load((ROOT / "pipelines" / "config" / "demo.yaml").read_text())


def fold_jobs(trials: int) -> list[dict]:
    """The folds to train: ``trials`` seeds × 4 class-disjoint folds of the demo's trainval classes."""
    from dml_core.data import synthetic
    from dml_core.splits import class_disjoint_folds, trainval_test_split

    d = _demo()
    ds = d["datasets"][0]
    table = synthetic(ds["num_classes"], ds["per_class"], ds["image_size"], seed=d["seed"])
    trainval, _ = trainval_test_split(table.labels)
    folds = class_disjoint_folds(trainval, n_folds=FOLDS, layout=d["protocol"]["fold_layout"])
    return [
        {"trial": t, "fold": f.index, "train": list(f.train_classes), "val": list(f.val_classes), "seed": d["seed"] + t}
        for t in range(trials)
        for f in folds
    ]


def train_one(job: dict, table) -> dict:
    """One demo fold with dml_core alone; returns its train seconds and the process id."""
    import torch

    from dml_core.data import ImageDataset, eval_transform, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.training.loop import TrainConfig, train_fold

    torch.set_num_threads(1)
    d = _demo()
    size = d["datasets"][0]["image_size"]
    p = d["protocol"]
    torch.manual_seed(job["seed"])
    model = build_model(**d["model"])
    loss = build_loss("contrastive", num_classes=len(job["train"]), embedding_dim=d["model"]["embedding_dim"])
    cfg = TrainConfig(
        iters_per_epoch=p["iters_per_epoch"],
        max_epochs=p["max_epochs"],
        eval_every=p["eval_every"],
        patience=p["patience"],
        seed=job["seed"],
        **p["train"],
    )
    r = train_fold(
        model,
        loss,
        ImageDataset(table.subset(job["train"]), train_transform(size)),
        ImageDataset(table.subset(job["val"]), eval_transform(size)),
        cfg,
    )
    return {"train_seconds": r.train_seconds, "pid": os.getpid(), "map_at_r": r.best_metrics.get("map_at_r")}


def _table():
    from dml_core.data import synthetic

    d = _demo()
    ds = d["datasets"][0]
    return synthetic(ds["num_classes"], ds["per_class"], ds["image_size"], seed=d["seed"])


def run_bare(jobs: list[dict]) -> list[dict]:
    table, out = _table(), []
    for job in jobs:
        t0 = time.time()
        r = train_one(job, table)
        out.append({**r, "wall": time.time() - t0})
    return out


def _timed(job, table_ref):
    import ray

    return train_one(job, ray.get(table_ref[0]))


def run_tasks(jobs: list[dict]) -> list[dict]:
    import ray

    remote = ray.remote(max_calls=0, num_cpus=1)(lambda job, ref: _timed(job, ref))
    ref, out = [ray.put(_table())], []
    for t in sorted({j["trial"] for j in jobs}):
        batch = [j for j in jobs if j["trial"] == t]
        t0 = time.time()
        refs = [remote.remote(j, ref) for j in batch]
        pending, done_at = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            done_at[ready[0]] = time.time()
        out += [{**ray.get(r), "wall": done_at[r] - t0} for r in refs]
    return out


def run_actors(jobs: list[dict]) -> list[dict]:
    import ray
    from ray.util import ActorPool

    @ray.remote(num_cpus=1)
    class FoldActor:
        def run(self, job, ref):
            t0 = time.time()
            r = _timed(job, ref)
            return {**r, "busy": time.time() - t0}

    ref, out = [ray.put(_table())], []
    pool = ActorPool([FoldActor.remote() for _ in range(FOLDS)])
    for t in sorted({j["trial"] for j in jobs}):
        batch = [j for j in jobs if j["trial"] == t]
        t0 = time.time()
        for r in pool.map_unordered(lambda a, j: a.run.remote(j, ref), batch):
            out.append({**r, "wall": time.time() - t0})
    return out


def run_repeater(jobs: list[dict], storage: str) -> list[dict]:
    import ray
    from ray import tune
    from ray.tune.search import Repeater
    from ray.tune.search.optuna import OptunaSearch

    by_key = {(j["trial"], j["fold"]): j for j in jobs}
    trials = len({j["trial"] for j in jobs})

    def trainable(config, table_ref=None):
        # The searcher's sample is ignored (the same folds as the other options): the group index comes from the
        # trial's position in its repeat group, recorded by the driver below.
        job = by_key[(config["group"], config["__trial_index__"])]
        t0 = time.time()
        r = _timed(job, table_ref)
        tune.report({**r, "busy": time.time() - t0, "t_end": time.time(), "score": r["map_at_r"] or 0.0})

    # One group per trial: "group" is a searched categorical whose values the searcher walks through in order
    # (points_to_evaluate), so group g trains trial g's seed and folds.
    searcher = OptunaSearch(
        space={"group": tune.choice(list(range(trials)))},
        metric="score",
        mode="max",
        points_to_evaluate=[{"group": g} for g in range(trials)],
    )
    t0 = time.time()
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trainable, table_ref=[ray.put(_table())]), {"cpu": 1}),
        tune_config=tune.TuneConfig(
            search_alg=Repeater(searcher, repeat=FOLDS, set_index=True),
            num_samples=trials * FOLDS,
            max_concurrent_trials=FOLDS,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(name="repeater", storage_path=storage, verbose=0),
    )
    grid = tuner.fit()
    rows = sorted((r.metrics for r in grid if r.metrics), key=lambda m: m["t_end"])
    # Tune gives a trial no submission time we can read; a fold's "wall" is the time since the previous fold ended
    # in the same process (so the gap Tune leaves between a reused actor's trials counts as overhead).
    last_end: dict[int, float] = {}
    out = []
    for r in rows:
        end = r["t_end"] - t0
        out.append(
            {
                "train_seconds": r["train_seconds"],
                "pid": r["pid"],
                "map_at_r": r["map_at_r"],
                "wall": end - last_end.get(r["pid"], 0.0),
            }
        )
        last_end[r["pid"]] = end
    return out


def summarise(name: str, rows: list[dict], wall: float, bare_wall: float | None) -> str:
    train = sum(r["train_seconds"] for r in rows)
    pids: dict[int, int] = {}
    after_first = []
    for r in rows:
        pids[r["pid"]] = pids.get(r["pid"], 0) + 1
        if pids[r["pid"]] > 1:
            after_first.append(r["wall"] - r["train_seconds"])
    over = statistics.median(after_first) if after_first else float("nan")
    ratio = f"{wall / bare_wall:.2f}" if bare_wall else "1"
    return f"| {name} | {len(rows)} | {wall:.1f} | {ratio} | {train:.1f} | {over:.2f} | {len(pids)} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray (4 folds in flight)")
    ap.add_argument("--options", default="bare,tasks,actors,repeater")
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    import ray
    import torch

    torch.set_num_threads(1)
    jobs = fold_jobs(args.trials)
    options = args.options.split(",")
    lines = [
        "| option | folds | wall s | wall / bare | Σ train_fold s | overhead / fold after a process's first, "
        "median s | processes |",
        "|---|---|---|---|---|---|---|",
    ]
    bare_wall = None
    with tempfile.TemporaryDirectory() as tmp:
        if "bare" in options:
            t0 = time.time()
            rows = run_bare(jobs)
            bare_wall = time.time() - t0
            lines.append(summarise("bare loop (this process)", rows, bare_wall, None))
        ray.init(
            num_cpus=args.cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
        )
        try:
            for name, fn in (
                ("tasks", run_tasks),
                ("actors", run_actors),
                ("repeater", lambda j: run_repeater(j, tmp)),
            ):
                if name not in options:
                    continue
                t0 = time.time()
                rows = fn(jobs)
                lines.append(
                    summarise(
                        {
                            "tasks": "Ray tasks, max_calls=0 (chosen)",
                            "actors": "ActorPool of 4 actors",
                            "repeater": "Tune Repeater, reuse_actors",
                        }[name],
                        rows,
                        time.time() - t0,
                        bare_wall,
                    )
                )
                print(lines[-1], flush=True)
        finally:
            ray.shutdown()
    print(
        f"\n{len(jobs)} demo folds ({args.trials} trials × {FOLDS}), {os.cpu_count()} cores, "
        f"Ray with {args.cpus} logical CPUs; wall times include each option's own start-up (process starts, "
        "imports) but not Ray's.\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
