"""dml_core.knn.self_knn (symmetric leave-one-out search) against faiss's exact flat search, and the
metrics through it against the faiss backend and pytorch-metric-learning's AccuracyCalculator.

Ties: on data whose products and sums are exact in float32 (quantised values) both searches see the
same float keys, so indices, distances and every metric must be identical, ties broken by the smaller
index like faiss's heap/reservoir.  On generic float data the two GEMMs may round a distance differently
in the last bit; there the neighbour lists may swap two entries whose distances agree to ~1e-6.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dml_core.knn as K
import dml_core.metrics as M
from dml_core.knn import self_knn
from dml_core.metrics import retrieval_details, retrieval_metrics

torch.set_num_threads(1)

PML_KEYS = {"precision_at_1": "precision_at_1", "r_precision": "r_precision",
            "map_at_r": "mean_average_precision_at_r"}
KS = dict(recall_ks=(1, 2, 4, 8, 16), ndcg_ks=(2, 4, 8, 16))


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


@pytest.mark.parametrize("k,tile", [(1, 64), (20, 128), (20, 4096), (150, 256), (700, 192)])
def test_equals_faiss_exactly_on_exact_ties(k, tile):
    """Quantised data: same float keys on both sides, so the same (distance, index) order, k < 100
    (faiss's heap) and k >= 100 (faiss's reservoir), one tile and many (ragged last block)."""
    x, _ = quantised(0)
    d, i = self_knn(torch.from_numpy(x), k, tile=tile)
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


def test_equals_faiss_exactly_on_unnormalised_integers():
    x, _ = integer_grid(1)
    d, i = self_knn(torch.from_numpy(x), 40, tile=256)
    fd, fi = faiss.knn(x, x, 40)
    np.testing.assert_array_equal(i.numpy(), fi)
    np.testing.assert_array_equal(d.numpy(), fd)


def test_duplicated_float_rows_tie_with_the_query_itself():
    """Exact copies of generic float rows: the copy ties with the query's own entry, the smaller index
    first, as in faiss."""
    x, _ = clustered(2)
    x = F.normalize(torch.from_numpy(x)).numpy()
    rng = np.random.default_rng(2)
    x2 = np.concatenate([x, x[rng.choice(len(x), 300, replace=False)]])
    x2 = x2[rng.permutation(len(x2))]
    d, i = self_knn(torch.from_numpy(x2), 12, tile=128)
    fd, fi = faiss.knn(x2, x2, 12)
    assert (d[:, 0] == d[:, 1]).sum() >= 0.95 * 2 * 300  # a duplicate pair ties at rank 1-2 for both rows
    np.testing.assert_array_equal(i.numpy(), fi)


def test_generic_floats_equal_faiss_up_to_last_bit_near_ties():
    x, _ = clustered(3, dim=16)
    x = F.normalize(torch.from_numpy(x)).numpy()
    d, i = self_knn(torch.from_numpy(x), 30, tile=128)
    fd, fi = faiss.knn(x, x, 30)
    np.testing.assert_allclose(d.numpy(), fd, atol=2e-6)
    same = (i.numpy() == fi).all(axis=1)
    assert same.mean() > 0.99
    for r in np.flatnonzero(~same):  # a differing row only reorders entries within float32 precision
        diff = np.flatnonzero(i[r].numpy() != fi[r])
        assert np.abs(d[r, diff].numpy() - fd[r, diff]).max() < 2e-6


def test_result_does_not_depend_on_the_tile_size():
    x, _ = clustered(4, dim=16)
    xt = torch.from_numpy(x)
    ref = self_knn(xt, 25, tile=4096)
    for tile in (64, 100, 320):
        d, i = self_knn(xt, 25, tile=tile)
        assert torch.equal(i, ref[1]) or (i != ref[1]).any(dim=1).float().mean() < 0.01
        torch.testing.assert_close(d, ref[0], atol=2e-6, rtol=0)


def test_default_tiles_and_panels_equal_faiss_exactly():
    """The shipped CPU sizes (TILE_CPU-row tiles in PANEL_CPU-row panels, chosen by measurement) on a set of
    a little over two tiles: off-diagonal tiles in several panels and a ragged last block, exact ties."""
    x, _ = quantised(8, n=2 * K.TILE_CPU + 700)
    assert K.TILE_CPU // K.PANEL_CPU >= 2
    d, i = self_knn(torch.from_numpy(x), 30)
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


def test_each_tile_is_computed_once_and_nothing_is_n_by_n(monkeypatch):
    """Counted matmuls: one tile × tile product per block pair a <= b (half of the flat search's
    pairs), all of the same shape, none larger than a tile."""
    x = torch.from_numpy(clustered(6, dim=16)[0])
    n, tile = x.shape[0], 128
    calls = []
    real, real_mm = torch.Tensor.__matmul__, torch.mm

    def counting(a, b):
        out = real(a, b)
        calls.append(tuple(out.shape))
        return out

    def counting_mm(a, b, **kw):  # the tiles are written into one reused buffer (out=)
        out = real_mm(a, b, **kw)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", counting)
    monkeypatch.setattr(torch, "mm", counting_mm)
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
    calls = []
    real_mm = torch.mm

    def counting_mm(a, b, **kw):
        out = real_mm(a, b, **kw)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "mm", counting_mm)
    self_knn(x, 10, tile=tile)
    blocks = -(-n // tile)
    assert set(calls) == {(panel, tile)}
    diag_panels = sum(-(-min(tile, n - a) // panel) for a in range(0, n, tile))
    assert len(calls) == blocks * (blocks - 1) // 2 * (tile // panel) + diag_panels


# ---------------------------------------------------------------------------------------------------
# the metrics through it


@pytest.mark.parametrize("make,normalize", [(quantised, True), (integer_grid, False)])
def test_metrics_identical_to_faiss_backend_and_pml_on_tied_uneven_data(make, normalize):
    x, y = make(7)
    assert np.bincount(np.unique(y, return_inverse=True)[1]).max() > 10 * np.median(
        np.bincount(np.unique(y, return_inverse=True)[1]))  # uneven classes
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
def test_metrics_equal_faiss_backend_and_pml_on_random_data(seed):
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
