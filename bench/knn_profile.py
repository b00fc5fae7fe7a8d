"""Where ``dml_core.evaluation.knn.self_knn`` spends its time on CPU: the numbers behind bench/README_metrics.md's
"Where the time goes" paragraph.

On the same clustered data as ``metrics_bench.py`` (L2-normalised, k = largest class + 1), one process prints:

* ``self_knn`` wall time;
* the GEMM floor: the very fp32 panel products of the search (``knn._panel_mm`` by the product ``knn._fp32_product``
  picks, every block pair a <= b, panel by panel) with no selection work, and the GFLOP/s they reach;
* how many CHUNK-wide chunks the off-diagonal tiles admit for elementwise checks (both sides), of all there are;
* the torch profiler's ops by self CPU time (``--profile``);
* the GFLOP/s of one panel product in fp32 by ``torch.mm`` and by oneDNN (``knn._fp32_product`` picks one) and in
  bf16 (what ``knn``'s bf16 pruning gains);
* with ``--prune fp32|bf16`` every search runs in that mode (default: the one ``self_knn`` picks itself);
* with ``--modes`` only this: ``self_knn`` in fp32 and in bf16 on the same data, whether both give the same distances
  and neighbours, which mode ``prune=None`` picks and the times its cost model weighs (``knn._bf16_times``) -- the
  measurements behind ``knn.BF16_PANEL_EXTRA`` and ``knn.BF16_PAIR_COST``.

    .venv/bin/python bench/knn_profile.py --n 60000 --threads 1 --profile
    .venv/bin/python bench/knn_profile.py --n 300000 --threads 2 --modes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from metrics_bench import make_data  # noqa: E402

from dml_core.evaluation import knn  # noqa: E402


def gemm_floor(x: torch.Tensor) -> tuple[float, float]:
    """Seconds and GFLOP/s of the search's panel products alone (tile pairs a <= b, as ``self_knn`` runs them)."""
    n, d = x.shape
    tile, panel = knn.TILE_CPU, knn.PANEL_CPU
    blocks = -(-n // tile)
    xp = torch.nn.functional.pad(x, (0, 0, 0, blocks * tile - n))
    out, how = torch.empty(panel, tile), knn._fp32_product(d, panel, tile)
    t0, products = time.perf_counter(), 0
    for a in range(blocks):
        for b in range(a, blocks):
            xb = xp[b * tile : (b + 1) * tile]
            for p in range(0, tile, panel):
                knn._panel_mm(xp[a * tile + p : a * tile + p + panel], xb, out, how)
                products += 1
    dt = time.perf_counter() - t0
    return dt, products * 2 * panel * tile * d / dt / 1e9


def live_chunks(x: torch.Tensor, k: int, prune: str) -> int:
    """Chunks the off-diagonal tiles gather for elementwise checks, counted around ``knn._Gathered.add``."""
    count = [0]
    add = knn._Gathered.add

    def counting(self, live, vals, offset):
        count[0] += live.numel()
        return add(self, live, vals, offset)

    knn._Gathered.add = counting
    try:
        knn.self_knn(x, k, prune=prune)
    finally:
        knn._Gathered.add = add
    return count[0]


def panel_gflops(dtype: torch.dtype, d: int, how: str = "mm", reps: int = 500) -> float:
    a, b = torch.randn(knn.TILE_CPU, d).to(dtype), torch.randn(knn.PANEL_CPU, d).to(dtype)
    out = torch.empty(knn.PANEL_CPU, knn.TILE_CPU, dtype=dtype)
    for _ in range(20):
        knn._panel_mm(b, a, out, how)
    t0 = time.perf_counter()
    for _ in range(reps):
        knn._panel_mm(b, a, out, how)
    return reps * 2 * knn.PANEL_CPU * knn.TILE_CPU * d / (time.perf_counter() - t0) / 1e9


def compare_modes(x: torch.Tensor, k: int) -> None:
    """``self_knn`` in both modes on ``x`` (after a bf16 warm-up on 40k rows: the once-per-process checks), and what
    ``prune=None`` decides from its measured times."""
    n, d = x.shape
    knn.self_knn(x[:40000], k, prune="bf16")
    chosen = knn.chosen_prune(n, d, k)
    tile, panel = knn._tile_and_panel(n, None, False)
    t32, t16, t_pair = knn._bf16_times(d, panel, tile)
    print(
        f"N={n} D={d} k={k} threads={torch.get_num_threads()}: prune=None picks {chosen}; fp32 panel product "
        f"{t32 * 1e3:.3f} ms, bf16 + conversion {t16 * 1e3:.3f} ms, working key {t_pair * 1e9:.1f} ns"
    )
    got = {}
    for prune in ("fp32", "bf16"):
        t0 = time.perf_counter()
        got[prune] = knn.self_knn(x, k, prune=prune)
        print(f"self_knn prune={prune}: {time.perf_counter() - t0:.2f} s")
    (d32, i32), (d16, i16) = got["fp32"], got["bf16"]
    print(f"same distances and neighbours: {torch.equal(d32, d16) and torch.equal(i32, i16)}")


def cuda_tiles(x: torch.Tensor, k: int, tiles: list[int]) -> None:
    """``self_knn`` on the GPU with each tile edge: seconds (synchronised), peak GPU memory, same result."""
    xc = x.cuda()
    knn.self_knn(xc[:20_000], k)  # warm-up: CUDA context, cuBLAS handles, allocator
    print(f"N={len(x)} D={x.shape[1]} k={k} {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    ref = None
    for tile in tiles:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        d, i = knn.self_knn(xc, k, tile=tile)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ref = (d, i) if ref is None else ref
        same = torch.equal(d, ref[0]) and torch.equal(i, ref[1])
        print(
            f"tile {tile}: self_knn {dt:.2f} s, peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MB, "
            f"same distances and neighbours as tile {tiles[0]}: {same}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also the torch profiler's table of one search")
    ap.add_argument(
        "--sweep",
        nargs="+",
        default=[],
        metavar="TILE:PANEL[:CHUNK]",
        help="also time self_knn with these CPU sizes (knn.TILE_CPU, PANEL_CPU, CHUNK), in this process",
    )
    ap.add_argument("--prune", choices=("fp32", "bf16"), help="self_knn's panel products (default: its own choice)")
    ap.add_argument("--modes", action="store_true", help="only time self_knn in fp32 and bf16; say which it picks")
    ap.add_argument(
        "--cuda-tiles",
        nargs="+",
        type=int,
        default=[],
        metavar="TILE",
        help="only this: self_knn on CUDA tensors with these tile edges (knn.TILE_CUDA), timed and "
        "compared with the first",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, labels = make_data(args.n, args.dim, seed=0)
    x = torch.nn.functional.normalize(torch.from_numpy(x), dim=1)
    k = int(torch.bincount(torch.from_numpy(labels)).max()) + 1
    if args.cuda_tiles:
        cuda_tiles(x, k, args.cuda_tiles)
        return
    knn.self_knn(x[:5000], k)  # warm-up: allocator, BLAS threads
    if args.modes:
        compare_modes(x, k)
        return
    prune = args.prune or knn.chosen_prune(args.n, args.dim, k)
    print(f"N={args.n} D={args.dim} k={k} threads={args.threads} prune={prune} torch {torch.__version__}")
    t0 = time.perf_counter()
    knn.self_knn(x, k, prune=prune)
    print(f"self_knn: {time.perf_counter() - t0:.2f} s")
    dt, gf = gemm_floor(x)
    print(
        f"panel GEMMs alone: {dt:.2f} s ({gf:.0f} GFLOP/s; fp32 products by "
        f"{knn._fp32_product(args.dim, knn.PANEL_CPU, knn.TILE_CPU)})"
    )
    blocks = -(-args.n // knn.TILE_CPU)
    tiles = blocks * (blocks - 1) // 2
    total = tiles * 2 * knn.TILE_CPU * (knn.TILE_CPU // knn.CHUNK)
    live = live_chunks(x, k, prune)
    print(f"live chunks: {live} of {total} ({100 * live / total:.1f} %) over {tiles} off-diagonal tiles, both sides")
    for dtype, how in ((torch.float32, "mm"), (torch.float32, "onednn"), (torch.bfloat16, "mm")):
        try:
            print(
                f"one {knn.PANEL_CPU}x{knn.TILE_CPU}x{args.dim} panel product in {dtype} by {how}: "
                f"{panel_gflops(dtype, args.dim, how):.0f} GFLOP/s"
            )
        except (RuntimeError, AttributeError) as e:  # a torch without oneDNN's op (or its fp32 kernel)
            print(f"{dtype} by {how}: {str(e).splitlines()[0]}")
    ref = None
    for spec in args.sweep:  # the sizes knn.py ships were chosen with this
        tile, panel, *chunk = (int(v) for v in spec.split(":"))
        old = knn.TILE_CPU, knn.PANEL_CPU, knn.CHUNK
        knn.TILE_CPU, knn.PANEL_CPU, knn.CHUNK = tile, panel, chunk[0] if chunk else knn.CHUNK
        t0 = time.perf_counter()
        _, idx = knn.self_knn(x, k, prune=prune)
        dt = time.perf_counter() - t0
        ref = idx if ref is None else ref
        print(f"sizes {spec}: self_knn {dt:.2f} s, same neighbours as the first: {torch.equal(idx, ref)}")
        knn.TILE_CPU, knn.PANEL_CPU, knn.CHUNK = old
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            knn.self_knn(x, k, prune=prune)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
