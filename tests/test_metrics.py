"""dml_core.evaluation.metrics against its external anchors.

* MAP@R / R-Precision / P@1 / NMI: pytorch-metric-learning 2.x ``AccuracyCalculator(k="max_bin_count")``
  to 1e-6, leave-one-out and query-vs-reference, with uneven class sizes, singleton classes and
  exact duplicates (docs/protocol.md §Metrics).
* Recall@k, nDCG@k, MAP@R: a brute-force numpy reference (full distance matrix, stable sort) written here.
* nDCG@k: the MPA paper's Table 3 rankings (§3.5; docs/losses/multi_proxy_anchor.md §nDCG@k).
* NMI: sklearn ``normalized_mutual_info_score``.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dml_core.evaluation.metrics as M
from dml_core.evaluation.metrics import ndcg_at_k, normalized_mutual_info, retrieval_metrics

torch.set_num_threads(1)

KEYS = [
    "precision_at_1",
    "r_precision",
    "map_at_r",
    "recall_at_1",
    "recall_at_2",
    "recall_at_4",
    "recall_at_8",
    "ndcg_at_2",
    "ndcg_at_4",
    "ndcg_at_8",
    "nmi",
]
PML_KEYS = {
    "precision_at_1": "precision_at_1",
    "r_precision": "r_precision",
    "map_at_r": "mean_average_precision_at_r",
    "nmi": "NMI",
}


# ---------------------------------------------------------------------------------------------------
# data and references


def clustered(seed, n_classes=60, max_size=14, dim=16, noise=1.5, singletons=5):
    """Uneven class sizes (1..max_size) plus ``singletons`` one-image classes, shuffled."""
    rng = np.random.default_rng(seed)
    sizes = np.concatenate([rng.integers(2, max_size + 1, size=n_classes), np.ones(singletons, int)])
    labels = np.repeat(np.arange(len(sizes)) * 3 + 7, sizes)  # non-contiguous class ids
    rng.shuffle(labels)
    centers = rng.normal(size=(labels.max() + 1, dim))
    x = centers[labels] + noise * rng.normal(size=(len(labels), dim))
    return x.astype(np.float32), labels


def pml(query, query_labels, reference=None, reference_labels=None):
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(include=tuple(PML_KEYS.values()), k="max_bin_count", device=torch.device("cpu"))
    kw = {}
    if reference is not None:
        kw = dict(reference=reference, reference_labels=torch.as_tensor(reference_labels))
    return calc.get_accuracy(query, torch.as_tensor(query_labels), **kw)


def unit(x):
    return F.normalize(torch.as_tensor(x), p=2, dim=1)


def brute_force(x, labels, ks, query=None, query_labels=None):
    """Per-query metrics from a full float64 distance matrix; the query itself is removed by index."""
    ref = unit(x).double().numpy()
    loo = query is None
    q = ref if loo else unit(query).double().numpy()
    ql = labels if loo else query_labels
    d = ((q[:, None, :] - ref[None, :, :]) ** 2).sum(-1)
    out = {f"recall_at_{k}": [] for k in ks} | {f"ndcg_at_{k}": [] for k in ks} | {"map_at_r": []}
    for i in range(len(q)):
        order = np.argsort(d[i], kind="stable")
        if loo:
            order = order[order != i]
        rel = (labels[order] == ql[i]).astype(int)
        r = int((labels == ql[i]).sum()) - int(loo)
        if r < 1:
            continue
        for k in ks:
            out[f"recall_at_{k}"].append(rel[:k].any())
            out[f"ndcg_at_{k}"].append(ndcg_at_k(rel, r, k))
        prec = np.cumsum(rel[:r]) / np.arange(1, r + 1)
        out["map_at_r"].append(float((prec * rel[:r]).sum() / r))
    return {k: float(np.mean(v)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------
# equality with pytorch-metric-learning


@pytest.mark.parametrize("seed", [0, 1])
def test_leave_one_out_equals_pml(seed):
    x, y = clustered(seed)
    ours = retrieval_metrics(x, y)  # normalises internally
    ref = pml(unit(x), y)
    for k, pk in PML_KEYS.items():
        assert abs(ours[k] - ref[pk]) <= 1e-6, (k, ours[k], ref[pk])
    assert 0.05 < ours["map_at_r"] < 0.95  # the data is neither trivial nor hopeless
    assert ours["recall_at_1"] == ours["precision_at_1"]


def test_query_vs_reference_equals_pml():
    """In-Shop style: R = count in the reference; query classes absent from it are excluded."""
    x, y = clustered(3, n_classes=50)
    rng = np.random.default_rng(3)
    is_query = rng.random(len(y)) < 0.4
    # two query-only classes (absent from the reference) and the reference's singletons stay there
    y = y.copy()
    y[np.flatnonzero(is_query)[:6]] = 10_001
    y[np.flatnonzero(is_query)[6:9]] = 10_002
    q, ql, r, rl = x[is_query], y[is_query], x[~is_query], y[~is_query]
    assert not np.isin([10_001, 10_002], rl).any()
    ours = retrieval_metrics(r, rl, query_embeddings=q, query_labels=ql)
    ref = pml(unit(q), ql, unit(r), rl)
    for k, pk in PML_KEYS.items():
        assert abs(ours[k] - ref[pk]) <= 1e-6, (k, ours[k], ref[pk])


def test_prenormalised_without_normalize_equals_pml():
    x, y = clustered(4)
    xn = unit(x)
    ours = retrieval_metrics(xn.numpy(), y, normalize=False)
    ref = pml(xn, y)
    for k, pk in PML_KEYS.items():
        assert abs(ours[k] - ref[pk]) <= 1e-6, (k, ours[k], ref[pk])


def test_exact_duplicates_and_ties_equal_pml():
    """Duplicated rows (within and across classes) give distance ties, so the query need not rank first
    among its own k+1 neighbours; PML removes it wherever it ranks, or drops the last column."""
    x, y = clustered(5, n_classes=40, dim=8)
    rng = np.random.default_rng(5)
    src = rng.choice(len(y), size=80, replace=False)
    x2 = np.concatenate([x, x[src]])
    y2 = np.concatenate([y, np.where(rng.random(80) < 0.5, y[src], y[rng.permutation(src)])])
    ours = retrieval_metrics(x2, y2)
    ref = pml(unit(x2), y2)
    for k, pk in PML_KEYS.items():
        assert abs(ours[k] - ref[pk]) <= 1e-6, (k, ours[k], ref[pk])


def test_remove_self_wherever_it_ranks():
    idx = np.array([[5, 0, 7], [1, 2, 3], [9, 8, 2]])
    got = M._remove_self(idx, np.array([0, 1, 4]))
    # row 0: self at rank 2; row 1: self first; row 2: self absent -> last column dropped
    np.testing.assert_array_equal(got, [[5, 7], [2, 3], [9, 8]])


def test_identical_points_of_one_class_are_perfect():
    x = np.repeat(np.eye(4, dtype=np.float32), 3, axis=0)  # 4 classes × 3 identical points
    y = np.repeat(np.arange(4), 3)
    m = retrieval_metrics(x, y, recall_ks=(1, 2), ndcg_ks=(2,))
    assert m["precision_at_1"] == m["map_at_r"] == m["r_precision"] == m["ndcg_at_2"] == 1.0
    # k-means from random initial points may put two centroids in one class (NMI < 1 here): PML's too.
    assert m["nmi"] == pytest.approx(pml(unit(x), y)["NMI"], abs=1e-9)


# ---------------------------------------------------------------------------------------------------
# Recall@k / nDCG@k / MAP@R against the brute-force reference


def test_recall_ndcg_map_equal_brute_force_leave_one_out():
    x, y = clustered(6, n_classes=40, max_size=12)
    ks = (1, 2, 4, 8, 16)  # 16 > largest R: the search must go deeper than max_bin_count
    ours = retrieval_metrics(x, y, recall_ks=ks, ndcg_ks=ks)
    ref = brute_force(x, y, ks)
    for k, v in ref.items():
        assert abs(ours[k] - v) <= 1e-9, (k, ours[k], v)


def test_recall_ndcg_map_equal_brute_force_with_query_set():
    x, y = clustered(7, n_classes=30)
    split = np.arange(len(y)) % 3 == 0
    ks = (1, 3, 8)
    ours = retrieval_metrics(
        x[~split], y[~split], query_embeddings=x[split], query_labels=y[split], recall_ks=ks, ndcg_ks=ks
    )
    ref = brute_force(x[~split], y[~split], ks, query=x[split], query_labels=y[split])
    for k, v in ref.items():
        assert abs(ours[k] - v) <= 1e-9, (k, ours[k], v)


def test_blocked_search_gives_the_same_values(monkeypatch):
    x, y = clustered(8)
    whole = retrieval_metrics(x, y)
    monkeypatch.setattr(M, "QUERY_BLOCK_ELEMENTS", 64)  # ~5 queries per block
    assert len(M._query_blocks(len(y), 13, x.shape[1])) > 50
    blocked = retrieval_metrics(x, y)
    for k in KEYS:  # only the summation order differs
        assert blocked[k] == pytest.approx(whole[k], abs=1e-12), k


def test_query_blocks_cover_all_rows_and_respect_the_blas_threshold(monkeypatch):
    monkeypatch.setattr(M, "QUERY_BLOCK_ELEMENTS", 1_000_000)
    min_rows = -(-int(M.faiss.cvar.distance_compute_blas_threshold) // 128)
    blocks = M._query_blocks(1_000_003, 50, 128)
    assert blocks[0].start == 0 and blocks[-1].stop == 1_000_003
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    sizes = [b.stop - b.start for b in blocks]
    rows = 1_000_000 // 128  # the query copy (dim 128) is wider than the 50 neighbours
    assert min(sizes) >= min_rows and max(sizes) <= rows + 1 and len(blocks) == -(-1_000_003 // rows)
    assert max(b.stop - b.start for b in M._query_blocks(1_000_003, 500, 128)) <= 1_000_000 // 500 + 1
    # memory wins when the budget cannot hold min_rows rows
    monkeypatch.setattr(M, "QUERY_BLOCK_ELEMENTS", 1000)
    assert max(b.stop - b.start for b in M._query_blocks(5000, 100, 128)) <= 10


def test_memory_stays_far_below_n_by_n():
    """numpy allocations of the metric code stay O(N·k), not O(N²) (an N×N float32 is 64 MB here)."""
    rng = np.random.default_rng(9)
    n = 4000
    y = rng.integers(0, 400, size=n)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    tracemalloc.start()
    retrieval_metrics(x, y, ndcg_ks=(2,), recall_ks=(1,))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < n * n * 4 / 10, peak


# ---------------------------------------------------------------------------------------------------
# nDCG@k: MPA paper Table 3


TABLE3 = [  # ranking (top 10), nDCG@10 ×100 (unrounded; the paper prints one decimal), MAP@R ×100 (R=4)
    ([1, 0, 0, 0, 0, 0, 0, 0, 0, 0], 39.04, 25.0),
    ([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], 50.32, 25.0),
    ([1, 0, 1, 0, 0, 0, 0, 0, 0, 0], 58.56, 41.67),
    ([1, 0, 1, 0, 0, 0, 1, 0, 0, 1], 82.85, 41.67),
    ([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], 100.0, 100.0),
]


@pytest.mark.parametrize("ranking,ndcg10,_map_r", TABLE3)
def test_table3_ndcg_of_one_ranking(ranking, ndcg10, _map_r):
    assert round(100 * ndcg_at_k(ranking, num_relevant=4, k=10), 2) == ndcg10


def test_table3_rankings_through_the_block_metrics():
    """The same five rankings through the vectorised path: nDCG@10, MAP@R (R=4), Recall@10 = 1."""
    match = np.array([row for row, *_ in TABLE3], dtype=bool)
    r = np.full(len(match), 4)
    per_query = M._per_query(match, r, (10,), (10,))
    for i in range(len(match)):
        s = {k: float(v[i]) for k, v in per_query.items()}
        assert round(100 * s["ndcg_at_10"], 2) == TABLE3[i][1]
        assert round(100 * s["map_at_r"], 2) == TABLE3[i][2]
        assert s["recall_at_10"] == 1.0
        assert s["precision_at_1"] == 1.0
        assert s["r_precision"] == [0.25, 0.25, 0.5, 0.5, 1.0][i]  # hits among the first R=4


def test_ndcg_at_k_edge_cases():
    assert ndcg_at_k([0, 0, 1], num_relevant=1, k=3) == pytest.approx(1 / math.log2(4))
    assert ndcg_at_k([1], num_relevant=5, k=4) == pytest.approx(1 / sum(1 / math.log2(i + 1) for i in range(1, 5)))
    assert math.isnan(ndcg_at_k([0, 0], num_relevant=0, k=2))


def test_well_separated_classes_score_one():
    """5 classes × 4 images, one-hot-like embeddings: R@1 = nDCG@10 = MAP@R = 1 (query excluded, n_q = 3)."""
    rng = np.random.default_rng(10)
    y = np.repeat(np.arange(5), 4)
    x = np.eye(5, dtype=np.float32)[y] + 0.01 * rng.normal(size=(20, 5)).astype(np.float32)
    m = retrieval_metrics(x, y, recall_ks=(1,), ndcg_ks=(10,))
    for k in ("precision_at_1", "r_precision", "map_at_r", "recall_at_1", "ndcg_at_10", "nmi"):
        assert m[k] == pytest.approx(1.0, abs=1e-12), k


# ---------------------------------------------------------------------------------------------------
# NMI


@pytest.mark.parametrize("seed", range(4))
def test_nmi_equals_sklearn(seed):
    from sklearn.metrics import normalized_mutual_info_score

    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 400))
    a = rng.integers(0, int(rng.integers(1, 30)), size=n) * 5 - 3
    b = np.where(rng.random(n) < 0.6, a, rng.integers(0, 20, size=n))
    assert normalized_mutual_info(a, b) == pytest.approx(normalized_mutual_info_score(a, b), abs=1e-12)


@pytest.mark.parametrize(
    "a,b",
    [([0, 0, 0], [1, 1, 1]), ([0, 0, 1], [3, 3, 3]), ([0, 1, 2], [0, 1, 2]), ([0, 1, 2], [5, 5, 6]), ([7], [7])],
)
def test_nmi_limit_cases_equal_sklearn(a, b):
    from sklearn.metrics import normalized_mutual_info_score

    assert normalized_mutual_info(np.array(a), np.array(b)) == pytest.approx(
        normalized_mutual_info_score(a, b), abs=1e-12
    )


def test_nmi_is_one_on_perfectly_separated_clusters():
    """Two far-apart classes: Lloyd's k-means recovers them from any pair of initial points (if both
    start in one class, the other class pulls one centroid across in the first update), so NMI = 1."""
    rng = np.random.default_rng(11)
    y = np.repeat([4, 9], [30, 50])
    x = np.where(y[:, None] == 4, 1.0, -1.0) * np.ones((1, 16)) + 0.01 * rng.normal(size=(80, 16))
    assert retrieval_metrics(x.astype(np.float32), y)["nmi"] == pytest.approx(1.0, abs=1e-12)


def test_nmi_reproduces_pmls_kmeans_local_optimum():
    """12 separated classes, random initial centroids: k-means stops in a local optimum (two centroids
    in one class).  The metric is defined by PML's k-means, so it must land in the same one."""
    rng = np.random.default_rng(11)
    y = np.repeat(np.arange(12), 6)
    x = (10 * rng.normal(size=(12, 16))[y] + 0.01 * rng.normal(size=(len(y), 16))).astype(np.float32)
    ours = retrieval_metrics(x, y)["nmi"]
    assert ours < 0.99
    assert ours == pytest.approx(pml(unit(x), y)["NMI"], abs=1e-9)


def test_nmi_close_to_pml_on_overlapping_clusters():
    """Same faiss k-means (niter=20, seed 1234) as PML's FaissKMeans: equal up to k-means noise."""
    x, y = clustered(12, n_classes=30, noise=2.0)
    ours = retrieval_metrics(x, y)["nmi"]
    ref = pml(unit(x), y)["NMI"]
    assert 0.2 < ours < 0.95
    assert abs(ours - ref) <= 1e-3


# ---------------------------------------------------------------------------------------------------
# edge cases of docs/protocol.md §Metrics (self-exclusion, lone queries) and bad input


def test_all_queries_lone_gives_nan_like_pml():
    x, _ = clustered(13, n_classes=10)
    y = np.arange(len(x))  # every class a singleton
    ours = retrieval_metrics(x, y)
    ref = pml(unit(x), y)
    for k in KEYS[:-1]:
        assert math.isnan(ours[k]), k
    assert math.isnan(ref["mean_average_precision_at_r"]) and math.isnan(ref["precision_at_1"])
    assert ours["nmi"] == pytest.approx(1.0)  # N clusters for N singleton classes


def test_no_query_label_in_reference_gives_nan():
    x, y = clustered(14, n_classes=10)
    m = retrieval_metrics(x, y, query_embeddings=x[:5], query_labels=np.full(5, -1))
    assert all(math.isnan(m[k]) for k in KEYS[:-1])


def test_lone_queries_are_excluded_not_counted_as_misses():
    """Singleton classes placed where they never enter anyone's top R: every metric is unchanged, so
    they were dropped from the average rather than counted as 0."""
    x, y = clustered(15, n_classes=20, singletons=0)
    x = np.concatenate([x + 20.0, np.zeros((len(x), 1))], axis=1)  # all points in a narrow cone
    base = retrieval_metrics(x.astype(np.float32), y)
    lone = np.zeros((7, x.shape[1]))
    lone[:, -1] = 1.0  # orthogonal to the cone: farther than any same-cone neighbour
    lone[:, 0] = np.arange(7) * 1e-3
    more = retrieval_metrics(np.concatenate([x, lone]).astype(np.float32), np.concatenate([y, 1000 + np.arange(7)]))
    for k in KEYS[:-1]:
        assert more[k] == pytest.approx(base[k], abs=1e-12), k


def test_torch_and_numpy_inputs_agree_and_values_are_python_floats():
    x, y = clustered(16)
    a = retrieval_metrics(x, y)
    b = retrieval_metrics(torch.from_numpy(x).double().requires_grad_(), torch.from_numpy(y))
    assert list(a) == KEYS and a == b
    assert all(type(v) is float for v in a.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_input_equals_cpu_input():
    x, y = clustered(17)
    cpu = retrieval_metrics(x, y)
    gpu = retrieval_metrics(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
    for k in KEYS:
        assert abs(cpu[k] - gpu[k]) <= 1e-6, k


def test_gpu_search_path_uses_a_gpu_flat_index(monkeypatch):
    """Dispatch logic only (this machine has no faiss GPU build): GPU index when k fits, else CPU."""
    made = []

    class FakeGpuIndex(M.faiss.IndexFlatL2):
        def __init__(self, res, d):
            super().__init__(d)
            made.append(self)

    monkeypatch.setattr(M.faiss, "StandardGpuResources", lambda: object(), raising=False)
    monkeypatch.setattr(M.faiss, "GpuIndexFlatL2", FakeGpuIndex, raising=False)
    ref = unit(np.random.default_rng(0).normal(size=(50, 4))).numpy()
    s = M._FlatL2Search(ref, 5, use_gpu=True)
    assert s.index is made[0] and s.index.ntotal == 50
    np.testing.assert_array_equal(s(ref[:20]), M.faiss.knn(ref[:20], ref, 5)[1])
    assert M._FlatL2Search(ref, M._GPU_MAX_K + 1, use_gpu=True).index is None


def test_nan_rows_are_counted_in_the_error():
    x, y = clustered(18, n_classes=10)
    x[[1, 4, 9], 0] = np.nan
    x[9, 1] = np.inf
    x[12, 2] = -np.inf
    with pytest.raises(ValueError, match="embeddings contain 4 rows with NaN/inf values"):
        retrieval_metrics(x, y)
    with pytest.raises(ValueError, match="query_embeddings contain 4 rows"):
        retrieval_metrics(x[20:], y[20:], query_embeddings=x[:20], query_labels=y[:20])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, y: retrieval_metrics(x, y[:-1]), "labels has 99 entries but embeddings has 100 rows"),
        (
            lambda x, y: retrieval_metrics(x, y, query_embeddings=x[:3], query_labels=y[:4]),
            "query_labels has 4 entries but query_embeddings has 3 rows",
        ),
        (
            lambda x, y: retrieval_metrics(x, y, query_embeddings=x[:3, :2], query_labels=y[:3]),
            "query_embeddings have 2 dims but embeddings have 8",
        ),
        (lambda x, y: retrieval_metrics(x, y, query_embeddings=x[:3]), "must be given together"),
        (lambda x, y: retrieval_metrics(x, y.astype(float)), "labels must hold integer class ids"),
        (lambda x, y: retrieval_metrics(x[:, 0], y), r"embeddings must be 2-D"),
        (lambda x, y: retrieval_metrics(x[:0], y[:0]), "embeddings is empty"),
        (lambda x, y: retrieval_metrics(x, y, recall_ks=(0,)), "recall_ks must be positive integers"),
        (lambda x, y: retrieval_metrics(list(x), y), "torch tensor or numpy array"),
    ],
)
def test_bad_input_raises_one_clear_error(call, message):
    rng = np.random.default_rng(19)
    x = rng.normal(size=(100, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=100)
    with pytest.raises(ValueError, match=message):
        call(x, y)


def test_nmi_false_skips_only_the_clustering():
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(60, 8)).astype(np.float32)
    labels = rng.integers(0, 6, size=60)
    full = retrieval_metrics(emb, labels)
    fast = retrieval_metrics(emb, labels, nmi=False)
    assert "nmi" not in fast and "nmi" in full
    assert fast == {k: v for k, v in full.items() if k != "nmi"}


# ---------------------------------------------------------------------------------------------------
# retrieval_details: the neighbours and per-query / per-class values behind retrieval_metrics


@pytest.mark.parametrize("query_set", [False, True])
def test_details_metrics_equal_retrieval_metrics_and_per_class_averages_back(query_set):
    x, y = clustered(20, n_classes=30, singletons=4)
    kw = {}
    if query_set:
        split = np.arange(len(y)) % 3 == 0
        kw = dict(query_embeddings=x[split], query_labels=y[split])
        x, y = x[~split], y[~split]
    d = M.retrieval_details(x, y, **kw)
    assert d.metrics == retrieval_metrics(x, y, **kw)
    q_labels = kw.get("query_labels", y)
    valid = ~np.isnan(d.per_query["map_at_r"])
    assert (~valid).sum() >= 1  # some queries are excluded (singletons / classes absent from the reference)
    assert sum(c["count"] for c in d.per_class.values()) == valid.sum()
    assert set(d.per_class) == set(np.unique(q_labels[valid]).tolist())
    for name, values in d.per_query.items():
        assert values.shape == (len(q_labels),) and values.dtype == np.float64
        assert d.metrics[name] == pytest.approx(values[valid].mean(), abs=1e-12)
        weighted = sum(c[name] * c["count"] for c in d.per_class.values()) / valid.sum()
        assert weighted == pytest.approx(d.metrics[name], abs=1e-12), name
    for name in ("map_at_r", "r_precision", "precision_at_1"):
        assert 0.05 < d.metrics[name] < 0.95


def test_details_neighbours_are_the_ranked_leave_one_out_list():
    x, y = clustered(21, n_classes=20)
    d = M.retrieval_details(x, y, nmi=False)
    xn = unit(x).double().numpy()
    sim = xn @ xn.T
    np.fill_diagonal(sim, -np.inf)  # leave-one-out: the query itself is never its own neighbour
    depth = d.knn_indices.shape[1]
    assert depth == max(np.bincount(y).max() - 1, 8)
    assert d.knn_indices.dtype == np.int64 and d.knn_similarity.dtype == np.float32
    expect = np.argsort(-sim, axis=1, kind="stable")[:, :depth]
    np.testing.assert_array_equal(d.knn_indices, expect)  # continuous data: no ties
    np.testing.assert_allclose(d.knn_similarity, np.take_along_axis(sim, expect, axis=1), atol=1e-6)
    # the per-query values are recomputable from those neighbours (MLRC paper §3.2)
    i = int(np.flatnonzero(np.bincount(y)[y] > 3)[0])
    r = int((y == y[i]).sum()) - 1
    rel = (y[d.knn_indices[i, :r]] == y[i]).astype(float)
    assert d.per_query["map_at_r"][i] == pytest.approx((np.cumsum(rel) / np.arange(1, r + 1) * rel).sum() / r)
    assert d.per_query["r_precision"][i] == pytest.approx(rel.mean())
    assert d.per_query["precision_at_1"][i] == rel[0]


def test_details_of_lone_queries_have_neighbours_but_no_values():
    x, y = clustered(22, n_classes=10, singletons=3)
    d = M.retrieval_details(x, y, nmi=False)
    lone = np.bincount(y)[y] == 1
    assert lone.sum() == 3
    assert np.isnan(d.per_query["map_at_r"][lone]).all() and not np.isnan(d.per_query["map_at_r"][~lone]).any()
    assert (d.knn_indices[lone] != np.flatnonzero(lone)[:, None]).all()
    assert all(int(c) not in d.per_class for c in y[lone])
