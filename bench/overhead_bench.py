"""Benchmark: what the orchestration costs on top of the training itself, for both fold executors.

One run, the same folds three ways:

1. **warm** — the demo preset (``pipelines/demo.yaml``; ``--losses`` to cut it down) as a real sweep with
   single-worker folds on reused Ray worker processes (``resources.fold_executor: warm``);
2. **bare loop** — the anchor: every fold that sweep ran (same hyperparameters, same seeds, same data), trained again
   one after another in this process with ``dml_core`` alone (no Ray, no MLflow), test embeddings included for
   reproductions — what a researcher's own for-loop would do;
3. **train** — the same preset with Ray Train DDP folds (``workers_per_fold: --train-workers``, one loss by default:
   it is slow), for the per-fold overhead of a worker-group launch.

Per executor it prints the sweep's wall time, the per-fold overhead (fold wall time from submission to result −
``train_fold``'s own seconds; median after the first fold of each study), and the peak resident memory of each
kind of Ray process (sampled every 0.5 s from /proc: fold workers, trial drivers, Train controllers).  The
fold marks come from the fold runs' MLflow metrics (``time.fit_start`` … ``time.fit_end``, see
``pipelines/trial.py``).

    python bench/overhead_bench.py                        # demo preset: warm + bare loop + train (1 loss)
    python bench/overhead_bench.py --skip-train --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class RssSampler:
    """Peak RSS per Ray process, grouped by the process title Ray gives it (``ray::<task or actor>``)."""

    def __init__(self, period: float = 0.5):
        self.period, self.peak, self.kind = period, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if not cmd.startswith("ray::"):
                        continue
                    rss = next(int(line.split()[1]) for line in (proc / "status").read_text().splitlines()
                               if line.startswith("VmRSS:")) / 1024
                except (OSError, StopIteration, ValueError):
                    continue
                pid = int(proc.name)
                # the title changes with the task it runs; a reused worker keeps the kind of its fold task
                kind = cmd.split()[0][len("ray::"):].split(".")[0].split("(")[0] or "?"
                if kind != "IDLE" or pid not in self.kind:
                    self.kind[pid] = kind
                self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
            self._stop.wait(self.period)

    def by_kind(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for pid, rss in self.peak.items():
            out.setdefault(self.kind.get(pid, "?"), []).append(rss)
        return out


def _sweep(doc: dict, storage: Path, name: str):
    from pipelines.config import parse_config
    from pipelines.sweep import run_sweep

    doc = copy.deepcopy(doc)
    doc["name"], doc["storage"] = name, str(storage)
    cfg = parse_config(doc)
    with RssSampler() as rss:
        t0 = time.time()
        outcome = run_sweep(cfg)
        wall = time.time() - t0
    return cfg, outcome, wall, rss.by_kind()


def _fold_runs(outcome) -> list:
    from mlflow.tracking import MlflowClient

    from pipelines.tracking import search_all

    c = MlflowClient(outcome.tracking_uri)
    return search_all(c, outcome.experiment_id, "")


def _overheads(runs) -> tuple[list[float], list[float], list[float]]:
    """(overhead of every fold, overhead after the first fold of each study, in-worker train seconds)."""
    folds = sorted((r for r in runs if r.data.tags.get("stage") == "fold"),
                   key=lambda r: r.data.metrics["time.fit_start"])
    first_seen: set[str] = set()
    every, warm, train = [], [], []
    for r in folds:
        m = r.data.metrics
        o = (m["time.fit_end"] - m["time.fit_start"]) - m["train_seconds"]
        every.append(o)
        train.append(m["train_seconds"])
        study = r.data.tags["study"]
        key = f"{study}/{r.data.tags['fold']}"
        if key in first_seen:
            warm.append(o)
        first_seen.add(key)
    return every, warm, train


def _bare_loop(cfg, runs) -> tuple[float, int]:
    """Every fold of ``runs`` again, sequentially, in this process: dml_core only."""
    import torch

    from dml_core.data import ImageDataset, eval_transform, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.train import TrainConfig, embed, train_fold
    from pipelines.preflight import preflight
    from pipelines.sweep import _Sweep
    from pipelines.trial import _fold_config

    plans = {p.key: p for p in preflight(cfg)}
    by_id = {r.info.run_id: r for r in runs}
    folds = [r for r in runs if r.data.tags.get("stage") == "fold"]
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    t0 = time.time()
    for r in sorted(folds, key=lambda r: r.data.metrics["time.fit_start"]):
        parent = by_id[r.data.tags["mlflow.parentRunId"]]
        plan = plans[r.data.tags["study"]]
        ctx = _Sweep(cfg, [plan], tracker=SimpleNamespace(uri="", experiment_id=""))._context(plan, "", None)
        hparams = {k: _num(v) for k, v in parent.data.params.items()}
        fold = plan.dataset.manifest.folds[int(r.data.tags["fold"])]
        fc = _fold_config(ctx, fold, hparams, int(parent.data.tags["seed"]), "", "reproduction" in parent.data.tags,
                          plan.dataset.manifest, "")
        table = plan.dataset.table
        torch.manual_seed(fc["train"]["seed"])
        model = build_model(**fc["model"])
        loss = build_loss(fc["loss"], num_classes=len(fold.train_classes), embedding_dim=fc["model"]["embedding_dim"],
                          **fc["loss_params"])
        res = train_fold(model, loss, ImageDataset(table.subset(list(fold.train_classes)), train_transform(ctx.image_size)),
                         ImageDataset(table.subset(list(fold.val_classes)), eval_transform(ctx.image_size)),
                         TrainConfig(**fc["train"]))
        if fc["evaluate_test"] and res.status == "ok":
            model.load_state_dict(res.best_state["model"])
            embed(model, ImageDataset(table.subset(list(plan.dataset.manifest.test_classes)),
                                      eval_transform(ctx.image_size)), batch_size=fc["train"].get("eval_batch_size", 128))
    return time.time() - t0, len(folds)


def _num(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            continue
    return v


def _stats(xs: list[float]) -> str:
    if not xs:
        return "–"
    return f"median {statistics.median(xs):6.2f}  mean {statistics.fmean(xs):6.2f}  max {max(xs):6.2f}"


def _report(label: str, wall: float, runs, rss: dict[str, list[float]]) -> dict:
    every, warm, train = _overheads(runs)
    print(f"\n{label}: sweep wall {wall:.1f} s, {len(every)} folds, Σ train_fold {sum(train):.1f} s")
    print(f"  per-fold overhead (fold wall − train_fold), every fold      {_stats(every)} s")
    print(f"  per-fold overhead after the first fold of each study/fold  {_stats(warm)} s")
    print("  peak RSS per process (MB), by Ray process kind:")
    for kind, xs in sorted(rss.items()):
        print(f"    {kind:28s} n={len(xs):3d}  max {max(xs):7.0f}  median {statistics.median(xs):7.0f}")
    return {"wall_s": wall, "folds": len(every), "train_sum_s": sum(train),
            "overhead_median_s": statistics.median(every) if every else None,
            "overhead_after_first_median_s": statistics.median(warm) if warm else None,
            "rss_mb": {k: {"n": len(v), "max": max(v), "median": statistics.median(v)} for k, v in rss.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", type=int, default=None, help="use the demo's first N losses (default: all)")
    ap.add_argument("--train-workers", type=int, default=2, help="DDP workers per fold on the Ray Train path")
    ap.add_argument("--train-losses", type=int, default=1, help="losses on the Ray Train path (default 1: slow)")
    ap.add_argument("--skip-train", action="store_true", help="skip the Ray Train path")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args()

    from pipelines.presets import DEMO

    doc = copy.deepcopy(DEMO)
    if args.losses:
        doc["losses"] = doc["losses"][:args.losses]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg, outcome, wall, rss = _sweep(dict(doc, resources=dict(doc["resources"], fold_executor="warm")),
                                         Path(tmp), "warm")
        runs = _fold_runs(outcome)
        out["warm"] = _report("warm single-worker folds (Ray tasks on reused processes)", wall, runs, rss)
        bare, n = _bare_loop(cfg, runs)
        print(f"\nbare sequential loop (no Ray, no MLflow), the same {n} folds: {bare:.1f} s")
        print(f"  warm sweep wall / bare loop = {wall / bare:.2f}")
        out["bare_loop_s"], out["warm_over_bare"] = bare, wall / bare
        if not args.skip_train:
            tdoc = dict(doc, losses=doc["losses"][:args.train_losses],
                        resources=dict(doc["resources"], fold_executor="train", workers_per_fold=args.train_workers))
            _, toutcome, twall, trss = _sweep(tdoc, Path(tmp), "train")
            out["train"] = _report(f"Ray Train DDP folds ({args.train_workers} workers per fold, "
                                   f"{args.train_losses} loss)", twall, _fold_runs(toutcome), trss)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
