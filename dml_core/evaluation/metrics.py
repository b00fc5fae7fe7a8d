"""Retrieval metrics of the Metric Learning Reality Check (MLRC) and of the MPA paper.

``retrieval_metrics`` returns, for L2-normalised embeddings ranked by exact L2 distance:

* ``precision_at_1``, ``r_precision``, ``map_at_r`` -- Musgrave et al., "A Metric Learning Reality
  Check" (ECCV 2020), paper §3.2; docs/protocol.md §Metrics.  MAP@R(q) = (1/R) Σ_{i=1..R} P(i)·rel(i),
  R = number of references of the query's class (minus the query itself when it is part of the reference
  set); R-Precision(q) = (hits among the first R)/R.  Values equal pytorch-metric-learning 2.x
  ``AccuracyCalculator(k="max_bin_count")`` (docs/protocol.md §Metrics): same lone-query exclusion, same self-exclusion
  (the query's own index is removed wherever it ranks; if it is not among the k+1 results the last column is
  dropped), the same exact L2 ranking with ties broken by the smaller index (faiss ``IndexFlatL2``),
  queries averaged micro (one query = one vote).
* ``recall_at_{k}`` -- the "Recall@k" of DML papers: the fraction of queries with at least one
  same-class item among their k nearest neighbours (MPA paper §3.5; docs/losses/multi_proxy_anchor.md §nDCG@k).
  ``recall_at_1 == precision_at_1``.
* ``ndcg_at_{k}`` -- MPA paper Eqs. 19-20: DCG(k) = Σ_{i=1..k} (2^{r_i} − 1)/log2(i+1) with binary
  r_i, divided by the ideal DCG Σ_{i=1..min(k, n_q)} 1/log2(i+1); n_q = R.  Returned as a fraction
  (the paper prints 100 × nDCG@k).
* ``nmi`` -- normalised mutual information between the labels and a k-means clustering of the query
  embeddings with k = number of distinct query labels: faiss ``Kmeans`` with 20 iterations and faiss's
  default seed, exactly PML's ``FaissKMeans(niter=20)``; NMI with sklearn's
  ``normalized_mutual_info_score`` semantics (arithmetic mean of the two entropies).

kNN search (``backend``): leave-one-out sets go by default (``"auto"``) through ``dml_core.evaluation.knn.self_knn``,
an exact symmetric search in torch (CPU or CUDA, where the embeddings are) that computes each pair's
distance once and returns faiss's (distance, index) order -- on CPU from ``SYMMETRIC_MIN_ROWS_CPU`` rows
on, where it is the faster one.  A query set (In-Shop), a small CPU set, or a top-k state too large for
memory (``SYMMETRIC_MAX_ENTRIES``) goes through faiss's flat search (``"faiss"``; a GPU index for CUDA
inputs when faiss has GPUs).  Both give the same neighbours on exact ties (tests/test_knn.py).  faiss
runs with ``torch.get_num_threads()`` threads.

Memory: the searches keep only ``k = max R`` neighbours per query (plus the largest requested
recall/nDCG k) -- faiss over query blocks, the symmetric search over tiles -- and the metrics are
computed block by block from the neighbour indices, so nothing of size N×N (or #classes × N) is ever
allocated.  ``retrieval_details`` also returns the neighbours, per-query and per-class values.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dml_core.evaluation import openblas_core
from dml_core.evaluation.knn import self_knn

with openblas_core.for_faiss_import():  # faiss-cpu's OpenBLAS does not know recent Xeons (~3x slower kernels)
    import faiss

__all__ = [
    "METRICS_VERSION",
    "RetrievalDetails",
    "retrieval_details",
    "retrieval_metrics",
    "ndcg_at_k",
    "normalized_mutual_info",
]

# Budget for one query block, in kNN-matrix entries (rows × neighbours).  The per-block arrays are a few
# of these (int64 indices, bool matches, float sums), i.e. a few hundred MB at most.  Tests shrink it
# to exercise the block loop.
QUERY_BLOCK_ELEMENTS = 1 << 22

# PML's FaissKMeans(niter=20); faiss's default seed (1234) is kept so both pick the same initial centroids.
KMEANS_NITER = 20

# The largest k a faiss GPU flat index can return (faiss/gpu/utils/DeviceDefs.cuh, CUDA >= 9.5).
_GPU_MAX_K = 2048


# ----------------------------------------------------------------------------------------------------
# input checking


def _is_cuda(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda


def _embedding_matrix(x, name: str) -> torch.Tensor:
    """Float32 2-D torch tensor (same device) of ``x``; one ValueError naming ``name`` if it is unusable."""
    if isinstance(x, np.ndarray):
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise ValueError(f"{name} must be a numeric array, got dtype {x.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, torch.Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name} must be a real-valued tensor, got dtype {x.dtype}")
        t = x.detach()
    else:
        raise ValueError(f"{name} must be a torch tensor or numpy array, got {type(x).__name__}")
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows × dims), got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    t = t.to(torch.float32)
    # A float64 row sum cannot overflow for finite float32 entries, and NaN/inf propagate into it:
    # one cheap pass instead of an N×D boolean mask.
    bad = int((~torch.isfinite(t.sum(dim=1, dtype=torch.float64))).sum())
    if bad:
        raise ValueError(f"{name} contain {bad} rows with NaN/inf values")
    return t


def _label_vector(y, name: str, n_rows: int, rows_name: str) -> np.ndarray:
    """int64 numpy vector of ``y`` with one entry per row of the embeddings called ``rows_name``."""
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    elif not isinstance(y, np.ndarray):
        try:
            y = np.asarray(y)
        except Exception as err:  # re-raised with the field named
            raise ValueError(f"{name} cannot be read as an array: {err}") from err
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one class id per row), got shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise ValueError(f"{name} must hold integer class ids, got dtype {y.dtype}")
    if len(y) != n_rows:
        raise ValueError(f"{name} has {len(y)} entries but {rows_name} has {n_rows} rows")
    return y.astype(np.int64, copy=False)


def _ks(ks: Sequence[int], name: str) -> tuple[int, ...]:
    out = tuple(ks)
    for k in out:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"{name} must be positive integers, got {k!r}")
    return tuple(int(k) for k in out)


# ----------------------------------------------------------------------------------------------------
# per-ranking metrics


def ndcg_at_k(relevance: Sequence[int] | np.ndarray, num_relevant: int, k: int) -> float:
    """nDCG@k of one ranking, MPA paper Eqs. 19-20 (docs/losses/multi_proxy_anchor.md §nDCG@k).

    ``relevance[i]`` is 1 if the (i+1)-th retrieved item has the query's class.  ``num_relevant`` is
    n_q, the number of database items of the query's class (the query itself excluded).
    DCG(k) = Σ_{i=1..k} (2^{r_i} − 1)/log2(i+1); the ideal DCG puts all n_q relevant items first.
    Returns a fraction in [0, 1] (the paper prints 100 ×); NaN when ``num_relevant`` is 0.
    """
    rel = np.asarray(relevance, dtype=np.float64)[:k]
    if rel.ndim != 1:
        raise ValueError(f"relevance must be 1-D, got shape {rel.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if num_relevant < 1:
        return float("nan")
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    dcg = float(np.sum((np.exp2(rel) - 1.0) * discount[: len(rel)]))
    ideal = float(np.sum(discount[: min(k, num_relevant)]))
    return dcg / ideal


def _discounts(n: int) -> tuple[np.ndarray, np.ndarray]:
    """1/log2(i+1) for ranks i = 1..n and its cumulative sum (the ideal DCG for n_q relevant items)."""
    disc = 1.0 / np.log2(np.arange(2, n + 2, dtype=np.float64))
    return disc, np.cumsum(disc)


def _per_query(
    match: np.ndarray,
    r: np.ndarray,
    recall_ks: tuple[int, ...],
    ndcg_ks: tuple[int, ...],
) -> dict[str, np.ndarray]:
    """Per-query metric values (float64) of a block of queries: the one definition every global,
    per-class and per-query number is derived from.

    ``match[q, j]``: the (j+1)-th neighbour of query q has q's class (self already removed).
    ``r[q] >= 1``: the query's R (= n_q).  Every array here is (block × depth) at most.
    """
    n, depth = match.shape
    cols = np.arange(depth)
    in_r = cols[None, :] < r[:, None]
    hits_r = match & in_r  # relevant items among the first R
    n_hits_r = hits_r.sum(axis=1)
    # MAP@R (MLRC paper §3.2): P(i)·rel(i) summed over i <= R, divided by R.  cumsum of hits_r equals the
    # number of hits up to i for every i <= R, i.e. P(i)·i.
    cum = np.cumsum(hits_r, axis=1, dtype=np.int32 if depth < 2**31 else np.int64)
    ap = (np.where(hits_r, cum, 0) / (cols + 1.0)[None, :]).sum(axis=1) / r
    out = {
        "precision_at_1": match[:, 0].astype(np.float64),
        "r_precision": n_hits_r / r,  # MLRC paper §3.2: hits among the first R, over R
        "map_at_r": ap,
    }
    for k in recall_ks:
        out[f"recall_at_{k}"] = match[:, :k].any(axis=1).astype(np.float64)
    if ndcg_ks:
        disc, ideal = _discounts(max(ndcg_ks))
        for k in ndcg_ks:
            kk = min(k, depth)
            dcg = match[:, :kk] @ disc[:kk]  # Eq. 19 with binary r_i: 2^r − 1 = r
            best = ideal[np.minimum(k, r) - 1]  # Eq. 20 denominator: min(k, n_q) relevant items first
            out[f"ndcg_at_{k}"] = dcg / best
    return out


# ----------------------------------------------------------------------------------------------------
# kNN search


def _remove_self(indices: np.ndarray, self_index: np.ndarray) -> np.ndarray:
    """Drop each query's own index from its k+1 neighbours, wherever it ranks (PML >= 1.5.2
    ``return_results``).  Rows where the query is not among the results (ties with duplicates can push
    it out) lose their last column instead, so every row keeps k neighbours."""
    is_self = indices == self_index[:, None]
    absent = ~is_self.any(axis=1)
    is_self[absent, -1] = True
    return indices[~is_self].reshape(len(indices), indices.shape[1] - 1)


def _gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class _FlatL2Search:
    """Exact L2 kNN over a fixed reference set, searched one query block at a time.

    CPU: ``faiss.knn`` runs the same ``knn_L2sqr`` kernel as ``IndexFlatL2.search`` (what PML uses)
    without copying the references into an index.  GPU (inputs on CUDA and a GPU build of faiss):
    a ``GpuIndexFlatL2``, unless k exceeds the GPU limit, in which case the CPU is used, as PML does.
    """

    def __init__(self, reference: np.ndarray, k: int, use_gpu: bool):
        self.reference = reference
        self.k = k
        self.index = None
        if use_gpu and k <= _GPU_MAX_K:
            self._res = faiss.StandardGpuResources()
            self.index = faiss.GpuIndexFlatL2(self._res, reference.shape[1])
            self.index.add(reference)

    def __call__(self, queries: np.ndarray) -> np.ndarray:
        if self.index is not None:
            _, idx = self.index.search(queries, self.k)
        else:
            _, idx = faiss.knn(queries, self.reference, self.k)
        return idx


def _query_blocks(n: int, depth: int, dim: int) -> list[slice]:
    """Near-equal query blocks of at most ~QUERY_BLOCK_ELEMENTS entries per array: a block holds
    rows × depth neighbour entries and a rows × dim copy of its query embeddings.

    faiss switches from a direct to a BLAS distance kernel when rows × dim reaches
    ``distance_compute_blas_threshold``; keeping every block on the same side of that threshold as a
    single search over all queries makes the blocked search return exactly what one search would (the
    two kernels round differently, which matters for near-ties).  Memory wins when both cannot hold.
    """
    rows = max(1, QUERY_BLOCK_ELEMENTS // max(depth, dim, 1))
    n_blocks = -(-n // rows)
    threshold = int(getattr(faiss.cvar, "distance_compute_blas_threshold", 0))
    min_rows = -(-threshold // dim) if threshold > 0 else 1
    if n >= min_rows and rows >= min_rows:
        n_blocks = min(n_blocks, n // min_rows)
    n_blocks = max(1, n_blocks)
    bounds = np.linspace(0, n, n_blocks + 1).round().astype(int)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


# ----------------------------------------------------------------------------------------------------
# NMI


def normalized_mutual_info(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """NMI with the arithmetic-mean normaliser, sklearn ``normalized_mutual_info_score`` semantics.

    NMI = I(U; V) / ((H(U) + H(V)) / 2).  Limits as in sklearn: 1.0 when both labelings are a single
    cluster, 0.0 when the mutual information is 0.  Computed from the sparse contingency table (only
    the non-empty cells), so memory is O(N).
    """
    u_ids, u = np.unique(np.asarray(labels_true), return_inverse=True)
    v_ids, v = np.unique(np.asarray(labels_pred), return_inverse=True)
    u, v = u.ravel(), v.ravel()
    if len(u) != len(v):
        raise ValueError(f"labels_true has {len(u)} entries but labels_pred has {len(v)}")
    nu, nv = len(u_ids), len(v_ids)
    if nu == nv and nu <= 1:
        return 1.0
    if nu == 1 or nv == 1:
        return 0.0
    n = float(len(u))
    cells, n_ij = np.unique(u.astype(np.int64) * nv + v, return_counts=True)
    a = np.bincount(u).astype(np.float64)
    b = np.bincount(v).astype(np.float64)
    n_ij = n_ij.astype(np.float64)
    terms = (n_ij / n) * (np.log(n_ij) + math.log(n) - np.log(a[cells // nv]) - np.log(b[cells % nv]))
    terms[np.abs(terms) < np.finfo(np.float64).eps] = 0.0  # round-off guard, as sklearn
    mi = max(float(terms.sum()), 0.0)
    if mi == 0.0:
        return 0.0
    h_u = -float(np.sum((a / n) * (np.log(a) - math.log(n))))
    h_v = -float(np.sum((b / n) * (np.log(b) - math.log(n))))
    return mi / max((h_u + h_v) / 2.0, np.finfo(np.float64).eps)


def _kmeans_assignments(x: np.ndarray, n_clusters: int, use_gpu: bool) -> np.ndarray:
    """faiss k-means (PML ``FaissKMeans(niter=20)``), then each point's nearest final centroid."""
    # min_points_per_centroid only controls faiss's "too few points" warning (Clustering.cpp), not the
    # result; val folds legitimately have few images per class, so the warning is silenced.
    km = faiss.Kmeans(x.shape[1], n_clusters, niter=KMEANS_NITER, min_points_per_centroid=1, gpu=bool(use_gpu))
    km.train(x)
    _, assign = km.index.search(x, 1)
    return assign[:, 0]


# ----------------------------------------------------------------------------------------------------
# the public entry points

BACKENDS = ("auto", "torch", "faiss")

#: The symmetric torch search keeps every row's top-k in memory at once (int64): above this many
#: entries (N × (depth + 1)) ``backend="auto"`` uses faiss's query-blocked search instead.
#: The version of what these metrics compute.  A study's protocol fingerprint records it: two studies are comparable
#: only under the same version.  Raise it with any change that alters a metric's value (tests/test_fingerprint.py
#: pins the values of version 1 on a fixed input).
METRICS_VERSION = 1

SYMMETRIC_MAX_ENTRIES = 1 << 27

#: Below this many rows, CPU leave-one-out goes through faiss under ``backend="auto"``: the symmetric
#: search's per-tile overhead outweighs the halved GEMM on small sets (bench/README_metrics.md: 1.4× faiss's
#: time at 10k, 0.76× at 100k, one thread).  CUDA inputs always take the symmetric search.
SYMMETRIC_MIN_ROWS_CPU = 50_000


@dataclass
class RetrievalDetails:
    """Everything behind one ``retrieval_metrics`` call (``retrieval_details`` returns it).

    * ``metrics``: exactly what ``retrieval_metrics`` returns for the same inputs.
    * ``knn_indices``: (N_queries, depth) int64; row i = the reference indices of query i's neighbours in
      rank order, the query itself excluded in leave-one-out mode (PML's self removal), i.e. the very
      neighbours the metrics were computed from.  depth = max(largest R, largest recall/nDCG k), capped at
      the number of other references.  Lone queries (excluded from the metrics) still get their neighbours.
    * ``knn_similarity``: (N_queries, depth) float32 cosine similarity of each query to each neighbour
      (dot product of the L2-normalised embeddings).
    * ``per_query``: metric name -> (N_queries,) float64 value per query; NaN for queries excluded from the
      metrics (no other reference of their class).  Keys: every kNN metric of ``metrics``
      (``map_at_r``, ``r_precision``, ``precision_at_1``, ``recall_at_k``, ``ndcg_at_k``).
    * ``per_class``: query class id -> {metric: mean over the class's evaluated queries, ..., "count":
      number of evaluated queries}; only classes with at least one evaluated query.  The count-weighted
      mean over classes equals the global value (queries are averaged micro, one query = one vote).
    """

    metrics: dict[str, float]
    knn_indices: np.ndarray
    knn_similarity: np.ndarray
    per_query: dict[str, np.ndarray]
    per_class: dict[int, dict[str, float]]


def _check_backend(backend: str, loo: bool) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch" and not loo:
        raise ValueError(
            "backend 'torch' (symmetric search) is for leave-one-out only; "
            "a query set is searched with backend 'faiss' or 'auto'"
        )
    return backend


@contextlib.contextmanager
def _faiss_threads():
    """faiss (its own OpenMP pool) uses torch's thread count for the call: one knob, and no
    oversubscription inside Ray workers, whose torch thread count follows the task's CPUs."""
    old = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(max(1, torch.get_num_threads()))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(old)


def _evaluate(
    embeddings,
    labels,
    *,
    query_embeddings,
    query_labels,
    recall_ks: Sequence[int],
    ndcg_ks: Sequence[int],
    normalize: bool,
    nmi: bool,
    backend: str,
    details: bool,
):
    """The single implementation behind ``retrieval_metrics`` and ``retrieval_details``."""
    recall_ks = _ks(recall_ks, "recall_ks")
    ndcg_ks = _ks(ndcg_ks, "ndcg_ks")
    if (query_embeddings is None) != (query_labels is None):
        raise ValueError("query_embeddings and query_labels must be given together")
    _check_backend(backend, loo=query_embeddings is None)
    with _faiss_threads():
        return _evaluate_checked(
            embeddings,
            labels,
            query_embeddings=query_embeddings,
            query_labels=query_labels,
            recall_ks=recall_ks,
            ndcg_ks=ndcg_ks,
            normalize=normalize,
            nmi=nmi,
            backend=backend,
            details=details,
        )


def _evaluate_checked(
    embeddings, labels, *, query_embeddings, query_labels, recall_ks, ndcg_ks, normalize, nmi, backend, details
):
    use_gpu = (_is_cuda(embeddings) or _is_cuda(query_embeddings)) and _gpu_available()
    loo = query_embeddings is None
    ref_t, ref, query, q_labels, rel = _prepared(embeddings, labels, query_embeddings, query_labels, normalize)
    n_self = 1 if loo else 0
    n_q = len(query)
    names = ["precision_at_1", "r_precision", "map_at_r"]
    names += [f"recall_at_{k}" for k in recall_ks] + [f"ndcg_at_{k}" for k in ndcg_ks]
    per_query = {name: np.full(n_q, np.nan) for name in names}

    # kNN depth: PML's k="max_bin_count" (the largest R), deepened to the largest recall/nDCG k, never
    # more than the number of other references.  Details need every query's neighbours; the metrics
    # alone search only the queries they average over.
    valid = rel.valid
    max_r = int(rel.r_all[valid].max()) if valid.any() else 0
    depth = min(max(max_r, max(recall_ks + ndcg_ks, default=1)), len(ref) - n_self)
    if backend == "auto":
        big_enough = n_q >= SYMMETRIC_MIN_ROWS_CPU or ref_t.is_cuda
        backend = "torch" if loo and big_enough and n_q * (depth + 1) <= SYMMETRIC_MAX_ENTRIES else "faiss"
    searched = np.arange(n_q) if details or backend == "torch" else np.flatnonzero(valid)
    knn_idx = np.zeros((n_q, depth), dtype=np.int64) if details else None
    knn_sim = np.zeros((n_q, depth), dtype=np.float32) if details else None
    if depth >= 1 and len(searched):
        for rows, idx in _neighbour_blocks(ref_t, ref, query, searched, depth, loo, backend, use_gpu):
            if details:
                knn_idx[rows] = idx
                knn_sim[rows] = _cosine(query, rows, ref, idx, normalized=normalize)
            _score(rows, idx, rel, recall_ks, ndcg_ks, per_query)
    del ref_t

    n_valid = int(valid.sum())
    out = {name: (float(np.mean(per_query[name][valid])) if n_valid else float("nan")) for name in names}
    if nmi:
        n_clusters = len(np.unique(q_labels))
        assign = _kmeans_assignments(query, n_clusters, use_gpu)
        out["nmi"] = float(normalized_mutual_info(q_labels, assign))
    out = {k: float(v) for k, v in out.items()}
    if not details:
        return out
    return RetrievalDetails(
        metrics=out,
        knn_indices=knn_idx,
        knn_similarity=knn_sim,
        per_query=per_query,
        per_class=_per_class(per_query, q_labels, valid),
    )


class _Relevance(NamedTuple):
    """Which references are relevant to each query: class codes of the references and the queries (-1: a class
    without references), R per query (its class's references, itself excluded in leave-one-out mode), and the
    queries with R >= 1 (those the metrics average over)."""

    ref_codes: np.ndarray
    q_codes: np.ndarray
    r_all: np.ndarray
    valid: np.ndarray


def _prepared(embeddings, labels, query_embeddings, query_labels, normalize):
    """The checked inputs: the reference matrix as a tensor (for ``self_knn``) and as a float32 array, the query
    array (the references themselves in leave-one-out mode), the query labels and their ``_Relevance``."""
    ref_t = _embedding_matrix(embeddings, "embeddings")
    ref_labels = _label_vector(labels, "labels", ref_t.shape[0], "embeddings")
    loo = query_embeddings is None
    if loo:
        q_t, q_labels = ref_t, ref_labels
    else:
        q_t = _embedding_matrix(query_embeddings, "query_embeddings")
        q_labels = _label_vector(query_labels, "query_labels", q_t.shape[0], "query_embeddings")
        if q_t.shape[1] != ref_t.shape[1]:
            raise ValueError(f"query_embeddings have {q_t.shape[1]} dims but embeddings have {ref_t.shape[1]}")

    if normalize:
        ref_t = F.normalize(ref_t, p=2, dim=1)
        q_t = ref_t if loo else F.normalize(q_t, p=2, dim=1)
    ref = np.ascontiguousarray(ref_t.cpu().numpy(), dtype=np.float32)
    query = ref if loo else np.ascontiguousarray(q_t.cpu().numpy(), dtype=np.float32)
    del q_t

    # R per query: reference count of its class, minus itself in leave-one-out mode.
    classes, ref_codes, ref_counts = np.unique(ref_labels, return_inverse=True, return_counts=True)
    ref_codes = ref_codes.ravel()
    pos = np.clip(np.searchsorted(classes, q_labels), 0, len(classes) - 1)
    known = classes[pos] == q_labels
    q_codes = np.where(known, pos, -1)
    r_all = np.where(known, ref_counts[pos], 0) - (1 if loo else 0)
    return ref_t, ref, query, q_labels, _Relevance(ref_codes, q_codes, r_all, r_all >= 1)


def _neighbour_blocks(ref_t, ref, query, searched, depth, loo, backend, use_gpu):
    """(query rows, their ``depth`` nearest references, the query itself removed in leave-one-out mode) for the
    ``searched`` queries, block by block."""
    n_self = 1 if loo else 0
    if backend == "torch":
        # one search of the whole set against itself, each pair's distance computed once
        _, idx = self_knn(ref_t, depth + 1)
        blocks = [(searched, idx.cpu().numpy())]
    else:
        search = _FlatL2Search(ref, depth + n_self, use_gpu)
        blocks = (
            (searched[b], search(query[searched[b]]))
            for b in _query_blocks(len(searched), depth + n_self, ref.shape[1])
        )
    for rows, idx in blocks:
        yield rows, (_remove_self(idx, rows) if loo else idx)


def _score(rows, idx, rel: _Relevance, recall_ks, ndcg_ks, per_query: dict[str, np.ndarray]) -> None:
    """The per-query metrics of the ``rows`` with R >= 1, from their neighbours ``idx``, into ``per_query``."""
    ok = rel.valid[rows]
    rows, idx = rows[ok], idx[ok]
    if len(rows):
        match = rel.ref_codes[idx] == rel.q_codes[rows][:, None]
        for name, value in _per_query(match, rel.r_all[rows], recall_ks, ndcg_ks).items():
            per_query[name][rows] = value


def _cosine(query: np.ndarray, rows: np.ndarray, ref: np.ndarray, idx: np.ndarray, *, normalized: bool) -> np.ndarray:
    """float32 cosine similarity of each query row to each of its neighbours, in chunks of ~1M floats."""
    out = np.empty(idx.shape, dtype=np.float32)
    if idx.shape[1] == 0:
        return out
    step = max(1, (1 << 20) // (idx.shape[1] * ref.shape[1]))
    for a in range(0, len(rows), step):
        q = torch.from_numpy(query[rows[a : a + step]])
        r = torch.from_numpy(ref[idx[a : a + step]])
        if not normalized:
            q, r = F.normalize(q, p=2, dim=-1), F.normalize(r, p=2, dim=-1)
        out[a : a + step] = torch.einsum("bd,bkd->bk", q, r).numpy()
    return out


def _per_class(
    per_query: dict[str, np.ndarray], q_labels: np.ndarray, valid: np.ndarray
) -> dict[int, dict[str, float]]:
    """Class id -> mean of each per-query metric over the class's evaluated queries, plus their count."""
    cls, inv, counts = np.unique(q_labels[valid], return_inverse=True, return_counts=True)
    inv = inv.ravel()
    means = {name: np.bincount(inv, weights=v[valid], minlength=len(cls)) / counts for name, v in per_query.items()}
    return {
        int(c): {name: float(m[i]) for name, m in means.items()} | {"count": int(counts[i])} for i, c in enumerate(cls)
    }


def retrieval_metrics(
    embeddings,
    labels,
    *,
    query_embeddings=None,
    query_labels=None,
    recall_ks: Sequence[int] = (1, 2, 4, 8),
    ndcg_ks: Sequence[int] = (2, 4, 8),
    normalize: bool = True,
    nmi: bool = True,
    backend: str = "auto",
) -> dict[str, float]:
    """MAP@R, R-Precision, P@1, Recall@k, nDCG@k and NMI of a labelled embedding set.

    Without a query set every row is a query against all the *other* rows (leave-one-out,
    PML ``ref_includes_query=True``): R = count of the query's class − 1 and queries whose class has no
    other member are excluded.  With ``query_embeddings``/``query_labels`` (In-Shop style) the queries
    are searched against ``embeddings``: R = count of the query's class in the reference set and
    queries whose class is absent from it are excluded.  If every query is excluded the kNN metrics are
    NaN (PML's behaviour).  NMI clusters the query embeddings (the whole set without a query set).
    MAP@R and R-Precision as defined in Musgrave et al., "A Metric Learning Reality Check", §3.2
    (docs/protocol.md §Metrics); the
    global values are the means of the per-query values (``retrieval_details`` exposes them).

    Embeddings are L2-normalised (``normalize=True``, torch ``F.normalize``) and searched with exact L2
    distance, ties broken by the smaller index.  ``backend="auto"``: leave-one-out through the
    symmetric torch search (``dml_core.evaluation.knn.self_knn``, on the embeddings' device; on CPU from
    ``SYMMETRIC_MIN_ROWS_CPU`` rows), otherwise and for a query set through faiss (a GPU index on CUDA
    inputs when faiss has GPUs); ``"torch"`` / ``"faiss"`` force one.  Inputs
    are torch tensors (CPU or CUDA) or numpy arrays; labels are integer class ids.  Returns python floats.

    ``nmi=False`` skips the k-means clustering (and the ``nmi`` key): it is most of the cost on large sets
    and checkpoint selection needs only MAP@R.
    """
    return _evaluate(
        embeddings,
        labels,
        query_embeddings=query_embeddings,
        query_labels=query_labels,
        recall_ks=recall_ks,
        ndcg_ks=ndcg_ks,
        normalize=normalize,
        nmi=nmi,
        backend=backend,
        details=False,
    )


def retrieval_details(
    embeddings,
    labels,
    *,
    query_embeddings=None,
    query_labels=None,
    recall_ks: Sequence[int] = (1, 2, 4, 8),
    ndcg_ks: Sequence[int] = (2, 4, 8),
    normalize: bool = True,
    nmi: bool = True,
    backend: str = "auto",
) -> RetrievalDetails:
    """``retrieval_metrics`` plus the neighbours and the per-query / per-class values behind it.

    Same arguments and the same code path as ``retrieval_metrics`` (its ``metrics`` field is identical);
    see ``RetrievalDetails`` for the fields.  Memory: O(N · depth) for the neighbour arrays.
    """
    return _evaluate(
        embeddings,
        labels,
        query_embeddings=query_embeddings,
        query_labels=query_labels,
        recall_ks=recall_ks,
        ndcg_ks=ndcg_ks,
        normalize=normalize,
        nmi=nmi,
        backend=backend,
        details=True,
    )
