"""Benchmark: dml_core.metrics.retrieval_metrics vs pytorch-metric-learning's AccuracyCalculator.

For each N (default 10k and 100k, D = 128, CPU) it builds a clustered data set with realistic class
structure (~10 images per class, sizes 2..18, plus 1% singleton classes, like SOP), then runs each side
in its own subprocess so that peak RSS is attributable:

* ours: ``retrieval_metrics(x, labels)`` (normalises; P@1, RP, MAP@R, Recall@{1,2,4,8}, nDCG@{2,4,8}, NMI)
* PML:  ``AccuracyCalculator(k="max_bin_count", include=(P@1, RP, MAP@R, NMI))`` on ``F.normalize(x)``
  (PML's other default metrics -- AMI, MAP, MRR -- are excluded: we do not compute them).

Each child reports the wall time of the metric call and its peak RSS (``ru_maxrss``), plus the RSS
right before the call (imports + data) so the call's own footprint is visible.  The parent prints the
values, the largest absolute difference over the shared metrics, the time ratio and the size of an
N×N float32 matrix for comparison.

    python bench/metrics_bench.py                      # N = 10k, 100k
    python bench/metrics_bench.py --sizes 2000 20000   # quick
    python bench/metrics_bench.py --sizes 1000000 --sides ours --no-nmi --repeats 1
                                                       # 1M × 128: ours only (PML's class × N matrix would be
                                                       # ~100 GB); kNN metrics only (k-means on 1M would take hours)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARED = {  # ours -> PML key
    "precision_at_1": "precision_at_1",
    "r_precision": "r_precision",
    "map_at_r": "mean_average_precision_at_r",
    "nmi": "NMI",
}


def make_data(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """~n points in classes of 2..18 images (mean 10) plus 1% singleton classes, Gaussian clusters
    around random centres; noise chosen so that MAP@R is mid-range rather than 0 or 1."""
    rng = np.random.default_rng(seed)
    n_single = n // 100
    sizes = rng.integers(2, 19, size=(n - n_single) // 10 + 1)
    while sizes.sum() < n - n_single:  # short draw: add classes rather than inflating the last one
        sizes = np.concatenate([sizes, rng.integers(2, 19, size=(n - n_single - sizes.sum()) // 2 + 1)])
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n - n_single) + 1]
    sizes[-1] -= sizes.sum() - (n - n_single)
    sizes = sizes[sizes > 0]
    sizes = np.concatenate([sizes, np.ones(n_single, dtype=sizes.dtype)])
    labels = np.repeat(np.arange(len(sizes)), sizes)
    rng.shuffle(labels)
    centres = rng.normal(size=(len(sizes), dim)).astype(np.float32)
    x = centres[labels]
    x += 1.6 * rng.normal(size=x.shape).astype(np.float32)
    return x, labels.astype(np.int64)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(side: str, path: str, threads: int, nmi: bool) -> None:
    """One measurement in a fresh process; prints one JSON line."""
    import faiss
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    data = np.load(path)
    x, labels = data["x"], data["labels"]
    spent = {"knn": 0.0, "kmeans": 0.0}

    def timed(fn, key):  # wall time inside the faiss kNN search / k-means, to split the total
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    if side == "ours":
        import dml_core.metrics as M

        search_call = M._FlatL2Search.__call__
        M._FlatL2Search.__call__ = timed(search_call, "knn")
        M._kmeans_assignments = timed(M._kmeans_assignments, "kmeans")
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        values = M.retrieval_metrics(x, labels, nmi=nmi)
        seconds = time.perf_counter() - t0
    else:
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        include = tuple(v for k, v in SHARED.items() if nmi or k != "nmi")
        calc = AccuracyCalculator(include=include, k="max_bin_count", device=torch.device("cpu"))
        calc.knn_func = timed(calc.knn_func, "knn")
        calc.kmeans_func = timed(calc.kmeans_func, "kmeans")
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        values = calc.get_accuracy(F.normalize(torch.from_numpy(x), p=2, dim=1), torch.from_numpy(labels))
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = cpu.ru_utime + cpu.ru_stime - cpu0
    print(json.dumps({"seconds": seconds, "rss_before_mb": rss0, "peak_rss_mb": peak, "values": values,
                      "knn_s": spent["knn"], "kmeans_s": spent["kmeans"], "cpu_s": cpu_s}))


def run_side(side: str, path: str, threads: int, nmi: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, path, str(threads), str(int(nmi))],
        capture_output=True, text=True, check=False, env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pick(runs: list[dict]) -> dict:
    """The fastest run: on a shared machine the minimum is the run least disturbed by other load."""
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per side, alternating which side goes first")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="faiss/torch threads in both children (1 = least sensitive to other load)")
    ap.add_argument("--sides", nargs="+", choices=("ours", "pml"), default=["ours", "pml"],
                    help="which implementations to run (PML cannot run at 1M: its class × N matrix)")
    ap.add_argument("--no-nmi", dest="nmi", action="store_false",
                    help="kNN metrics only, on both sides (skips the k-means clustering for NMI)")
    ap.add_argument("--child", nargs=4, metavar=("SIDE", "NPZ", "THREADS", "NMI"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), bool(int(args.child[3])))
        return

    import faiss

    print(f"cpus={os.cpu_count()} threads={args.threads} repeats={args.repeats} "
          f"loadavg_before={' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    header = ("N", "D", "classes", "max|class|", "ours s (min)", "PML s (min)", "ratio of mins",
              "median paired ratio", "ours CPU s (min)", "PML CPU s (min)", "CPU ratio",
              "ours peak MB", "PML peak MB", "N×N f32 MB", "max|Δ|")
    print(" | ".join(header))
    rows = []
    shared = {k: pk for k, pk in SHARED.items() if args.nmi or k != "nmi"}
    na = "—"
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            x, labels = make_data(n, args.dim, args.seed)
            path = str(Path(tmp) / f"data_{n}.npz")
            np.savez(path, x=x, labels=labels)
            del x
            runs = {side: [] for side in args.sides}
            for rep in range(args.repeats):
                for side in args.sides if rep % 2 == 0 else args.sides[::-1]:
                    load = os.getloadavg()[0]
                    runs[side].append(run_side(side, path, args.threads, args.nmi) | {"load": load})
            best = {side: _pick(r) for side, r in runs.items()}
            ours, ref = best.get("ours"), best.get("pml")
            cpu = {side: min(r["cpu_s"] for r in rs) for side, rs in runs.items()}
            peak = {side: max(r["peak_rss_mb"] for r in rs) for side, rs in runs.items()}
            if ours and ref:
                diff = f"{max(abs(o['values'][k] - p['values'][pk]) for o, p in zip(runs['ours'], runs['pml']) for k, pk in shared.items()):.1e}"
                paired = sorted(o["seconds"] / p["seconds"] for o, p in zip(runs["ours"], runs["pml"]))
                ratios = (f"{ours['seconds'] / ref['seconds']:.3f}", f"{paired[len(paired) // 2]:.3f}",
                          f"{cpu['ours'] / cpu['pml']:.3f}")
            else:
                diff, ratios = na, (na, na, na)
            counts = np.bincount(labels)

            def fmt(side, value, spec):
                return format(value, spec) if side in best else na

            row = (n, args.dim, len(counts), int(counts.max()),
                   fmt("ours", ours and ours["seconds"], ".2f"), fmt("pml", ref and ref["seconds"], ".2f"),
                   ratios[0], ratios[1], fmt("ours", cpu.get("ours"), ".1f"), fmt("pml", cpu.get("pml"), ".1f"),
                   ratios[2], fmt("ours", peak.get("ours"), ".0f"), fmt("pml", peak.get("pml"), ".0f"),
                   f"{n * n * 4 / 2**20:.0f}", diff)
            rows.append((row, runs, best))
            print(" | ".join(str(v) for v in row), flush=True)
    print(f"loadavg_after={' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for row, runs, best in rows:
        names = {"ours": "ours", "pml": "PML"}
        print(f"\nN={row[0]}: RSS before the call (imports + data) "
              + ", ".join(f"{names[s]} {b['rss_before_mb']:.0f} MB" for s, b in best.items()))
        for side, rs in runs.items():
            walls = ", ".join(f"{r['seconds']:.2f} (CPU {r['cpu_s']:.1f}, load {r['load']:.1f})" for r in rs)
            print(f"  {names[side]:4s} all runs [s]: {walls}")
        for side, r in best.items():
            rest = r["seconds"] - r["knn_s"] - r["kmeans_s"]
            print(f"  {names[side]:4s} fastest {r['seconds']:.2f} s = faiss kNN {r['knn_s']:.2f} + k-means (NMI) "
                  f"{r['kmeans_s']:.2f} + rest {rest:.2f}; process CPU {r['cpu_s']:.1f} s")
        for side, r in best.items():
            print(f"  {names[side] + ':':5s}", {k: round(v, 6) for k, v in r["values"].items()})

if __name__ == "__main__":
    main()
