"""Pruned vs unpruned searches (``protocol.pruning``, docs/protocol.md §Pruning): the same sweep — same losses, seeds,
trial count and reproductions — run twice, once with ASHA and once without, then per loss the winner's test MAP@R
(concatenated, over the reproductions, paired by reproduction seed) and the search's ``cost.cpu_seconds``.

    python bench/pruning_bench.py --out pruning-bench            # both sweeps, then the table
    python bench/pruning_bench.py --out pruning-bench --report   # the table again from the sweeps' MLflow stores

Each sweep is one ``dmlrc sweep`` process (local Ray, sqlite MLflow store in its folder); ``--num-cpus`` logical CPUs,
one study at a time, so both sweeps get the same machine.  Writes ``<out>/pruning_bench.json`` and prints a markdown
table (bench/README_pruning.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSSES = ["contrastive", "triplet", "ntxent", "multi_similarity", "margin", "proxy_anchor"]


def sweep_config(args, pruned: bool) -> dict:
    name = "pruned" if pruned else "unpruned"
    protocol = {
        "folds": args.folds,
        "fold_layout": "kfold",
        "trials": args.trials,
        "startup_trials": args.startup_trials,
        "reproductions": args.reproductions,
        "iters_per_epoch": args.iters_per_epoch,
        "eval_every": 1,
        "patience": args.max_epochs,  # the full budget unless pruned: the comparison is about the scheduler
        "max_epochs": args.max_epochs,
        "train": {"classes_per_batch": 8, "m": 4, "optimizer": "adam", "trunk_lr": 1e-3, "embedder_lr": 1e-3},
    }
    if pruned:
        protocol.update(pruning="asha", pruning_grace_period=args.grace, pruning_reduction_factor=args.reduction)
    out = Path(args.out).resolve()
    return {
        "name": name,
        "seed": args.seed,
        "datasets": [
            {
                "name": "synthetic",
                "kind": "synthetic",
                "num_classes": args.classes,
                "per_class": args.per_class,
                "image_size": 16,
            }
        ],
        "losses": args.losses,
        "model": {"trunk": "tiny", "embedding_dim": 32, "freeze_bn": False},
        "protocol": protocol,
        "resources": {
            "workers_per_fold": 1,
            "max_concurrent_trials": 1,
            "max_concurrent_studies": 1,
            "num_cpus": args.num_cpus,
        },
        "tracking": {"uri": f"sqlite:///{out / name / 'mlflow.db'}", "experiment": name},
        "storage": str(out / "runs"),
    }


def run_sweep(args, pruned: bool) -> float:
    cfg = sweep_config(args, pruned)
    out = Path(args.out).resolve()
    (out / cfg["name"]).mkdir(parents=True, exist_ok=True)
    path = out / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    with open(out / f"{cfg['name']}.log", "w") as log:
        subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(path)], cwd=out, stdout=log, stderr=log, check=True
        )
    return time.time() - t0


def read_sweep(out: Path, name: str) -> dict[str, dict]:
    """Per loss: the winner, its reproductions' test MAP@R by reproduction index, and the cost split."""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import PARENT, search_all

    c = MlflowClient(f"sqlite:///{out / name / 'mlflow.db'}")
    runs = search_all(c, c.get_experiment_by_name(name).experiment_id, "")
    kids: dict[str, list] = {}
    for r in runs:
        kids.setdefault(r.data.tags.get(PARENT), []).append(r)
    studies = {}
    for s in (r for r in runs if r.data.tags["stage"] == "study"):
        m = s.data.metrics
        mine = kids.get(s.info.run_id, [])
        reps = [r for r in mine if r.data.tags["stage"] == "reproduction"]
        trials = [r for r in mine if r.data.tags["stage"] == "trial"]
        rep_cpu = sum(r.data.metrics.get("cost.cpu_seconds", 0.0) for r in reps)
        studies[s.data.tags["loss"]] = {
            "best_trial": s.data.tags.get("best_trial_id"),
            "best_val": m.get("best.val.map_at_r.mean"),
            "best_params": {k[5:]: v for k, v in s.data.params.items() if k.startswith("best.")},
            "test": {int(r.data.tags["reproduction"]): r.data.metrics.get("test.concat.map_at_r") for r in reps},
            "trials": len(trials),
            "pruned": sum(t.data.tags.get("status") == "pruned" for t in trials),
            "cpu_seconds": m.get("cost.cpu_seconds", 0.0),
            "search_cpu_seconds": m.get("cost.cpu_seconds", 0.0) - rep_cpu,
            "pruned_cpu_seconds": m.get("cost.pruned.cpu_seconds", 0.0),
        }
    return studies


def compare(pruned: dict, unpruned: dict) -> dict:
    from dml_core.evaluation.stats import confidence_interval, paired_t_test

    rows, means_p, means_u = [], [], []
    for loss in sorted(set(pruned) & set(unpruned)):
        p, u = pruned[loss], unpruned[loss]
        idx = sorted(set(p["test"]) & set(u["test"]))
        a = [p["test"][i] for i in idx]
        b = [u["test"][i] for i in idx]
        diff = [x - y for x, y in zip(a, b)]
        mean, lo, hi = confidence_interval(diff) if len(diff) > 1 else (float("nan"),) * 3
        _, pval = paired_t_test(a, b) if len(diff) > 1 and np.std(diff) > 0 else (float("nan"), float("nan"))
        means_p.append(float(np.mean(a)))
        means_u.append(float(np.mean(b)))
        saved = u["search_cpu_seconds"] - p["search_cpu_seconds"]
        rows.append(
            {
                "loss": loss,
                "test_pruned": float(np.mean(a)),
                "test_unpruned": float(np.mean(b)),
                "diff": mean,
                "diff_ci": [lo, hi],
                "p": pval,
                "same_winner_params": p["best_params"] == u["best_params"],
                "trials_pruned": p["pruned"],
                "trials": p["trials"],
                "search_cpu_unpruned": u["search_cpu_seconds"],
                "search_cpu_pruned": p["search_cpu_seconds"],
                "search_cpu_saved": saved,
                "search_cpu_saved_pct": 100.0 * saved / u["search_cpu_seconds"] if u["search_cpu_seconds"] else 0.0,
            }
        )
    d = [x - y for x, y in zip(means_p, means_u)]
    across = dict(zip(("mean", "ci_low", "ci_high"), confidence_interval(d))) if len(d) > 1 else {}
    if len(d) > 1 and np.std(d) > 0:
        across["t"], across["p"] = paired_t_test(means_p, means_u)
    total_u = sum(r["search_cpu_unpruned"] for r in rows)
    total_p = sum(r["search_cpu_pruned"] for r in rows)
    return {
        "losses": rows,
        "across_losses": across,
        "search_cpu_unpruned": total_u,
        "search_cpu_pruned": total_p,
        "search_cpu_saved_pct": 100.0 * (total_u - total_p) / total_u if total_u else 0.0,
    }


def _f(v: float, nd: int = 4) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def markdown(result: dict) -> str:
    lines = [
        "| loss | test MAP@R pruned | unpruned | diff (95% CI, paired by reproduction) | p | same winner | "
        "pruned trials | search CPU-s unpruned → pruned (saved) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["losses"]:
        lo, hi = r["diff_ci"]
        lines.append(
            f"| {r['loss']} | {_f(r['test_pruned'])} | {_f(r['test_unpruned'])} | {_f(r['diff'])} [{_f(lo)}, "
            f"{_f(hi)}] | {_f(r['p'], 3)} | {'yes' if r['same_winner_params'] else 'no'} | {r['trials_pruned']}/"
            f"{r['trials']} | {r['search_cpu_unpruned']:.0f} → {r['search_cpu_pruned']:.0f} "
            f"({r['search_cpu_saved_pct']:.0f} %) |"
        )
    a = result["across_losses"]
    lines.append("")
    lines.append(
        f"Across losses (paired by loss, n = {len(result['losses'])}): mean diff {_f(a.get('mean'))} "
        f"[{_f(a.get('ci_low'))}, {_f(a.get('ci_high'))}], p = {_f(a.get('p'), 3)}; search CPU-s "
        f"{result['search_cpu_unpruned']:.0f} → {result['search_cpu_pruned']:.0f} "
        f"({result['search_cpu_saved_pct']:.0f} % saved)."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--losses", nargs="+", default=LOSSES)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--startup-trials", type=int, default=3)
    ap.add_argument("--reproductions", type=int, default=3)
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument("--iters-per-epoch", type=int, default=6)
    ap.add_argument("--max-epochs", type=int, default=6)
    ap.add_argument("--grace", type=int, default=1)
    ap.add_argument("--reduction", type=float, default=2.0)
    ap.add_argument("--classes", type=int, default=48)
    ap.add_argument("--per-class", type=int, default=8)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--report", action="store_true", help="only read the sweeps already run under --out")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    walls = {}
    if not args.report:
        for pruned in (False, True):
            walls["pruned" if pruned else "unpruned"] = run_sweep(args, pruned)
            print(f"{'pruned' if pruned else 'unpruned'} sweep: {walls['pruned' if pruned else 'unpruned']:.0f} s")
    result = compare(read_sweep(out, "pruned"), read_sweep(out, "unpruned"))
    result["args"] = vars(args)
    if walls:
        result["wall_seconds"] = walls
    (out / "pruning_bench.json").write_text(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
