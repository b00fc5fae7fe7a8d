"""Exact k-nearest-neighbour search of a set against itself, computing each pair's distance once.

The Metric Learning Reality Check evaluates leave-one-out on one set (Musgrave et al., "A Metric Learning
Reality Check", §3.2; docs/protocol.md §Metrics; PML ``AccuracyCalculator`` with ``ref_includes_query=True``):
queries = references, so the distance matrix is symmetric and a flat search (faiss ``IndexFlatL2``, what PML
uses) computes every pair twice.  ``self_knn`` computes the tile X_a·X_bᵀ of each block pair a ≤ b once and merges it
into the running top-k of *both* its row block and its column block.

Result semantics are faiss's exact flat L2 search of the set against itself (``faiss.knn(x, x, k)``):

* key of (query i, reference j): the squared L2 distance in float32, ``(‖x_i‖² + ‖x_j‖²) − 2·x_i·x_j``
  (faiss ``exhaustive_L2sqr_blas``), negative round-off clamped to 0;
* the k smallest keys per row, the query itself included, **ties broken by the smaller reference
  index** -- faiss's heap (``CMax`` with id tie-break, k < 100) and reservoir (k ≥ 100) both return the
  lexicographic (distance, index) order; here the order is made exact by ranking 64-bit composite keys
  (float bits << 32 | index), which have no ties at all.

Off a diagonal tile, row i and row j see the very same float32 key for the pair (it is computed once);
a diagonal tile holds both orders of its pairs.  Every GEMM has the same panel × tile shape (X is padded
with masked zero rows; a tile is computed as tile / panel row panels, one GEMM on CUDA), because BLAS
libraries choose kernels -- and summation orders -- by shape: duplicated rows then get bit-identical keys
wherever they sit, and tie.  Keys equal faiss's bit for bit when the products and sums are exact
(quantised data); on generic data the two GEMMs (faiss's BLAS vs torch's) may round a pair's distance
differently in the last bit, which can only swap two neighbours whose distances agree to float32 precision.

Order of work: rows are grouped into blocks by a few Lloyd iterations (near rows together); the diagonal
tiles run first and in full: each row's bound is the k-th smallest of its ``CHUNK``-wide chunk minima
within its block (k distinct keys lie below it, so it bounds the row's final k-th key), and merging the
block's keys below the bound starts every row with its k best within its block as an exact threshold;
then the off-diagonal tiles, nearest block pairs first.

Memory is O(N·k + panel·tile): the running top-k (int64 composite keys) and one panel at a time, never
N×N.  Most of a tile is never looked at elementwise: right after a panel's GEMM (512 × 4096 float32 =
8 MB on CPU), the maximum similarity of each ``CHUNK``-wide chunk of its rows and of
each ``CHUNK``-high chunk of its columns is compared with the admission threshold of the row (of block a)
or column (a row of block b) it belongs to (from its current k-th distance), and only the chunks that can
hold a better neighbour are gathered from the panel; the tile as a whole is never stored.  The candidates
of both sides then go through one merge per tile.
Runs on CPU or CUDA tensors with torch's thread count (``torch.get_num_threads()``); CUDA matmuls run in
full fp32 (TF32 off for the call).  On CPU the fp32 panel products are ``torch.mm`` (MKL) or oneDNN's matmul,
whichever ``_fp32_product`` measures faster for the shape (MKL runs only its AVX2 kernels on AMD CPUs, where
oneDNN can be more than twice as fast; figures in bench/README_metrics.md); every product of one search goes the
same way, and oneDNN is used only where a pair's product does not depend on where its rows sit.

bf16 pruning (CPU, ``prune="bf16"``; ``None`` chooses it where it pays, ``chosen_prune``): on CPUs whose bf16
GEMMs run well ahead of the fp32 ones at hand (e.g. with AMX tiles; figures in bench/README_metrics.md), on sets
large enough for that to pay (``_bf16_pays``), the off-diagonal panels are multiplied in bf16 and used only to *prune*:
every comparison with a threshold is lowered by a rigorous bound on the bf16 error, and the pairs that pass are keyed in
fp32 pair by pair (``_PairDots``: exact, but summed in another order than a GEMM); the diagonal tiles stay fp32 GEMMs,
used for bounds and candidates (widened by the fp32-vs-fp32 rounding bound, ``_widen``). That search runs ``BF16_EXTRA``
deeper than k; ``_refine`` then re-keys the kept pairs as the BLAS's GEMM rounds them (``_fma_dots`` with the K
block ``_gemm_k_block`` found) and re-sorts, and rows where a dropped pair could still cross the k-th place are
searched again in full. So the results equal the fp32 mode's, near-ties included; ``prune=None`` uses bf16 only
where that K block was found (an explicit ``prune="bf16"`` without one is exact for single-chain keys, which may
differ from the GEMM's in the last bit, as faiss's BLAS and torch's may).  The pair dot products and rounding bounds
of that mode (``_PairDots``, ``_fma_dots``, ``_widen``, ``_bf16_err``) are in ``dml_core/evaluation/knn_dots.py``.
"""

from __future__ import annotations

import contextlib
import time

import torch

from dml_core.evaluation.knn_dots import _bf16_err, _fma_dots, _PairDots, _widen

__all__ = ["self_knn", "chosen_prune", "TILE_CPU", "TILES_CUDA"]

#: Block edge of one tile on CPU / CUDA (rows of X per block).  A CPU tile of 4096² float32 would be 64 MB:
#: it is computed and searched in panels of PANEL_CPU rows.
TILE_CPU = 4096
#: CUDA tile edges, largest first: the search takes the largest whose buffers (``CUDA_TILE_BYTES`` per tile entry)
#: fit in half the device's free memory.  A CUDA tile is one GEMM, and the per-tile selection ops are small
#: kernels whose launches and host syncs dominate small tiles, so the largest tile that fits is the fastest (sizes
#: chosen by measurement: bench/README_gpu.md, "The symmetric kNN on CUDA: tile size").
TILES_CUDA = (32768, 16384, 8192)
#: Peak GPU bytes per tile entry (two float32 tile buffers and their masks), measured: bench/README_gpu.md.
CUDA_TILE_BYTES = 8.5

#: Rows per GEMM panel on CPU (a multiple of CHUNK).  Tile and panel sizes are chosen by measurement, not derived:
#: large tiles in large panels mean fewer, larger GEMMs and fewer per-panel ops, which beat cache-sized panels; with
#: oneDNN's faster products (``_fp32_product``) a 512-row panel beat 1024 and 256 (``bench/knn_profile.py --sweep``;
#: figures in bench/README_metrics.md).  CUDA computes a tile in one GEMM.
PANEL_CPU = 512

#: Width of the chunks whose maximum gates the elementwise check (a multiple of it pads each tile).
CHUNK = 32

#: Smallest set for which ``prune=None`` considers bf16 pruning (it needs many off-diagonal tiles to pay
#: for its one-off checks, ``_bf16_pays``).
BF16_MIN_ROWS = 32768

#: Extra depth of the bf16 mode's search (working keys), so that near-ties at the k-th place rarely need a
#: row's full search in ``_refine``.
BF16_EXTRA = 4

#: The bf16 mode's own work, which ``_bf16_pays`` weighs against the time its bf16 panel products save: per
#: off-diagonal panel, ``BF16_PANEL_EXTRA`` times its bf16 product (the extra live chunks, hits and working keys of
#: the pairs its error bound admits); per row and unit of search depth (k + ``BF16_EXTRA``), ``BF16_PAIR_COST``
#: working-key computations (``_PairDots``; ``_refine``'s GEMM-rounded keys, the merges).  Fitted to the two modes'
#: measured times on a CPU with fast bf16 GEMMs (128-D SOP-like sets, k = 19; the points are in
#: bench/README_metrics.md, and ``bench/knn_profile.py --modes`` re-measures them); near a tie the model keeps the
#: simpler fp32 mode.
BF16_PANEL_EXTRA = 1 / 3
BF16_PAIR_COST = 10.0

#: oneDNN's fp32 panel products must run this many times faster than ``torch.mm``'s (MKL) for the CPU search to
#: use them (``_fp32_product``).
ONEDNN_MIN_SPEEDUP = 1.2

_BF16_TIMES: dict[tuple[int, int, int, int], tuple[float, float, float]] = {}
_FP32_PRODUCT: dict[tuple[int, int, int, int], str] = {}
_GEMM_K_BLOCK: dict[tuple[int, int, int, int], int | None] = {}

_IDX_BITS = 32
_IDX_MASK = (1 << _IDX_BITS) - 1
# +inf key with the largest index: sorts after every real entry and decodes to +inf.
_EMPTY = (0x7F800000 << _IDX_BITS) | 0x7FFFFFFF


@contextlib.contextmanager
def _ieee_fp32(device: torch.device):
    """Full-precision fp32 matmuls on CUDA for the duration (no TF32), restored afterwards."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    try:  # the legacy flag, unless the caller has used torch's newer fp32_precision API (mixing raises)
        old = m.allow_tf32
        m.allow_tf32 = False
        restore = lambda: setattr(m, "allow_tf32", old)  # noqa: E731 - the undo of the flag that was set
    except RuntimeError:
        old = m.fp32_precision
        m.fp32_precision = "ieee"
        restore = lambda: setattr(m, "fp32_precision", old)  # noqa: E731 - the undo of the flag that was set
    try:
        yield
    finally:
        restore()


def _keys(norm_t: torch.Tensor, norm_r: torch.Tensor, sim: torch.Tensor) -> torch.Tensor:
    """float32 squared L2 distance from norms and dot products as faiss forms it, (n_t + n_r) − 2·s
    (one rounding after the sum: 2·s is exact), negative round-off clamped to 0."""
    return torch.sub(norm_t + norm_r, sim, alpha=2).clamp_min_(0)


def _composite(keys: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """int64 (key bits << 32 | reference index): orders like (key, index) for keys >= 0 (−0 made +0,
    whose bits would sort first)."""
    keys = torch.where(keys > 0, keys, torch.zeros_like(keys))
    return (keys.view(torch.int32).to(torch.int64) << _IDX_BITS) | ref


def _gemm_k_block(d: int, panel: int, tile: int) -> int | None:
    """The K block with which ``_fma_dots`` rounds exactly as this BLAS's fp32 panel × tile × d product at
    torch's current thread count (D itself first, then multiples of 16 below it), or None where no block does
    (the bf16 mode's keys would then differ from the fp32 mode's in last bits).  Checked on 4096 entries of a
    product of random rows, corners included; measured once per process and shape."""
    key = (d, panel, tile, torch.get_num_threads())
    if key not in _GEMM_K_BLOCK:
        gen = torch.Generator().manual_seed(1)
        a, b = torch.randn(panel, d, generator=gen), torch.randn(tile, d, generator=gen)
        ref = _panel_mm(a, b, torch.empty(panel, tile), _fp32_product(d, panel, tile))  # as the search multiplies
        x = torch.cat([a, b])
        i = torch.cat([torch.tensor([0, 0, panel - 1, panel - 1]), torch.randint(0, panel, (4092,), generator=gen)])
        j = torch.cat([torch.tensor([0, tile - 1, 0, tile - 1]), torch.randint(0, tile, (4092,), generator=gen)])
        want = ref[i, j]
        _GEMM_K_BLOCK[key] = None
        for block in (d, *range((d - 1) // 16 * 16, 0, -16)):
            # a cheap screen on 256 entries, then all of them
            if torch.equal(_fma_dots(x, i[:256], panel + j[:256], block), want[:256]) and torch.equal(
                _fma_dots(x, i, panel + j, block), want
            ):
                _GEMM_K_BLOCK[key] = block
                break
    return _GEMM_K_BLOCK[key]


def _best_time(run) -> float:
    """Best of three timed calls of ``run`` after one warm-up call, in seconds."""
    run()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _panel_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, how: str) -> torch.Tensor:
    """Every panel product of the search, a·bᵀ (rows of ``a`` against rows of ``b``): into ``out`` by ``torch.mm``
    (``how="mm"``; the bf16 ones too), or a new tensor from oneDNN's fp32 matmul (``how="onednn"``,
    ``_fp32_product``)."""
    if how == "onednn":
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return torch.mm(a, b.T, out=out)


def _fp32_product(d: int, panel: int, tile: int) -> str:
    """How the CPU search multiplies its fp32 panel × tile × d products: ``"onednn"`` where torch has oneDNN's
    fp32 matmul, it is ``ONEDNN_MIN_SPEEDUP`` times faster than ``torch.mm`` (best of three each) and a pair's
    product does not depend on where its rows sit in the operands (rows rolled: the same bits; duplicated rows
    must tie); else ``"mm"``.  torch's CPU ``mm`` is MKL, which runs only its AVX2 kernels on AMD CPUs, where
    oneDNN's product can be more than twice as fast with bit-identical values (bench/README_metrics.md).  Measured
    once per process, shape and thread count."""
    key = (d, panel, tile, torch.get_num_threads())
    if key not in _FP32_PRODUCT:
        _FP32_PRODUCT[key] = "mm"
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            gen = torch.Generator().manual_seed(2)
            a, b = torch.randn(panel, d, generator=gen), torch.randn(tile, d, generator=gen)
            out = torch.empty(panel, tile)
            got: torch.Tensor | None
            moved: torch.Tensor | None
            try:
                got = _panel_mm(a, b, out, "onednn")
                moved = _panel_mm(a.roll(1, 0), b.roll(3, 0), out, "onednn")
            except RuntimeError:  # a build whose oneDNN lacks the op for these operands
                got = moved = None
            if got is not None and moved is not None and torch.equal(moved, got.roll((1, 3), (0, 1))):
                mm, onednn = (_best_time(lambda h=h: _panel_mm(a, b, out, h)) for h in ("mm", "onednn"))
                if mm >= ONEDNN_MIN_SPEEDUP * onednn:
                    _FP32_PRODUCT[key] = "onednn"
    return _FP32_PRODUCT[key]


def _refine(x: torch.Tensor, cand: torch.Tensor, k: int, block: int | None) -> torch.Tensor:
    """bf16 mode's last step: the exact top-k of every row in GEMM-rounded keys (``_fma_dots``) from the search's
    top-``kk`` in working keys (``cand``, (n, kk) composite, rows in x's order; kk >= k).

    A pair the search dropped has a working key >= the row's kk-th one, and its GEMM-rounded key is at most
    ``_widen`` below that; where the kk-th working key minus that margin is not above the row's new k-th key
    (near-ties across the cut, exact ties) the row is searched again in full (``_rows_in_full``)."""
    n, kk = cand.shape
    norms = (x * x).sum(dim=1)
    widen = _widen(norms, x.shape[1], float(norms.max().sqrt()))
    ref = (cand & _IDX_MASK).view(-1)
    rows = torch.arange(n, device=x.device).repeat_interleave(kk)
    keys = _keys(norms[rows], norms[ref], _fma_dots(x, rows, ref, block))
    comp = torch.sort(_composite(keys, ref).view(n, kk), dim=1).values[:, :k]
    if kk < n:
        redo = (_decode_keys(cand[:, -1]) - widen <= _decode_keys(comp[:, -1])).nonzero().squeeze(1)
        if redo.numel():
            comp[redo] = _rows_in_full(x, norms, widen, redo, _decode_keys(comp[redo, -1]), k, block)
    return comp


def _rows_in_full(x, norms, widen, rows, kth, k, block):
    """Exact top-k (GEMM-rounded keys) of ``rows`` against all of x: an fp32 product finds every pair whose
    key can be <= ``kth`` (an upper bound of the row's k-th key), ``_fma_dots`` keys them."""
    n = x.shape[0]
    top = _TopK(rows.numel(), k, torch.full((rows.numel(),), float("inf"), device=x.device))
    per = max(1, 2**24 // n)  # rows per product: 64 MB of similarities
    for s in range(0, rows.numel(), per):
        r = rows[s : s + per]
        approx = _keys(norms[r, None], norms[None, :], x[r] @ x.T)
        t, j = (approx <= (kth[s : s + per] + widen[r])[:, None]).nonzero().unbind(1)
        top.merge(t + s, j, _keys(norms[r[t]], norms[j], _fma_dots(x, r[t], j, block)), grouped=True)
    return top.best


def _bf16_pays(n: int, d: int, k: int, panel: int, tile: int) -> bool:
    """Whether ``prune=None`` uses the bf16 mode for an (n, d) set searched for k neighbours in panel × tile
    products, on this CPU at torch's current thread count: its final keys must round like the fp32 GEMM's
    (``_gemm_k_block`` finds a K block), and the time its bf16 products save on the off-diagonal panels must exceed
    its own work (``BF16_PANEL_EXTRA``, ``BF16_PAIR_COST``), with the times of ``_bf16_times``:

        panels · (t_fp32 − (1 + BF16_PANEL_EXTRA) · t_bf16) > n · (k + BF16_EXTRA) · BF16_PAIR_COST · t_pair

    Panels grow with n² and the per-row work with n, so the same CPU may search a smaller set in fp32 and a larger
    one in bf16 (where the break-even fell on the CPUs measured: bench/README_metrics.md).  A CPU whose bf16 products
    are slower than its fp32 ones never picks bf16."""
    if _gemm_k_block(d, panel, tile) is None:
        return False
    t32, t16, t_pair = _bf16_times(d, panel, tile)
    blocks = -(-n // tile)
    panels = blocks * (blocks - 1) // 2 * (tile // panel)
    return panels * (t32 - (1 + BF16_PANEL_EXTRA) * t16) > n * (k + BF16_EXTRA) * BF16_PAIR_COST * t_pair


def _bf16_times(d: int, panel: int, tile: int) -> tuple[float, float, float]:
    """Seconds of one fp32 panel product as the search runs it (``_fp32_product``), of one bf16 panel product
    with its conversion back to fp32 (as the bf16 mode runs it), and of one working key (``_PairDots``, per pair,
    gathered from a set larger than the caches); best of three each, ~0.3 s; measured once per process, shape and
    thread count."""
    key = (d, panel, tile, torch.get_num_threads())
    if key not in _BF16_TIMES:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(panel, d, generator=gen), torch.randn(tile, d, generator=gen)
        how, out = _fp32_product(d, panel, tile), torch.empty(panel, tile)
        a16, b16, out16 = a.to(torch.bfloat16), b.to(torch.bfloat16), out.to(torch.bfloat16)
        t32 = _best_time(lambda: _panel_mm(a, b, out, how))
        t16 = _best_time(lambda: out.copy_(_panel_mm(a16, b16, out16, "mm")))
        rows = max(1024, min(65536, 2**23 // d))  # 32 MB of float32 rows at most
        x = torch.randn(rows, d, generator=gen)
        i = torch.sort(torch.randint(0, rows, (65536,), generator=gen)).values  # candidates come grouped by row
        j = torch.randint(0, rows, (65536,), generator=gen)
        dots = _PairDots(x)
        _BF16_TIMES[key] = (t32, t16, _best_time(lambda: dots(i, j)) / i.numel())
    return _BF16_TIMES[key]


def _decode_keys(comp: torch.Tensor) -> torch.Tensor:
    return (comp >> _IDX_BITS).to(torch.int32).view(torch.float32)


class _TopK:
    """Running exact top-k (smallest composite keys) of every row, plus each row's admission threshold."""

    def __init__(self, n: int, k: int, bound: torch.Tensor):
        self.k = k
        self.best = torch.full((n, k), _EMPTY, dtype=torch.int64, device=bound.device)
        self.bound = bound  # a float32 upper bound of each row's final k-th key (never tightened below it)
        self.thr = bound.clone()

    def merge(self, target: torch.Tensor, ref: torch.Tensor, keys: torch.Tensor, grouped: bool = False) -> None:
        """Merge candidate (target row, reference index, key) triples, each pair at most once overall;
        ``grouped``: the triples of one target are already contiguous.  Candidates above a row's threshold
        need no filtering: the top-k of the row and its candidates drops them."""
        if target.numel() == 0:
            return
        comp = _composite(keys, ref)
        if not grouped:
            order = torch.argsort(target, stable=True)
            target, comp = target[order], comp[order]
        rows, seg, counts = torch.unique_consecutive(target, return_inverse=True, return_counts=True)
        width = int(counts.max())
        slot = torch.arange(target.numel(), device=target.device) - (counts.cumsum(0) - counts)[seg]
        pad = torch.full((rows.numel(), width), _EMPTY, dtype=torch.int64, device=target.device)
        pad[seg, slot] = comp
        merged = torch.cat([self.best[rows], pad], dim=1)
        if width <= self.k // 2:  # a full sort of a short row is cheaper than topk's selection
            merged = torch.sort(merged, dim=1).values[:, : self.k]
        else:
            merged = torch.topk(merged, self.k, dim=1, largest=False, sorted=True).values
        self.best[rows] = merged
        self.thr[rows] = torch.minimum(self.bound[rows], _decode_keys(merged[:, -1]))


def _hits(vals: torch.Tensor, owner: torch.Tensor, limit: torch.Tensor, below: bool):
    """The entries of gathered chunks ``vals`` (pairs, CHUNK) that pass the ``limit`` of their target
    ``owner`` (``vals <= limit`` if ``below``, else ``>=``): (pair, offset in the chunk, value)."""
    lim = limit.index_select(0, owner)[:, None]
    hit = (vals <= lim if below else vals >= lim).view(-1).nonzero().squeeze(1)
    p = hit.div(CHUNK, rounding_mode="floor")
    return p, hit - p * CHUNK, vals.view(-1)[hit]


class _Gathered:
    """Chunks of a tile gathered panel by panel right after each panel's GEMM: flat chunk ids in the
    tile's chunk grid and their CHUNK values."""

    def __init__(self):
        self.live, self.vals = [], []

    def add(self, live: torch.Tensor, vals: torch.Tensor, offset: int) -> None:
        if live.numel():
            self.live.append(live + offset)
            self.vals.append(vals)

    def cat(self):
        if not self.live:
            return None
        if len(self.live) == 1:
            return self.live[0], self.vals[0]
        return torch.cat(self.live), torch.cat(self.vals)


def _diag_panel(keys: torch.Tensor, k: int, valid: int, kmin: torch.Tensor, widen: torch.Tensor | None = None):
    """Admission bound and candidates of a diagonal panel's rows (their whole rows of the block):
    ``keys`` (rows, tile) with the columns from ``valid`` on set to +inf.  The bound is the k-th
    smallest of the row's chunk minima -- k distinct entries are <= it, so it is >= the row's k-th key
    within the block -- or, with fewer than k chunks, the exact k-th key.  Returns (bound, row, column,
    key) of the entries <= bound; ``kmin``: a (rows, tile // CHUNK) buffer.  ``widen`` (per row): the most
    by which the working keys (``_PairDots``) may differ from ``keys``: the bound returned is raised by it and the
    entries kept are those <= bound + 2·widen, which covers every entry whose final key is <= that bound."""
    h, t = keys.shape
    nc = t // CHUNK
    if -(-valid // CHUNK) >= k:
        mins = torch.amin(keys.view(h, nc, CHUNK), dim=2, out=kmin[:h])
        bound = torch.topk(mins, k, dim=1, largest=False, sorted=False).values.amax(dim=1)
        keep = bound if widen is None else bound + 2 * widen
        live = (mins <= keep[:, None]).view(-1).nonzero().squeeze(1)
        ri = live.div(nc, rounding_mode="floor")
        p, o, v = _hits(keys.view(-1, CHUNK).index_select(0, live), ri, keep, below=True)
        return bound if widen is None else bound + widen, ri[p], (live[p] - ri[p] * nc) * CHUNK + o, v
    keys = keys[:, :valid]
    if valid >= k:
        bound = torch.topk(keys, k, dim=1, largest=False, sorted=False).values.amax(dim=1)
    else:
        bound = torch.full((h,), float("inf"), device=keys.device)
    keep = bound if widen is None else bound + 2 * widen
    i, j = (keys <= keep[:, None]).nonzero().unbind(1)
    return bound if widen is None else bound + widen, i, j, keys[i, j]


def _need(norms: torch.Tensor, thr: torch.Tensor, other_min: float, slack: torch.Tensor) -> torch.Tensor:
    """Similarity a pair must reach for its key to possibly be <= thr: key = n_t + n_r − 2s <= thr ⇔
    s >= (n_t + n_r − thr)/2, lowered to the smallest n_r of the other side and by a rounding slack."""
    need = (norms + other_min - thr) * 0.5 - slack
    return need.clamp_min(torch.finfo(torch.float32).min)  # an unbounded row still rejects the −inf padding


def _cluster_order(x: torch.Tensor, tile: int, iters: int = 4) -> torch.Tensor:
    """A row order that puts near rows in the same block: rows sorted by their cluster in a few Lloyd
    iterations with ceil(N / tile) centres (started at evenly spaced rows).  Only the speed depends on it
    (diagonal tiles then give tight thresholds, so later tiles admit fewer candidates); the result is
    exact for any order."""
    n = x.shape[0]
    c = -(-n // tile)
    if c <= 1:
        return torch.arange(n, device=x.device)
    centres = x[torch.linspace(0, n - 1, c, device=x.device).round().to(torch.int64)]
    assign = torch.empty(n, dtype=torch.int64, device=x.device)
    for it in range(iters + 1):
        half_norms = 0.5 * (centres * centres).sum(dim=1)
        for a in range(0, n, tile):  # nearest centre in L2: argmax x·c − ‖c‖²/2
            assign[a : a + tile] = (x[a : a + tile] @ centres.T - half_norms).argmax(dim=1)
        if it == iters:
            break
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=c).to(x.dtype)
        centres = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres)
    return torch.argsort(assign, stable=True)


def _pair_order(x: torch.Tensor, starts: range, tile: int, n: int) -> list[tuple[int, int]]:
    """Off-diagonal block pairs (a < b), nearest block means first: thresholds tighten early."""
    means = torch.stack([x[a : min(a + tile, n)].mean(dim=0) for a in starts])
    dist = torch.cdist(means[None], means[None])[0].cpu()
    pairs = [(i, j) for i in range(len(starts)) for j in range(i + 1, len(starts))]
    pairs.sort(key=lambda p: float(dist[p]))
    return [(starts[i], starts[j]) for i, j in pairs]


def _cuda_tile(n: int, device: torch.device | None) -> int:
    """The largest of ``TILES_CUDA`` whose buffers fit in half the device's free memory (the smallest if none);
    no larger than an N-row set needs."""
    free = torch.cuda.mem_get_info(device)[0]
    need = -(-n // CHUNK) * CHUNK
    for tile in TILES_CUDA:
        if CUDA_TILE_BYTES * min(tile, need) ** 2 <= free / 2:
            return tile
    return TILES_CUDA[-1]


def _tile_and_panel(n: int, tile: int | None, cuda: bool, device: torch.device | None = None) -> tuple[int, int]:
    """Tile edge (a multiple of CHUNK, at most N rounded up) and GEMM panel rows (a divisor of the tile; the
    whole tile on CUDA) for an N-row set."""
    if tile is None:
        tile = _cuda_tile(n, device) if cuda else TILE_CPU
    tile = max(CHUNK, min(tile - tile % CHUNK, -(-n // CHUNK) * CHUNK))
    panel = tile if cuda else min(tile, PANEL_CPU)
    while tile % panel:  # panels tile the tile exactly
        panel -= CHUNK
    return tile, panel


def chosen_prune(n: int, d: int, k: int, *, cuda: bool = False, tile: int | None = None) -> str:
    """The panel products ``self_knn(prune=None)`` uses for the k nearest neighbours in an (n, d) set: ``"bf16"`` on
    CPU sets of ``BF16_MIN_ROWS`` rows or more where ``_bf16_pays`` (measured once per process and shape), else
    ``"fp32"``."""
    if cuda or n < BF16_MIN_ROWS:
        return "fp32"
    tile, panel = _tile_and_panel(n, tile, cuda)
    return "bf16" if _bf16_pays(n, d, k, panel, tile) else "fp32"


def _check_args(x: torch.Tensor, k: int, prune: str | None) -> None:
    if x.ndim != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be a 2-D float32 tensor, got {tuple(x.shape)} {x.dtype}")
    if not 1 <= k <= x.shape[0]:
        raise ValueError(f"k must be in 1..{x.shape[0]}, got {k}")
    if prune not in (None, "fp32", "bf16"):
        raise ValueError(f"prune must be 'fp32', 'bf16' or None, got {prune!r}")
    if prune == "bf16" and x.is_cuda:
        raise ValueError("prune='bf16' is a CPU mode; CUDA tensors are searched in fp32")


class _Bf16:
    """The bf16 mode's operands: bf16 rows and a bf16 panel buffer for the off-diagonal products, the working keys'
    dot products, and the rounding bounds of the diagonal keys (``widen``) and of the bf16 products (``err``)."""

    def __init__(self, x: torch.Tensor, norms: torch.Tensor, panel: int, tile: int):
        d, mx = x.shape[1], float(norms.max().sqrt())
        self.x16, self.dots = x.to(torch.bfloat16), _PairDots(x)
        self.s16 = torch.empty(panel, tile, dtype=torch.bfloat16)
        self.widen = _widen(norms, d, mx)  # how far a diagonal GEMM key may sit from the working key
        self.err = _bf16_err(norms, d, mx)


class _Search:
    """One ``self_knn`` search: the rows in block order (``perm``), padded to whole tiles, their norms and the reused
    panel buffers; ``diagonal`` starts the running top-k, ``off_diagonal`` merges every other block pair into it."""

    def __init__(self, x: torch.Tensor, tile: int, panel: int, how: str, depth: int, low: bool):
        self.n, self.tile, self.panel, self.how, self.depth = x.shape[0], tile, panel, how, depth
        self.nc = tile // CHUNK
        self.perm = _cluster_order(x, tile)  # block order only; indices below are mapped back through perm
        self.starts = range(0, self.n, tile)
        # Every GEMM has the same panel × tile shape (x padded with zero rows, masked below): BLAS
        # libraries pick kernels, and with them summation orders, by shape, and a pair's dot product
        # must not depend on where it sits -- duplicated rows must give bit-identical keys to tie.
        self.x = torch.nn.functional.pad(x[self.perm], (0, 0, 0, len(self.starts) * tile - self.n)).contiguous()
        self.norms = (self.x * self.x).sum(dim=1)
        self.bf16 = _Bf16(self.x, self.norms, panel, tile) if low else None
        # One panel buffer for every torch.mm product (a fresh tensor per product costs page faults on first
        # touch; oneDNN's products come as new tensors all the same, and are still faster where chosen).
        dev = self.x.device
        self.sbuf = torch.empty(panel, tile, device=dev)
        self.smax = torch.empty(panel, self.nc, device=dev)  # row-chunk maxima (minima of keys on the diagonal)
        self.cmax = torch.empty(panel // CHUNK, tile, device=dev)  # column-chunk maxima
        self.kbuf = torch.empty(panel, tile, device=dev)  # keys of a diagonal panel

    def diagonal(self) -> _TopK:
        """Diagonal tiles first, in full: each row's bound (>= its k-th smallest key within its own block of near
        rows, ``_cluster_order``) is an upper bound of its final k-th key and starts its threshold."""
        x, norms, tile, panel, n, bf = self.x, self.norms, self.tile, self.panel, self.n, self.bf16
        bound = torch.full((n,), float("inf"), device=x.device)
        diag = []
        for a in self.starts:
            xa, na = x[a : a + tile], norms[a : a + tile]
            ra = min(tile, n - a)
            for p in range(0, ra, panel):
                h = min(panel, ra - p)
                s = _panel_mm(xa[p : p + panel], xa, self.sbuf, self.how)
                keys = torch.add(na[p : p + h, None], na[None, :], out=self.kbuf[:h])  # _keys, in a reused buffer
                keys.sub_(s[:h], alpha=2).clamp_min_(0)
                if ra < tile:
                    keys[:, ra:] = float("inf")
                widen = bf.widen[a + p : a + p + h] if bf is not None else None
                bd, i, j, v = _diag_panel(keys, self.depth, ra, self.smax, widen)
                if bf is not None:  # the working keys of the candidates
                    v = _keys(na[p + i], na[j], bf.dots(a + p + i, a + j))
                bound[a + p : a + p + h] = bd
                diag.append((i + (a + p), self.perm[j + a], v))
        top = _TopK(n, self.depth, bound)
        for cand in diag:
            top.merge(*cand, grouped=True)
        return top

    def off_diagonal(self, top: _TopK) -> None:
        """Every block pair a < b, nearest first: the candidates of both sides of its tile merged into ``top``."""
        norms, n = self.norms, self.n
        nmin = float(norms[:n].min())
        slack = 2.0**-20 * (norms[:n] + float(norms.max()) + top.bound.clamp_max(torch.finfo(torch.float32).max))
        for a, b in _pair_order(self.x, self.starts, self.tile, n):  # a < b: block a is never the ragged last one
            rb = min(self.tile, n - b)
            # rows of block a against the columns of block b (row chunks), and rows of block b against
            # the columns of block a (column chunks), from the same tile
            need_a = _need(norms[a : a + self.tile], top.thr[a : a + self.tile], nmin, slack[a : a + self.tile])
            need_b = _need(norms[b : b + rb], top.thr[b : b + rb], nmin, slack[b : b + rb])
            if self.bf16 is not None:  # the bf16 products may fall short of the exact ones by up to err
                err = self.bf16.err
                need_a, need_b = need_a - err[a : a + self.tile], need_b - err[b : b + rb]
            rows, cols = self._gather(a, b, rb, need_a, need_b)
            parts = self._candidates(a, b, rows, cols, need_a, need_b)
            if parts:  # one merge for both sides: their targets are disjoint
                merge_target, merge_ref, merge_keys = (torch.cat(z) for z in zip(*parts))
                top.merge(merge_target, merge_ref, merge_keys, grouped=True)

    def _gather(self, a: int, b: int, rb: int, need_a: torch.Tensor, need_b: torch.Tensor):
        """The tile's row chunks and column chunks that can hold a candidate, panel by panel."""
        x, tile, panel, nc, bf = self.x, self.tile, self.panel, self.nc, self.bf16
        need_a2 = need_a[:, None]
        need_b = torch.nn.functional.pad(need_b, (0, tile - rb), value=float("inf"))
        rows, cols = _Gathered(), _Gathered()
        for p in range(0, tile, panel):
            if bf is not None:
                _panel_mm(bf.x16[a + p : a + p + panel], bf.x16[b : b + tile], bf.s16, "mm")
                s = self.sbuf.copy_(bf.s16)  # fp32 for the reductions below (a bf16 amax is several times slower)
            else:
                s = _panel_mm(x[a + p : a + p + panel], x[b : b + tile], self.sbuf, self.how)
            if rb < tile:
                s[:, rb:] = -float("inf")  # padding rows of x: never a neighbour
            # chunk maxima right after the GEMM; only chunks that can hold a candidate are read again
            rm = torch.amax(s.view(panel, nc, CHUNK), dim=2, out=self.smax)
            live = (rm >= need_a2[p : p + panel]).view(-1).nonzero().squeeze(1)
            rows.add(live, s.view(-1, CHUNK).index_select(0, live), p * nc)
            cm = torch.amax(s.view(panel // CHUNK, CHUNK, tile), dim=1, out=self.cmax)
            live = (cm >= need_b).view(-1).nonzero().squeeze(1)  # (row chunk, column), row-major
            rc = live.div(tile, rounding_mode="floor")
            col_chunks = s.as_strided((panel // CHUNK, tile, CHUNK), (CHUNK * tile, 1, tile))  # [row chunk, col]
            cols.add(live, col_chunks[rc, live - rc * tile], p // CHUNK * tile)
        return rows, cols

    def _candidates(self, a: int, b: int, rows: _Gathered, cols: _Gathered, need_a, need_b) -> list:
        """(target, reference, key) of the gathered entries that pass their target's threshold: rows of block a,
        then rows of block b (sorted by target, for the merge)."""
        na, nb = self.norms[a : a + self.tile], self.norms[b : b + self.tile]
        nc, perm, bf = self.nc, self.perm, self.bf16
        parts = []
        got = rows.cat()
        if got is not None:
            live, vals = got
            ri = live.div(nc, rounding_mode="floor")
            q, o, v = _hits(vals, ri, need_a, below=False)
            i, j = ri[q], (live[q] - ri[q] * nc) * CHUNK + o
            parts.append((i + a, perm[j + b], _keys(na[i], nb[j], bf.dots(a + i, b + j) if bf is not None else v)))
        got = cols.cat()
        if got is not None:
            live, vals = got
            rc = live.div(self.tile, rounding_mode="floor")
            cj = live - rc * self.tile
            order = torch.sort(cj * nc + rc).indices  # by column (the target), for the merge
            rc, cj, vals = rc[order], cj[order], vals.index_select(0, order)
            q, o, v = _hits(vals, cj, need_b, below=False)
            i, j = rc[q] * CHUNK + o, cj[q]
            parts.append((j + b, perm[i + a], _keys(nb[j], na[i], bf.dots(b + j, a + i) if bf is not None else v)))
        return parts


def self_knn(
    x: torch.Tensor, k: int, *, tile: int | None = None, prune: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest rows of every row of ``x`` (itself included), exact, like ``faiss.knn(x, x, k)``.

    ``x``: (N, D) float32 tensor on CPU or CUDA; ``1 <= k <= N``.  Returns (distances, indices): (N, k)
    float32 squared L2 distances (float32 formula of faiss's BLAS path, clamped at 0) and int64 indices,
    ascending by (distance, index).  Each tile of X·Xᵀ with block a ≤ block b is computed once.
    ``prune``: ``"fp32"`` or ``"bf16"`` (CPU only; see the module docstring) for the off-diagonal panel
    products; ``None``: ``chosen_prune`` (bf16 on large CPU sets where it is faster and its keys round like the
    fp32 GEMM's, else fp32).
    """
    _check_args(x, k, prune)
    n = x.shape[0]
    tile, panel = _tile_and_panel(n, tile, x.is_cuda, x.device)
    if prune is None:
        prune = chosen_prune(n, x.shape[1], k, cuda=x.is_cuda, tile=tile)
    low = prune == "bf16"
    how = "mm" if x.is_cuda else _fp32_product(x.shape[1], panel, tile)  # the fp32 panel products
    # bf16: a deeper search on working keys, then _refine on the caller's rows (contiguous: one reduction order)
    x_in, depth = (x.contiguous(), min(n, k + BF16_EXTRA)) if low else (None, k)
    with _ieee_fp32(x.device), torch.no_grad():
        search = _Search(x, tile, panel, how, depth, low)
        top = search.diagonal()
        search.off_diagonal(top)
        best = torch.empty_like(top.best)
        best[search.perm] = top.best
        if low and x_in is not None:  # x_in is set wherever low is
            # final keys rounded like this BLAS's GEMM where _gemm_k_block finds its K block (prune=None
            # requires it); an explicit prune="bf16" without one keys by a single chain over D
            best = _refine(x_in, best, k, _gemm_k_block(x_in.shape[1], panel, tile))
    return _decode_keys(best), best & _IDX_MASK
