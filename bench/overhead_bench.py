"""Benchmark: what the orchestration costs on top of the training itself, for both fold executors.

One run, the same folds three ways:

1. **warm** — the demo preset (``pipelines/config/demo.yaml``; ``--losses`` to cut it down) as a real sweep with
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
``pipelines/execution/folds/trial.py``).

    python bench/overhead_bench.py                        # demo preset: warm + bare loop + train (1 loss)
    python bench/overhead_bench.py --skip-train --json out.json
    python bench/overhead_bench.py --imports              # only: what a fold process's imports cost (RSS)

``--imports`` runs, in a fresh interpreter, what a warm fold process does for the demo's tiny model — import
torch, Ray, ``dml_core``, the fold code and the MLflow client, build the tiny model and the protocol transforms,
train and evaluate a few iterations — and prints the resident memory after each step (``/proc/self/status``
VmRSS, and the peak VmHWM), the modules that decide it (``torchvision``, ``torch._dynamo``, ``mlflow``), and the
split of the final RSS into shared library pages and private memory (``/proc/self/smaps_rollup``).
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
        self.peak_anon: dict[int, float] = {}  # RssAnon: the process's own memory, without mapped library files
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _ours() -> set[int]:
        """This process's descendants (the Ray it started), not other programs' Ray processes on the machine."""
        import os

        parent: dict[int, int] = {}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        ours, me = set(), os.getpid()
        for pid in parent:
            p, seen = pid, 0
            while p in parent and p != me and seen < 64:
                p, seen = parent[p], seen + 1
            if p == me:
                ours.add(pid)
        return ours

    def _run(self) -> None:
        while not self._stop.is_set():
            ours = self._ours()
            for proc in Path("/proc").glob("[0-9]*"):
                if int(proc.name) not in ours:
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if not cmd.startswith("ray::"):
                        continue
                    status = {
                        line.split(":")[0]: line.split()[1]
                        for line in (proc / "status").read_text().splitlines()
                        if line.startswith(("VmRSS:", "RssAnon:"))
                    }
                    rss, anon = int(status["VmRSS"]) / 1024, int(status["RssAnon"]) / 1024
                except (OSError, KeyError, IndexError, ValueError):
                    continue
                pid = int(proc.name)
                # the title changes with the task it runs; a reused worker keeps the kind of its fold task
                kind = cmd.split()[0][len("ray::") :].split(".")[0].split("(")[0].split(":")[0] or "?"
                if kind != "IDLE" or pid not in self.kind:
                    self.kind[pid] = kind
                self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
                self.peak_anon[pid] = max(self.peak_anon.get(pid, 0.0), anon)
            self._stop.wait(self.period)

    def by_kind(self) -> dict[str, list[tuple[float, float]]]:
        """{kind: [(peak VmRSS, peak RssAnon) per process]} in MB."""
        out: dict[str, list[tuple[float, float]]] = {}
        for pid, rss in self.peak.items():
            out.setdefault(self.kind.get(pid, "?"), []).append((rss, self.peak_anon.get(pid, 0.0)))
        return out


_IMPORT_STEPS = r"""
import json, sys, time

def mem():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out

def flags():
    has = lambda p: any(m == p or m.startswith(p + ".") for m in sys.modules)
    return {"torchvision": has("torchvision"), "torch._dynamo": has("torch._dynamo"), "mlflow": has("mlflow")}

def tiny_fold():
    import torch
    from dml_core.data import ImageDataset, eval_transform, synthetic, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.training.loop import TrainConfig, train_fold
    torch.set_num_threads(1)
    table = synthetic(num_classes=16, per_class=20, image_size=16, seed=0)  # the demo's image size
    model = build_model(trunk="tiny", embedding_dim=128)
    loss = build_loss("contrastive", num_classes=8, embedding_dim=128)
    train = ImageDataset(table.subset(list(range(8))), train_transform(16))
    val = ImageDataset(table.subset(list(range(8, 16))), eval_transform(16))
    return train_fold(model, loss, train, val, TrainConfig(iters_per_epoch=8, max_epochs=2, eval_every=1)).status

def build():
    from dml_core.data import eval_transform, synthetic, train_transform
    from dml_core.models import build_model
    img = __import__("dml_core.data").data.decode_image(synthetic(2, 1, 16, 0).images[0])
    build_model(trunk="tiny", embedding_dim=128)(train_transform(16)(img)[None])
    eval_transform(16)(img)

steps = [
    ("python", lambda: None),
    ("import torch", lambda: __import__("torch")),
    ("import ray", lambda: __import__("ray")),
    ("dml_core data, models, training", lambda: __import__("dml_core.training.loop") and __import__("dml_core.models")),
    ("dml_core.evaluation.metrics (faiss)", lambda: __import__("dml_core.evaluation.metrics")),
    ("dml_core.losses (pytorch-metric-learning, scipy)", lambda: __import__("dml_core.losses")),
    ("pipelines.execution.folds.fold, .folds.warm", lambda: __import__("pipelines.execution.folds.warm")),
    ("pipelines.tracking.runs (MLflow client)", lambda: __import__("pipelines.tracking.runs")),
    ("tiny model + transforms, applied", build),
    ("tiny fold trained (torch.optim)", tiny_fold),
    ("+ torchvision.transforms.v2 (the old transforms)", lambda: __import__("torchvision.transforms.v2")),
]
rows = []
for name, fn in steps:
    t0 = time.time()
    fn()
    rows.append({"step": name, "seconds": time.time() - t0, **mem(), **flags()})
smaps = {}
for line in open("/proc/self/smaps_rollup"):
    parts = line.split()
    if len(parts) == 3 and parts[2] == "kB":
        smaps[parts[0].rstrip(":")] = int(parts[1]) / 1024
print(json.dumps({"rows": rows, "smaps": smaps}))
"""


def _import_breakdown() -> dict:
    """Resident memory of a fresh interpreter, step by step through what a tiny-model warm fold process does."""
    import os
    import subprocess

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_STEPS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"import breakdown failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\nfresh interpreter, step by step (MB; VmRSS after the step, its increase, peak VmHWM so far):")
    prev = 0.0
    for r in out["rows"]:
        loaded = ", ".join(k for k in ("torchvision", "torch._dynamo", "mlflow") if r[k]) or "–"
        print(
            f"  {r['step']:50s} {r['VmRSS']:7.0f} {r['VmRSS'] - prev:+7.0f}  peak {r['VmHWM']:7.0f}"
            f"  {r['seconds']:5.1f} s  loaded: {loaded}"
        )
        prev = r["VmRSS"]
    sm = out["smaps"]
    print(
        f"  at the end: Rss {sm.get('Rss', 0):.0f} = shared/clean file pages "
        f"{sm.get('Shared_Clean', 0) + sm.get('Private_Clean', 0):.0f}"
        f" + private dirty {sm.get('Private_Dirty', 0):.0f} (+ shared dirty {sm.get('Shared_Dirty', 0):.0f});"
        f" anonymous {sm.get('Anonymous', 0):.0f}"
    )
    return out


def _sweep(doc: dict, storage: Path, name: str):
    from pipelines.config.schema import parse_config
    from pipelines.execution.sweep import run_sweep

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

    from pipelines.tracking.runs import search_all

    c = MlflowClient(outcome.tracking_uri)
    return search_all(c, outcome.experiment_id, "")


def _overheads(runs) -> tuple[list[float], list[float], list[float]]:
    """(overhead of every fold, overhead after the first fold of each study, in-worker train seconds)."""
    # a fold killed before it finished (e.g. by Ray's memory monitor on a crowded machine) has no time marks
    folds = sorted(
        (r for r in runs if r.data.tags.get("stage") == "fold" and "time.fit_start" in r.data.metrics),
        key=lambda r: r.data.metrics["time.fit_start"],
    )
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


def _fold_process_peaks(runs) -> list[float]:
    """Each fold process's peak RSS as it measured it (``process.rss_peak_mb`` of its fold runs), one per pid."""
    peaks: dict[str, float] = {}
    for r in runs:
        m, tags = r.data.metrics, r.data.tags
        if tags.get("stage") == "fold" and "process.rss_peak_mb" in m:
            key = f"{tags.get('node_id', '')}/{tags.get('pid', r.info.run_id)}"
            peaks[key] = max(peaks.get(key, 0.0), m["process.rss_peak_mb"])
    return list(peaks.values())


def _bare_loop(cfg, runs) -> tuple[float, int]:
    """Every fold of ``runs`` again, sequentially, in this process: dml_core only."""
    import torch

    from dml_core.data import ImageDataset, eval_transform, train_transform
    from dml_core.losses import build_loss
    from dml_core.models import build_model
    from dml_core.training.loop import embed, train_fold
    from pipelines.execution.folds.trial import _fold_config
    from pipelines.execution.preflight.study_plans import preflight
    from pipelines.execution.studies.sweep_studies import SweepStudies

    plans = {p.key: p for p in preflight(cfg)}
    by_id = {r.info.run_id: r for r in runs}
    folds = [r for r in runs if r.data.tags.get("stage") == "fold"]
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    t0 = time.time()
    for r in sorted(folds, key=lambda r: r.data.metrics["time.fit_start"]):
        parent = by_id[r.data.tags["mlflow.parentRunId"]]
        plan = plans[r.data.tags["study"]]
        ctx = SweepStudies(cfg, [plan], tracker=SimpleNamespace(uri="", experiment_id=""))._context(plan, "", None)
        hparams = {k: _num(v) for k, v in parent.data.params.items()}
        fold = plan.dataset.manifest.folds[int(r.data.tags["fold"])]
        fc = _fold_config(
            ctx,
            fold,
            hparams,
            int(parent.data.tags["seed"]),
            "",
            "reproduction" in parent.data.tags,
            plan.dataset.manifest,
            "",
        )
        table = plan.dataset.table
        torch.manual_seed(fc.train.seed)
        model = build_model(**fc.model)
        loss = build_loss(
            fc.loss,
            num_classes=len(fold.train_classes),
            embedding_dim=fc.model["embedding_dim"],
            **fc.loss_params,
        )
        res = train_fold(
            model,
            loss,
            ImageDataset(table.subset(list(fold.train_classes)), train_transform(ctx.image_size)),
            ImageDataset(table.subset(list(fold.val_classes)), eval_transform(ctx.image_size)),
            fc.train,
        )
        if fc.evaluate_test and res.status == "ok":
            model.load_state_dict(res.best_state["model"])
            embed(
                model,
                ImageDataset(table.subset(list(plan.dataset.manifest.test_classes)), eval_transform(ctx.image_size)),
                batch_size=fc.train.eval_batch_size,
            )
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
    print(
        "  peak RSS per process (MB), by Ray process kind (sampled every 0.5 s from /proc; anon = without the"
        " mapped library files, which processes share):"
    )
    for kind, xs in sorted(rss.items()):
        r, a = [x[0] for x in xs], [x[1] for x in xs]
        print(
            f"    {kind:28s} n={len(xs):3d}  max {max(r):7.0f}  median {statistics.median(r):7.0f}"
            f"   anon max {max(a):7.0f}  median {statistics.median(a):7.0f}"
        )
    own = _fold_process_peaks(runs)
    if own:
        print(
            f"  peak RSS per fold process (MB), its own ru_maxrss at the end of its last fold (rank 0):"
            f"  n={len(own)}  max {max(own):7.0f}  median {statistics.median(own):7.0f}"
        )
    return {
        "wall_s": wall,
        "folds": len(every),
        "train_sum_s": sum(train),
        "fold_process_rss_peak_mb": {"n": len(own), "max": max(own), "median": statistics.median(own)} if own else None,
        "overhead_median_s": statistics.median(every) if every else None,
        "overhead_after_first_median_s": statistics.median(warm) if warm else None,
        "rss_mb": {
            k: {
                "n": len(v),
                "max": max(x[0] for x in v),
                "median": statistics.median(x[0] for x in v),
                "anon_max": max(x[1] for x in v),
                "anon_median": statistics.median(x[1] for x in v),
            }
            for k, v in rss.items()
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", type=int, default=None, help="use the demo's first N losses (default: all)")
    ap.add_argument("--train-workers", type=int, default=2, help="DDP workers per fold on the Ray Train path")
    ap.add_argument("--train-losses", type=int, default=1, help="losses on the Ray Train path (default 1: slow)")
    ap.add_argument("--skip-train", action="store_true", help="skip the Ray Train path")
    ap.add_argument("--skip-warm", action="store_true", help="skip the warm path and the bare loop")
    ap.add_argument("--trials", type=int, default=None, help="BO trials per study (default: the demo's)")
    ap.add_argument("--reproductions", type=int, default=None, help="reproductions per study (default: the demo's)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    ap.add_argument("--imports", action="store_true", help="only the step-by-step RSS of a fold process's imports")
    args = ap.parse_args()

    if args.imports:
        out = {"imports": _import_breakdown()}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0

    from pipelines.config.presets import DEMO

    doc = copy.deepcopy(DEMO)
    if args.losses:
        doc["losses"] = doc["losses"][: args.losses]
    for key in ("trials", "reproductions"):
        if getattr(args, key) is not None:
            doc["protocol"] = dict(doc["protocol"], **{key: getattr(args, key)})
            if key == "trials":
                doc["protocol"]["startup_trials"] = min(doc["protocol"].get("startup_trials", 1), args.trials)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_warm:
            cfg, outcome, wall, rss = _sweep(
                dict(doc, resources=dict(doc["resources"], fold_executor="warm")), Path(tmp), "warm"
            )
            runs = _fold_runs(outcome)
            out["warm"] = _report("warm single-worker folds (Ray tasks on reused processes)", wall, runs, rss)
            bare, n = _bare_loop(cfg, runs)
            print(f"\nbare sequential loop (no Ray, no MLflow), the same {n} folds: {bare:.1f} s")
            print(f"  warm sweep wall / bare loop = {wall / bare:.2f}")
            out["bare_loop_s"], out["warm_over_bare"] = bare, wall / bare
        if not args.skip_train:
            tdoc = dict(
                doc,
                losses=doc["losses"][: args.train_losses],
                resources=dict(doc["resources"], fold_executor="train", workers_per_fold=args.train_workers),
            )
            _, toutcome, twall, trss = _sweep(tdoc, Path(tmp), "train")
            out["train"] = _report(
                f"Ray Train DDP folds ({args.train_workers} workers per fold, {args.train_losses} loss)",
                twall,
                _fold_runs(toutcome),
                trss,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
