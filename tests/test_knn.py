"""dml_core.evaluation.knn.self_knn (symmetric leave-one-out search) against faiss's exact flat search, and the
metrics through it against the faiss backend and pytorch-metric-learning's AccuracyCalculator.

Ties: on data whose products and sums are exact in float32 (quantised values) both searches see the
same float keys, so indices, distances and every metric must be identical, ties broken by the smaller
index like faiss's heap/reservoir.  On generic float data the two GEMMs may round a distance differently
in the last bit; there the neighbour lists may swap two entries whose distances agree to ~1e-6.

The search tests run in both CPU modes (``prune="fp32"``: keys from the panel GEMMs; ``"bf16"``: bf16 panel
products only prune, a deeper search on per-pair fp32 keys, then the kept pairs re-keyed as a GEMM rounds them)
with the same expectations.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dml_core.evaluation.knn as K
import dml_core.evaluation.knn_dots as KD
import dml_core.evaluation.metrics as M
from dml_core.evaluation.knn import self_knn
from dml_core.evaluation.metrics import retrieval_details, retrieval_metrics

torch.set_num_threads(1)

PML_KEYS = {"precision_at_1": "precision_at_1", "r_precision": "r_precision", "map_at_r": "mean_average_precision_at_r"}
KS = dict(recall_ks=(1, 2, 4, 8, 16), ndcg_ks=(2, 4, 8, 16))
PRUNES = ("fp32", "bf16")


def quantised(seed, n=1500, dim=12, n_classes=60, flip=0.35):
    """Rows with exactly four entries of ±0.5 (unit norm, so normalising changes nothing, and every dot
    product is a multiple of 0.25: exact in float32).  Classes of very uneven size (1..~120) share
    prototypes, so there are exact duplicates within and across classes and massive distance ties."""
    rng = np.random.default_rng(seed)
    protos = np.zeros((n_classes, dim), np.float32)
    for c in range(n_classes):
        protos[c, rng.choice(dim, 4, replace=False)] = rng.choice([-0.5, 0.5], 4)
    weights = rng.pareto(1.2, n_classes) + 0.05
    labels = rng.choice(n_classes, size=n, p=weights / weights.sum())
    x = protos[labels].copy()
    for i in np.flatnonzero(rng.random(n) < flip):  # move one nonzero coordinate elsewhere
        on, off = np.flatnonzero(x[i]), np.flatnonzero(x[i] == 0)
        j, m = rng.choice(on), rng.choice(off)
        x[i, m], x[i, j] = x[i, j], 0.0
    return x, labels * 5 + 3


def integer_grid(seed, n=2000, dim=6):
    """Unnormalised small integers: exact squared distances of different norms (normalize=False)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(n, dim)).astype(np.float32)
    labels = np.where(x[:, 0] >= 1, 0, 1 + (x[:, 1] + 3) * 7 + (x[:, 2] + 3)).astype(int)  # one huge class
    labels[rng.choice(n, 5, replace=False)] = 1000 + np.arange(5)  # and singletons
    return x, labels


def clustered(seed, n_classes=80, dim=32):
    rng = np.random.default_rng(seed)
    sizes = np.concatenate([rng.integers(2, 25, n_classes), np.ones(6, int)])
    labels = np.repeat(np.arange(len(sizes)), sizes)
    rng.shuffle(labels)
    x = rng.normal(size=(len(sizes), dim))[labels] + 1.3 * rng.normal(size=(len(labels), dim))
    return x.astype(np.float32), labels


def pml(x, y):
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(include=tuple(PML_KEYS.values()), k="max_bin_count", device=torch.device("cpu"))
    return calc.get_accuracy(torch.as_tensor(x), torch.as_tensor(y))


# ---------------------------------------------------------------------------------------------------
# the search itself


@pytest.mark.parametrize("prune", PRUNES)
@pytest.mark.parametrize("k,tile", [(1, 64), (20, 128), (20, 4096), (150, 256), (700, 192)])
def test_equals_faiss_exactly_on_exact_ties(k, tile, prune):
    """Quantised data: same float keys on both sides, so the same (distance, index) order, k < 100
    (faiss's heap) and k >= 100 (faiss's reservoir), one tile and many (ragged last block)."""
    x, _ = quantised(0)
    d, i = self_knn(torch.from_numpy(x), k, tile=tile, prune=prune)
    fd, fi = faiss.knn(x, x, k)
    np.testing.assert_array_equal(i.numpy(), fi)
    np.testing.assert_array_equal(d.numpy(), fd)
    # massive ties: the lists are ordered by (distance, index)
    if k > 1:
        dn, inn = d.numpy(), i.numpy()
        tied = dn[:, 1:] == dn[:, :-1]
        assert tied.mean() > 0.5 and (inn[:, 1:][tied] > inn[:, :-1][tied]).all()
    else:  # k = 1: with duplicates the smallest index of the tied group, not always the row itself
        assert (i[:, 0].numpy() < np.arange(len(x))).any()


@pytest.mark.parametrize("prune", PRUNES)
def test_equals_faiss_exactly_on_unnormalised_integers(prune):
    x, _ = integer_grid(1)
    d, i = self_knn(torch.from_numpy(x), 40, tile=256, prune=prune)
    fd, fi = faiss.knn(x, x, 40)
    np.testing.assert_array_equal(i.numpy(), fi)
    np.testing.assert_array_equal(d.numpy(), fd)


@pytest.mark.parametrize("prune", PRUNES)
def test_duplicated_float_rows_tie_with_the_query_itself(prune):
    """Exact copies of generic float rows: the copy ties with the query's own entry, the smaller index
    first, as in faiss."""
    x, _ = clustered(2)
    x = F.normalize(torch.from_numpy(x)).numpy()
    rng = np.random.default_rng(2)
    x2 = np.concatenate([x, x[rng.choice(len(x), 300, replace=False)]])
    x2 = x2[rng.permutation(len(x2))]
    d, i = self_knn(torch.from_numpy(x2), 12, tile=128, prune=prune)
    fd, fi = faiss.knn(x2, x2, 12)
    assert (d[:, 0] == d[:, 1]).sum() >= 0.95 * 2 * 300  # a duplicate pair ties at rank 1-2 for both rows
    np.testing.assert_array_equal(i.numpy(), fi)


@pytest.mark.parametrize("prune", PRUNES)
def test_generic_floats_equal_faiss_up_to_last_bit_near_ties(prune):
    x, _ = clustered(3, dim=16)
    x = F.normalize(torch.from_numpy(x)).numpy()
    d, i = self_knn(torch.from_numpy(x), 30, tile=128, prune=prune)
    fd, fi = faiss.knn(x, x, 30)
    np.testing.assert_allclose(d.numpy(), fd, atol=2e-6)
    same = (i.numpy() == fi).all(axis=1)
    assert same.mean() > 0.99
    for r in np.flatnonzero(~same):  # a differing row only reorders entries within float32 precision
        diff = np.flatnonzero(i[r].numpy() != fi[r])
        assert np.abs(d[r, diff].numpy() - fd[r, diff]).max() < 2e-6


def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@pytest.mark.parametrize("how", ["mm", "onednn"])
def test_both_fp32_products_give_faiss_results_on_ties_and_duplicates(monkeypatch, how):
    """The CPU search's two fp32 panel products (``torch.mm``; oneDNN, which ``_fp32_product`` picks where it is
    faster): faiss's exact result on quantised data, one tile and several, and duplicated float rows tie."""
    if how == "onednn" and not _has_onednn():
        pytest.skip("this torch has no oneDNN fp32 matmul (torch.ops.mkldnn._linear_pointwise)")
    monkeypatch.setattr(K, "_fp32_product", lambda *a: how)
    x, _ = quantised(6)
    fd, fi = faiss.knn(x, x, 20)
    for tile in (128, 2048):
        d, i = self_knn(torch.from_numpy(x), 20, tile=tile, prune="fp32")
        np.testing.assert_array_equal(i.numpy(), fi)
        np.testing.assert_array_equal(d.numpy(), fd)
    x = F.normalize(torch.from_numpy(clustered(2)[0])).numpy()
    rng = np.random.default_rng(6)
    x2 = np.concatenate([x, x[rng.choice(len(x), 300, replace=False)]])
    x2 = x2[rng.permutation(len(x2))]
    d, i = self_knn(torch.from_numpy(x2), 12, tile=128, prune="fp32")
    assert (d[:, 0] == d[:, 1]).sum() >= 0.95 * 2 * 300  # a duplicate pair ties at rank 1-2 for both rows
    np.testing.assert_array_equal(i.numpy(), faiss.knn(x2, x2, 12)[1])


def test_fp32_product_is_onednn_only_where_faster_and_position_independent(monkeypatch):
    """The once-per-process choice times real products: oneDNN made slower loses, ``torch.mm`` made slower loses
    to it, and a oneDNN whose rounding depends on where a row sits (duplicates would stop tying) is never used."""
    import time

    if not _has_onednn():
        pytest.skip("this torch has no oneDNN fp32 matmul (torch.ops.mkldnn._linear_pointwise)")
    real = K._panel_mm

    def choice(slow, moved_rounds=False):
        def mm(a, b, out, how):
            if how == slow:
                time.sleep(0.02)
            got = real(a, b, out, how)
            if moved_rounds and how == "onednn":  # the panel's first row one ulp off, wherever its data came from
                got = got.clone()
                got[0] = torch.nextafter(got[0], torch.tensor(float("inf")))
            return got

        monkeypatch.setattr(K, "_panel_mm", mm)
        monkeypatch.setattr(K, "_FP32_PRODUCT", {})
        return K._fp32_product(16, 64, 128)

    assert choice(slow="onednn") == "mm"
    assert choice(slow="mm") == "onednn"
    assert K._FP32_PRODUCT == {(16, 64, 128, torch.get_num_threads()): "onednn"}
    assert choice(slow="mm", moved_rounds=True) == "mm"


def test_result_does_not_depend_on_the_tile_size():
    x, _ = clustered(4, dim=16)
    xt = torch.from_numpy(x)
    ref = self_knn(xt, 25, tile=4096)
    for tile in (64, 100, 320):
        d, i = self_knn(xt, 25, tile=tile)
        assert torch.equal(i, ref[1]) or (i != ref[1]).any(dim=1).float().mean() < 0.01
        torch.testing.assert_close(d, ref[0], atol=2e-6, rtol=0)


@pytest.mark.parametrize("prune", PRUNES)
def test_default_tiles_and_panels_equal_faiss_exactly(prune):
    """The shipped CPU sizes (TILE_CPU-row tiles in PANEL_CPU-row panels, chosen by measurement) on a set of
    a little over two tiles: off-diagonal tiles in several panels and a ragged last block, exact ties."""
    x, _ = quantised(8, n=2 * K.TILE_CPU + 700)
    assert K.TILE_CPU // K.PANEL_CPU >= 2
    d, i = self_knn(torch.from_numpy(x), 30, prune=prune)
    fd, fi = faiss.knn(x, x, 30)
    np.testing.assert_array_equal(i.numpy(), fi)
    np.testing.assert_array_equal(d.numpy(), fd)


def test_k_equal_to_n_and_tiny_sets():
    x = quantised(5, n=70)[0]
    d, i = self_knn(torch.from_numpy(x), 70, tile=64)
    np.testing.assert_array_equal(i.numpy(), faiss.knn(x, x, 70)[1])
    assert sorted(i[0].tolist()) == list(range(70))
    d, i = self_knn(torch.from_numpy(x[:1]), 1)
    assert i.tolist() == [[0]] and d.tolist() == [[0.0]]
    with pytest.raises(ValueError, match="k must be in 1..70"):
        self_knn(torch.from_numpy(x), 71)
    with pytest.raises(ValueError, match="float32"):
        self_knn(torch.from_numpy(x).double(), 3)
    with pytest.raises(ValueError, match="prune must be 'fp32', 'bf16' or None, got 'fp16'"):
        self_knn(torch.from_numpy(x), 3, prune="fp16")


def test_each_tile_is_computed_once_and_nothing_is_n_by_n(monkeypatch):
    """Counted matmuls: one tile × tile product per block pair a <= b (half of the flat search's
    pairs), all of the same shape, none larger than a tile."""
    x = torch.from_numpy(clustered(6, dim=16)[0])
    n, tile = x.shape[0], 128
    calls = []
    real, real_mm = torch.Tensor.__matmul__, K._panel_mm

    def counting(a, b):
        out = real(a, b)
        calls.append(tuple(out.shape))
        return out

    K._fp32_product(16, tile, tile)  # its once-per-process timing multiplies too

    def counting_mm(a, b, out, how):  # every tile product of the search goes through _panel_mm
        out = real_mm(a, b, out, how)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", counting)
    monkeypatch.setattr(K, "_panel_mm", counting_mm)
    self_knn(x, 10, tile=tile)
    blocks = -(-n // tile)
    assert blocks >= 8
    tiles = [s for s in calls if s[1] > blocks]  # the cluster assignment has one column per block
    assert set(tiles) == {(tile, tile)}
    assert len(tiles) == blocks * (blocks + 1) // 2
    assert len(tiles) < 0.6 * blocks * blocks  # vs blocks² tiles for the flat search


@pytest.mark.parametrize("make", [quantised, clustered])
def test_panels_give_the_same_result_as_whole_tiles(monkeypatch, make):
    """A tile computed in row panels (chunk maxima and candidates taken panel by panel, the diagonal's
    bounds from chunk minima) gives exactly the result of one GEMM per tile, ragged last block included;
    exact ties (quantised data) against faiss too."""
    x, _ = make(7)
    xt = torch.from_numpy(x)
    monkeypatch.setattr(K, "PANEL_CPU", 4096)
    ref = self_knn(xt, 20, tile=256)
    for panel in (32, 64, 96):  # 96 does not divide 256: the largest multiple of CHUNK below it that does
        monkeypatch.setattr(K, "PANEL_CPU", panel)
        d, i = self_knn(xt, 20, tile=256)
        assert torch.equal(d, ref[0]) and torch.equal(i, ref[1])
    if make is quantised:
        fd, fi = faiss.knn(x, x, 20)
        assert np.array_equal(ref[1].numpy(), fi) and np.array_equal(ref[0].numpy(), fd)


def test_panels_compute_each_tile_once(monkeypatch):
    """Counted matmuls with panels: every product has the same panel × tile shape; the off-diagonal
    tiles are computed once each, the diagonal ones down to their last real row."""
    x = torch.from_numpy(clustered(6, dim=16)[0])
    n, tile, panel = x.shape[0], 128, 32
    monkeypatch.setattr(K, "PANEL_CPU", panel)
    calls = _counting_mm(monkeypatch, (16, panel, tile))
    self_knn(x, 10, tile=tile)
    blocks = -(-n // tile)
    calls = [shape for shape, _ in calls]
    assert set(calls) == {(panel, tile)}
    diag_panels = sum(-(-min(tile, n - a) // panel) for a in range(0, n, tile))
    assert len(calls) == blocks * (blocks - 1) // 2 * (tile // panel) + diag_panels


def _counting_mm(monkeypatch, shape=None):
    """Record (shape, input dtype) of every panel product (``knn._panel_mm``); ``shape`` (D, panel, tile): measure
    the once-per-process choice of fp32 product first, whose timing multiplies too."""
    calls, real_mm = [], K._panel_mm
    if shape is not None:
        K._fp32_product(*shape)

    def counting_mm(a, b, out, how):
        got = real_mm(a, b, out, how)
        calls.append((tuple(got.shape), a.dtype))
        return got

    monkeypatch.setattr(K, "_panel_mm", counting_mm)
    return calls


def test_bf16_mode_multiplies_off_diagonal_panels_once_in_bf16(monkeypatch):
    """bf16 mode: every off-diagonal panel product once, in bf16 (no fp32 redo of a tile: survivors get
    per-pair dot products); the diagonal tiles' panels in fp32; the same panel × tile shape throughout."""
    x = torch.from_numpy(clustered(6, dim=16)[0])
    n, tile, panel = x.shape[0], 128, 32
    monkeypatch.setattr(K, "PANEL_CPU", panel)
    K._gemm_k_block(16, panel, tile)  # the once-per-process rounding check has its own fp32 product
    calls = _counting_mm(monkeypatch, (16, panel, tile))
    self_knn(x, 10, tile=tile, prune="bf16")
    blocks = -(-n // tile)
    assert {shape for shape, _ in calls} == {(panel, tile)}
    diag_panels = sum(-(-min(tile, n - a) // panel) for a in range(0, n, tile))
    assert sum(dt == torch.bfloat16 for _, dt in calls) == blocks * (blocks - 1) // 2 * (tile // panel)
    assert sum(dt == torch.float32 for _, dt in calls) == diag_panels


def test_prune_none_uses_bf16_only_on_large_sets_where_it_measured_faster(monkeypatch):
    x = torch.from_numpy(quantised(9, n=700)[0])
    ref = self_knn(x, 15, tile=128, prune="fp32")
    calls = _counting_mm(monkeypatch)
    for min_rows, pays, want in [(10_000, True, False), (500, False, False), (500, True, True)]:
        monkeypatch.setattr(K, "BF16_MIN_ROWS", min_rows)
        monkeypatch.setattr(K, "_bf16_pays", lambda n, d, k, panel, tile, pays=pays: pays)
        calls.clear()
        d, i = self_knn(x, 15, tile=128)
        assert any(dt == torch.bfloat16 for _, dt in calls) is want
        assert torch.equal(i, ref[1]) and torch.equal(d, ref[0])  # exact data: the same result either way


def test_fma_dots_round_like_a_gemm():
    """The bf16 mode's final keys: dot products rounded as FMA chains, the order of the SGEMM micro-kernels,
    so they agree with torch.mm (and faiss) where an elementwise product + sum agrees on ~13 % of pairs.
    Exact products (quantised data) agree always."""
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(2048, 128, generator=g))
    i, j = torch.randint(0, 512, (20000,), generator=g), torch.randint(0, 2048, (20000,), generator=g)
    ref = torch.mm(x[:512], x.T)[i, j]
    assert (K._fma_dots(x, i, j) == ref).float().mean() > 0.99
    assert (K._PairDots(x)(i, j) == ref).float().mean() < 0.5  # what the chain is there for
    q = torch.from_numpy(quantised(3)[0])
    i, j = torch.arange(len(q)), torch.randperm(len(q), generator=g)
    assert torch.equal(K._fma_dots(q, i, j), (q[i] * q[j]).sum(dim=1))
    for block in (None, 5, 7):  # any block order is exact on exact data
        assert torch.equal(K._fma_dots(q, i, j, block), (q[i] * q[j]).sum(dim=1))


def test_fma_dots_engines_give_the_same_bits(monkeypatch):
    """``_fma_dots`` runs its FMA chains on ``addcmul_`` in float32 where ``_fused_addcmul`` finds it fused, else in
    float64 emulation: on generic floats, one chain or K blocks, both engines give the same bits (and the chain
    agrees with the GEMM as above)."""
    g = torch.Generator().manual_seed(4)
    x = F.normalize(torch.randn(3000, 96, generator=g))
    i, j = torch.randint(0, 3000, (40000,), generator=g), torch.randint(0, 3000, (40000,), generator=g)
    monkeypatch.setattr(KD, "_FUSED_ADDCMUL", None)
    fused = KD._fused_addcmul()
    monkeypatch.setattr(KD, "_FUSED_ADDCMUL", False)
    emulated = [K._fma_dots(x, i, j, block) for block in (None, 32, 40)]
    if not fused:
        pytest.skip("torch.addcmul is not a fused multiply-add on this build: only the float64 engine runs")
    monkeypatch.setattr(KD, "_FUSED_ADDCMUL", True)
    for block, want in zip((None, 32, 40), emulated):
        assert torch.equal(K._fma_dots(x, i, j, block), want)


def test_fused_addcmul_is_detected_not_assumed(monkeypatch):
    """An ``addcmul`` that rounds its product before the sum (what a build without FMA contraction computes) is
    seen as unfused, so ``_fma_dots`` falls back to the float64 engine instead of keying by another rounding."""
    monkeypatch.setattr(KD, "_FUSED_ADDCMUL", None)
    monkeypatch.setattr(torch, "addcmul", lambda acc, a, b: acc + a * b)
    assert KD._fused_addcmul() is False
    assert KD._FUSED_ADDCMUL is False  # once per process


def test_gemm_k_block_is_the_order_of_this_blas():
    """Wide rows (D = 512): BLAS kernels may split K into blocks (MKL on one AMD Zen 3 CPU: 192; oneDNN on a Zen 5:
    one chain over all 512), where one chain over all D no longer rounds like the GEMM.  The block that
    ``_gemm_k_block`` finds reproduces the search's fp32 product (``_panel_mm``) on fresh entries of that shape;
    where it finds none, the single chain indeed disagrees."""
    g = torch.Generator().manual_seed(5)
    x = F.normalize(torch.randn(1024 + 2048, 512, generator=g))
    ref = K._panel_mm(x[:1024], x[1024:], torch.empty(1024, 2048), K._fp32_product(512, 1024, 2048))
    i, j = torch.randint(0, 1024, (20000,), generator=g), torch.randint(0, 2048, (20000,), generator=g)
    block = K._gemm_k_block(512, 1024, 2048)
    if block is None:
        assert (K._fma_dots(x, i, 1024 + j) == ref[i, j]).float().mean() < 0.99
    else:
        assert (K._fma_dots(x, i, 1024 + j, block) == ref[i, j]).float().mean() > 0.999
    assert K._GEMM_K_BLOCK[(512, 1024, 2048, torch.get_num_threads())] == block  # measured once


def test_prune_none_gives_the_fp32_result_exactly_for_wide_embeddings(monkeypatch):
    """D = 512 generic floats where bf16 products are fast: ``prune=None`` returns exactly the fp32 mode's
    distances and neighbours -- in bf16 mode with GEMM-blocked final keys, or in fp32 where no K block matched.
    (A single FMA chain over all 512 dimensions moves most distances by a last bit.)"""
    x = F.normalize(torch.from_numpy(clustered(21, n_classes=60, dim=512)[0]))
    ref = self_knn(x, 20, tile=256, prune="fp32")
    monkeypatch.setattr(K, "BF16_MIN_ROWS", 0)
    monkeypatch.setattr(K, "_bf16_times", lambda *a: (1.0, 0.0, 0.0))  # bf16 products free: pays wherever allowed
    calls = _counting_mm(monkeypatch)
    d, i = self_knn(x, 20, tile=256)
    used_bf16 = any(dt == torch.bfloat16 for _, dt in calls)
    assert used_bf16 == (K._gemm_k_block(512, 256, 256) is not None)
    assert torch.equal(d, ref[0]) and torch.equal(i, ref[1])


def test_bf16_pays_only_where_its_keys_round_like_the_gemm(monkeypatch):
    monkeypatch.setattr(K, "_bf16_times", lambda *a: (1.0, 0.0, 0.0))
    monkeypatch.setattr(K, "_gemm_k_block", lambda *a: None)
    assert K._bf16_pays(10**6, 128, 20, 1024, 4096) is False
    monkeypatch.setattr(K, "_gemm_k_block", lambda *a: 128)
    assert K._bf16_pays(10**6, 128, 20, 1024, 4096) is True


def test_bf16_pays_where_the_panel_time_it_saves_exceeds_its_own_work(monkeypatch):
    """The cost model behind ``prune=None``, on times ``_bf16_times`` measured on an Intel Xeon with AMX (two threads:
    fp32 panel product 1.53 ms, bf16 + conversion 0.64 ms, a working key 84 ns): at 100k × 128, k = 19, fp32 (the
    modes measured 7.8 vs 8.2 s), at 300k bf16 (56.5 vs 47.1 s), at 1M bf16; a deep search (k = 2000) makes the
    per-row work too large again; bf16 products hardly faster than fp32 never pay."""
    monkeypatch.setattr(K, "_gemm_k_block", lambda *a: 128)
    monkeypatch.setattr(K, "_bf16_times", lambda *a: (1.53e-3, 0.64e-3, 84e-9))
    assert K._bf16_pays(100_000, 128, 19, 512, 4096) is False
    assert K._bf16_pays(300_000, 128, 19, 512, 4096) is True
    assert K._bf16_pays(1_000_000, 128, 19, 512, 4096) is True
    assert K._bf16_pays(1_000_000, 128, 2000, 512, 4096) is False
    monkeypatch.setattr(K, "_bf16_times", lambda *a: (0.8e-3, 0.64e-3, 84e-9))
    assert K._bf16_pays(10_000_000, 128, 19, 512, 4096) is False
    monkeypatch.setattr(K, "_bf16_pays", lambda *a: True)
    assert K.chosen_prune(10**6, 128, 19) == "bf16"
    assert K.chosen_prune(K.BF16_MIN_ROWS - 1, 128, 19) == "fp32"  # too small to measure anything for
    assert K.chosen_prune(10**6, 128, 19, cuda=True) == "fp32"


def test_bf16_mode_equals_fp32_mode_on_generic_floats():
    """Near-ties included: the bf16 mode's final keys are GEMM-rounded, so its neighbours and distances are
    the fp32 mode's (where ``_gemm_k_block`` finds no K block for this BLAS, rows may differ where the
    single-chain keys and the GEMM's disagree)."""
    x = F.normalize(torch.from_numpy(clustered(16, n_classes=150, dim=24)[0]))
    a = self_knn(x, 25, tile=128, prune="fp32")
    b = self_knn(x, 25, tile=128, prune="bf16")
    if K._gemm_k_block(24, 128, 128) is not None:  # the keys round like this BLAS's GEMM: nothing may differ
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[1] == b[1]).all(dim=1).float().mean() >= 0.999
    assert (a[0] == b[0]).all(dim=1).float().mean() >= 0.999


def test_bf16_error_bound_holds_where_bf16_rounds_every_entry_down():
    """The threshold slack of the bf16 mode: on entries that all sit just below a bf16 rounding midpoint (every
    input rounds toward zero, every product of same-sign entries falls short), each bf16 panel product stays
    within ``_bf16_err`` of the fp32 one, and the shortfall is of the bound's order (so the bound is needed)."""
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(512, 64, generator=g)).abs().bfloat16().float() * (1 + 0.99 * 2.0**-9)
    assert bool((x.bfloat16().float() < x).all())
    exact = torch.mm(x, x.T)
    low = torch.mm(x.bfloat16(), x.bfloat16().T).float()
    norms = (x * x).sum(dim=1)
    err = K._bf16_err(norms, 64, float(norms.max().sqrt()))
    short = exact - low
    assert bool((short <= err[:, None]).all())
    assert float((short / err[:, None]).max()) > 0.4


def test_bf16_mode_keeps_near_duplicates_across_blocks():
    """Clusters of near-duplicate rows (distances far below bf16 resolution) spread over several blocks: the
    bf16 products cannot tell them apart, so only the error slack keeps the cross-block ones; the bf16 mode
    must still return the fp32 mode's neighbours (without the slack 3 of 2000 rows lose some)."""
    g = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(50, 24, generator=g))
    x = base.repeat_interleave(40, 0) + 1e-3 * torch.randn(2000, 24, generator=g)
    x = F.normalize(x[torch.randperm(2000, generator=g)])
    a = self_knn(x, 25, tile=128, prune="fp32")
    b = self_knn(x, 25, tile=128, prune="bf16")
    if K._gemm_k_block(24, 128, 128) is not None:  # the keys round like this BLAS's GEMM: nothing may differ
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert int((a[1] != b[1]).any(dim=1).sum()) <= 1


def test_refine_searches_a_row_again_where_a_dropped_pair_could_cross_the_cut(monkeypatch):
    """No extra depth on massively tied data: the k-th and the last kept working keys tie, so a dropped pair
    could tie with the k-th place; those rows are searched again in full and the result is still faiss's."""
    monkeypatch.setattr(K, "BF16_EXTRA", 0)
    redone = []
    real = K._rows_in_full
    monkeypatch.setattr(K, "_rows_in_full", lambda *a: redone.append(a[3].numel()) or real(*a))
    x, _ = quantised(17)
    d, i = self_knn(torch.from_numpy(x), 20, tile=128, prune="bf16")
    fd, fi = faiss.knn(x, x, 20)
    assert sum(redone) > 100
    np.testing.assert_array_equal(i.numpy(), fi)
    np.testing.assert_array_equal(d.numpy(), fd)


def test_bf16_times_are_measured_panel_products_and_working_keys(monkeypatch):
    """The cost model's inputs are real timings: a product made 20 ms slower shows in its own time only (the bf16
    one includes its conversion back to fp32), a working key's time is per pair, and the times are kept per
    (D, panel, tile, threads)."""
    import time

    real_mm, real_dots = K._panel_mm, K._PairDots.__call__
    K._fp32_product(16, 64, 128)
    for slow in (torch.bfloat16, torch.float32):

        def mm(a, b, out, how, slow=slow):
            if a.dtype == slow:
                time.sleep(0.02)
            return real_mm(a, b, out, how)

        monkeypatch.setattr(K, "_panel_mm", mm)
        monkeypatch.setattr(K, "_BF16_TIMES", {})
        t32, t16, t_pair = K._bf16_times(16, 64, 128)
        assert (t16 if slow == torch.bfloat16 else t32) >= 0.02 > (t32 if slow == torch.bfloat16 else t16)
        assert 0 < t_pair < 1e-5
        assert K._BF16_TIMES == {(16, 64, 128, torch.get_num_threads()): (t32, t16, t_pair)}
    monkeypatch.setattr(K._PairDots, "__call__", lambda self, i, j: time.sleep(0.0655) or real_dots(self, i, j))
    monkeypatch.setattr(K, "_BF16_TIMES", {})
    assert K._bf16_times(16, 64, 128)[2] >= 1e-6  # 65.5 ms over 65536 pairs


# ---------------------------------------------------------------------------------------------------
# the metrics through it


@pytest.fixture(params=PRUNES)
def prune_mode(request, monkeypatch):
    """retrieval_metrics calls self_knn with prune=None: make that choose the mode under test."""
    monkeypatch.setattr(K, "BF16_MIN_ROWS", 0)
    monkeypatch.setattr(K, "_bf16_pays", lambda *a: request.param == "bf16")
    return request.param


@pytest.mark.parametrize("make,normalize", [(quantised, True), (integer_grid, False)])
def test_metrics_identical_to_faiss_backend_and_pml_on_tied_uneven_data(make, normalize, prune_mode):
    x, y = make(7)
    assert np.bincount(np.unique(y, return_inverse=True)[1]).max() > 10 * np.median(
        np.bincount(np.unique(y, return_inverse=True)[1])
    )  # uneven classes
    ours = retrieval_details(x, y, normalize=normalize, nmi=False, backend="torch", **KS)
    flat = retrieval_details(x, y, normalize=normalize, nmi=False, backend="faiss", **KS)
    assert ours.metrics == flat.metrics
    np.testing.assert_array_equal(ours.knn_indices, flat.knn_indices)
    np.testing.assert_array_equal(ours.knn_similarity, flat.knn_similarity)
    ref = pml(F.normalize(torch.from_numpy(x)) if normalize else x, y)
    for k, pk in PML_KEYS.items():
        assert abs(ours.metrics[k] - ref[pk]) <= 1e-12, k  # PML sums in another order
    assert retrieval_metrics(x, y, normalize=normalize, nmi=False, **KS) == ours.metrics  # auto


@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_equal_faiss_backend_and_pml_on_random_data(seed, prune_mode):
    x, y = clustered(10 + seed)
    ours = retrieval_metrics(x, y, backend="torch", **KS)
    flat = retrieval_metrics(x, y, backend="faiss", **KS)
    assert ours == flat
    ref = pml(F.normalize(torch.from_numpy(x)), y)
    for k, pk in PML_KEYS.items():
        assert abs(ours[k] - ref[pk]) <= 1e-12, k
    assert 0.05 < ours["map_at_r"] < 0.95


def test_auto_backend_picks_symmetric_for_leave_one_out_and_faiss_for_a_query_set(monkeypatch):
    used = []
    monkeypatch.setattr(M, "self_knn", lambda *a, **kw: used.append("torch") or self_knn(*a, **kw))
    real = M._FlatL2Search.__call__
    monkeypatch.setattr(M._FlatL2Search, "__call__", lambda s, q: used.append("faiss") or real(s, q))
    x, y = clustered(12)
    retrieval_metrics(x, y, nmi=False)
    assert set(used) == {"faiss"}  # a small CPU set: faiss is faster there
    used.clear()
    monkeypatch.setattr(M, "SYMMETRIC_MIN_ROWS_CPU", 100)
    retrieval_metrics(x, y, nmi=False)
    assert set(used) == {"torch"}
    used.clear()
    retrieval_metrics(x[100:], y[100:], query_embeddings=x[:100], query_labels=y[:100], nmi=False)
    assert set(used) == {"faiss"}
    used.clear()
    monkeypatch.setattr(M, "SYMMETRIC_MAX_ENTRIES", 10)  # top-k state too large: the blocked faiss search
    retrieval_metrics(x, y, nmi=False)
    assert set(used) == {"faiss"}
    with pytest.raises(ValueError, match="backend 'torch' .* leave-one-out only"):
        retrieval_metrics(x[100:], y[100:], query_embeddings=x[:100], query_labels=y[:100], backend="torch")
    with pytest.raises(ValueError, match="backend must be one of auto, torch, faiss"):
        retrieval_metrics(x, y, backend="gpu")


def test_faiss_runs_with_torchs_thread_count(monkeypatch):
    seen = []
    real = M.faiss.knn
    monkeypatch.setattr(M.faiss, "knn", lambda *a, **kw: seen.append(faiss.omp_get_max_threads()) or real(*a, **kw))
    before = faiss.omp_get_max_threads()
    x, y = clustered(13)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        faiss.omp_set_num_threads(2)
        # torch and faiss may share one OpenMP runtime (then torch's count is whatever was set last): the call
        # must use torch's count as it is at the call, and give faiss its own setting back afterwards.
        want = torch.get_num_threads()
        retrieval_metrics(x, y, backend="faiss", nmi=False)
        assert seen and set(seen) == {want}
        assert faiss.omp_get_max_threads() == 2  # restored afterwards
    finally:
        torch.set_num_threads(old)
        faiss.omp_set_num_threads(before)


# ---------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.parametrize("tile", [256, None])
def test_cuda_branch_on_fake_cuda_tensors(tile):
    """The CUDA branch (tiles in one GEMM each, TF32 off, the metrics' auto backend) on fake CUDA tensors
    (tests/fake_cuda.py): it runs in CI, where there is no GPU, and fails where a GPU would fail first -- a
    buffer, index or constant made on the CPU and mixed with device tensors, an op without a CUDA kernel, an
    fp32 product with TF32 allowed.  Results equal the CPU branch's (exact data; the CPU computes both).
    ``tile=None``: the tile ``_cuda_tile`` picks, one tile for the whole set (diagonal only); 256: off-diagonal tiles,
    ragged last block.  The real GPU run is the next test."""
    from fake_cuda import fake_cuda, to_fake_cuda

    x, y = quantised(14)
    cpu = self_knn(torch.from_numpy(x), 37, tile=tile)
    a = retrieval_details(x, y, nmi=False, **KS)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the search must switch it off for its products
    try:
        with fake_cuda() as log:
            d, i = self_knn(to_fake_cuda(torch.from_numpy(x)), 37, tile=tile)
            assert d.is_cuda and i.is_cuda
            d, i = d.cpu(), i.cpu()
        with fake_cuda() as log_metrics:
            b = retrieval_details(to_fake_cuda(torch.from_numpy(x)), to_fake_cuda(torch.from_numpy(y)), nmi=False, **KS)
            with pytest.raises(ValueError, match="prune='bf16' is a CPU mode"):
                self_knn(to_fake_cuda(torch.from_numpy(x)), 5, prune="bf16")
        assert torch.backends.cuda.matmul.allow_tf32 is True  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert torch.equal(d, cpu[0]) and torch.equal(i, cpu[1])
    assert a.metrics == b.metrics
    np.testing.assert_array_equal(a.knn_indices, b.knn_indices)
    for lg in (log, log_metrics):
        assert lg.cuda_kernel_missing() == []
        assert lg.products and not any(tf32 for _, tf32 in lg.products)
    # on the GPU a tile is one GEMM (no CPU panels): one tile × tile product per block pair a <= b (the cluster
    # assignment's products have one column per block)
    side = -(-len(x) // K.CHUNK) * K.CHUNK if tile is None else tile
    blocks = -(-len(x) // side)
    tiles = [shape for shape, _ in log.products if shape[1] > blocks]
    assert set(tiles) == {(side, side)} and len(tiles) == blocks * (blocks + 1) // 2


@pytest.mark.parametrize(
    "free_gb, n, tile",
    [
        (78, 1_000_000, 32768),  # an 80 GB card: the largest tile (9.1 GB of buffers)
        (16, 1_000_000, 16384),  # 32768 would need 9.1 GB of the 8 GB allowed
        (4, 1_000_000, 8192),
        (1, 1_000_000, 8192),  # nothing fits half the free memory: the smallest
        (4, 10_000, 32768),  # a small set needs only its own rows: the tile is cut to N below
    ],
)
def test_cuda_tile_is_the_largest_that_fits_half_the_free_memory(monkeypatch, free_gb, n, tile):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gb << 30, 80 << 30))
    assert K._cuda_tile(n, None) == tile
    assert K._tile_and_panel(n, None, True)[0] == min(tile, -(-n // K.CHUNK) * K.CHUNK)
    assert K._tile_and_panel(n, None, False)[0] == min(K.TILE_CPU, -(-n // K.CHUNK) * K.CHUNK)  # CPU: fixed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_equals_cpu_exactly():
    """Exact-arithmetic data: CPU (MKL) and CUDA (cuBLAS, TF32 off) give the same keys, so the same
    neighbours and metrics; the caller's TF32 setting is restored."""
    torch.backends.cuda.matmul.allow_tf32 = True  # the kernel must switch it off for its matmuls
    for x in (quantised(14)[0], integer_grid(14)[0]):
        cpu = self_knn(torch.from_numpy(x), 37, tile=256)
        gpu = self_knn(torch.from_numpy(x).cuda(), 37, tile=256)
        assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())
    x, y = quantised(15)
    a = retrieval_details(x, y, nmi=False, **KS)
    b = retrieval_details(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda(), nmi=False, **KS)
    assert a.metrics == b.metrics
    np.testing.assert_array_equal(a.knn_indices, b.knn_indices)
    assert torch.backends.cuda.matmul.allow_tf32 is True  # restored
    torch.backends.cuda.matmul.allow_tf32 = False
