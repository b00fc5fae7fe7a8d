"""Scale by simulation: a sweep of many tiny studies on a multi-node Ray cluster of one machine.

    PYTHONPATH=$PWD python bench/cluster_scale_bench.py [--nodes 4 --slots 8 --studies 10] [--json out.json]

Starts the cluster of ``tests/cluster.py`` — a head with 0 CPUs and ``--nodes`` worker nodes of ``--slots`` logical
CPUs each — with S3 (SeaweedFS) storage and an MLflow server on PostgreSQL, and runs ``dmlrc sweep --address`` on a
sweep of ``--studies`` studies (one synthetic dataset each × the contrastive loss; 1 trial, 2 reproductions, 4 folds,
a few iterations).  Every fold is a warm task reserving 1 CPU, so the logical CPUs of the workers are the cluster's
fold *slots*: for Ray's scheduler a logical CPU and a custom accelerator resource (or a GPU) are the same kind of
countable resource, so this stands in for e.g. 4 nodes × 8 GPUs without the GPUs (on a 2-core machine the folds of
course share two real cores; the numbers measure scheduling and overheads, not compute).

Printed, from the MLflow runs the sweep wrote:

* capacity = nodes × slots;
* folds in flight over time, from each fold run's ``time.start`` / ``time.end`` marks (the fold function's own
  start and end inside its Ray worker): the peak and the time-weighted mean over the span *while work remains*
  (from the first fold's start to the last fold's end), and that mean as a share of the capacity (utilisation);
* the sweep's wall time (the ``dmlrc sweep`` process) against the sum of its studies' wall times (each study run's
  start to end); their ratio is the speed-up from running studies at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def in_flight(spans: list[tuple[float, float]]) -> tuple[int, float, float]:
    """(peak, time-weighted mean, span length) of the number of intervals open at once, over
    [min start, max end]."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    start, end = events[0][0], events[-1][0]
    level = peak = 0
    area = 0.0
    last = start
    for t, d in events:
        area += level * (t - last)
        last = t
        level += d
        peak = max(peak, level)
    return peak, area / max(end - start, 1e-9), end - start


def measure(client, experiment: str) -> dict:
    from pipelines.tracking.runs import search_all

    exp = client.get_experiment_by_name(experiment)
    runs = search_all(client, exp.experiment_id, "")
    folds = [r for r in runs if r.data.tags.get("stage") == "fold"]
    studies = [r for r in runs if r.data.tags.get("stage") == "study"]
    spans = [(r.data.metrics["time.start"], r.data.metrics["time.end"]) for r in folds]
    peak, mean, span = in_flight(spans)
    study_seconds = [(r.info.end_time - r.info.start_time) / 1000 for r in studies if r.info.end_time]
    return {
        "folds": len(folds),
        "fold_nodes": len({r.data.tags.get("node_id") for r in folds}),
        "studies": len(studies),
        "studies_done": sum(r.data.tags.get("done") == "true" for r in studies),
        "peak_in_flight": peak,
        "mean_in_flight": mean,
        "fold_span_s": span,
        "sum_study_s": sum(study_seconds),
        "fold_seconds_mean": sum(e - s for s, e in spans) / len(spans),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4, help="worker nodes")
    ap.add_argument("--slots", type=int, default=8, help="fold slots (logical CPUs) per worker node")
    ap.add_argument("--studies", type=int, default=10)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--reproductions", type=int, default=2, help="the schema's minimum")
    ap.add_argument("--iters", type=int, default=2, help="iterations per epoch (1 epoch)")
    ap.add_argument(
        "--max-concurrent-studies",
        type=int,
        default=None,
        help="resources.max_concurrent_studies (default: the schema's)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient

    from tests.cluster import cluster_sweep_config, local_cluster

    workdir = Path(tempfile.mkdtemp(prefix="dmlrc-scale-"))
    capacity = args.nodes * args.slots
    resources = {}
    if args.max_concurrent_studies is not None:
        resources["max_concurrent_studies"] = args.max_concurrent_studies
    with local_cluster(workdir, workers=args.nodes, worker_cpus=args.slots, object_store_mb=80) as c:
        name = "scale"
        cfg = cluster_sweep_config(
            workdir,
            c.tracking_uri,
            c.storage("scale"),
            name=name,
            datasets=args.studies,
            trials=args.trials,
            reproductions=args.reproductions,
            iters_per_epoch=args.iters,
            **resources,
        )
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg), "--address", c.address],
            cwd=workdir,
            capture_output=True,
            text=True,
            env=c.driver_env(),
        )
        wall = time.time() - t0
        if out.returncode != 0:
            sys.exit(f"sweep failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        m = measure(MlflowClient(c.tracking_uri), f"{name}-experiment")
    shutil.rmtree(workdir, ignore_errors=True)
    m.update(
        capacity=capacity,
        nodes=args.nodes,
        slots=args.slots,
        sweep_wall_s=wall,
        utilisation=m["mean_in_flight"] / capacity,
    )
    print(
        f"cluster: {args.nodes} worker nodes × {args.slots} slots = capacity {capacity}; "
        f"{m['studies_done']}/{m['studies']} studies done, {m['folds']} folds on {m['fold_nodes']} nodes "
        f"(mean fold {m['fold_seconds_mean']:.1f} s)"
    )
    print(
        f"folds in flight while work remains ({m['fold_span_s']:.0f} s): peak {m['peak_in_flight']}, "
        f"mean {m['mean_in_flight']:.2f} → utilisation {100 * m['utilisation']:.1f} % of {capacity} slots"
    )
    print(
        f"sweep wall {wall:.0f} s vs sum of study wall times {m['sum_study_s']:.0f} s "
        f"(ratio {m['sum_study_s'] / wall:.2f})"
    )
    if args.json:
        args.json.write_text(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
