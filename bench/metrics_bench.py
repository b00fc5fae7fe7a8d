"""Benchmark: dml_core.evaluation.metrics.retrieval_metrics (symmetric search and faiss backend) vs
pytorch-metric-learning's AccuracyCalculator vs faiss's raw exact flat search.

For each N (default 10k and 100k, D = 128, CPU) and each thread count (default 1 and 2) it builds a
clustered data set with realistic class structure (~10 images per class, sizes 2..18, plus 1% singleton
classes, like SOP), then runs each side in its own subprocess so that peak RSS is attributable:

* ours:       ``retrieval_metrics(x, labels, backend="torch")``: the symmetric leave-one-out search
              (``dml_core.evaluation.knn.self_knn``: each X·Xᵀ tile once); P@1, RP, MAP@R, Recall@{1,2,4,8},
              nDCG@{2,4,8}; the details name the panel products it chose (fp32, or bf16 pruning where that measured
              faster)
* ours-faiss: ``retrieval_metrics(x, labels, backend="faiss")``: the same metrics over faiss's flat search
* PML:        ``AccuracyCalculator(k="max_bin_count", include=(P@1, RP, MAP@R))`` on ``F.normalize(x)``
* ours-cuda:  ``retrieval_metrics`` on CUDA tensors (the same symmetric search; opt-in with ``--sides``):
              data on the GPU before the clock starts, kernels synchronised, peak GPU memory reported
* faiss-raw:  ``faiss.knn(xn, xn, depth + 1)`` alone on the normalised data (the exact flat search both
              ours-faiss and PML run; the floor the symmetric search is measured against)

Every side imports faiss through ``dml_core.evaluation.openblas_core`` (as ``dml_core.evaluation.metrics`` does), so
faiss's bundled OpenBLAS runs the kernels the CPU has on every side, the floor included.

NMI (k-means) is off by default (``--nmi`` adds it to ours, ours-faiss and PML): it is the same faiss
k-means on every side and would dominate the times.  Each child reports the wall time of its call, its
CPU time and its peak RSS (``ru_maxrss``) plus the RSS right before the call (imports + data).  Sides
alternate their order between repeats; ratios are given both as ratio of the fastest runs and as the
median of the per-repeat (paired) ratios, which is the number to trust on a shared machine.

    python bench/metrics_bench.py                                  # N = 10k, 100k; 1 and 2 threads
    python bench/metrics_bench.py --sizes 2000 20000 --threads 1   # quick
    python bench/metrics_bench.py --sizes 1000000 --sides ours --repeats 1 --threads 2
                                                                   # 1M × 128: ours only (PML's class × N
                                                                   # matrix would be ~100 GB)
    python bench/metrics_bench.py --sides ours-cuda ours --threads 1   # on a GPU machine: CUDA vs CPU
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
SIDES = ("ours", "ours-faiss", "pml", "faiss-raw")
GPU_SIDES = ("ours-cuda",)


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


def _depth(labels: np.ndarray, ks=(8,)) -> int:
    """retrieval_metrics' search depth: max(largest R, largest recall/nDCG k), capped at N − 1."""
    r_max = int(np.bincount(np.unique(labels, return_inverse=True)[1]).max()) - 1
    return min(max(r_max, *ks), len(labels) - 1)


def child(side: str, path: str, threads: int, nmi: bool) -> None:
    """One measurement in a fresh process; prints one JSON line."""
    import torch

    from dml_core.evaluation import openblas_core

    with openblas_core.for_faiss_import():  # every side's faiss with the same OpenBLAS kernels as dml_core's
        import faiss
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    data = np.load(path)
    x, labels = data["x"], data["labels"]
    spent = {"knn": 0.0, "kmeans": 0.0}

    cuda = side in GPU_SIDES

    def timed(fn, key):  # wall time inside the kNN search / k-means, to split the total
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                out = fn(*a, **kw)
                if cuda:
                    torch.cuda.synchronize()  # kernels run asynchronously: time them, not their launch
                return out
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    if side in ("ours", "ours-faiss"):
        import dml_core.evaluation.metrics as M

        M.self_knn = timed(M.self_knn, "knn")
        M._FlatL2Search.__call__ = timed(M._FlatL2Search.__call__, "knn")
        M._kmeans_assignments = timed(M._kmeans_assignments, "kmeans")
        backend = "torch" if side == "ours" else "faiss"
        if side == "ours":  # which panel products self_knn chooses (prune=None), as it chooses them
            from dml_core.evaluation import knn

            def recorded(*a, choose=knn.chosen_prune, **kw):
                spent["prune"] = choose(*a, **kw)
                return spent["prune"]

            knn.chosen_prune = recorded
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        values = M.retrieval_metrics(x, labels, nmi=nmi, backend=backend)
        seconds = time.perf_counter() - t0
    elif side == "ours-cuda":
        # The data on the GPU before the clock starts (a fold's embeddings are already there); the CUDA context
        # and cuBLAS are warmed up on a small call first.  Times include copying the neighbours back.
        import dml_core.evaluation.metrics as M

        xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(labels).cuda()
        M.retrieval_metrics(xt[:4096], yt[:4096], nmi=False, backend="torch")
        M.self_knn = timed(M.self_knn, "knn")
        M._kmeans_assignments = timed(M._kmeans_assignments, "kmeans")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        values = M.retrieval_metrics(xt, yt, nmi=nmi, backend="torch")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        spent["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        spent["gpu"] = torch.cuda.get_device_name()
    elif side == "pml":
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        include = tuple(v for k, v in SHARED.items() if nmi or k != "nmi")
        calc = AccuracyCalculator(include=include, k="max_bin_count", device=torch.device("cpu"))
        calc.knn_func = timed(calc.knn_func, "knn")
        calc.kmeans_func = timed(calc.kmeans_func, "kmeans")
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        values = calc.get_accuracy(F.normalize(torch.from_numpy(x), p=2, dim=1), torch.from_numpy(labels))
        seconds = time.perf_counter() - t0
    else:  # faiss-raw: the exact flat search alone, same depth as ours (k + 1 with the query itself)
        xn = np.ascontiguousarray(F.normalize(torch.from_numpy(x), p=2, dim=1).numpy())
        k = _depth(labels) + 1
        rss0, cpu0 = _rss_mb(), _cpu_s()
        t0 = time.perf_counter()
        faiss.knn(xn, xn, k)
        seconds = time.perf_counter() - t0
        spent["knn"] = seconds
        values = {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    cpu_s = _cpu_s() - cpu0
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rss_before_mb": rss0,
                "peak_rss_mb": peak,
                "values": values,
                "knn_s": spent["knn"],
                "kmeans_s": spent["kmeans"],
                "cpu_s": cpu_s,
                "gpu_peak_mb": spent.get("gpu_peak_mb"),
                "gpu": spent.get("gpu"),
                "prune": spent.get("prune"),
            }
        )
    )


def run_side(side: str, path: str, threads: int, nmi: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, path, str(threads), str(int(nmi))],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _max_diff(a: dict, b: dict, keys: dict) -> float:
    return max(abs(a[k] - b[pk]) for k, pk in keys.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, alternating the side order")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="faiss/torch thread counts to measure (each child uses one)",
    )
    ap.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES + GPU_SIDES,
        default=list(SIDES),
        help="which implementations to run (PML cannot run at 1M: its class × N matrix); "
        "ours-cuda: the symmetric search on CUDA tensors (needs a GPU)",
    )
    ap.add_argument("--nmi", action="store_true", help="also NMI (faiss k-means) on ours, ours-faiss and PML")
    ap.add_argument("--child", nargs=4, metavar=("SIDE", "NPZ", "THREADS", "NMI"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), bool(int(args.child[3])))
        return

    from dml_core.evaluation import openblas_core

    core = os.environ.get(openblas_core.VARIABLE) or openblas_core.core_for_flags(openblas_core.cpu_flags())
    print(
        f"cpus={os.cpu_count()} threads={args.threads} repeats={args.repeats} nmi={args.nmi} "
        f"faiss_openblas_core={core or 'detected by OpenBLAS'} "
        f"loadavg_before={' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    header = (
        "N",
        "threads",
        "side",
        "wall s (min)",
        "CPU s (min)",
        "kNN s",
        "peak RSS MB",
        "× PML (paired median)",
        "× faiss-raw (paired median)",
    )
    print(" | ".join(header))
    shared = {k: pk for k, pk in SHARED.items() if args.nmi or k != "nmi"}
    details = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            x, labels = make_data(n, args.dim, args.seed)
            path = str(Path(tmp) / f"data_{n}.npz")
            np.savez(path, x=x, labels=labels)
            del x
            for threads in args.threads:
                runs = {side: [] for side in args.sides}
                for rep in range(args.repeats):
                    for side in args.sides if rep % 2 == 0 else args.sides[::-1]:
                        load = os.getloadavg()[0]
                        runs[side].append(run_side(side, path, threads, args.nmi) | {"load": load})
                for side, rs in runs.items():

                    def paired(other):
                        if other not in runs or other == side:
                            return "—"
                        return f"{_median([a['seconds'] / b['seconds'] for a, b in zip(rs, runs[other])]):.3f}"

                    best = min(rs, key=lambda r: r["seconds"])
                    row = (
                        n,
                        threads,
                        side,
                        f"{best['seconds']:.2f}",
                        f"{min(r['cpu_s'] for r in rs):.1f}",
                        f"{best['knn_s']:.2f}",
                        f"{max(r['peak_rss_mb'] for r in rs):.0f}",
                        paired("pml"),
                        paired("faiss-raw"),
                    )
                    print(" | ".join(str(v) for v in row), flush=True)
                checks = []
                if "ours" in runs and "pml" in runs:
                    worst = max(_max_diff(a["values"], b["values"], shared) for a, b in zip(runs["ours"], runs["pml"]))
                    checks.append(f"max|ours − PML| {worst:.1e}")
                if "ours-cuda" in runs:
                    for other in ("ours", "ours-faiss"):
                        if other in runs:
                            same = {k: k for k in runs[other][0]["values"]}
                            worst = max(
                                _max_diff(a["values"], b["values"], same)
                                for a, b in zip(runs["ours-cuda"], runs[other])
                            )
                            checks.append(f"max|ours-cuda − {other}| {worst:.1e}")
                    if "pml" in runs:
                        worst = max(
                            _max_diff(a["values"], b["values"], shared) for a, b in zip(runs["ours-cuda"], runs["pml"])
                        )
                        checks.append(f"max|ours-cuda − PML| {worst:.1e}")
                if "ours" in runs and "ours-faiss" in runs:
                    same = {k: k for k in runs["ours"][0]["values"]}
                    worst = max(
                        _max_diff(a["values"], b["values"], same) for a, b in zip(runs["ours"], runs["ours-faiss"])
                    )
                    checks.append(f"max|ours − ours-faiss| {worst:.1e}")
                print(f"  N={n} threads={threads}: " + "; ".join(checks), flush=True)
                details.append((n, threads, runs, checks))
    print(f"loadavg_after={' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for n, threads, runs, checks in details:
        print(f"\nN={n} threads={threads}: " + "; ".join(checks))
        for side, rs in runs.items():
            walls = ", ".join(f"{r['seconds']:.2f} (CPU {r['cpu_s']:.1f}, load {r['load']:.1f})" for r in rs)
            gpu = f"; {rs[0]['gpu']}, peak GPU memory {rs[0]['gpu_peak_mb']:.0f} MB" if rs[0].get("gpu") else ""
            prune = f"; panel products {rs[0]['prune']}" if rs[0].get("prune") else ""
            print(f"  {side:10s} runs [s]: {walls}; RSS before the call {rs[0]['rss_before_mb']:.0f} MB{gpu}{prune}")
        for side in ("ours", "ours-cuda"):
            if side in runs:
                print(f"  {side} values:", {k: round(v, 6) for k, v in runs[side][0]["values"].items()})


if __name__ == "__main__":
    main()
